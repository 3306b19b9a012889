"""Images defined in Python: layer cache hits and rebuilds, failing steps, env/workdir, copies."""

from __future__ import annotations

import asyncio
import os

import pytest
from img_support import RUN_TAG

import hutch


def _layer_dirs(state) -> set[str]:
    d = state / "layers"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _node_files(state) -> set[str]:
    d = state / "nodes"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def test_layers_cache_and_rebuild_from_the_changed_step(base, make_sandbox, tmp_path, capsys, daemon):
    src = tmp_path / "tool.sh"
    src.write_text("#!/bin/sh\necho tool-v1\n")
    os.chmod(src, 0o755)
    image = (base.run_commands("echo built > /etc/step1", "mkdir -p /opt/x && echo y > /opt/x/y")
             .copy_local_file(src, "/opt/tool.sh")
             .env({"GREETING": "hello"})
             .workdir("/work")
             .run_commands("pwd > /etc/step5; echo $GREETING >> /etc/step5"))
    built = image.build()
    err = capsys.readouterr().err
    assert err.count(": building") == 5 and "cached" not in err
    assert built.ref.startswith("image:") and not built.steps

    sb = make_sandbox(image=built)
    r = sb.run("sh", "-c", "cat /etc/step1 /opt/x/y /etc/step5; /opt/tool.sh; pwd; echo $GREETING; "
                           "stat -c %a /opt/tool.sh", check=True)
    assert r.stdout.split() == ["built", "y", "/work", "hello", "tool-v1", "/work", "hello", "755"]

    # everything cached: no step runs, the same image comes back
    assert image.build().ref == built.ref
    err = capsys.readouterr().err
    assert ": building" not in err and "5/5" in err and "cached" in err

    # a changed copied file rebuilds its step and every step after it, not the ones before
    layers_before = _layer_dirs(daemon.state_dir)
    src.write_text("#!/bin/sh\necho tool-v2\n")
    changed = image.build()
    err = capsys.readouterr().err
    assert changed.ref != built.ref
    assert "1/5 RUN" in err and "1/5" not in [ln.split()[3] for ln in err.splitlines() if ": building" in ln]
    assert [ln.split()[3] for ln in err.splitlines() if ": building" in ln] == ["2/5", "3/5", "4/5", "5/5"]
    assert _layer_dirs(daemon.state_dir) - layers_before   # new layers for the rebuilt steps
    out = make_sandbox(image=changed).run("/opt/tool.sh", check=True).stdout
    assert out == "tool-v2\n"

    # Sandbox.create builds (here: a cache hit) and applies the image's env and workdir
    sb2 = make_sandbox(image=image)
    assert sb2.run("sh", "-c", "pwd; echo $GREETING", check=True).stdout == "/work\nhello\n"


def test_a_failing_step_raises_with_its_output_and_leaves_no_layer(base, daemon, capsys):
    good = base.run_commands("echo fine > /etc/fine")
    good.build(quiet=True)
    layers, nodes = _layer_dirs(daemon.state_dir), _node_files(daemon.state_dir)
    bad = good.run_commands("echo about to fail; echo oops >&2; dd if=/dev/zero of=/big bs=1M count=3; exit 3")
    with pytest.raises(hutch.ImageError) as ei:
        bad.build()
    e = ei.value
    assert e.returncode == 3 and "about to fail" in e.output and "oops" in e.output
    assert "exited with code 3" in str(e) and "Fix the step" in str(e)
    assert _layer_dirs(daemon.state_dir) == layers and _node_files(daemon.state_dir) == nodes
    assert not [p for p in (daemon.state_dir / "layers").iterdir() if p.name.startswith(".tmp-")]
    assert hutch.Sandbox.list(tags={"hutch-build": "x"}) == []
    # the step after a good one is retried from the cache on the next build
    with pytest.raises(hutch.ImageError):
        bad.build(quiet=True)


