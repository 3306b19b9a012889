"""The smolagents executor: a real CodeAgent whose code runs in a real hutch sandbox through Sandbox.run_code.
The model is a fake smolagents Model that answers with scripted code actions (the only fake)."""

from __future__ import annotations

import pytest

pytest.importorskip("smolagents", reason="pip install 'hutch[smolagents]'")

from smolagents import CodeAgent  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402

import hutch  # noqa: E402
from hutch.integrations.smolagents import HutchExecutor  # noqa: E402

from integ_support import running  # noqa: E402

class FakeModel(Model):
    """Answers each step with the next scripted reply (a thought and a <code> block), and records what it saw."""

    def __init__(self, replies):
        super().__init__(model_id="fake")
        self.replies, self.seen = list(replies), []

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kw):
        self.seen.append(messages)
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


def step(code: str) -> str:
    return f"Thought: next.\n<code>\n{code}\n</code>"


def test_code_agent_keeps_state_and_returns_the_final_answer(daemon, no_leaks):
    model = FakeModel([step("x = 20\nprint('x set')"), step("import math\ny = math.factorial(5) + x\nprint(y)"),
                       step("final_answer(y)")])
    ex = HutchExecutor(sandbox_options={"timeout": 120})
    with CodeAgent(tools=[], model=model, executor=ex, max_steps=5) as agent:
        assert agent.run("compute") == 140
        sid = ex.toolbox.owned_sandbox.id
    assert hutch.Sandbox.from_id(sid).status in ("terminated", "exited")
    observations = " ".join(str(m) for m in model.seen[-1])
    assert "x set" in observations and "140" in observations


def test_an_error_in_the_agents_code_goes_back_to_the_model(daemon, no_leaks):
    model = FakeModel([step("1 / 0"), step("final_answer('recovered')")])
    with CodeAgent(tools=[], model=model, executor=HutchExecutor(sandbox_options={"timeout": 120}),
                   max_steps=4) as agent:
        assert agent.run("go") == "recovered"
    assert "ZeroDivisionError" in " ".join(str(m) for m in model.seen[-1])


def test_a_crashed_run_ends_the_sandbox(daemon, no_leaks):
    class Boom(Exception):
        pass

    class Crashing(FakeModel):
        def generate(self, *a, **kw):
            if len(self.seen) == 1:
                raise Boom("model gone")
            return super().generate(*a, **kw)

    ex = HutchExecutor(sandbox_options={"timeout": 120})
    with pytest.raises(Exception):
        with CodeAgent(tools=[], model=Crashing([step("a = 1")]), executor=ex, max_steps=3) as agent:
            agent.run("go")
    assert not running({"integration": "smolagents"})


def test_a_given_sandbox_is_left_running(daemon, no_leaks):
    with hutch.Sandbox.create(image=hutch.Image.code_interpreter(), timeout=120) as sb:
        with CodeAgent(tools=[], model=FakeModel([step("final_answer(6 * 7)")]),
                       executor=HutchExecutor(sandbox=sb)) as agent:
            assert agent.run("go") == 42
        assert sb.run("true").returncode == 0
