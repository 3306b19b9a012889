"""hutch's tools in OpenAI's shapes, driven by the official clients against a scripted API on loopback (the
only fake): the Agents SDK's Runner with FunctionTools, the Responses API and Chat Completions with handle();
a real sandbox, a real store."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai", reason="pip install 'hutch[openai]'")
pytest.importorskip("agents", reason="pip install 'hutch[openai]'")

import agents  # noqa: E402
import openai  # noqa: E402

import hutch  # noqa: E402
from hutch.integrations import openai as ho  # noqa: E402
from hutch.integrations.openai import HutchTools  # noqa: E402

from integ_support import running  # noqa: E402
from fake_llm import (ScriptedAPI, chat_calls, chat_text, function_outputs, responses_calls,  # noqa: E402
                      responses_text)

agents.set_tracing_disabled(True)   # the SDK would send traces to OpenAI: loopback only in tests
pytestmark = pytest.mark.usefixtures("own_event_loop")   # Runner.run_sync: see the fixture


def agent_with(api: ScriptedAPI, tools: HutchTools) -> agents.Agent:
    model = agents.OpenAIResponsesModel(model="gpt-fake",
                                        openai_client=openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="k",
                                                                         max_retries=0))
    return agents.Agent(name="t", instructions="use the tools", tools=tools.agent_tools(), model=model)


def test_agents_sdk_run_writes_runs_and_remembers(store, opts, no_leaks):
    turns = [responses_calls(("c1", "hutch_files", {"action": "write", "path": "/home/user/n.txt", "content": "2\n40\n",
                                                    "encoding": None}),
                             ("c2", "hutch_memory_write", {"title": "Sum task", "entity_class": "tasks",
                                                           "body": "Summed the numbers.", "facts": None})),
             responses_calls(("c3", "hutch_exec", {"command": "awk '{s+=$1} END {print s}' /home/user/n.txt",
                                                   "timeout": None, "workdir": None, "stdin": None}),
                             ("c4", "hutch_memory_search", {"query": "churn", "k": 2, "classes": None})),
             responses_text("42")]
    with ScriptedAPI(turns) as api, HutchTools(memory=store, sandbox_options=opts) as tools:
        result = agents.Runner.run_sync(agent_with(api, tools), "sum them")
        sb = tools.owned_sandbox
        assert sb.files.read("/home/user/n.txt") == b"2\n40\n"
    assert result.final_output == "42"
    sent = {**function_outputs(api.requests[1]), **function_outputs(api.requests[2])}
    assert json.loads(sent["c3"])["stdout"] == "42\n"
    assert json.loads(sent["c4"])["hits"][0]["id"] == "orgs/acme"
    assert store.history("tasks/sum-task")[0].source == "openai:c2"
    tools_sent = {t["name"]: t for t in api.requests[0]["tools"]}
    assert set(tools_sent) >= {"hutch_exec", "hutch_files", "hutch_memory_search", "hutch_memory_write"}
    assert tools_sent["hutch_exec"]["strict"] is True
    assert hutch.Sandbox.from_id(sb.id).status in ("terminated", "exited")


def test_agents_sdk_bad_arguments_are_outputs_and_the_run_goes_on(store, opts, no_leaks):
    bad = [("b0", "hutch_exec", "{not json"), ("b1", "hutch_exec", {"command": 5}),
           ("b2", "hutch_files", {"action": "chmod", "path": "/x"}), ("b3", "hutch_files", {"action": "read"}),
           ("b4", "hutch_memory_write", {"title": "x", "entity_class": "../x"}),
           ("b5", "hutch_exec", {"command": "true", "rm_rf": True}),
           ("b6", "hutch_files", {"action": "write", "path": "/home/user/x", "content": "z" * (5 << 20)}),
           ("b7", "hutch_memory_search", {"query": "x", "k": 10 ** 9}), ("b8", "hutch_exec", '"a string"')]
    turns = [responses_calls(*bad), responses_text("recovered")]
    with ScriptedAPI(turns) as api, HutchTools(memory=store, sandbox_options=opts) as tools:
        result = agents.Runner.run_sync(agent_with(api, tools), "misbehave")
    assert result.final_output == "recovered"
    sent = function_outputs(api.requests[1])
    assert set(sent) == {b[0] for b in bad}
    for cid, out in sent.items():
        assert not out.startswith("{") and 0 < len(out) < 2000, (cid, out)
    assert "not JSON" in sent["b0"] and "StorePathError" in sent["b4"] and "rm_rf" in sent["b5"]
    assert "4,194,304" in sent["b6"] and "out of range" in sent["b7"]


def test_responses_api_loop_with_handle(sb, store):
    turns = [responses_calls(("r1", "hutch_exec", {"command": ["sh", "-c", "echo hi > /tmp/f; cat /tmp/f"],
                                                   "timeout": 10, "workdir": "/tmp", "stdin": None}),
                             ("r2", "some_other_tool", {})),
             responses_text("said hi")]
    with ScriptedAPI(turns) as api:
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="k", max_retries=0)
        items = [{"role": "user", "content": "say hi"}]
        r = client.responses.create(model="gpt-fake", input=items, tools=HutchTools(sb, store).tool_params())
        out = ho.handle(r, sandbox=sb, memory=store)
        assert [o["call_id"] for o in out] == ["r1"]   # other tools are the caller's
        items += [{"type": "function_call", "call_id": "r1", "name": "hutch_exec",
                   "arguments": r.output[0].arguments}] + out
        r2 = client.responses.create(model="gpt-fake", input=items)
    assert r2.output_text == "said hi"
    assert json.loads(function_outputs(api.requests[1])["r1"])["stdout"] == "hi\n"
    assert sb.files.read("/tmp/f") == b"hi\n"
    assert api.requests[0]["tools"][0]["type"] == "function" and "parameters" in api.requests[0]["tools"][0]


def test_chat_completions_loop_with_handle(sb, store):
    turns = [chat_calls(("k1", "hutch_memory_write", {"title": "Chat note", "entity_class": "notes", "body": "from chat",
                                                      "facts": ["f1"]}),
                        ("k2", "hutch_files", {"action": "list", "path": "/", "content": None, "encoding": None})),
             chat_text("ok")]
    with ScriptedAPI(turns) as api:
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="k", max_retries=0)
        tools = HutchTools(sb, store)
        msgs = [{"role": "user", "content": "note it"}]
        c = client.chat.completions.create(model="gpt-fake", messages=msgs, tools=tools.tool_params("chat"))
        msgs += [c.choices[0].message.model_dump(exclude_none=True)] + tools.handle(c)
        c2 = client.chat.completions.create(model="gpt-fake", messages=msgs)
    assert c2.choices[0].message.content == "ok"
    tool_msgs = {m["tool_call_id"]: m["content"] for m in api.requests[1]["messages"] if m["role"] == "tool"}
    assert json.loads(tool_msgs["k1"])["id"] == "notes/chat-note"
    assert "bin" in [e["name"] for e in json.loads(tool_msgs["k2"])["entries"]]
    assert store.get("notes/chat-note").facts == ["f1"]
    assert store.history("notes/chat-note")[0].source == "openai:k1"
    assert api.requests[0]["tools"][0]["function"]["strict"] is True
    assert tools.owned_sandbox is None


def test_handle_without_a_sandbox_makes_none(store, daemon):
    before = set(running())
    r = responses_calls(("x", "hutch_exec", {"command": "ls"}), ("y", "hutch_memory_search", {"query": "pricing"}))
    out = {o["call_id"]: o["output"] for o in ho.handle(r, memory=store)}
    assert "no tool 'hutch_exec'" in out["x"] and json.loads(out["y"])["hits"][0]["id"] == "topics/pricing"
    assert set(running()) == before


def test_a_crashed_agents_run_leaves_no_sandbox(opts, no_leaks):
    turns = [responses_calls(("c", "hutch_exec", {"command": "true", "timeout": None, "workdir": None, "stdin": None}))]
    with pytest.raises(Exception):   # the script has no second turn: the API answers 500 and the run fails
        with ScriptedAPI(turns) as api, HutchTools(sandbox_options=opts) as tools:
            try:
                agents.Runner.run_sync(agent_with(api, tools), "go")
            finally:
                sid = tools.owned_sandbox.id
    assert hutch.Sandbox.from_id(sid).status in ("terminated", "exited")
