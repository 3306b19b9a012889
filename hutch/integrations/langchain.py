"""LangChain tools over hutch: hutch_run_code, hutch_exec, hutch_files, hutch_memory_search, hutch_memory_write.

    from langchain.agents import create_agent
    from hutch.integrations.langchain import HutchToolkit

    with HutchToolkit(memory="./agent-memory") as toolkit:        # a sandbox is made on the first tool call
        agent = create_agent(model, toolkit.get_tools())
        agent.invoke({"messages": [("user", "How many lines has /etc/passwd?")]})
    # leaving the block ends the sandbox the toolkit made (a crash in the run too)

`HutchToolkit(sandbox=sb)` uses a sandbox you own instead. A tool answers bad arguments, a path out of
bounds or any hutch error with an error ToolMessage (status "error") that names the fix, so the agent
goes on. hutch_memory_write records the tool call's id as the commit's source ("langchain:<tool_call_id>").
The LangGraph store is hutch.integrations.langgraph.HutchStore.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from hutch.integrations._common import TOOL_ERRORS, Toolbox, error_text, require

(_tools,) = require("langchain", "langchain_core.tools")
from pydantic import BaseModel, Field  # noqa: E402  (after the check: pydantic comes with langchain-core)

ToolException, StructuredTool, InjectedToolCallId = (_tools.ToolException, _tools.StructuredTool,
                                                     _tools.InjectedToolCallId)


class RunCodeArgs(BaseModel):
    code: str = Field(description="Python code; variables, imports and files persist between calls.")
    timeout: float | None = Field(None, description="Seconds before the cell is interrupted (default 120).")


class ExecArgs(BaseModel):
    command: str | list[str] = Field(description='An argv list (["python3", "-c", "print(1)"]) or a shell line '
                                                 '("ls -l | wc -l", run by sh -c).')
    timeout: float | None = Field(None, description="Seconds before the command is killed (default 120).")
    workdir: str | None = Field(None, description="Directory to run in (default /home/user).")
    stdin: str | None = Field(None, description="Text fed to the command's standard input.")


class FilesArgs(BaseModel):
    action: Literal["read", "write", "list"] = Field(description="read a file, write (create or replace) "
                                                                 "one, or list a directory.")
    path: str = Field(description="Path in the sandbox, e.g. /home/user/report.csv.")
    content: str | None = Field(None, description="For write: the new content.")
    encoding: Literal["utf-8", "base64"] = Field("utf-8", description="For write: how content is encoded.")


class MemorySearchArgs(BaseModel):
    query: str = Field(description="What to look for, in plain words.")
    k: int = Field(5, description="How many hits (1-50).")
    classes: list[str] | None = Field(None, description='Only these entity classes, e.g. ["actors", "decisions"].')


class MemoryWriteArgs(BaseModel):
    title: str = Field(description='What the entity is called, e.g. "Alice Chen".')
    entity_class: str = Field(description='Its class: a lower-case plural such as "actors", "orgs", "decisions".')
    body: str | None = Field(None, description="Markdown text about it.")
    facts: list[str] | None = Field(None, description="Short statements to add to its facts.")
    tool_call_id: Annotated[str, InjectedToolCallId]


def _validation_error(e) -> str:
    return f"Invalid arguments: {e}. Call the tool again with arguments of the types its schema names."


def _tool(name: str, description: str, schema: type[BaseModel], fn) -> StructuredTool:
    def run(**kw: Any) -> str:
        try:
            return json.dumps(fn(**kw), ensure_ascii=False)
        except TOOL_ERRORS as e:
            raise ToolException(error_text(e)) from e

    return StructuredTool.from_function(func=run, name=name, description=description, args_schema=schema,
                                        handle_tool_error=True, handle_validation_error=_validation_error)


class HutchToolkit(Toolbox):
    """hutch's tools for a LangChain agent: `get_tools()`. Use it as a context manager (or call `close()`):
    the sandbox it made, if any, ends with it.

    `sandbox`: a running hutch.Sandbox (yours to end), or None to make one on first use from
    `sandbox_options` (hutch.Sandbox.create keywords). `memory`: a hutch.Memory or a path; with it come the
    memory tools. `run_code`: offer hutch_run_code (default: when this hutch has Sandbox.run_code).
    `source`: the prefix of the source a memory write records."""

    def __init__(self, sandbox=None, memory=None, *, sandbox_options: dict | None = None,
                 run_code: bool | None = None, source: str = "langchain") -> None:
        super().__init__(sandbox, memory, sandbox_options=sandbox_options, integration="langchain")
        import hutch

        self.offer_run_code = hasattr(hutch.Sandbox, "run_code") if run_code is None else run_code
        self.wants_interpreter = self.offer_run_code
        self.source = source

    def get_tools(self) -> list[StructuredTool]:
        """The tools: the sandbox ones, and the memory ones if this toolkit has a store."""
        tools = []
        if self.offer_run_code:
            tools.append(_tool(
                "hutch_run_code", "Run Python in a stateful interpreter in an isolated sandbox (like a notebook "
                "cell); returns the last expression's value, printed output and any error.", RunCodeArgs,
                lambda code, timeout=None: self.run_code(code, timeout=timeout).to_dict()))
        tools.append(_tool(
            "hutch_exec", "Run a command in an isolated Linux sandbox to its end; returns exit_code, stdout and "
            "stderr (a non-zero exit code is a result, not an error).", ExecArgs, self.exec))
        tools.append(_tool(
            "hutch_files", "Read, write or list files in the sandbox (text, or base64 for binary).", FilesArgs,
            self._files))
        if self.memory is not None:
            tools.append(_tool(
                "hutch_memory_search", "Search long-term memory by meaning, words, links and time; returns "
                "entity ids, titles, scores and snippets, best first.", MemorySearchArgs, self.memory_search))
            tools.append(_tool(
                "hutch_memory_write", "Remember something in long-term memory: creates the entity, or adds to "
                "it if one with that title exists in that class. Every call is one commit.", MemoryWriteArgs,
                self._memory_write))
        return tools

    def _files(self, action: str, path: str, content: str | None = None, encoding: str = "utf-8") -> dict:
        if action == "read":
            return self.read_file(path)
        if action == "write":
            return self.write_file(path, content, encoding=encoding)
        return self.list_files(path)

    def _memory_write(self, title, entity_class, tool_call_id: str, body=None, facts=None) -> dict:
        return self.memory_write(title, entity_class, body=body, facts=facts,
                                 source=f"{self.source}:{tool_call_id}")
