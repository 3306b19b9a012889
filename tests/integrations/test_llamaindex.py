"""LlamaIndex over hutch: the tool spec in a real FunctionAgent (model: LlamaIndex's own
MockFunctionCallingLLM, scripted) in a real sandbox, and the retriever over a real store."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("llama_index.core", reason="pip install 'hutch[llamaindex]'")

# llama-index-workflows' Workflow.__init__ lists its steps with inspect.getmembers(self), which reads every
# attribute of the pydantic model, the deprecated ones too (`__fields__`, `__fields_set__`, the instance's
# `model_computed_fields`): pydantic's deprecation warnings raised inside that package, for any FunctionAgent,
# that we cannot change (hutch.integrations.llamaindex makes no pydantic models)
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")

from llama_index.core.agent.workflow import FunctionAgent  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock  # noqa: E402
from llama_index.core.llms import MockLLM  # noqa: E402
from llama_index.core.llms.mock import MockFunctionCallingLLM  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402

import hutch  # noqa: E402
from hutch.integrations.llamaindex import HutchRetriever, HutchToolSpec  # noqa: E402

CONVERSATION = {
    "speaker_a": "Nadia", "speaker_b": "Tomas",
    "session_1_date_time": "1:56 pm on 8 May, 2023",
    "session_1": [
        {"speaker": "Nadia", "dia_id": "D1:1", "text": "Hi Tomas! How was your week?"},
        {"speaker": "Tomas", "dia_id": "D1:2", "text": "Busy. I started restoring an old sailing boat I bought."},
        {"speaker": "Nadia", "dia_id": "D1:3", "text": "I adopted a puppy from the shelter yesterday, a beagle!"},
        {"speaker": "Nadia", "dia_id": "D1:4", "text": "His name is Biscuit."},
    ],
    "qa": [],
}


def scripted_llm(*turns) -> tuple[MockFunctionCallingLLM, list]:
    """Each turn: a list of (tool_call_id, tool_name, kwargs), or the final text. Also returns the list of
    messages of the model's last call (the tool results the agent sent back included)."""
    seen: list[ChatMessage] = []
    queue = list(turns)

    def gen(messages, **kw):
        seen[:] = list(messages)
        t = queue.pop(0)
        if isinstance(t, str):
            return ChatMessage(role=MessageRole.ASSISTANT, content=t)
        return ChatMessage(role=MessageRole.ASSISTANT,
                           blocks=[ToolCallBlock(tool_call_id=i, tool_name=n, tool_kwargs=a) for i, n, a in t])

    return MockFunctionCallingLLM(response_generator=gen), seen


def run(agent, msg: str):
    async def go():
        return await agent.run(user_msg=msg)

    return asyncio.run(go())


def tool_results(seen) -> dict[str, str]:
    return {m.additional_kwargs.get("tool_call_id"): m.content for m in seen if m.role == MessageRole.TOOL}


def test_function_agent_runs_commands_and_files_in_its_sandbox(opts, no_leaks):
    llm, seen = scripted_llm([("w", "hutch_write_file", {"path": "/home/user/a/x.csv", "content": "a,b\n1,2\n"})],
                       [("e", "hutch_exec", {"command": "wc -l < /home/user/a/x.csv"}),
                        ("r", "hutch_read_file", {"path": "/home/user/a/x.csv"}),
                        ("l", "hutch_list_files", {"path": "/home/user/a"})],
                       "2 lines")
    with HutchToolSpec(sandbox_options=opts) as spec:
        tools = spec.to_tool_list()
        assert {t.metadata.name for t in tools} >= {"hutch_exec", "hutch_read_file", "hutch_write_file",
                                                    "hutch_list_files"}
        agent = FunctionAgent(tools=tools, llm=llm)
        out = run(agent, "count the lines")
        sb = spec.toolbox.owned_sandbox
        assert sb.files.read("/home/user/a/x.csv") == b"a,b\n1,2\n"
    assert str(out) == "2 lines"
    res = tool_results(seen)
    assert json.loads(res["e"])["stdout"].strip() == "2"
    assert json.loads(res["r"])["content"] == "a,b\n1,2\n"
    assert [e["name"] for e in json.loads(res["l"])["entries"]] == ["x.csv"]
    assert hutch.Sandbox.from_id(sb.id).status in ("terminated", "exited")


def test_bad_input_is_text_for_the_model_and_the_agent_goes_on(opts, no_leaks):
    llm, seen = scripted_llm([("a", "hutch_exec", {"command": ["not", "a", "string"]}),
                        ("b", "hutch_read_file", {"path": "/etc"}),
                        ("c", "hutch_write_file", {"path": "/home/user/big", "content": "x" * (5 << 20)}),
                        ("d", "hutch_exec", {"command": "true", "timeout": 1e9}),
                        ("e", "hutch_nonexistent_tool", {})],
                       "ok")
    with HutchToolSpec(sandbox_options=opts) as spec:
        out = run(FunctionAgent(tools=spec.to_tool_list(), llm=llm), "x")
    assert str(out) == "ok"
    res = tool_results(seen)
    assert set(res) == {"a", "b", "c", "d", "e"}
    assert "is a dir" in res["b"] and "4,194,304" in res["c"] and "out of range" in res["d"]
    assert all(not r.startswith("{") for r in res.values()), res


def test_retriever_nodes_carry_anchor_channels_and_scores(store):
    store.ingest_conversation(CONVERSATION, conv_id="c1")
    r = HutchRetriever(store, k=3)
    nodes = r.retrieve("What is the name of Nadia's dog?")
    top = nodes[0]
    assert top.node.metadata["anchor"] in ("D1:3", "D1:4") and top.node.metadata["speaker"] == "Nadia"
    assert top.node.id_ == f"{top.node.metadata['entity_id']}#{top.node.metadata['anchor']}"
    assert top.score > 0 and top.node.metadata["channels"] and "dense" in top.node.metadata["channels"]
    assert top.node.metadata["class"] == "interactions"
    assert ("Biscuit" in top.node.text) or ("beagle" in top.node.text)
    plain = HutchRetriever(store, k=2, classes=["orgs"]).retrieve("customer churn")
    assert [n.node.metadata["entity_id"] for n in plain] == ["orgs/acme"] and plain[0].node.metadata["anchor"] is None
    assert "churn" in plain[0].node.text
    anodes = asyncio.run(r.aretrieve("sailing boat"))
    assert anodes[0].node.metadata["anchor"] == "D1:2"


def test_retriever_feeds_a_query_engine(store):
    engine = RetrieverQueryEngine.from_args(HutchRetriever(store, k=2), llm=MockLLM())
    resp = engine.query("who is the head of data?")
    assert resp.source_nodes[0].node.metadata["entity_id"] == "actors/alice-chen"
    assert "Head of data" in resp.source_nodes[0].node.get_content()


def test_code_interpreter_keeps_state(daemon, no_leaks):
    llm, seen = scripted_llm([("1", "hutch_run_code", {"code": "import math\nr = 3"})],
                       [("2", "hutch_run_code", {"code": "round(math.pi * r ** 2, 2)"})], "done")
    with HutchToolSpec(sandbox_options={"timeout": 120}) as spec:
        run(FunctionAgent(tools=spec.to_tool_list(), llm=llm), "area")
    assert json.loads(tool_results(seen)["2"])["result"] == "28.27"
