"""The LangChain tools in a real LangChain agent (create_agent on LangGraph), a real sandbox and a real store.

The model is LangChain's own fake (GenericFakeChatModel) scripted with tool calls: the only fake, at the model
boundary. Each test drives full agent steps (the model asks for a tool, the tool runs, the result goes back)
and checks what landed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("langchain_core", reason="pip install 'hutch[langchain]'")
pytest.importorskip("langchain.agents", reason="pip install 'hutch[langchain]'")

from langchain.agents import create_agent  # noqa: E402
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402

import hutch  # noqa: E402
from hutch.integrations.langchain import HutchToolkit  # noqa: E402

from integ_support import running  # noqa: E402


class FakeToolCallingModel(GenericFakeChatModel):
    """LangChain's fake chat model, scripted; bind_tools is a no-op (the script already names the tools)."""

    def bind_tools(self, tools, **kwargs):
        return self


def call(name: str, args: dict, cid: str) -> dict:
    return {"name": name, "args": args, "id": cid, "type": "tool_call"}


def script(*turns) -> FakeToolCallingModel:
    """One AIMessage per model turn: a list of tool calls, or the final text."""
    msgs = [AIMessage(content=t) if isinstance(t, str) else AIMessage(content="", tool_calls=list(t)) for t in turns]
    return FakeToolCallingModel(messages=iter(msgs))


def tool_messages(result) -> dict[str, ToolMessage]:
    return {m.tool_call_id: m for m in result["messages"] if isinstance(m, ToolMessage)}


def test_agent_writes_runs_and_reads_in_its_own_sandbox(opts, no_leaks):
    with HutchToolkit(sandbox_options=opts) as tk:
        names = [t.name for t in tk.get_tools()]
        assert names[:2] == ["hutch_exec", "hutch_files"] or "hutch_run_code" in names
        agent = create_agent(script(
            [call("hutch_files", {"action": "write", "path": "/home/user/data/n.txt", "content": "3\n4\n5\n"}, "c1")],
            [call("hutch_exec", {"command": "awk '{s+=$1} END {print s}' /home/user/data/n.txt"}, "c2")],
            [call("hutch_files", {"action": "list", "path": "/home/user/data"}, "c3")],
            "The sum is 12."), tk.get_tools())
        result = agent.invoke({"messages": [("user", "Sum the numbers 3, 4, 5 in a file.")]})
        tm = tool_messages(result)
        assert json.loads(tm["c1"].content) == {"path": "/home/user/data/n.txt", "size": 6}
        assert json.loads(tm["c2"].content) == {"exit_code": 0, "stdout": "12\n", "stderr": ""}
        assert [e["name"] for e in json.loads(tm["c3"].content)["entries"]] == ["n.txt"]
        assert result["messages"][-1].content == "The sum is 12."
        sb = tk.owned_sandbox
        assert sb.files.read("/home/user/data/n.txt") == b"3\n4\n5\n"   # it landed in the sandbox itself
        assert sb.tags["created_by"] == "hutch-integrations" and sb.tags["integration"] == "langchain"
    assert hutch.Sandbox.from_id(sb.id).status in ("terminated", "exited")


def test_given_sandbox_is_used_and_left_running(sb):
    with HutchToolkit(sandbox=sb) as tk:
        agent = create_agent(script([call("hutch_exec", {"command": ["sh", "-c", "echo $0 > /tmp/who", "x"]}, "c1")],
                                    "ok"), tk.get_tools())
        agent.invoke({"messages": [("user", "go")]})
        assert tk.owned_sandbox is None
    assert sb.files.read("/tmp/who") == b"x\n"
    assert sb.run("true").returncode == 0   # still running: it is the caller's


def test_memory_tools_search_and_write_with_the_tool_calls_provenance(store, opts, no_leaks):
    with HutchToolkit(memory=store, sandbox_options=opts) as tk:
        agent = create_agent(script(
            [call("hutch_memory_search", {"query": "customer churn", "k": 3}, "s1")],
            [call("hutch_memory_write", {"title": "Churn review", "entity_class": "decisions",
                                         "body": "Call every client in week 2.", "facts": ["owner: Alice"]}, "w1")],
            "Noted."), tk.get_tools())
        tm = tool_messages(agent.invoke({"messages": [("user", "What about churn? Decide something.")]}))
        hits = json.loads(tm["s1"].content)["hits"]
        assert hits[0]["id"] == "orgs/acme" and "churn" in hits[0]["snippet"] and hits[0]["channels"]
        assert json.loads(tm["w1"].content)["id"] == "decisions/churn-review"
        assert tk.owned_sandbox is None   # memory tools need no sandbox: none was made
    e = store.get("decisions/churn-review")
    assert "Call every client in week 2." in e.body and e.facts == ["owner: Alice"]
    v = store.history("decisions/churn-review")
    assert len(v) == 1 and v[0].op == "put" and v[0].source == "langchain:w1"


