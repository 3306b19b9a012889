"""A smolagents CodeAgent whose code runs in a hutch sandbox (HutchExecutor, over Sandbox.run_code).

    python examples/integrations/smolagents_agent.py          # a scripted fake model: no key needed
    OPENAI_API_KEY=... python examples/integrations/smolagents_agent.py   # a real one (pip install openai)

Needs: pip install 'hutch[smolagents]', root, and a hutch with Sandbox.run_code (the stateful code
interpreter); with an older hutch this prints why it cannot run and exits 1.
"""

from __future__ import annotations

import os
import sys

import hutch
from hutch.integrations.smolagents import HutchExecutor
from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model


class ScriptedModel(Model):
    """Answers each step with the next scripted code action; a stand-in for a real model."""

    def __init__(self, replies):
        super().__init__(model_id="scripted")
        self.replies = list(replies)

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kw):
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


def model():
    if os.environ.get("OPENAI_API_KEY"):
        from smolagents import OpenAIServerModel

        return OpenAIServerModel(model_id=os.environ.get("OPENAI_MODEL", "gpt-4.1-mini"))
    return ScriptedModel(["Thought: compute it.\n<code>\na, b = 0, 1\nfor _ in range(20):\n    a, b = b, a + b\n"
                          "print(a)\n</code>", "Thought: done.\n<code>\nfinal_answer(a)\n</code>"])


def main() -> int:
    try:
        executor = HutchExecutor(sandbox_options={"timeout": 300})
    except hutch.ConfigError as e:
        print(f"cannot run: {e}", file=sys.stderr)
        return 1
    with CodeAgent(tools=[], model=model(), executor=executor, max_steps=5) as agent:
        print("answer:", agent.run("What is the 20th Fibonacci number?"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