def test_bad_step_arguments_name_the_fix(base, tmp_path):
    with pytest.raises(hutch.InvalidSpecError, match="Debian package name"):
        base.apt_install("git; rm -rf /")
    with pytest.raises(hutch.InvalidSpecError, match="options"):
        base.pip_install("--index-url=http://evil/")
    with pytest.raises(hutch.NotFoundError, match="not a file"):
        base.copy_local_file(tmp_path / "missing", "/x")
    with pytest.raises(hutch.InvalidSpecError, match="absolute path"):
        base.workdir("relative")
    with pytest.raises(hutch.InvalidSpecError, match="dict of str"):
        base.env({"A": 1})


def test_copy_local_dir_and_async_create_builds(base, tmp_path, daemon):
    tools = tmp_path / "tools"
    (tools / "sub").mkdir(parents=True)
    (tools / "a.txt").write_text("A")
    (tools / "sub" / "b.txt").write_text("B")
    image = base.copy_local_dir(tools, "/opt/tools").env({"K": "v"})

    async def main():
        sb = await hutch.AsyncSandbox.create(image=image, tags=RUN_TAG, timeout=60)
        try:
            r = await sb.run("sh", "-c", "cat /opt/tools/a.txt /opt/tools/sub/b.txt; echo $K; echo s > /snap",
                             check=True)
            snap = await sb.snapshot_filesystem()
            sb2 = await hutch.AsyncSandbox.create(image=snap, tags=RUN_TAG, timeout=60)
            try:
                r2 = await sb2.run("cat", "/snap", "/opt/tools/a.txt", check=True)
            finally:
                await sb2.terminate()
            return r.stdout + r2.stdout
        finally:
            await sb.terminate()

    assert asyncio.run(main()) == "ABv\ns\nA"


def test_steps_run_without_network_by_default(base):
    bad = base.run_commands("wget -q -T 2 -O- http://192.0.2.1/ || (echo no-network; exit 7)")
    with pytest.raises(hutch.ImageError) as ei:
        bad.build(quiet=True)
    assert "no-network" in ei.value.output


def test_build_steps_keep_a_few_capabilities_and_sandboxes_none(base, make_sandbox):
    built = base.run_commands("mkdir /home/agent && chown 1000:1000 /home/agent && "
                              "grep CapEff /proc/self/status > /etc/build-caps").build(quiet=True)
    sb = make_sandbox(image=built)
    out = sb.run("sh", "-c", "stat -c %u:%g /home/agent; cat /etc/build-caps; grep CapEff /proc/self/status; "
                             "chown 0:0 /home/agent || echo refused", check=True).stdout.split("\n")
    assert out[0] == "1000:1000"
    assert out[1].split()[1] == "00000000000004fb"   # CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID NET_BIND
    assert out[2].split()[1] == "0000000000000000" and "refused" in out[3]
    with pytest.raises(hutch.InvalidSpecError, match="may keep only"):
        from hutch.sandbox._spec import SandboxSpec

        SandboxSpec.build(capabilities=["SYS_ADMIN"])


def test_cli_image_build_names_the_image(busybox_root, daemon, tmp_path):
    from click.testing import CliRunner

    from hutch.cli import cli

    f = tmp_path / "images.py"
    f.write_text("import hutch\n"
                 f"agent_image = hutch.Image.from_directory({str(busybox_root)!r}).run_commands('echo cli > /cli')\n"
                 "not_an_image = 3\n")
    runner = CliRunner()
    r = runner.invoke(cli, ["image", "build", f"{f}:agent_image"])
    assert r.exit_code == 0, r.output
    ref = r.output.strip().splitlines()[-1]
    assert ref.startswith("image:") and hutch.Image.from_name("agent_image").ref == ref
    assert "agent_image" in runner.invoke(cli, ["image", "ls"]).output
    r = runner.invoke(cli, ["image", "build", f"{f}:not_an_image"])
    assert r.exit_code == 2 and "not a hutch.Image" in r.output
    r = runner.invoke(cli, ["image", "build", "images.py"])
    assert r.exit_code == 2 and "FILE:NAME" in r.output
