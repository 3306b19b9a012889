"""A LlamaIndex FunctionAgent with hutch's code-interpreter tool spec, and a retriever over hutch memory.

    python examples/integrations/llamaindex_agent.py          # LlamaIndex's scripted mock LLM: no key needed
    OPENAI_API_KEY=... python examples/integrations/llamaindex_agent.py   # pip install llama-index-llms-openai

Needs: pip install 'hutch[llamaindex]' (and root, for the sandbox).
"""

from __future__ import annotations

import asyncio
import os
import tempfile

import hutch
from hutch.integrations.llamaindex import HutchRetriever, HutchToolSpec
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.llms.mock import MockFunctionCallingLLM


def llm():
    if os.environ.get("OPENAI_API_KEY"):
        from llama_index.llms.openai import OpenAI

        return OpenAI(model=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"))
    script = [[ToolCallBlock(tool_call_id="1", tool_name="hutch_write_file",
                             tool_kwargs={"path": "/home/user/data.csv", "content": "x,y\n1,2\n3,4\n"})],
              [ToolCallBlock(tool_call_id="2", tool_name="hutch_exec",
                             tool_kwargs={"command": "awk -F, 'NR>1 {s+=$2} END {print s}' /home/user/data.csv"})],
              "The y column sums to 6."]

    def answer(messages, **kw):
        step = script.pop(0)
        if isinstance(step, str):
            return ChatMessage(role=MessageRole.ASSISTANT, content=step)
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=step)

    return MockFunctionCallingLLM(response_generator=answer)


async def main() -> None:
    with HutchToolSpec(sandbox_options={"timeout": 300}) as spec:
        agent = FunctionAgent(tools=spec.to_tool_list(), llm=llm(),
                              system_prompt="Work in the sandbox; show your numbers.")
        print("agent:", await agent.run(user_msg="Write a small CSV and sum its y column."))

    with tempfile.TemporaryDirectory(prefix="hutch-example-") as tmp:   # the example's memory, removed after it
        mem = hutch.Memory(os.path.join(tmp, "memory"))
        mem.put("decisions", "Pricing", body="We chose tiered pricing in November, after the churn review.")
        mem.put("notes", "Lunch", body="Tacos on Tuesday.")
        for n in HutchRetriever(mem, k=2).retrieve("what did we decide about prices?"):
            print(f"retrieved {n.node.metadata['entity_id']} score={n.score:.3f} "
                  f"channels={sorted(n.node.metadata['channels'])}: {n.node.text[:60]}")


if __name__ == "__main__":
    asyncio.run(main())
