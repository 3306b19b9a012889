"""The code interpreter's values: what `Sandbox.run_code` returns, and its I/O-free protocol half.

    ex = sb.run_code("import pandas as pd; pd.DataFrame({'x': range(5)})['x'].sum()")
    ex.text                      # '10': the cell's value, as text (its execute_result's text/plain)
    ex.results[0].formats()      # ['text'] ... a chart gives ['png', 'text']
    ex.logs.stdout               # what it printed, in the chunks it came in
    ex.error                     # None, or an ExecutionError(name, value, traceback): an error is a result

The cells run in a Jupyter kernel (ipykernel) inside the sandbox, spoken to by a bridge process there
(hutch/sandbox/_inside/bridge.py); the SDK reads the bridge's line-delimited JSON through the exec's stdout.
What the bridge sends is the sandbox's output, so it is read as untrusted input: every line and every
cell is bounded here again (CELL_*), whatever the bridge claims.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from hutch._core.errors import ConfigError, InvalidSpecError
from hutch.sandbox._inside import bridge

#: What one cell brings back at most: characters of stdout and of stderr, of result data (base64 for
#: images), of an error's value and traceback. The rest is dropped and counted in `Execution.dropped`.
CELL_STREAM = bridge.CELL_STREAM
CELL_RESULTS = bridge.CELL_RESULTS
CELL_ERROR = bridge.CELL_ERROR
#: Bytes of one protocol line the SDK accepts (a result of CELL_RESULTS characters, UTF-8 and JSON-escaped).
MAX_LINE = 6 * CELL_RESULTS
#: Chunks of one stream kept apart in `Logs`; more are joined into the last one.
MAX_CHUNKS = 4096
DEFAULT_CONTEXT = bridge.DEFAULT
LANGUAGES = ("python",)

# MIME type -> Result attribute
_FORMATS = (("text/plain", "text"), ("text/html", "html"), ("text/markdown", "markdown"),
            ("image/svg+xml", "svg"), ("image/png", "png"), ("image/jpeg", "jpeg"), ("application/json", "json"),
            ("text/latex", "latex"), ("application/javascript", "javascript"), ("application/pdf", "pdf"))
_BINARY = {"image/png", "image/jpeg", "application/pdf"}


@dataclass(frozen=True)
class Result:
    """One rich output of a cell: its value (`is_main_result`) or something it displayed (a chart, a table).

    `data` is the MIME bundle as the kernel sent it (base64 text for binary types); the properties decode
    the common ones: `.png` / `.jpeg` / `.pdf` are bytes, `.json` a parsed value, the rest text; None where
    the cell did not produce that format."""

    data: Mapping[str, Any]
    is_main_result: bool = False

    def _get(self, mime: str) -> str | None:
        v = self.data.get(mime)
        return v if isinstance(v, str) else None

    @property
    def text(self) -> str | None:
        """text/plain: the repr the kernel made (Jupyter's Out[n])."""
        return self._get("text/plain")

    @property
    def html(self) -> str | None:
        """text/html (a pandas DataFrame's table, for one)."""
        return self._get("text/html")

    @property
    def markdown(self) -> str | None:
        return self._get("text/markdown")

    @property
    def svg(self) -> str | None:
        return self._get("image/svg+xml")

    @property
    def latex(self) -> str | None:
        return self._get("text/latex")

    @property
    def javascript(self) -> str | None:
        return self._get("application/javascript")

    @property
    def png(self) -> bytes | None:
        """The PNG image's bytes (a matplotlib chart shown with plt.show(), or at the end of its cell)."""
        return _b64(self._get("image/png"))

    @property
    def jpeg(self) -> bytes | None:
        return _b64(self._get("image/jpeg"))

    @property
    def pdf(self) -> bytes | None:
        return _b64(self._get("application/pdf"))

    @property
    def json(self) -> Any:
        """application/json, parsed."""
        v = self.data.get("application/json")
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                return v
        return v

    def formats(self) -> list[str]:
        """The formats present, by attribute name (e.g. ['png', 'text']); other MIME types are in `data`."""
        return sorted(name for mime, name in _FORMATS if mime in self.data)

    def __repr__(self) -> str:
        return f"Result(formats={self.formats()}, is_main_result={self.is_main_result})"


def _b64(v) -> bytes | None:
    if not isinstance(v, str):
        return None
    try:
        return base64.b64decode(v)
    except (binascii.Error, ValueError):
        return None


@dataclass(frozen=True)
class ExecutionError:
    """An error a cell ended with. `name`: the exception's class (ZeroDivisionError ...), or TimeoutError
    (the cell ran past its timeout and was interrupted; the kernel and its state survive), or KernelDied (the
    kernel process ended, os._exit() or out of memory: its state is lost, the next call gets a fresh one)."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True)
class Logs:
    """What a cell printed, in the chunks the kernel sent (join them for the whole text)."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Execution:
    """The outcome of one `run_code` call. An error in the cell is here (`error`), not raised."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None
    #: True when this context's kernel had died since the previous call and a fresh one ran this cell:
    #: variables and imports of earlier cells are gone.
    restarted: bool = False
    context: str = DEFAULT_CONTEXT
    #: characters left out by the per-cell bounds: {"stdout": n, "stderr": n, "results": n}
    dropped: Mapping[str, int] = field(default_factory=dict)

    @property
    def text(self) -> str | None:
        """The cell's value as text (the text/plain of its main result), or None if it had none."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def truncated(self) -> bool:
        return any(self.dropped.values())


@dataclass(frozen=True)
class CodeContext:
    """An independent interpreter (its own kernel, variables and working directory) in one sandbox."""

    id: str
    cwd: str | None = None
    language: str = "python"


# --------------------------------------------------------------------------- checks of the caller's input

def check_code(code) -> str:
    if not isinstance(code, str):
        raise ConfigError(f"code must be a str of Python source, not {type(code).__name__}; "
                          "e.g. sb.run_code(\"print(1 + 1)\").")
    if "\0" in code:
        raise ConfigError("code contains a NUL character; remove it.")
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"code is not valid Unicode text ({e.reason} at index {e.start}); pass text that "
                          "encodes as UTF-8.") from None
    return code


