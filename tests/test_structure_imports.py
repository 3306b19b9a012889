"""Who may import whom (docs/architecture.md, the map at the top), checked on the source.

The sandbox wing is cut by the process its code runs in:
  hutch/sandbox/*.py          the caller's process (the SDK), plus the contract both sides share (_spec, _api)
  hutch/sandbox/_host/        the host as root: the daemon and its children (zygote, inits, egress gateway)
  hutch/sandbox/_inside/      inside a sandbox (the interpreter's bridge, sent as source)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SANDBOX = ROOT / "hutch" / "sandbox"
CONTRACT = {"hutch.sandbox._spec", "hutch.sandbox._api"}
#: what the zygote and each init run (`python -I -S`): these modules and the packages above them
ZYGOTE = ["hutch.sandbox._host.native.zygote", "hutch.sandbox._host.native.init",
          "hutch.sandbox._host.native.initwire", "hutch.sandbox._host.native.linux",
          "hutch.sandbox._host.native.ptys"]
#: what each gVisor sandbox's keeper runs (`python -I -S`), the zygote's modules besides
KEEPER = ["hutch.sandbox._host.gvisor.keeper"]
STDLIB_ONLY = ZYGOTE + KEEPER + ["hutch.sandbox._host.native.seccomp"]
BRIDGE = "hutch.sandbox._inside.bridge"
BRIDGE_THIRD_PARTY = {"jupyter_client", "zmq"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def path_of(module: str) -> Path:
    p = ROOT.joinpath(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module an `import` or `from ... import` names, at any depth of the file (lazy imports too);
    `from pkg import name` counts as pkg.name when that is a module of hutch."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pytest.fail(f"{path}: relative import on line {node.lineno}; hutch imports absolutely")
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if node.module.startswith("hutch") and path_of(sub).exists()
                            else node.module))
    return out


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def caller_side() -> list[Path]:
    return sorted(p for p in SANDBOX.glob("*.py") if module_name(p) not in CONTRACT)


@pytest.mark.parametrize("path", caller_side(), ids=lambda p: p.name)
def test_the_caller_side_never_imports_the_host_side(path):
    bad = [f"line {n}: {m}" for n, m in imports(path)
           if under(m, "hutch.sandbox._host") or under(m, "hutch.sandbox._inside") and m != BRIDGE]
    assert bad == [], f"{path.relative_to(ROOT)} runs in the caller's process: {bad}"


@pytest.mark.parametrize("path", sorted(SANDBOX.glob("_host/**/*.py")), ids=lambda p: module_name(p)[14:])
def test_the_host_side_imports_only_itself_the_contract_and_core(path):
    bad = []
    for n, m in imports(path):
        if not under(m, "hutch"):   # third party, stdlib
            continue
        if under(m, "hutch._core") or under(m, "hutch.sandbox._host") or m in CONTRACT or m == "hutch._version":
            continue
        bad.append(f"line {n}: {m}")
    assert bad == [], f"{path.relative_to(ROOT)} runs on the host: {bad}"


@pytest.mark.parametrize("module", sorted(CONTRACT))
def test_the_contract_imports_only_core(module):
    bad = [f"line {n}: {m}" for n, m in imports(path_of(module)) if under(m, "hutch") and not under(m, "hutch._core")]
    assert bad == [], f"{module} is shared by both sides: {bad}"


def stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_the_zygotes_modules_import_only_the_standard_library(module):
    bad = [f"line {n}: {m}" for n, m in imports(path_of(module))
           if not stdlib(m) and m not in STDLIB_ONLY]
    assert bad == [], f"{module} runs in the zygote or an init (python -I -S): {bad}"


def test_the_bridge_imports_only_the_standard_library_and_jupyter():
    bad = [f"line {n}: {m}" for n, m in imports(path_of(BRIDGE))
           if not stdlib(m) and m.split(".")[0] not in BRIDGE_THIRD_PARTY]
    assert bad == [], f"{BRIDGE} runs inside a sandbox, sent as source: {bad}"


def test_the_zygote_loads_nothing_but_the_standard_library():
    """What `python -I -S` really loads for the zygote and the init: the packages above them run too."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            + "; ".join(f"import {m}" for m in ZYGOTE + KEEPER)
            + "; print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    ours = {"__main__", "hutch", "hutch._version", "hutch._core", "hutch._core.errors", "hutch.sandbox", "hutch.sandbox._host",
            "hutch.sandbox._host.native", "hutch.sandbox._host.gvisor", *ZYGOTE, *KEEPER}
    bad = [m for m in loaded if not stdlib(m) and m not in ours]
    assert bad == [], f"the zygote would load {bad}"
    assert set(ZYGOTE + KEEPER) <= set(loaded)


