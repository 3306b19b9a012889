"""What every adapter's tools do, framework-free: `Toolbox` runs commands and code in a sandbox, moves its
files, searches and writes a memory store, and checks every argument a model sends first.

A model's arguments are untrusted input: each is checked for its type and bounded in size here, so that an
adapter only has to turn `TOOL_ERRORS` into its framework's tool error. Results are plain dicts (JSON).
Only hutch's public API is used (`hutch.Sandbox`, `hutch.Memory`).

Who ends a sandbox: one given to a Toolbox is the caller's and is never terminated here; one the Toolbox
made (lazily, on the first tool call that needs it) is ended by `close()` / leaving its `with` block, by a
finalizer if the Toolbox is dropped, and by the daemon when this process ends (it holds the sandbox's lease).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import os
import posixpath
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import hutch

#: Bytes of stdout / stderr a tool result carries per stream (the rest is drained, dropped and counted).
MAX_OUTPUT = 100_000
#: Bytes a file tool reads or writes in one call.
MAX_FILE = 4 << 20
#: Characters of code, a command line or a memory body a model may send in one call.
MAX_TEXT = 1 << 20
#: Characters of a search query, a title, a path, an argument.
MAX_SHORT = 4096
#: Entries a listing returns.
MAX_ENTRIES = 1000
#: Seconds a command or cell may run unless the call says less; and the most it may ask for.
DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 3600.0
#: Tags of every sandbox an adapter creates (plus integration=<name>).
TAG = {"created_by": "hutch-integrations"}
#: What a tool turns into a tool error for the model (anything else is a bug and propagates).
TOOL_ERRORS = (hutch.Error, ValueError, TypeError)


def require(extra: str, *modules: str) -> list:
    """Import `modules`; a missing one is one ImportError line naming the extra that installs it."""
    out = []
    for name in modules:
        try:
            out.append(importlib.import_module(name))
        except ImportError as e:
            raise ImportError(f"hutch.integrations.{extra} needs {e.name or name}, which is not installed: "
                              f"pip install 'hutch[{extra}]'") from None
    return out


def error_text(e: BaseException) -> str:
    """What a model reads of an error: its kind and the message that names the fix."""
    return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ argument checks (model input is untrusted)

def text_arg(name: str, value: Any, *, limit: int = MAX_SHORT, required: bool = True) -> str | None:
    """A string argument of at most `limit` characters; None only when not `required`."""
    if value is None:
        if required:
            raise hutch.ConfigError(f"'{name}' is required: give it as a string.")
        return None
    if not isinstance(value, str):
        raise hutch.ConfigError(f"'{name}' must be a string, not {type(value).__name__}.")
    if len(value) > limit:
        raise hutch.ConfigError(f"'{name}' is {len(value):,} characters; at most {limit:,} are accepted "
                                "in one call: split it, or write it to a file first.")
    return value


def number_arg(name: str, value: Any, *, lo: float, hi: float, default: float | None, integer: bool = False):
    """A number in [lo, hi] (bools are not numbers); `default` when None."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise hutch.ConfigError(f"'{name}' must be {'a whole number' if integer else 'a number'}, "
                                f"not {value!r}.")
    if not lo <= value <= hi:
        raise hutch.ConfigError(f"'{name}'={value} is out of range: give {lo:g} to {hi:g}.")
    return int(value) if integer else float(value)


def str_list_arg(name: str, value: Any, *, items: int = 256, limit: int = MAX_SHORT) -> list[str] | None:
    """A list of strings (at most `items`, each at most `limit` characters), or None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise hutch.ConfigError(f"'{name}' must be a list of strings, not {type(value).__name__}.")
    if len(value) > items:
        raise hutch.ConfigError(f"'{name}' has {len(value)} items; at most {items} are accepted.")
    return [text_arg(f"{name}[{i}]", v, limit=limit) for i, v in enumerate(value)]


def sandbox_path(value: Any, workdir: str = "/home/user", name: str = "path") -> str:
    """An absolute path inside the sandbox (a relative one is taken from `workdir`)."""
    p = text_arg(name, value)
    if not p or "\x00" in p:
        raise hutch.ConfigError(f"'{name}' must be a non-empty path without NUL bytes, such as /home/user/a.txt.")
    return posixpath.normpath(p if p.startswith("/") else posixpath.join(workdir, p))


# ------------------------------------------------------------------ the code interpreter seam

@dataclass(frozen=True)
class CodeError:
    """A cell's exception, as the interpreter reported it (an error is a result, not an exception)."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True)
