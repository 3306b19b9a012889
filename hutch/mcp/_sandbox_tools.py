"""MCP tools over sandboxes: create, exec, read and write files, list, terminate.

Sandboxes made here are tagged `created_by=mcp` and belong to this server
process: when it exits, the host daemon ends them. The tools act only on the
sandboxes this process created (other sandboxes of the host, made by other users
of the daemon, are out of a client's reach), and what a client may make the host
do is `policy` (hutch/mcp/_policy.py: no host directories unless allowed).
"""

from __future__ import annotations

import base64
from typing import Any

from hutch._core.errors import ConfigError, NotFoundError
from hutch.mcp._policy import HostAccess
from hutch.mcp._tools import DESTRUCTIVE, READ_ONLY, RUNS_CODE, WRITE, first, tool

#: Bytes of stdout / stderr a tool result carries (the sandbox drains and drops the rest; the result says so).
MAX_OUTPUT = 100_000
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
        image: an image reference or a built image's name (default: Debian with python3, pip and venv; host
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
        image = policy.check_image(image)
        policy.check_mounts(mounts)
        sb = hutch.Sandbox.create(image=image or server_default_image, timeout=timeout, memory=memory, cpu=cpu,
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
