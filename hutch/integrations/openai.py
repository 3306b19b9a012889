"""hutch's tools in OpenAI's shapes: function tools for the Agents SDK, and the same tools (definitions and
call handling) for the Responses and Chat Completions APIs.

    from agents import Agent, Runner
    from hutch.integrations.openai import HutchTools

    with HutchTools(memory="./agent-memory") as tools:        # a sandbox is made on the first call
        agent = Agent(name="analyst", instructions="...", tools=tools.agent_tools())
        Runner.run_sync(agent, "How many lines has /etc/passwd?")

    # Responses API (Chat Completions: format="chat", then messages += tools.handle(completion))
    r = client.responses.create(model=MODEL, input=items, tools=tools.tool_params())
    items += r.output + tools.handle(r)                        # function_call_output items

The tools: hutch_exec, hutch_files, hutch_memory_search and hutch_memory_write (with a store), and
hutch_run_code when this hutch has Sandbox.run_code. Their schemas are strict (every property required,
optional ones nullable). Bad arguments, invalid JSON, a path out of bounds or any hutch error come back as
the tool's output, text naming the fix, never as an exception in the run. A memory write records the call's
id as its commit's source ("openai:<call_id>"). `handle(response, sandbox=, memory=)` is the same without
an object, on a sandbox you own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hutch.integrations._common import TOOL_ERRORS, Toolbox, error_text, require

require("openai", "openai")

_S, _N, _I = {"type": ["string", "null"]}, {"type": ["number", "null"]}, {"type": ["integer", "null"]}
_LIST = {"type": ["array", "null"], "items": {"type": "string"}}


def _obj(**props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SPECS: dict[str, tuple[str, dict]] = {
    "hutch_run_code": ("Run Python in a stateful interpreter in an isolated sandbox (like a notebook cell); "
                       "returns the last expression's value, printed output and any error.",
                       _obj(code={"type": "string"}, timeout=_N)),
    "hutch_exec": ("Run a command in an isolated Linux sandbox to its end; returns exit_code, stdout and "
                   "stderr. command: an argv list, or a shell line run by sh -c. A non-zero exit_code is a result.",
                   _obj(command={"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                        timeout=_N, workdir=_S, stdin=_S)),
    "hutch_files": ("Read, write (create or replace) or list files in the sandbox. content: for write; "
                    "encoding: utf-8 (default) or base64.",
                    _obj(action={"type": "string", "enum": ["read", "write", "list"]}, path={"type": "string"},
                         content=_S, encoding={"type": ["string", "null"], "enum": ["utf-8", "base64", None]})),
    "hutch_memory_search": ("Search long-term memory by meaning, words, links and time; returns entity ids, "
                            "titles, scores and snippets, best first. k: 1-50 hits; classes: only these.",
                            _obj(query={"type": "string"}, k=_I, classes=_LIST)),
    "hutch_memory_write": ("Remember something in long-term memory: creates the entity, or adds to it if one "
                           "with that title exists in that class (a lower-case plural: actors, orgs, decisions). "
                           "Every call is one commit.",
                           _obj(title={"type": "string"}, entity_class={"type": "string"}, body=_S, facts=_LIST)),
}


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


class HutchTools(Toolbox):
    """hutch's tools for OpenAI's APIs. Use it as a context manager (or `close()`): the sandbox it made ends
    with it. `sandbox`: a running hutch.Sandbox (yours), or None to make one on first use from
    `sandbox_options`. `memory`: a hutch.Memory or a path (the memory tools come with it). `run_code`:
    offer hutch_run_code (default: when this hutch has Sandbox.run_code). `source`: memory writes' prefix."""

    def __init__(self, sandbox=None, memory=None, *, sandbox_options: dict | None = None,
                 run_code: bool | None = None, source: str = "openai", sandbox_tools: bool = True) -> None:
        super().__init__(sandbox, memory, sandbox_options=sandbox_options, integration="openai")
        import hutch

        self.offer_run_code = hasattr(hutch.Sandbox, "run_code") if run_code is None else run_code
        self.wants_interpreter = self.offer_run_code
        self.source = source
        self.sandbox_tools = sandbox_tools

    @property
    def names(self) -> list[str]:
        """The tools offered: the sandbox ones (unless sandbox_tools=False), the memory ones with a store."""
        out = ((["hutch_run_code"] if self.offer_run_code else []) + ["hutch_exec", "hutch_files"]
               if self.sandbox_tools else [])
        return out + (["hutch_memory_search", "hutch_memory_write"] if self.memory is not None else [])

    # ------------------------------------------------------------ one call

    def call(self, name: str, arguments: Any, call_id: str = "") -> tuple[str, bool]:
        """Run tool `name` with `arguments` (a JSON string or a dict); (output text, succeeded)."""
        try:
            if name not in self.names:
                raise ValueError(f"There is no tool {name!r} here: use one of {', '.join(self.names)}.")
            args = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
            if not isinstance(args, dict):
                raise ValueError("The arguments must be a JSON object.")
            unknown = set(args) - set(SPECS[name][1]["properties"])
            if unknown:
                raise ValueError(f"Unknown argument(s) {sorted(unknown)}: {name} takes "
                                 f"{', '.join(SPECS[name][1]['properties'])}.")
            return json.dumps(self._dispatch(name, args, call_id), ensure_ascii=False), True
        except json.JSONDecodeError as e:
            return f"Invalid arguments: not JSON ({e}). Call {name} again with a JSON object.", False
        except TOOL_ERRORS as e:
            return error_text(e), False

    def _dispatch(self, name: str, a: dict, call_id: str) -> dict:
        if name == "hutch_run_code":
            return self.run_code(a.get("code"), timeout=a.get("timeout")).to_dict()
        if name == "hutch_exec":
            return self.exec(a.get("command"), timeout=a.get("timeout"), workdir=a.get("workdir"),
                             stdin=a.get("stdin"))
        if name == "hutch_files":
            action = a.get("action")
            if action == "read":
                return self.read_file(a.get("path"))
            if action == "write":
                return self.write_file(a.get("path"), a.get("content"), encoding=a.get("encoding"))
            if action == "list":
                return self.list_files(a.get("path"))
            raise ValueError(f"'action' must be read, write or list, not {action!r}.")
        if name == "hutch_memory_search":
            return self.memory_search(a.get("query"), k=a.get("k"), classes=a.get("classes"))
        return self.memory_write(a.get("title"), a.get("entity_class"), body=a.get("body"), facts=a.get("facts"),
                                 source=f"{self.source}:{call_id}" if call_id else self.source)

    # ------------------------------------------------------------ the shapes

    def tool_params(self, format: str = "responses") -> list[dict]:
        """Tool definitions for `tools=`: format "responses" (Responses API) or "chat" (Chat Completions)."""
        if format not in ("responses", "chat"):
            raise ValueError('format must be "responses" or "chat".')
        out = []
        for n in self.names:
            desc, params = SPECS[n]
            fn = {"name": n, "description": desc, "parameters": params, "strict": True}
            out.append({"type": "function", **fn} if format == "responses" else {"type": "function", "function": fn})
        return out

    def handle(self, response: Any) -> list[dict]:
        """Outputs for the tool calls in `response` that are hutch's: function_call_output items for a
        Responses answer, role "tool" messages for a Chat Completions one (other tools are left to you)."""
        if _field(response, "choices") is not None:
            msg = _field(_field(response, "choices")[0], "message")
            out = []
            for tc in _field(msg, "tool_calls") or []:
                fn = _field(tc, "function")
                if _field(fn, "name") in SPECS:
                    text, _ = self.call(_field(fn, "name"), _field(fn, "arguments"), _field(tc, "id"))
                    out.append({"role": "tool", "tool_call_id": _field(tc, "id"), "content": text})
            return out
        out = []
        for item in _field(response, "output") or []:
            if _field(item, "type") == "function_call" and _field(item, "name") in SPECS:
                text, _ = self.call(_field(item, "name"), _field(item, "arguments"), _field(item, "call_id"))
                out.append({"type": "function_call_output", "call_id": _field(item, "call_id"), "output": text})
        return out

    def agent_tools(self) -> list:
        """The tools as Agents SDK FunctionTools (each call runs in a worker thread)."""
        (agents,) = require("openai", "agents")
        tools = []
        for n in self.names:
            desc, params = SPECS[n]

            async def invoke(ctx, arguments: str, _name: str = n) -> str:
                text, _ = await asyncio.to_thread(self.call, _name, arguments, getattr(ctx, "tool_call_id", ""))
                return text

            tools.append(agents.FunctionTool(name=n, description=desc, params_json_schema=params,
                                             on_invoke_tool=invoke, strict_json_schema=True))
        return tools


def handle(response: Any, *, sandbox=None, memory=None) -> list[dict]:
    """`HutchTools(sandbox, memory).handle(response)` on a sandbox you own; none is ever made here (without
    one, a call of a sandbox tool is answered with an error naming the tools there are)."""
    return HutchTools(sandbox, memory, sandbox_tools=sandbox is not None).handle(response)
