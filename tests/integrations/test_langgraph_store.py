"""HutchStore against LangGraph's BaseStore contract, a real store (files + git), and a real LangGraph agent
whose tool writes long-term memory through the store (the model: LangChain's scripted fake)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

pytest.importorskip("langgraph.store.base", reason="pip install 'hutch[langchain]'")

from typing import Annotated  # noqa: E402

from langchain.agents import create_agent  # noqa: E402
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.prebuilt import InjectedStore  # noqa: E402
from langgraph.store.base import GetOp, InvalidNamespaceError, PutOp  # noqa: E402

import hutch  # noqa: E402
from hutch.integrations.langgraph import HutchStore, class_of, slug_of  # noqa: E402


@pytest.fixture
def mem(tmp_path):
    return hutch.Memory(tmp_path / "store")


def git(mem, *args) -> str:
    return subprocess.run(["git", "-C", str(mem.root), *args], capture_output=True, text=True, check=True).stdout


def test_put_get_update_delete_are_files_and_commits(mem):
    st = HutchStore(mem)
    st.put(("users", "u-42"), "prefs", {"text": "likes short answers", "n": 3, "tags": ["a", "b"],
                                         "nested": {"when": "2026-01-01", "ok": True, "none": None}})
    it = st.get(("users", "u-42"), "prefs")
    assert it.value == {"text": "likes short answers", "n": 3, "tags": ["a", "b"],
                        "nested": {"when": "2026-01-01", "ok": True, "none": None}}
    assert it.namespace == ("users", "u-42") and it.key == "prefs" and it.created_at <= it.updated_at
    e = mem.get("users--u-42/prefs")                                  # a plain entity file in git
    assert "likes short answers" in e.body
    assert (mem.root / "users--u-42" / "prefs.md").read_text().startswith("---\n")
    st.put(("users", "u-42"), "prefs", {"text": "likes long answers"})
    assert st.get(("users", "u-42"), "prefs").value == {"text": "likes long answers"}
    st.delete(("users", "u-42"), "prefs")
    assert st.get(("users", "u-42"), "prefs") is None and not mem.exists("users--u-42/prefs")
    ops = [v.op for v in mem.history("users--u-42/prefs")]
    assert ops == ["forget", "update", "put"]
    assert all(v.source == "langgraph:store" for v in mem.history("users--u-42/prefs"))
    assert "deleted through the LangGraph store" in git(mem, "log", "-1", "--format=%B")
    st.delete(("users", "u-42"), "prefs")   # deleting what is gone is a no-op, as in LangGraph's stores


def test_a_batch_of_writes_is_one_commit_and_last_write_wins(mem):
    st = HutchStore(mem)
    before = int(git(mem, "rev-list", "--count", "HEAD"))
    res = st.batch([PutOp(("a",), "k1", {"v": 1}), PutOp(("a",), "k2", {"v": 2}), PutOp(("a",), "k1", {"v": 3}),
                    GetOp(("a",), "k1")])
    assert res[:3] == [None, None, None] and res[3].value == {"v": 3}
    assert int(git(mem, "rev-list", "--count", "HEAD")) == before + 1
    assert asyncio.run(st.aget(("a",), "k2")).value == {"v": 2}


def test_odd_namespaces_and_keys_map_to_safe_distinct_files(mem):
    st = HutchStore(mem)
    odd = [(("Users", "Ünïcode ns"), "a/b/../../c"), (("users", "u 1"), ".."), (("x" * 80,), "k"),
           (("users--u", "1"), "k"), (("users", "u--1"), "k"), (("users", "x0123456789abcdef"), "k"),
           (("n",), "../../../etc/passwd"), (("n",), ""), (("n",), "x.md"), (("n",), "ok~1")]
    for i, (ns, key) in enumerate(odd):
        st.put(ns, key, {"i": i})
    classes = {class_of(ns) for ns, _ in odd}
    assert len({(class_of(ns), slug_of(k)) for ns, k in odd}) == len(odd)   # injective
    for i, (ns, key) in enumerate(odd):
        assert st.get(ns, key).value == {"i": i}
    for cls in classes:
        assert (mem.root / cls).is_dir() and (mem.root / cls).resolve().parent == mem.root.resolve()
    assert not (mem.root.parent / "etc").exists()
    assert mem.check().ok
    with pytest.raises(InvalidNamespaceError):
        st.put(("a.b",), "k", {})
    with pytest.raises(ValueError, match="JSON"):
        st.put(("n",), "bad", {"when": object()})
    with pytest.raises(ValueError, match="at most"):
        st.put(("n",), "huge", {"t": "x" * (2 << 20)})
    assert st.get(("n",), "huge") is None and st.get(("n",), "bad") is None


def test_search_by_meaning_with_filters_and_list_namespaces(mem):
    st = HutchStore(mem)
    st.put(("users", "u1", "memories"), "m1", {"text": "Alice prefers tea over coffee", "kind": "pref", "n": 1})
    st.put(("users", "u1", "memories"), "m2", {"text": "Alice's project is about churn", "kind": "fact", "n": 5})
    time.sleep(1.1)   # the files record seconds: m3 is the newest
    st.put(("users", "u2", "memories"), "m3", {"text": "Bob prefers coffee", "kind": "pref", "n": 9})
    mem.put("actors", "Not An Item", body="prefers coffee too")   # other classes are not items
    hits = st.search(("users", "u1"), query="what does she like to drink?", limit=5)
    assert hits and hits[0].key == "m1" and hits[0].score > 0
    assert {h.namespace for h in hits} == {("users", "u1", "memories")}
    assert [h.key for h in st.search(("users",), filter={"kind": "pref"}, query="coffee")] in (["m3", "m1"],
                                                                                                ["m1", "m3"])
    assert [h.key for h in st.search(("users",), filter={"n": {"$gte": 5}})] == ["m3", "m2"]   # newest first
    assert len(st.search(("users",), limit=1, offset=1)) == 1
    assert st.list_namespaces() == [("users", "u1", "memories"), ("users", "u2", "memories")]
    assert st.list_namespaces(prefix=("users", "u2")) == [("users", "u2", "memories")]
    assert st.list_namespaces(suffix=("memories",), max_depth=2) == [("users", "u1"), ("users", "u2")]
    assert st.search(("actors",)) == []


def test_an_entity_that_is_not_an_item_is_never_overwritten(mem):
    mem.put("notes", "k", body="hand-written", slug="k")
    st = HutchStore(mem)
    assert st.get(("notes",), "k") is None
    with pytest.raises(hutch.EntityExistsError):
        st.put(("notes",), "k", {"v": 1})
    assert mem.get("notes/k").body.strip() == "hand-written"


def test_a_langgraph_agent_remembers_through_the_store(mem):
    class FakeToolCallingModel(GenericFakeChatModel):
        def bind_tools(self, tools, **kw):
            return self

    @tool
    def remember(text: str, store: Annotated[object, InjectedStore()]) -> str:
        """Remember a fact about the user."""
        store.put(("users", "u-7"), "fact-1", {"text": text})
        return "remembered"

    @tool
    def recall(query: str, store: Annotated[object, InjectedStore()]) -> str:
        """Recall facts about the user."""
        return json.dumps([h.value["text"] for h in store.search(("users", "u-7"), query=query)])

    st = HutchStore(mem, source="agent:support")
    model = FakeToolCallingModel(messages=iter([
        AIMessage(content="", tool_calls=[{"name": "remember", "args": {"text": "The user's dog is called Rex."},
                                            "id": "t1", "type": "tool_call"}]),
        AIMessage(content="", tool_calls=[{"name": "recall", "args": {"query": "dog name"}, "id": "t2",
                                            "type": "tool_call"}]),
        AIMessage(content="Your dog is Rex.")]))
    agent = create_agent(model, [remember, recall], store=st)
    out = agent.invoke({"messages": [("user", "My dog is Rex. What's my dog's name?")]})
    recalled = [m for m in out["messages"] if getattr(m, "tool_call_id", None) == "t2"][0]
    assert json.loads(recalled.content) == ["The user's dog is called Rex."]
    assert mem.get("users--u-7/fact-1").meta["value"] == {"text": "The user's dog is called Rex."}
    assert mem.history("users--u-7/fact-1")[0].source == "agent:support"
