"""MCP tools over sandboxes: create, exec, run code (a stateful interpreter), read and write files, list, terminate.

Sandboxes made here are tagged `created_by=mcp` and belong to this server
process: when it exits, the host daemon ends them. The tools act only on the
sandboxes this process created (other sandboxes of the host, made by other users
of the daemon, are out of a client's reach), and what a client may make the host
do is `policy` (hutch/mcp/_policy.py: no host directories unless allowed).
"""

from __future__ import annotations

import base64
from typing import Any

from mcp.types import ImageContent, TextContent

from hutch._core.errors import ConfigError, NotFoundError
from hutch.mcp._policy import HostAccess
from hutch.mcp._tools import DESTRUCTIVE, READ_ONLY, RUNS_CODE, WRITE, first, tool

#: Bytes of stdout / stderr a tool result carries (the sandbox drains and drops the rest; the result says so).
MAX_OUTPUT = 100_000
#: Images one run_code result carries (a cell that draws more says how many were left out).
MAX_IMAGES = 8
#: The image name sandbox_create takes for hutch.Image.code_interpreter().
CODE_INTERPRETER = "code-interpreter"
#: Seconds the sandbox run_code makes for itself (when no sandbox_id is given) may live.
CODE_SANDBOX_TIMEOUT = 3600
TAG = {"created_by": "mcp"}


def _info(sb) -> dict[str, Any]:
    i = sb.info
    return {"id": sb.id, "name": sb.name, "status": sb.status, "tags": sb.tags, "returncode": sb.returncode,
            "image": (i.get("spec") or {}).get("image")}


