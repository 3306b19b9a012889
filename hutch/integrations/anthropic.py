"""Claude's client-side tools served by hutch: the memory tool over an SMF store, bash and the text editor
over a sandbox.

    import anthropic, hutch
    from hutch.integrations import anthropic as ha

    mem = hutch.Memory("./agent-memory")
    with hutch.Sandbox.create() as sb:
        msgs = [{"role": "user", "content": "Remember that I like tea, then count the files in /etc."}]
        while True:
            r = client.messages.create(model=MODEL, max_tokens=1024, messages=msgs,
                                       tools=ha.tool_params(sandbox=sb, memory=mem))
            msgs.append({"role": "assistant", "content": r.content})
            if r.stop_reason != "tool_use":
                break
            msgs.append({"role": "user", "content": ha.handle(r, sandbox=sb, memory=mem)})

`handle(response, sandbox=, memory=)` answers every tool_use block of the tools hutch serves (memory,
bash, str_replace_based_edit_tool) with a tool_result block; others are left to you. A memory change is
one commit whose source is the call ("anthropic:<tool_use id>"). For the SDK's tool runner
(`client.beta.messages.tool_runner(tools=[...])`) use the tool objects: `HutchMemoryTool(mem)`,
`HutchBashTool(sb)`, `HutchTextEditorTool(sb)` (`tools(sandbox=, memory=)` gives all that apply).
Bad input, a path out of /memories, a payload past its bound: a tool_result with is_error and the fix.
"""

from __future__ import annotations

import weakref
from typing import Any

from hutch.integrations._common import (DEFAULT_TIMEOUT, MAX_TIMEOUT, TOOL_ERRORS, Toolbox, as_memory,
                                        error_text, number_arg, require, text_arg)
from hutch.integrations._editor import Editor
from hutch.integrations._memfiles import MemoryFiles
from hutch.integrations._shell import Shell

(_lib,) = require("anthropic", "anthropic.lib.tools")
ToolError, BetaBuiltinFunctionTool, BetaAbstractMemoryTool = (_lib.ToolError, _lib.BetaBuiltinFunctionTool,
                                                              _lib.BetaAbstractMemoryTool)

BASH = {"type": "bash_20250124", "name": "bash"}
EDITOR = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
MEMORY = {"type": "memory_20250818", "name": "memory"}
_EDITOR_NAMES = ("str_replace_based_edit_tool", "str_replace_editor")


def _guarded(fn, input: Any) -> str:
    try:
        return fn(input)
    except TOOL_ERRORS as e:
        raise ToolError(error_text(e)) from e


class HutchMemoryTool(BetaAbstractMemoryTool):
    """The memory tool (memory_20250818) over a hutch.Memory: /memories/<class>/<name>.md are its entities.
    `source`: what each commit records as its source (handle() records the tool_use id instead)."""

    def __init__(self, memory: Any, *, source: str = "anthropic:memory") -> None:
        super().__init__()
        self.files = MemoryFiles(as_memory(memory))
        self.source = source

    def call(self, input: object, *, source: str | None = None) -> str:
        return _guarded(lambda a: self.files.run(a, source=source or self.source), input)

    def execute(self, command) -> str:
        return self.call(command.to_dict() if hasattr(command, "to_dict") else dict(command))

    # the SDK's abstract commands, each one call
    def view(self, command) -> str:
        return self.execute(command)

    create = str_replace = insert = delete = rename = view


