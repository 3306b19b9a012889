"""The run plan: built once from a spec as a frozen value, each later decision a copy, and read by the init
(stdlib only) as the plain dict of its fields."""

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import hutch
from hutch.sandbox._host.native import init as init_module
from hutch.sandbox._host.native.plan import Plan, PlannedMount, build_plan, needs_write_range, with_bind_maps
from hutch.sandbox._spec import SandboxSpec


@pytest.fixture
def spec_and_image(tmp_path):
    layer, src = tmp_path / "layer", tmp_path / "src"
    layer.mkdir()
    src.mkdir()
    spec = SandboxSpec.build(mounts=[hutch.Mount.bind(str(src), "/ro"), hutch.Mount.bind(str(src), "/rw", readonly=False),
                                     hutch.Mount.tmpfs("/t", size="1M")], capabilities=["CHOWN"], memory="32M")
    return spec, SimpleNamespace(lowerdirs=(layer,))


def test_the_plan_is_a_frozen_value_and_each_decision_a_copy(spec_and_image):
    spec, image = spec_and_image
    plan = build_plan(spec, image, scratch="/run/x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hostname = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mounts[0].map = "sandbox"
    mapped = with_bind_maps(plan, root=1_000_000_000, userns=True)
    assert [m.map for m in plan.mounts] == [None, None, None]          # the original is what it was
    assert [m.map for m in mapped.mounts] == ["sandbox", None, None]   # read-only through the sandbox's namespace
    assert needs_write_range(plan) and not needs_write_range(dataclasses.replace(plan, mounts=plan.mounts[:1]))
    assert plan.shm == 32 << 20 and plan.caps == (0,) and plan.lowerdirs == (str(image.lowerdirs[0]),)


def test_the_plan_refuses_what_the_host_cannot_serve(spec_and_image, tmp_path):
    spec, image = spec_and_image
    with pytest.raises(hutch.InvalidSpecError, match="not a usable directory"):
        build_plan(spec, SimpleNamespace(lowerdirs=(tmp_path / "gone",)), scratch="/run/x")
    owned = SandboxSpec.build(mounts=[hutch.Mount.bind(str(tmp_path), "/o", readonly=False, owner=1_000_000_001)])
    with pytest.raises(hutch.InvalidSpecError, match="host ids hutch gives sandboxes"):
        build_plan(owned, image, scratch="/run/x")


def _keys_read(tree, name):
    """The string keys the init reads from `name` (name["k"], name.get("k"))."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name and node.args \
                and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


def test_what_the_init_reads_is_what_the_plan_sends(spec_and_image):
    """Both sides of the plan's wire: every key the init's root setup reads is a field of the plan."""
    tree = ast.parse(Path(init_module.__file__).read_text())
    setup = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_setup_root")
    plan_keys, mount_keys = _keys_read(setup, "plan"), _keys_read(setup, "m")
    assert plan_keys and mount_keys
    assert plan_keys <= {f.name for f in dataclasses.fields(Plan)}, plan_keys
    assert mount_keys <= {f.name for f in dataclasses.fields(PlannedMount)}, mount_keys
    spec, image = spec_and_image
    wire = json.loads(json.dumps(with_bind_maps(build_plan(spec, image, scratch="/run/x"), 0, True).to_wire()))
    assert set(wire) == {f.name for f in dataclasses.fields(Plan)}
    assert wire["mounts"][0] == {"kind": "bind", "target": "/ro", "source": spec.mounts[0].source, "readonly": True,
                                 "size": None, "owner": None, "volume": False, "map": "sandbox", "tree": None}
