"""`hutch repl`: an interactive Python interpreter whose cells run in a fresh sandbox (Sandbox.run_code).

The prompt and the line editing are the host's (readline); each complete statement is sent as one cell.
Ctrl-C while a cell runs interrupts it (the kernel and its state survive); Ctrl-C at the prompt drops the
line; Ctrl-D ends the session, and the sandbox with it.
"""

from __future__ import annotations

import codeop
import importlib
import os
import struct
import sys

import click

from hutch.cli._sandbox import create_kwargs, sandbox_options

PS1, PS2 = ">>> ", "... "
SESSION_TIMEOUT = 3600.0   # seconds a repl's sandbox lives unless --timeout says otherwise
BANNER = ("hutch repl: Python in sandbox {id} ({image}); state persists between cells, charts are shown as "
          "image lines (--images DIR saves them). Ctrl-C interrupts a cell, Ctrl-D ends the session.")


def _png_size(data: bytes) -> tuple[int, int] | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    return None


class _Printer:
    """The callbacks of one cell: output as it comes, then the value, charts and the error."""

    def __init__(self, images: str | None, counter: list[int]):
        self.images, self.counter = images, counter
        self.errors = 0

    def stdout(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def stderr(self, text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def result(self, r) -> None:
        png = r.png
        if png is not None:
            size = _png_size(png)
            shown = f"{size[0]}x{size[1]} " if size else ""
            line = f"[image/png {shown}{len(png):,} bytes"
            if self.images:
                self.counter[0] += 1
                path = os.path.join(self.images, f"hutch-repl-{self.counter[0]}.png")
                with open(path, "wb") as f:
                    f.write(png)
                line += f", saved to {path}"
            print(line + "]", flush=True)
        elif r.text is not None:
            print(r.text, flush=True)

    def error(self, e) -> None:
        self.errors += 1
        if e.name == "KernelDied":
            print(f"[{e.name}: {e.value}]", file=sys.stderr, flush=True)
        elif e.traceback:
            print(e.traceback, file=sys.stderr, flush=True)
        else:
            print(f"{e.name}: {e.value}", file=sys.stderr, flush=True)


def _read_cell(interactive: bool) -> str | None:
    """One complete statement (several lines for a block), or None at end-of-file (Ctrl-D)."""
    lines: list[str] = []
    while True:
        try:
            line = input(PS2 if lines else PS1) if interactive else sys.stdin.readline()
        except EOFError:
            line = None
        if line is None or (not interactive and line == ""):
            return "\n".join(lines) if lines else None
        lines.append(line.rstrip("\n"))
        source = "\n".join(lines)
        if not source.strip():
            lines = []
            continue
        try:   # None: an open block or bracket, which needs more lines (a block ends at an empty line)
            if codeop.compile_command(source, "<cell>", "exec") is not None:
                return source
        except (SyntaxError, ValueError, OverflowError):
            return source   # the kernel reports the error, as Python would


@click.command()
@sandbox_options
@click.option("--images", type=click.Path(file_okay=False, writable=True),
              help="Save each chart a cell shows into this directory (hutch-repl-N.png).")
def repl(images, **opts):
    """An interactive Python interpreter in a fresh sandbox (the code-interpreter image by default).

    Variables, imports and data persist between cells; matplotlib charts come back as PNG images.
    Ctrl-C interrupts the running cell, Ctrl-D ends the session and the sandbox. Without --image the
    sandbox is made from hutch.Image.code_interpreter(); without --timeout it lives an hour.

    \b
    Examples:
      hutch repl
      hutch repl --images ./charts --memory 2G
      echo 'import sys; print(sys.version)' | hutch repl --image my-analysis-image
    """
    import hutch

    if click.get_current_context().get_parameter_source("timeout") == click.core.ParameterSource.DEFAULT:
        opts["timeout"] = SESSION_TIMEOUT   # a session, not a command: --timeout's default would end it in 5 minutes
    kw = create_kwargs(**opts)
    shown = opts["image"] or "the code-interpreter image"
    if kw["image"] is None:
        kw["image"] = hutch.Image.code_interpreter()
    if images:
        os.makedirs(images, exist_ok=True)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            importlib.import_module("readline")   # loading it gives input() line editing and history
        except ImportError:
            pass
    counter = [0]
    with hutch.Sandbox.create(**kw) as sb:
        if interactive:
            print(BANNER.format(id=sb.id, image=shown), file=sys.stderr)
        p = _Printer(images, counter)
        while True:
            try:
                cell = _read_cell(interactive)
            except KeyboardInterrupt:   # at the prompt: drop the line, as Python does
                print("\nKeyboardInterrupt", file=sys.stderr)
                continue
            if cell is None:
                break
            seen = p.errors
            try:
                sb.run_code(cell, on_stdout=p.stdout, on_stderr=p.stderr, on_result=p.result, on_error=p.error)
            except KeyboardInterrupt:   # run_code interrupted the cell and let it end first
                if p.errors == seen:    # (else the kernel's KeyboardInterrupt traceback was shown)
                    print("KeyboardInterrupt", file=sys.stderr, flush=True)
        if interactive:
            print(file=sys.stderr)
