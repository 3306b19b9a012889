"""OpenAI's shapes: an Agents SDK agent with hutch's function tools, and a SandboxAgent on a hutch sandbox.

    python examples/integrations/openai_agent.py              # the Agents SDK's ScriptedModel: no key needed
    OPENAI_API_KEY=... python examples/integrations/openai_agent.py   # a real model

Needs: pip install 'hutch[openai]' (and root, for the sandboxes). For the Responses / Chat Completions APIs
without the SDK: HutchTools.tool_params() and HutchTools.handle(response) (docs/integrations.md).
"""

from __future__ import annotations

import os
import tempfile

import agents
import hutch
from agents import Agent, RunConfig, Runner
from agents.sandbox import SandboxAgent, SandboxRunConfig
from agents.testing import ScriptedModel, assistant_message, function_call
from hutch.integrations.openai import HutchTools
from hutch.integrations.openai_sandbox import HutchSandboxClient, HutchSandboxClientOptions

REAL = bool(os.environ.get("OPENAI_API_KEY"))
MODEL = os.environ.get("OPENAI_MODEL", "gpt-4.1-mini")
if not REAL:
    agents.set_tracing_disabled(True)   # nothing leaves the machine with the scripted model


def model(*steps):
    return MODEL if REAL else ScriptedModel(list(steps))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hutch-example-") as tmp:   # the example's memory, removed after it
        demo(hutch.Memory(os.path.join(tmp, "memory")))


def demo(mem: hutch.Memory) -> None:
    with HutchTools(memory=mem, sandbox_options={"timeout": 300}) as tools:
        agent = Agent(name="analyst", instructions="Compute in the sandbox, remember results.",
                      tools=tools.agent_tools(), model=model(
                          [function_call("hutch_exec", {"command": "python3 -c 'print(2 ** 64)'", "timeout": None,
                                                        "workdir": None, "stdin": None}, call_id="c1")],
                          [function_call("hutch_memory_write", {"title": "Two to the 64", "entity_class": "results",
                                                                "body": "2**64 = 18446744073709551616", "facts": None},
                                         call_id="c2")],
                          [assistant_message("2**64 is 18446744073709551616 (remembered).")]))
        print("agent:", Runner.run_sync(agent, "What is 2**64? Remember it.").final_output)
    print("memory:", mem.ls(), "source:", mem.history(mem.ls()[0])[0].source if mem.ls() else None)

    dev = SandboxAgent(name="dev", instructions="Use the shell in /workspace.", model=model(
        [function_call("exec_command", {"cmd": "printf 'print(\"fizz\")\\n' > fizz.py && python3 fizz.py && pwd"},
                       call_id="s1")],
        [assistant_message("Wrote and ran fizz.py in /workspace.")]))
    cfg = RunConfig(sandbox=SandboxRunConfig(client=HutchSandboxClient(),
                                             options=HutchSandboxClientOptions(memory="1G", timeout=300)))
    print("sandbox agent:", Runner.run_sync(dev, "Write fizz.py and run it.", run_config=cfg).final_output)


if __name__ == "__main__":
    main()