class CodeResult:
    """One cell run by `Sandbox.run_code`: its result's text, what it printed, images, and its error."""

    text: str | None
    stdout: str
    stderr: str
    pngs: tuple[bytes, ...] = ()
    error: CodeError | None = None
    dropped: int = 0   # characters of stdout / stderr beyond MAX_OUTPUT, not kept

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"result": self.text, "stdout": self.stdout, "stderr": self.stderr}
        if self.pngs:
            out["images"] = [f"PNG image, {len(p):,} bytes" for p in self.pngs]
        if self.error is not None:
            out["error"] = {"name": self.error.name, "value": self.error.value,
                            "traceback": self.error.traceback[-MAX_OUTPUT:]}
        if self.dropped:
            out["truncated"] = f"{self.dropped:,} characters of output beyond {MAX_OUTPUT:,} were dropped"
        return out


class _Capped:
    """Collects streamed output up to MAX_OUTPUT characters and counts the rest."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.kept = self.dropped = 0

    def __call__(self, chunk: Any) -> None:
        s = chunk if isinstance(chunk, str) else str(chunk)
        room = max(0, MAX_OUTPUT - self.kept)
        self.parts.append(s[:room])
        self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - room)

    def text(self) -> str:
        return "".join(self.parts)


def run_code(sandbox, code: str, *, timeout: float | None = None, context: Any = None) -> CodeResult:
    """Run `code` in the sandbox's stateful interpreter (`Sandbox.run_code`, issue 15).

    The one place the adapters meet run_code: until a hutch with `Sandbox.run_code` is installed, every
    code-interpreter tool answers with this ConfigError instead of faking an interpreter."""
    run = getattr(sandbox, "run_code", None)
    if run is None:
        raise hutch.ConfigError(
            "This hutch has no Sandbox.run_code (the stateful code interpreter) yet, so code cells cannot run: "
            "run `python3 -c ...` with the exec tool instead, or upgrade hutch.")
    out, err = _Capped(), _Capped()
    kw: dict[str, Any] = {"timeout": timeout, "on_stdout": out, "on_stderr": err}
    if context is not None:
        kw["context"] = context
    ex = run(code, **kw)
    e = getattr(ex, "error", None)
    error = None if e is None else CodeError(str(getattr(e, "name", "")), str(getattr(e, "value", "")),
                                             str(getattr(e, "traceback", "") or ""))
    pngs = tuple(r.png for r in (getattr(ex, "results", None) or ()) if getattr(r, "png", None))
    pngs = tuple(base64.b64decode(p) if isinstance(p, str) else bytes(p) for p in pngs)
    text = getattr(ex, "text", None)
    return CodeResult(None if text is None else str(text)[:MAX_OUTPUT], out.text(), err.text(), pngs, error,
                      out.dropped + err.dropped)


# ------------------------------------------------------------------ the toolbox

def _terminate(sb) -> None:
    try:
        sb.terminate()
    except hutch.Error:
        pass   # already gone, or the daemon with it: either way nothing is left running


def as_memory(memory: Any):
    """A hutch.Memory, or None: a path (str / PathLike) opens (or creates) the store there."""
    if memory is None or isinstance(memory, hutch.Memory):
        return memory
    if isinstance(memory, (str, os.PathLike)):
        return hutch.Memory(memory)
    raise hutch.ConfigError(f"memory must be a hutch.Memory or a path to a store, not {type(memory).__name__}.")


class Toolbox:
    """The sandbox and memory store behind one agent's tools.

    `sandbox`: a running hutch.Sandbox to use (the caller ends it), or None to have one made on first use
    with `sandbox_options` (keyword arguments of hutch.Sandbox.create), ended by `close()`.
    `memory`: a hutch.Memory (or a path) for the memory tools, or None.
    """

    def __init__(self, sandbox=None, memory=None, *, sandbox_options: dict | None = None,
                 integration: str = "integrations") -> None:
        if sandbox is not None and not hasattr(sandbox, "files"):
            raise hutch.ConfigError(f"sandbox must be a hutch.Sandbox, not {type(sandbox).__name__}.")
        self.sandbox_given = sandbox
        self.memory = as_memory(memory)
        self.sandbox_options = dict(sandbox_options or {})
        self.integration = integration
        self._owned = None
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = None
        #: make the sandbox from hutch.Image.code_interpreter() when sandbox_options names no image (set by the
        #: adapters that offer a run_code tool: their cells need a kernel)
        self.wants_interpreter = False

    @property
    def sandbox(self):
        """The sandbox the tools act on (made now if this Toolbox makes its own and has none yet)."""
        if self.sandbox_given is not None:
            return self.sandbox_given
        with self._lock:
            if self._closed:
                raise hutch.StateError("This toolbox was closed, and the sandbox it made is gone: make a new one.")
            if self._owned is None:
                opts = dict(self.sandbox_options)
                opts.setdefault("timeout", 600)
                if self.wants_interpreter and opts.get("image") is None:
                    opts["image"] = hutch.Image.code_interpreter()
                opts["tags"] = {**(opts.get("tags") or {}), **TAG, "integration": self.integration}
                self._owned = hutch.Sandbox.create(**opts)
                self._finalizer = weakref.finalize(self, _terminate, self._owned)
            return self._owned

    @property
    def owned_sandbox(self):
        """The sandbox this Toolbox made, if any (None before the first tool call that needed one)."""
        return self._owned

    def close(self) -> None:
        """End the sandbox this Toolbox made (a given one is left running). Closing twice is harmless."""
        with self._lock:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()   # terminates once, and never again at garbage collection

    def __enter__(self) -> "Toolbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _mem(self):
        if self.memory is None:
            raise hutch.ConfigError("These tools have no memory store: give memory=hutch.Memory(path).")
        return self.memory

    # ------------------------------------------------------------ sandbox tools

    def exec(self, command: Any, *, timeout: Any = None, workdir: Any = None, stdin: Any = None) -> dict:
        """Run a command (an argv list, or a line for `sh -c`) to its end: exit code, stdout, stderr."""
        if isinstance(command, str):
            argv = ["sh", "-c", text_arg("command", command, limit=MAX_TEXT)]
        else:
            argv = str_list_arg("command", command, items=4096, limit=MAX_TEXT)
            if not argv:
                raise hutch.ConfigError("'command' is required: an argv list such as [\"ls\", \"-l\"], "
                                        "or a shell line such as \"ls -l | wc -l\".")
        t = number_arg("timeout", timeout, lo=0.1, hi=MAX_TIMEOUT, default=DEFAULT_TIMEOUT)
        wd = None if workdir is None else sandbox_path(workdir, name="workdir")
        data = text_arg("stdin", stdin, limit=MAX_FILE, required=False)
        r = self.sandbox.run(*argv, timeout=t, workdir=wd, stdin=data if data is not None else False,
                             max_output=MAX_OUTPUT)
        res = {"exit_code": r.returncode, "stdout": r.stdout, "stderr": r.stderr}
        if r.reason != "exited":
            res["reason"] = r.reason   # timeout, killed, oom
        if r.truncated:
            res["truncated"] = (f"output was cut to its first {MAX_OUTPUT:,} bytes per stream ({r.stdout_dropped:,} "
                                f"bytes of stdout and {r.stderr_dropped:,} of stderr dropped); write it to a file "
                                "and read parts of it.")
        return res

    def stat_file(self, path: str, *, limit: int = MAX_FILE):
        """The FileInfo of a regular file of at most `limit` bytes at `path` (else a ConfigError naming why)."""
        info = self.sandbox.files.stat(path)
        if info.type != "file":
            raise hutch.ConfigError(f"{path} is a {info.type}, not a regular file"
                                    + (": list it instead." if info.type == "dir" else "."))
        if info.size > limit:
            raise hutch.ConfigError(f"{path} is {info.size:,} bytes; at most {limit:,} are read in one call: "
                                    "read parts of it with a command (head -c, tail -c, sed -n '1,100p').")
        return info

    def read_file(self, path: Any) -> dict:
        """A file's content: UTF-8 text, or base64 if it is binary."""
        p = sandbox_path(path)
        self.stat_file(p)
        data = self.sandbox.files.read(p)[:MAX_FILE]   # a file grown since stat() is cut, not taken whole
        try:
            return {"path": p, "encoding": "utf-8", "content": data.decode("utf-8"), "size": len(data)}
        except UnicodeDecodeError:
            return {"path": p, "encoding": "base64", "content": base64.b64encode(data).decode(), "size": len(data)}

    def write_file(self, path: Any, content: Any, *, encoding: Any = "utf-8") -> dict:
        """Create or replace a file (its parent directories are made)."""
        p = sandbox_path(path)
        enc = encoding or "utf-8"
        if enc not in ("utf-8", "base64"):
            raise hutch.ConfigError("'encoding' must be \"utf-8\" or \"base64\".")
        text = text_arg("content", content, limit=MAX_FILE * (2 if enc == "base64" else 1))
        try:
            data = base64.b64decode(text, validate=True) if enc == "base64" else text.encode()
        except binascii.Error as e:
            raise hutch.ConfigError(f"'content' is not valid base64 ({e}).") from None
        if len(data) > MAX_FILE:
            raise hutch.ConfigError(f"'content' is {len(data):,} bytes; at most {MAX_FILE:,} are written in one call.")
        self.sandbox.files.write(p, data)   # makes the parent directories
        return {"path": p, "size": len(data)}

    def list_files(self, path: Any = None) -> dict:
        """The entries of a directory: name, type, size."""
        p = sandbox_path(path if path is not None else "/home/user")
        entries = self.sandbox.files.list(p)
        out = [{"name": e.name, "type": e.type, "size": e.size} for e in entries[:MAX_ENTRIES]]
        res: dict[str, Any] = {"path": p, "entries": out}
        if len(entries) > MAX_ENTRIES:
            res["truncated"] = f"{len(entries) - MAX_ENTRIES:,} more entries not shown"
        return res

    def run_code(self, code: Any, *, timeout: Any = None) -> CodeResult:
        """Run a cell in the sandbox's stateful Python interpreter (state persists between calls)."""
        c = text_arg("code", code, limit=MAX_TEXT)
        t = number_arg("timeout", timeout, lo=0.1, hi=MAX_TIMEOUT, default=DEFAULT_TIMEOUT)
        return run_code(self.sandbox, c, timeout=t)

    # ------------------------------------------------------------ memory tools

    def memory_search(self, query: Any, *, k: Any = None, classes: Any = None) -> dict:
        """Search the memory store; best hits first, each with its id, title, score, channels and a snippet."""
        q = text_arg("query", query)
        if not q.strip():
            raise hutch.ConfigError("'query' is empty: say what to look for, e.g. \"customer churn\".")
        n = number_arg("k", k, lo=1, hi=50, default=5, integer=True)
        cls = str_list_arg("classes", classes, items=64, limit=64)
        hits = self._mem().search(q, k=n, classes=cls or None)
        return {"query": q, "hits": [hit_dict(h) for h in hits]}

    def memory_write(self, title: Any, entity_class: Any, *, body: Any = None, facts: Any = None,
                     source: str) -> dict:
        """Remember something: create the entity `entity_class`/`title`, or add to it if it exists. One commit."""
        t = text_arg("title", title, limit=200)
        cls = text_arg("entity_class", entity_class, limit=64)
        b = text_arg("body", body, limit=MAX_TEXT, required=False) or ""
        f = str_list_arg("facts", facts, items=100, limit=2000) or []
        e = self._mem().put(cls, t, body=b, facts=f, source=source, exist_ok=True)
        return {"id": e.id, "title": e.title, "facts": e.facts}


def hit_dict(h) -> dict[str, Any]:
    """One search hit as a model reads it."""
    return {"id": h.entity_id, "title": h.title, "score": round(float(h.score), 4),
            "channels": {c: dict(v) for c, v in h.channels.items()}, "anchor": h.anchor,
            "snippet": h.text.strip()[:500]}
