"""A LangChain agent (create_agent, on LangGraph) with hutch's tools and a LangGraph store kept as SMF files.

    python examples/integrations/langchain_agent.py          # a scripted fake model: no key needed
    OPENAI_API_KEY=... python examples/integrations/langchain_agent.py   # a real one (pip install langchain-openai)

Needs: pip install 'hutch[langchain]' (and root, for the sandboxes). The agent runs commands in a sandbox
made for the run (gone when the block ends), remembers a decision in the store (one commit, its source the
tool call), and the LangGraph store keeps a user preference as a file in the same git history.
"""

from __future__ import annotations

import os
import tempfile

import hutch
from hutch.integrations.langchain import HutchToolkit
from hutch.integrations.langgraph import HutchStore
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage


class ScriptedModel(GenericFakeChatModel):
    """LangChain's fake chat model with a script of tool calls; a stand-in for a real model."""

    def bind_tools(self, tools, **kwargs):
        return self


def model():
    if os.environ.get("OPENAI_API_KEY"):
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"))
    calls = [
        [{"name": "hutch_exec", "args": {"command": "python3 -c 'print(sum(range(101)))'"}, "id": "c1"}],
        [{"name": "hutch_memory_write", "args": {"title": "Gauss sum", "entity_class": "results",
                                                 "body": "sum(range(101)) is 5050, computed in a sandbox."},
          "id": "c2"}],
    ]
    return ScriptedModel(messages=iter([AIMessage(content="", tool_calls=c) for c in calls]
                                       + [AIMessage(content="The sum of 0..100 is 5050; I noted it.")]))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hutch-example-") as tmp:   # the example's memory, removed after it
        demo(hutch.Memory(os.path.join(tmp, "memory")))


def demo(mem: hutch.Memory) -> None:
    store = HutchStore(mem)
    store.put(("users", "ada"), "style", {"text": "Ada prefers short answers."})
    with HutchToolkit(memory=mem, sandbox_options={"timeout": 300}) as toolkit:
        agent = create_agent(model(), toolkit.get_tools(), store=store,
                             system_prompt="Compute in the sandbox; remember results.")
        result = agent.invoke({"messages": [("user", "What is the sum of 0..100? Remember it.")]})
        for m in result["messages"]:
            print(f"{m.type:>5}: {str(m.content)[:200]}")
    print("\nremembered:", [v.source for v in mem.history("results/gauss-sum")], mem.get("results/gauss-sum").body.strip())
    print("store search:", [(h.key, h.value) for h in store.search(("users",), query="how to answer")])
    print("store files:", mem.root)


if __name__ == "__main__":
    main()
