"""hutch as the Agents SDK's sandbox backend: a real SandboxAgent run (model: a scripted Responses API on
loopback, the only fake) whose shell tool runs in a real hutch sandbox, and the SDK's session API on it."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

pytest.importorskip("agents.sandbox", reason="pip install 'hutch[openai]'")

import agents  # noqa: E402
import openai  # noqa: E402
from agents import RunConfig, Runner  # noqa: E402
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig  # noqa: E402
from agents.sandbox.errors import InvalidManifestPathError  # noqa: E402

from hutch.integrations.openai_sandbox import HutchSandboxClient, HutchSandboxClientOptions  # noqa: E402

from integ_support import RUN_TAG, running  # noqa: E402
from fake_llm import ScriptedAPI, function_outputs, responses_calls, responses_text  # noqa: E402

agents.set_tracing_disabled(True)
pytestmark = pytest.mark.usefixtures("own_event_loop")   # Runner.run_sync: see the fixture


def model(api):
    return agents.OpenAIResponsesModel(model="gpt-fake", openai_client=openai.AsyncOpenAI(
        base_url=f"{api.url}/v1", api_key="k", max_retries=0))


def options(busybox_image, **kw):
    return HutchSandboxClientOptions(image=busybox_image.ref, timeout=120, tags={**RUN_TAG, **kw})


def test_a_sandbox_agent_runs_its_shell_in_hutch_and_the_sandbox_ends_with_the_run(busybox_image, no_leaks):
    turns = [responses_calls(("c1", "exec_command", {"cmd": "echo hi > note.txt; cat note.txt; pwd; ls; wc -l < /etc/passwd"})),
             responses_text("wrote note.txt")]
    with ScriptedAPI(turns) as api:
        agent = SandboxAgent(name="dev", instructions="use the shell", model=model(api))
        cfg = RunConfig(sandbox=SandboxRunConfig(client=HutchSandboxClient(),
                                                 options=options(busybox_image, case="run")))
        result = Runner.run_sync(agent, "write a note", run_config=cfg)
    assert result.final_output == "wrote note.txt"
    out = function_outputs(api.requests[1])["c1"]
    assert "hi" in out and "/workspace" in out and "note.txt" in out
    assert out.rstrip().endswith("1")   # the busybox root's /etc/passwd (one line): it ran in the sandbox
    assert not running({"case": "run"})   # ended with the run (an ended sandbox leaves the daemon's list)


def test_a_failed_run_leaves_no_sandbox(busybox_image, no_leaks):
    turns = [responses_calls(("c1", "exec_command", {"cmd": "true"}))]   # then the API answers 500
    with ScriptedAPI(turns) as api:
        agent = SandboxAgent(name="dev", instructions="x", model=model(api))
        cfg = RunConfig(sandbox=SandboxRunConfig(client=HutchSandboxClient(),
                                                 options=options(busybox_image, case="fail")))
        with pytest.raises(Exception):
            Runner.run_sync(agent, "go", run_config=cfg)
    assert "c1" in function_outputs(api.requests[1])   # the command ran in a sandbox before the failure
    assert not running({"case": "fail"})


def test_the_session_api_files_exec_confinement_and_snapshots(busybox_image, no_leaks):
    async def go():
        client = HutchSandboxClient()
        s = await client.create(manifest=Manifest(root="/workspace"), options=options(busybox_image, case="api"))
        try:
            await s.start()
            await s.write("src/app.txt", io.BytesIO(b"hello\n"))
            assert (await s.read("src/app.txt")).read() == b"hello\n"
            r = await s.exec("cat src/app.txt | wc -c")
            assert r.ok() and r.stdout.strip() == b"6"
            assert (await s.exec("exit 3")).exit_code == 3
            await s.exec("ln -s /etc /workspace/etc-link")
            for bad in ("../etc/passwd", "/etc/passwd", "etc-link/passwd"):   # the last through a symlink
                with pytest.raises(InvalidManifestPathError):
                    await s.read(bad)
                with pytest.raises(InvalidManifestPathError):
                    await s.write(bad, io.BytesIO(b"x"))
            assert (await s.exec("wc -l < /etc/passwd")).stdout.strip() == b"1"   # untouched
            tar = await s.persist_workspace()
            state = s.state
            payload = client.serialize_session_state(state)
        finally:
            await s.aclose()
            await client.delete(s)
        assert not running({"case": "api"})
        # a new sandbox from the snapshot: the workspace comes back
        s2 = await client.create(options=options(busybox_image, case="api2"))
        try:
            await s2.start()
            await s2.hydrate_workspace(tar)
            assert (await s2.read("src/app.txt")).read() == b"hello\n"
        finally:
            await s2.aclose()
            await client.delete(s2)
        restored = client.deserialize_session_state(json.loads(json.dumps(payload)))
        assert restored.sandbox_id == state.sandbox_id

    asyncio.run(go())
