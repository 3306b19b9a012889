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


def _client_images() -> list[dict]:
    from hutch.sandbox import _client

    return _client.default_client().json("GET", "/v1/images")["images"]


def test_a_built_name_works_everywhere_an_image_is_accepted(busybox_root, daemon, tmp_path, make_sandbox):
    """`hutch image build images.py:agent_image`, then the name as image= of the SDK (sync and async), of
    `hutch run --image`, and of MCP's sandbox_create; a sandbox records the image the name meant then."""
    import asyncio
    import os
    import subprocess
    import sys

    from click.testing import CliRunner
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    from hutch.cli import cli

    f = tmp_path / "images.py"
    f.write_text("import hutch\n"
                 f"agent_image = hutch.Image.from_directory({str(busybox_root)!r}).run_commands('echo named > /which')\n")
    r = CliRunner().invoke(cli, ["image", "build", f"{f}:agent_image", "-q"])
    assert r.exit_code == 0, r.output
    ref = r.output.strip().splitlines()[-1]

    # the name moved here from the image test_cli_image_build_names_the_image built (one name, one image)
    assert [i["ref"] for i in _client_images() if i.get("name") == "agent_image"] == [ref]
    sb = make_sandbox(image="agent_image")
    assert sb.run("cat", "/which", check=True).stdout == "named\n"
    assert sb.info["spec"]["image"] == ref   # the id, not the name: a name may move to another image

    async def aio():
        asb = await hutch.AsyncSandbox.create(image="agent_image", timeout=60, tags=RUN_TAG)
        try:
            return (await asb.run("cat", "/which", check=True)).stdout
        finally:
            await asb.terminate()
    assert asyncio.run(aio()) == "named\n"

    env = {k: v for k, v in os.environ.items() if k.startswith("HUTCH_") or k == "PATH"}
    r = subprocess.run([sys.executable, "-m", "hutch", "run", "--image", "agent_image", "--", "cat", "/which"],
                       capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout) == (0, "named\n"), r.stderr

    # a step on top of the name builds on the image it names now
    top = hutch.Image("agent_image").run_commands("echo top >> /which").build(quiet=True)
    assert make_sandbox(image=top).run("cat", "/which", check=True).stdout == "named\ntop\n"

    async def mcp_session(*flags):
        params = StdioServerParameters(command=sys.executable, args=["-m", "hutch", "mcp", *flags], env=env)
        async with Client(params) as client:
            res = await client.call_tool("sandbox_create", {"image": "agent_image", "timeout": 60,
                                                            "tags": RUN_TAG})
            if not flags:   # the name leads to a host directory (its base): an MCP client may not use that
                assert res.is_error and f"built on dir:{busybox_root}" in res.content[0].text, res.content
                return None
            assert not res.is_error, res.content
            sid = res.structured_content["result"]["sandbox_id"]
            try:
                out = await client.call_tool("sandbox_exec", {"sandbox_id": sid, "command": ["cat", "/which"]})
                return out.structured_content["result"]["stdout"]
            finally:
                await client.call_tool("sandbox_terminate", {"sandbox_id": sid})
    assert asyncio.run(mcp_session()) is None
    assert asyncio.run(mcp_session("--allow-host-dirs")) == "named\n"

    with pytest.raises(hutch.NotFoundError, match="name of a built image"):
        make_sandbox(image="no_such_image_name")
    with pytest.raises(hutch.InvalidSpecError, match="cannot name a built image"):
        hutch.Image.from_directory(busybox_root).run_commands("true").build(name="debian-slim", quiet=True)


def test_a_name_moves_to_the_image_built_last(base, make_sandbox):
    """One name, one image, also when the image named second had been built (unnamed) before."""
    first = base.run_commands("echo first > /which").build(name="moving_name", quiet=True)
    second_img = base.run_commands("echo second > /which")
    second = second_img.build(quiet=True)                 # built and stored, no name yet
    assert second_img.build(name="moving_name", quiet=True).ref == second.ref
    named = [i["ref"] for i in _client_images() if i.get("name") == "moving_name"]
    assert named == [second.ref] and first.ref != second.ref
    assert make_sandbox(image="moving_name").run("cat", "/which", check=True).stdout == "second\n"