def check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or timeout != timeout or timeout == float("inf"):
        raise ConfigError(f"timeout={timeout!r} must be a positive number of seconds (or None: no limit but "
                          "the sandbox's own).")
    return float(timeout)


def context_id(context) -> str:
    if context is None:
        return DEFAULT_CONTEXT
    if isinstance(context, CodeContext):
        return context.id
    if isinstance(context, str) and context:
        return context
    raise ConfigError(f"context={context!r} must be a CodeContext from create_code_context() (or its id), "
                      "or None for the sandbox's default context.")


def check_new_context(cwd, language) -> str | None:
    if language not in LANGUAGES:
        raise ConfigError(f"language={language!r} is not supported; the code interpreter runs "
                          f"{', '.join(LANGUAGES)}.")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
        raise InvalidSpecError(f"cwd={cwd!r} must be an absolute path inside the sandbox, like '/home/user/work'.")
    return cwd


def check_callback(name: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise ConfigError(f"{name}={fn!r} must be a callable (it is called with each chunk) or None.")


# --------------------------------------------------------------------------- the protocol, I/O-free

def request(op: str, **fields) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class Lines:
    """Bytes from the bridge -> its JSON messages, each line at most MAX_LINE bytes (a longer one is skipped
    and counted in `oversized`; a line that is not a JSON object too)."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit, self.buf, self.skipping, self.oversized = limit, bytearray(), False, 0

    def feed(self, data: bytes) -> list[dict]:
        out = []
        while data:
            i = data.find(b"\n")
            part, data = (data, b"") if i < 0 else (data[:i], data[i + 1:])
            if not self.skipping:
                self.buf += part
                if len(self.buf) > self.limit:
                    self.buf.clear()
                    self.skipping = True
            if i < 0:
                break
            if self.skipping:
                self.skipping, self.oversized = False, self.oversized + 1
                continue
            line, self.buf = bytes(self.buf), bytearray()
            if line.strip():
                try:
                    msg = json.loads(line)
                except ValueError:
                    msg = None
                if isinstance(msg, dict):
                    out.append(msg)
                else:
                    self.oversized += 1
        return out


def _str(v, limit: int) -> str:
    return (v if isinstance(v, str) else "" if v is None else str(v))[:limit]


class Cell:
    """One run_code call: its bridge messages in, an Execution out, bounded whatever the bridge sends.

    `feed(msg)` returns what to hand the caller's callbacks: a list of (name, value) with name one of
    on_stdout, on_stderr, on_result, on_error."""

    def __init__(self, context: str) -> None:
        self.context = context
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.results: list[Result] = []
        self.error: ExecutionError | None = None
        self.left = {"stdout": CELL_STREAM, "stderr": CELL_STREAM, "results": CELL_RESULTS}
        self.dropped = {"stdout": 0, "stderr": 0, "results": 0}
        self.count: int | None = None
        self.restarted = False
        self.done = False

    def _stream(self, name: str, text) -> str:
        text = _str(text, 1 << 62)
        room = self.left[name]
        if len(text) > room:
            self.dropped[name] += len(text) - room
            text = text[:room]
        self.left[name] -= len(text)
        chunks = self.stdout if name == "stdout" else self.stderr
        if text:
            if len(chunks) >= MAX_CHUNKS:
                chunks[-1] += text
            else:
                chunks.append(text)
        return text

    def feed(self, msg: dict) -> list[tuple[str, Any]]:
        kind = msg.get("kind")
        if self.done:
            return []
        if kind in ("stdout", "stderr"):
            text = self._stream(kind, msg.get("text"))
            return [("on_" + kind, text)] if text else []
        if kind == "result":
            data = msg.get("data")
            if not isinstance(data, dict):
                return []
            bundle, size = {}, 0
            for mime, v in data.items():
                if not isinstance(mime, str):
                    continue
                n = len(v) if isinstance(v, str) else len(json.dumps(v))
                if size + n > self.left["results"]:
                    self.dropped["results"] += n
                    continue
                bundle[mime], size = v, size + n
            self.left["results"] -= size
            if not bundle:
                return []
            r = Result(bundle, bool(msg.get("main")))
            self.results.append(r)
            return [("on_result", r)]
        if kind == "error":
            self.error = ExecutionError(_str(msg.get("name"), 256), _str(msg.get("value"), CELL_ERROR),
                                        _str(msg.get("traceback"), CELL_ERROR))
            return [("on_error", self.error)]
        if kind == "done":
            self.done = True
            c = msg.get("execution_count")
            self.count = c if isinstance(c, int) and not isinstance(c, bool) else None
            self.restarted = self.restarted or msg.get("restarted") is True
            d = msg.get("dropped")
            if isinstance(d, dict):
                for k in self.dropped:
                    v = d.get(k)
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                        self.dropped[k] += v
        return []

    def interpreter_lost(self, why: str) -> list[tuple[str, Any]]:
        """The bridge (and with it every kernel) ended while this cell ran."""
        self.done = True
        self.error = ExecutionError("KernelDied", f"the code interpreter ended while running this cell ({why}); "
                                    "its state (variables, imports) was lost, and the next call starts a fresh one", "")
        return [("on_error", self.error)]

    def execution(self) -> Execution:
        return Execution(list(self.results), Logs(list(self.stdout), list(self.stderr)), self.error, self.count,
                         self.restarted, self.context, dict(self.dropped))


Callbacks = Mapping[str, Callable | None]


__all__ = ["CodeContext", "Execution", "ExecutionError", "Logs", "Result"]