def register(server, *, image: str | None = None, memory_mount=None, policy: HostAccess | None = None) -> None:
    """Add the sandbox tools to `server`. `image`: the default image; `memory_mount(writable, target)`
    returns a hutch.MemoryMount of the server's store, or is None when the server has no store;
    `policy`: what clients may ask of the host (default: no host directories)."""
    import hutch

    policy = policy or HostAccess(default_image=image)
    owned: dict[str, str | None] = {}   # id -> name of each sandbox this server created
    # one handle per sandbox that ran code: its interpreter (and so the cells' state) lives in the handle
    interpreters: dict[str, Any] = {}

    def _sb(sandbox_id, id_):
        sid = first(sandbox_id=sandbox_id, id=id_)
        if not sid:
            raise ConfigError("Give the sandbox_id that sandbox_create returned (sandbox_list shows them).")
        real = sid if sid in owned else next((i for i, n in owned.items() if n is not None and n == sid), None)
        if real is None:
            raise NotFoundError(f"{sid} is not a sandbox of this MCP server, which acts only on the sandboxes it "
                                "created: create one with sandbox_create, or see sandbox_list.")
        return hutch.Sandbox.from_id(real)

    @tool(server, WRITE)
    def sandbox_create(image: str | None = None, timeout: float = 600, memory: str = "512M", cpu: float = 1.0,
                       allow_domains: list[str] | None = None, env: dict[str, str] | None = None,
                       name: str | None = None, mount_memory: str | None = None,
                       tags: dict[str, str] | None = None) -> dict[str, Any]:
        """Start an isolated Linux sandbox (no network unless allow_domains is given); returns its sandbox_id.

        Run commands in it with sandbox_exec, move files with sandbox_write_file / sandbox_read_file,
        end it with sandbox_terminate (it also ends after `timeout` seconds, or when this server stops).
        image: an image reference or a built image's name (default: Debian with python3, pip and venv;
        "code-interpreter": with pandas, numpy, matplotlib and a Jupyter kernel, for run_code; host
        directories, dir:..., are refused unless the server was started with --allow-host-dirs).
        memory: a size such as "512M" or "2G".
        allow_domains: DNS names it may reach over HTTPS/HTTP, e.g. ["pypi.org", "*.pythonhosted.org"].
        mount_memory: "ro" or "rw" mounts this server's memory store at /memory, so code can
        `ls '/memory/search/<query>/'` and cat the hits; with "rw" its writes become commits naming the sandbox.
        """
        mounts = []
        if mount_memory is not None:
            if mount_memory not in ("ro", "rw"):
                raise ConfigError("mount_memory must be \"ro\" (read-only) or \"rw\" (writable).")
            if memory_mount is None:
                raise ConfigError("This MCP server has no memory store: start it with `hutch mcp --store PATH`.")
            mounts.append(memory_mount(mount_memory == "rw", "/memory"))
        network = hutch.Network.allow(domains=allow_domains) if allow_domains else None
        if image != CODE_INTERPRETER:   # hutch's own image, not a name to look up and check
            image = policy.check_image(image)
        policy.check_mounts(mounts)
        chosen = hutch.Image.code_interpreter() if image == CODE_INTERPRETER else image or server_default_image
        sb = hutch.Sandbox.create(image=chosen, timeout=timeout, memory=memory, cpu=cpu,
                                  network=network, env=env, name=name, tags={**(tags or {}), **TAG},
                                  mounts=mounts)
        owned[sb.id] = sb.name
        return {"sandbox_id": sb.id, **_info(sb)}

    server_default_image = image

    @tool(server, RUNS_CODE)
    def sandbox_exec(sandbox_id: str | None = None, command: list[str] | str | None = None,
                     timeout: float | None = 120, workdir: str | None = None, env: dict[str, str] | None = None,
                     stdin: str | None = None, id: str | None = None, cmd: list[str] | str | None = None,
                     argv: list[str] | None = None) -> dict[str, Any]:
        """Run a command in a sandbox to completion; returns exit_code, stdout and stderr.

        command: an argv list (["python3", "-c", "print(1)"]) or a shell line ("ls -l | wc -l"), which
        runs under `sh -c` inside the sandbox. timeout: seconds before the command (not the sandbox) is
        killed. stdin: text fed to the command. A non-zero exit_code is a result, not an error. Each stream
        carries its first 100,000 bytes; beyond that the result has "truncated" and the bytes dropped.
        """
        c = first(command=command, cmd=cmd, argv=argv)
        if not c:
            raise ConfigError("sandbox_exec needs a command, e.g. {\"command\": [\"ls\", \"-l\"]} or \"ls -l\".")
        args = ["sh", "-c", c] if isinstance(c, str) else [str(a) for a in c]
        r = _sb(sandbox_id, id).run(*args, timeout=timeout, workdir=workdir, env=env,
                                   stdin=stdin if stdin is not None else False, max_output=MAX_OUTPUT)
        res = {"exit_code": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "reason": r.reason}
        if r.truncated:
            res.update(stdout_dropped=r.stdout_dropped, stderr_dropped=r.stderr_dropped,
                       truncated=f"output was cut to its first {MAX_OUTPUT} bytes per stream ({r.stdout_dropped} bytes "
                                 f"of stdout and {r.stderr_dropped} of stderr dropped); write it to a file and read parts.")
        return res

    @tool(server, RUNS_CODE)
    def run_code(code: str, sandbox_id: str | None = None, timeout: float | None = 120,
                 id: str | None = None) -> list[TextContent | ImageContent]:
        """Run Python in a stateful interpreter (a Jupyter kernel) in a sandbox, like a notebook cell.

        Variables and imports persist between calls on the same sandbox. The result is the cell's printed
        output and value as text, each chart (matplotlib's plt.show(), or a figure left at the end of the
        cell) as a PNG image, and an error as text with its traceback. Without sandbox_id, the first call
        makes a sandbox with pandas, numpy and matplotlib for this server and later calls reuse it (its id
        is in the text); with sandbox_id, that sandbox's image must have ipykernel (make it with
        sandbox_create and image "code-interpreter"). timeout: seconds before the cell is interrupted (the
        interpreter and its state survive).
        """
        sid = first(sandbox_id=sandbox_id, id=id)
        if sid:
            sb = _sb(sid, None)
            sb = interpreters.setdefault(sb.id, sb)
        else:
            sb = interpreters.get("")
            if sb is None or sb.poll() is not None:
                sb = hutch.Sandbox.create(image=hutch.Image.code_interpreter(), timeout=CODE_SANDBOX_TIMEOUT,
                                          tags={**TAG, "tool": "run_code"})
                owned[sb.id] = sb.name
                interpreters[""] = interpreters[sb.id] = sb
        return code_result(sb.run_code(code, timeout=timeout), sb.id)

    @tool(server, READ_ONLY)
    def sandbox_read_file(path: str, sandbox_id: str | None = None, id: str | None = None) -> dict[str, Any]:
        """Read a file from a sandbox: text as UTF-8, or base64 (encoding="base64") if it is binary."""
        data = _sb(sandbox_id, id).files.read(path)
        try:
            return {"path": path, "encoding": "utf-8", "content": data.decode("utf-8"), "size": len(data)}
        except UnicodeDecodeError:
            return {"path": path, "encoding": "base64", "content": base64.b64encode(data).decode(), "size": len(data)}

    @tool(server, DESTRUCTIVE)
    def sandbox_write_file(path: str, content: str, sandbox_id: str | None = None, encoding: str = "utf-8",
                           id: str | None = None) -> dict[str, Any]:
        """Create or replace a file in a sandbox (parents are created). encoding: "utf-8" or "base64"."""
        if encoding not in ("utf-8", "base64"):
            raise ConfigError("encoding must be \"utf-8\" or \"base64\".")
        data = base64.b64decode(content) if encoding == "base64" else content.encode()
        _sb(sandbox_id, id).files.write(path, data)
        return {"path": path, "size": len(data)}

    @tool(server, READ_ONLY)
    def sandbox_list(tags: dict[str, str] | None = None) -> dict[str, Any]:
        """List the sandboxes this server created (running and ended), optionally only those with these tags."""
        want = {**(tags or {}), **TAG}
        return {"sandboxes": [_info(sb) for sb in hutch.Sandbox.list(tags=want) if sb.id in owned]}

    @tool(server, DESTRUCTIVE)
    def sandbox_terminate(sandbox_id: str | None = None, id: str | None = None) -> dict[str, Any]:
        """End a sandbox now: its processes and files are gone. Harmless if it already ended."""
        sb = _sb(sandbox_id, id)
        sb.terminate()
        return {"sandbox_id": sb.id, "status": sb.status}


