"""LlamaIndex over hutch: a code-interpreter tool spec on a sandbox, and a retriever over a memory store.

    from llama_index.core.agent.workflow import FunctionAgent
    from hutch.integrations.llamaindex import HutchRetriever, HutchToolSpec

    with HutchToolSpec() as spec:                              # a sandbox is made on the first call
        agent = FunctionAgent(tools=spec.to_tool_list(), llm=llm)
        await agent.run("Plot y = x^2 and tell me the area under it from 0 to 3.")

    retriever = HutchRetriever(hutch.Memory("./agent-memory"), k=5)
    for n in retriever.retrieve("what did Alice decide about pricing?"):
        n.node.metadata["entity_id"], n.node.metadata["anchor"], n.node.metadata["channels"], n.score

The spec's tools: hutch_exec, hutch_read_file, hutch_write_file, hutch_list_files, and hutch_run_code
(a stateful Python cell) when this hutch has Sandbox.run_code. A tool answers bad input or a hutch error
with text that names the fix (the agent goes on). The retriever returns one node per hit: its text (the
turn for an anchored hit, else the entity's body), its id `<entity>[#<anchor>]`, and as metadata the
entity id, title, class, anchor, source and each search channel's rank and score.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hutch.integrations._common import TOOL_ERRORS, Toolbox, as_memory, error_text, hit_dict, require

_spec, _retr, _schema = require("llamaindex", "llama_index.core.tools.tool_spec.base",
                                "llama_index.core.base.base_retriever", "llama_index.core.schema")
BaseToolSpec, BaseRetriever = _spec.BaseToolSpec, _retr.BaseRetriever
NodeWithScore, TextNode = _schema.NodeWithScore, _schema.TextNode


def _answer(fn, *a, **kw) -> str:
    try:
        out = fn(*a, **kw)
        return json.dumps(out.to_dict() if hasattr(out, "to_dict") else out, ensure_ascii=False)
    except TOOL_ERRORS as e:
        return f"Error: {error_text(e)}"


class HutchToolSpec(BaseToolSpec):
    """A code-interpreter tool spec: `to_tool_list()`. `sandbox`: a running hutch.Sandbox (yours to end),
    or None to make one on first use from `sandbox_options`, ended by `close()` / the `with` block.
    `run_code`: offer hutch_run_code (default: when this hutch has Sandbox.run_code)."""

    def __init__(self, sandbox=None, *, sandbox_options: dict | None = None, run_code: bool | None = None) -> None:
        import hutch

        self.toolbox = Toolbox(sandbox, sandbox_options=sandbox_options, integration="llamaindex")
        offer = hasattr(hutch.Sandbox, "run_code") if run_code is None else run_code
        self.toolbox.wants_interpreter = offer
        self.spec_functions = (["hutch_run_code"] if offer else []) + ["hutch_exec", "hutch_read_file",
                                                                        "hutch_write_file", "hutch_list_files"]

    def close(self) -> None:
        self.toolbox.close()

    def __enter__(self) -> "HutchToolSpec":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hutch_run_code(self, code: str, timeout: float | None = None) -> str:
        """Run Python code in a stateful interpreter in an isolated sandbox (like a notebook cell: variables,
        imports and files persist between calls). Returns JSON: the last expression's value (result), stdout,
        stderr, images (charts) and error (name, value, traceback) if the code raised."""
        return _answer(self.toolbox.run_code, code, timeout=timeout)

    def hutch_exec(self, command: str, timeout: float | None = None, workdir: str | None = None) -> str:
        """Run a shell command line (sh -c) in an isolated Linux sandbox to its end. Returns JSON with
        exit_code, stdout and stderr; a non-zero exit_code is a result, not an error."""
        return _answer(self.toolbox.exec, command, timeout=timeout, workdir=workdir)

    def hutch_read_file(self, path: str) -> str:
        """Read a file in the sandbox: JSON with its content (UTF-8 text, or base64 if binary)."""
        return _answer(self.toolbox.read_file, path)

    def hutch_write_file(self, path: str, content: str) -> str:
        """Create or replace a text file in the sandbox (its directories are made)."""
        return _answer(self.toolbox.write_file, path, content)

    def hutch_list_files(self, path: str = "/home/user") -> str:
        """List a directory in the sandbox: names, types and sizes."""
        return _answer(self.toolbox.list_files, path)


class HutchRetriever(BaseRetriever):
    """Nodes from `memory.search(query, k=, classes=)`, scored by hutch's fused score; the hit's anchor and
    per-channel ranks and scores are in each node's metadata."""

    def __init__(self, memory: Any, *, k: int = 5, classes: list[str] | None = None, **kwargs: Any) -> None:
        self.memory = as_memory(memory)
        if self.memory is None:
            raise ValueError("HutchRetriever needs a store: HutchRetriever(hutch.Memory(path)).")
        self.k, self.classes = k, classes
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle) -> list:
        out = []
        for h in self.memory.search(query_bundle.query_str, k=self.k, classes=self.classes):
            d = hit_dict(h)
            e = h.head  # the start of the file (what the hit's text is from), never all of a huge one
            meta = {"entity_id": h.entity_id, "title": d["title"], "class": e.cls, "anchor": h.anchor,
                    "source": e.source, "channels": d["channels"], "speaker": h.speaker}
            node = TextNode(id_=h.entity_id + (f"#{h.anchor}" if h.anchor else ""), text=h.text.strip(),
                            metadata=meta, excluded_embed_metadata_keys=list(meta),
                            excluded_llm_metadata_keys=["channels", "source"])
            out.append(NodeWithScore(node=node, score=float(h.score)))
        return out

    async def _aretrieve(self, query_bundle) -> list:
        return await asyncio.to_thread(self._retrieve, query_bundle)