BAD_CALLS = [
    ("hutch_exec", {"command": 123}),                                      # wrong type
    ("hutch_exec", {"command": []}),                                       # empty argv
    ("hutch_exec", {"command": "true", "timeout": -5}),                    # out of range
    ("hutch_exec", {"command": "x" * (2 << 20)}),                          # huge payload
    ("hutch_files", {"action": "delete", "path": "/etc/passwd"}),          # not an action
    ("hutch_files", {"action": "read", "path": "/proc"}),                  # a directory, not a file
    ("hutch_files", {"action": "read", "path": "/nonexistent"}),           # missing
    ("hutch_files", {"action": "read", "path": "/tmp/big"}),               # past MAX_FILE
    ("hutch_files", {"action": "read", "path": "/tmp"}),                   # a directory
    ("hutch_files", {"action": "write", "path": "/home/user/b", "content": "!!", "encoding": "base64"}),
    ("hutch_files", {"action": "write", "path": "/home/user/big", "content": "y" * (5 << 20)}),
    ("hutch_memory_search", {"query": "churn", "k": "lots"}),
    ("hutch_memory_search", {"query": "   "}),
    ("hutch_memory_write", {"title": "x", "entity_class": "../../etc"}),   # escapes the store
    ("hutch_memory_write", {"title": "x", "entity_class": ".git"}),
    ("hutch_memory_write", {"title": "x", "entity_class": "notes", "body": {"a": 1}}),
]


def test_bad_tool_input_is_a_tool_error_and_the_agent_goes_on(store, opts, no_leaks):
    setup = [call("hutch_exec", {"command": "head -c 5000000 /dev/zero > /tmp/big"}, "setup")]
    calls = [call(n, a, f"b{i}") for i, (n, a) in enumerate(BAD_CALLS)]
    before = set(os.listdir(store.root))
    with HutchToolkit(memory=store, sandbox_options=opts) as tk:
        agent = create_agent(script(setup, calls, [call("hutch_exec", {"command": "echo alive"}, "ok")], "done"),
                             tk.get_tools())
        result = agent.invoke({"messages": [("user", "misbehave")]})
    tm = tool_messages(result)
    for i, (name, args) in enumerate(BAD_CALLS):
        m = tm[f"b{i}"]
        assert m.status == "error", (name, args, m.content)
        assert len(m.content) < 2000 and m.content.strip(), (name, m.content)
    assert "ConfigError" in tm["b3"].content and "1,048,576" in tm["b3"].content
    assert "StorePathError" in tm["b13"].content and "5,000,000 bytes" in tm["b7"].content
    assert "is a dir" in tm["b8"].content
    assert json.loads(tm["ok"].content)["stdout"] == "alive\n"
    assert result["messages"][-1].content == "done"
    assert set(os.listdir(store.root)) == before   # nothing half-written in the store


def test_a_crash_in_the_agent_run_ends_the_sandbox(opts, no_leaks):
    class Boom(Exception):
        pass

    def turns():
        yield AIMessage(content="", tool_calls=[call("hutch_exec", {"command": "sleep 0"}, "c1")])
        raise Boom("the model service went away")

    made = []
    with pytest.raises(Boom):
        with HutchToolkit(sandbox_options=opts) as tk:
            agent = create_agent(FakeToolCallingModel(messages=turns()), tk.get_tools())
            try:
                agent.invoke({"messages": [("user", "go")]})
            finally:
                made.append(tk.owned_sandbox)
    assert made[0] is not None and hutch.Sandbox.from_id(made[0].id).status in ("terminated", "exited")
    assert not running({"integration": "langchain"})


def test_a_dropped_toolkit_ends_its_sandbox(opts, no_leaks):
    tk = HutchToolkit(sandbox_options=opts)
    tk.exec("true")
    sid = tk.owned_sandbox.id
    del tk
    import gc

    gc.collect()
    assert hutch.Sandbox.from_id(sid).status in ("terminated", "exited")


AGENT_THEN_SIGKILL = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import hutch
from hutch.integrations.langchain import HutchToolkit
tk = HutchToolkit(sandbox_options={"image": hutch.Image.from_directory(sys.argv[2]), "timeout": 120,
                                   "tags": {"killed": "yes"}})
next(t for t in tk.get_tools() if t.name == "hutch_exec").invoke({"command": "true"})
print(tk.owned_sandbox.id, flush=True)
time.sleep(300)
"""


def test_a_killed_agent_process_leaves_no_sandbox(daemon, busybox_image, no_leaks):
    here = os.path.dirname(__file__)
    p = subprocess.Popen([sys.executable, "-c", AGENT_THEN_SIGKILL, here, busybox_image.ref.removeprefix("dir:")],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        sid = p.stdout.readline().strip()
        assert sid, "the agent process did not start its sandbox"
        assert hutch.Sandbox.from_id(sid).status == "running"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and hutch.Sandbox.from_id(sid).status == "running":
        time.sleep(0.1)
    assert hutch.Sandbox.from_id(sid).status != "running"


def test_run_code_keeps_state_between_cells(daemon, no_leaks):
    with HutchToolkit(sandbox_options={"timeout": 120}) as tk:
        agent = create_agent(script([call("hutch_run_code", {"code": "x = 41"}, "r1")],
                                    [call("hutch_run_code", {"code": "print('hi'); x + 1"}, "r2")],
                                    [call("hutch_run_code", {"code": "1/0"}, "r3")], "done"), tk.get_tools())
        tm = tool_messages(agent.invoke({"messages": [("user", "compute")]}))
    r2 = json.loads(tm["r2"].content)
    assert r2["result"] == "42" and r2["stdout"] == "hi\n"
    assert json.loads(tm["r3"].content)["error"]["name"] == "ZeroDivisionError"