class HutchBashTool(BetaBuiltinFunctionTool):
    """The bash tool (bash_20250124) in a sandbox: one persistent shell (cwd and variables carry over);
    `restart: true` starts a fresh one. A non-zero exit is a result with is_error, as in Anthropic's own."""

    def __init__(self, sandbox, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.shell = Shell(Toolbox(sandbox).sandbox)
        self.timeout = timeout

    def to_dict(self) -> dict:
        return dict(BASH)

    def call(self, input: object) -> str:
        return _guarded(self._run, input)

    def _run(self, a: Any) -> str:
        if not isinstance(a, dict):
            raise TypeError("The bash tool's input is an object with a 'command' (or 'restart': true).")
        if a.get("restart") is True:
            self.shell.restart()
            return "The shell was restarted (a new session: cwd and variables are reset)."
        cmd = text_arg("command", a.get("command"))
        t = number_arg("timeout", a.get("timeout"), lo=0.1, hi=MAX_TIMEOUT, default=self.timeout)
        r = self.shell.run(cmd, timeout=t)
        if r.exit_code != 0:
            raise ToolError((r.text() or "(no output)") + ("" if r.exit_code is None else f"\n[exit code {r.exit_code}]"))
        return r.text() or "(no output)"

    def close(self) -> None:
        self.shell.close()


class HutchTextEditorTool(BetaBuiltinFunctionTool):
    """The text editor (text_editor_20250728, str_replace_based_edit_tool) over a sandbox's files."""

    def __init__(self, sandbox, *, max_characters: int | None = None) -> None:
        super().__init__()
        self.editor = Editor(Toolbox(sandbox), max_characters=max_characters)

    def to_dict(self) -> dict:
        d = dict(EDITOR)
        if self.editor.max_characters is not None:
            d["max_characters"] = self.editor.max_characters
        return d

    def call(self, input: object) -> str:
        return _guarded(self.editor.run, input)


def tools(*, sandbox=None, memory=None) -> list:
    """The tool objects that apply: bash and the editor with a sandbox, the memory tool with a store."""
    out: list = []
    if sandbox is not None:
        out += [_bash_for(sandbox), HutchTextEditorTool(sandbox)]
    if memory is not None:
        out.append(HutchMemoryTool(memory))
    return out


def tool_params(*, sandbox=None, memory=None) -> list[dict]:
    """The `tools=` entries of messages.create for what you give: bash and the editor, the memory tool."""
    return ([dict(BASH), dict(EDITOR)] if sandbox is not None else []) + ([dict(MEMORY)] if memory is not None else [])


_shells: "weakref.WeakKeyDictionary[Any, HutchBashTool]" = weakref.WeakKeyDictionary()


def _bash_for(sandbox) -> HutchBashTool:
    """One bash session per sandbox, kept while the sandbox object lives (state carries across handle())."""
    tool = _shells.get(sandbox)
    if tool is None:
        tool = _shells[sandbox] = HutchBashTool(sandbox)
    return tool


def _blocks(response: Any) -> list:
    content = response.get("content") if isinstance(response, dict) else getattr(response, "content", None)
    return list(content or [])


def _get(block: Any, key: str) -> Any:
    return block.get(key) if isinstance(block, dict) else getattr(block, key, None)


def handle(response: Any, *, sandbox=None, memory=None) -> list[dict]:
    """tool_result blocks for every tool_use of `response` (a Message or its dict) that hutch serves.

    Send them back as the next user message's content. A call of a tool hutch serves but was not given
    what it needs (bash without a sandbox) is answered with is_error, naming the argument to pass."""
    mem_files = MemoryFiles(as_memory(memory)) if memory is not None else None
    results = []
    for b in _blocks(response):
        if _get(b, "type") != "tool_use":
            continue
        name, tid, args = _get(b, "name"), _get(b, "id"), _get(b, "input")
        if name == "memory":
            run = (lambda a: mem_files.run(a, source=f"anthropic:{tid}")) if mem_files else None
            missing = "memory=hutch.Memory(path)"
        elif name == "bash":
            run = _bash_for(sandbox)._run if sandbox is not None else None
            missing = "sandbox=hutch.Sandbox.create()"
        elif name in _EDITOR_NAMES:
            run = HutchTextEditorTool(sandbox).editor.run if sandbox is not None else None
            missing = "sandbox=hutch.Sandbox.create()"
        else:
            continue   # not a tool hutch serves: the caller answers it
        if run is None:
            results.append({"type": "tool_result", "tool_use_id": tid, "is_error": True,
                            "content": f"The {name} tool is not available here: the application must call "
                                       f"handle(..., {missing})."})
            continue
        try:
            results.append({"type": "tool_result", "tool_use_id": tid, "content": run(args)})
        except ToolError as e:
            results.append({"type": "tool_result", "tool_use_id": tid, "is_error": True, "content": str(e)})
        except TOOL_ERRORS as e:
            results.append({"type": "tool_result", "tool_use_id": tid, "is_error": True, "content": error_text(e)})
    return results