def code_result(ex, sandbox_id: str) -> list[TextContent | ImageContent]:
    """An Execution as MCP content: one text (output, value, error, what was left out), then its images."""
    text, images, left_out = [], [], 0
    out, err = "".join(ex.logs.stdout), "".join(ex.logs.stderr)
    if out:
        text.append(out[:MAX_OUTPUT])
    if err:
        text.append("[stderr]\n" + err[:MAX_OUTPUT])
    for r in ex.results:
        png = r.png
        if png is not None:
            if len(images) < MAX_IMAGES:
                images.append(ImageContent(type="image", data=base64.b64encode(png).decode(), mime_type="image/png"))
            else:
                left_out += 1
        elif r.text is not None:   # the value, or a displayed table (its text/plain)
            text.append(r.text[:MAX_OUTPUT])
    if ex.error is not None:
        text.append(f"Error: {ex.error.name}: {ex.error.value}\n{ex.error.traceback}"[:MAX_OUTPUT])
    if ex.restarted:
        text.insert(0, "[the interpreter had restarted: variables and imports of earlier cells are gone]")
    if left_out:
        text.append(f"[{left_out} more images not shown]")
    if ex.truncated:
        text.append(f"[output cut: {ex.dropped}]")
    text.append(f"[sandbox_id {sandbox_id}, cell {ex.execution_count}]")
    return [TextContent(type="text", text="\n".join(text)), *images]