def test_the_checks_see_what_they_forbid(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom hutch.sandbox._host import volumes\ndef g():\n    from hutch.sandbox import _spec\n")
    assert imports(f) == [(1, "os"), (2, "hutch.sandbox._host.volumes"), (4, "hutch.sandbox._spec")]


def test_test_helpers_are_importable_whatever_directories_one_run_collects():
    """Each test directory is on sys.path under its own conftest; a helper imported by name must be unique."""
    tests = ROOT / "tests"
    seen: dict[str, Path] = {}
    for p in sorted(tests.rglob("*.py")):
        for n, m in imports(p):
            assert m.split(".")[0] != "conftest", f"{p.relative_to(ROOT)} line {n}: move the helper into a support module"
        if p.name != "conftest.py" and not p.name.startswith("test_") and p.parent != tests:
            assert p.stem not in seen, f"{p.relative_to(ROOT)} and {seen[p.stem].relative_to(ROOT)} share a name"
            seen[p.stem] = p


def private_imports(path: Path) -> list[str]:
    """`from m import _x` where m._x is not a module, and `m._x` where m is a hutch module this file imported
    (by a name of its own, or spelt out: `import hutch.a.b` then `hutch.a.b._x`)."""
    tree = ast.parse(path.read_text(), str(path))
    modules, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module.startswith("hutch") and path_of(f"{node.module}.{a.name}").exists():
                    modules.add(a.asname or a.name)
                elif a.name.startswith("_"):
                    out.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name.startswith("hutch"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node.value, ast.Attribute) and (owner := ast.unparse(node.value)).startswith("hutch.") \
                and path_of(owner).exists() and not path_of(f"{owner}.{node.attr}").exists():
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "hutch").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT / "hutch")))
def test_no_module_imports_another_modules_private_names(path):
    assert private_imports(path) == [], f"{path.relative_to(ROOT)}: make the name public where it is defined"


def test_the_private_name_check_sees_what_it_forbids(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom hutch.sandbox._spec import _MOUNT_FIELDS, Mount\nfrom hutch.sandbox import _client\n"
                 "from hutch.sandbox._host.egress import netns as n\nos._exit\n_client._UDS_BASE\nn._x\n_client.Client\n"
                 "import hutch.memory._tx\nhutch.memory._tx._syncfs\nhutch.memory._tx.Tx\nhutch.sandbox._client\n")
    assert private_imports(f) == ["line 2: from hutch.sandbox._spec import _MOUNT_FIELDS",
                                  "line 6: _client._UDS_BASE", "line 7: n._x", "line 10: hutch.memory._tx._syncfs"]



ENTRY_POINTS = ("hutch.fuse", "hutch.mcp", "hutch.integrations", "hutch.cli")
CORE_AND_WINGS = [p for pkg in ("_core", "sandbox", "memory") for p in sorted((ROOT / "hutch" / pkg).rglob("*.py"))]


def upward_imports(path: Path, core: bool) -> list[str]:
    """Imports of an entry point, and for a module of _core any of hutch's but _core's."""
    return [f"line {n}: {m}" for n, m in imports(path)
            if any(under(m, e) for e in ENTRY_POINTS)
            or core and under(m, "hutch") and m != "hutch" and not under(m, "hutch._core")]


@pytest.mark.parametrize("path", CORE_AND_WINGS, ids=lambda p: str(p.relative_to(ROOT / "hutch")))
def test_core_and_the_wings_never_import_the_entry_points(path):
    """The map in docs/architecture.md: the entry points join the wings, never the other way round, and
    _core (shared by every part) imports nothing of hutch but itself."""
    bad = upward_imports(path, core=path.is_relative_to(ROOT / "hutch" / "_core"))
    assert bad == [], f"{path.relative_to(ROOT)}: {bad}"


def test_the_upward_import_check_sees_what_it_forbids(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import hutch\nfrom hutch._core import errors\nfrom hutch.cli import main\nimport hutch.memory\n")
    assert upward_imports(f, core=False) == ["line 3: hutch.cli"]
    assert upward_imports(f, core=True) == ["line 3: hutch.cli", "line 4: hutch.memory"]


# --- the fleet (hutch/fleet/, and its caller side hutch/sandbox/_fleet.py) ----------------------------------

FLEET = ROOT / "hutch" / "fleet"


@pytest.mark.parametrize("path", sorted(FLEET.rglob("*.py")), ids=lambda p: p.name)
def test_the_fleet_imports_core_the_caller_side_and_memory(path):
    """The fleet runs on Ray nodes and starts daemons as processes: it never imports the host side."""
    bad = [f"line {n}: {m}" for n, m in imports(path)
           if under(m, "hutch") and m != "hutch" and not (under(m, "hutch._core") or under(m, "hutch.fleet")
                                                          or under(m, "hutch.memory") or under(m, "hutch.sandbox"))
           or under(m, "hutch.sandbox._host") or under(m, "hutch.sandbox._inside")]
    assert bad == [], f"{path.relative_to(ROOT)}: {bad}"


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "hutch").rglob("*.py")
                                        if not (p.is_relative_to(FLEET) or p.is_relative_to(ROOT / "hutch" / "cli"))),
                         ids=lambda p: str(p.relative_to(ROOT / "hutch")))
def test_only_the_cli_imports_the_fleet(path):
    bad = [f"line {n}: {m}" for n, m in imports(path) if under(m, "hutch.fleet")]
    assert bad == [], f"{path.relative_to(ROOT)}: the fleet is an entry point; the SDK's side is sandbox/_fleet.py"


def test_ray_is_imported_only_when_a_fleet_is_used():
    """A single host needs no Ray: no module imports it at load time (only inside the functions a fleet runs)."""
    for path in sorted((ROOT / "hutch").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in names if under(m, "ray")], f"{path.relative_to(ROOT)} imports ray at load time"
    code = "import hutch, hutch.sandbox._client, hutch.fleet, hutch.cli, sys; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
