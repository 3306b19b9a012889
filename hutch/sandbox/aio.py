"""`hutch.AsyncSandbox`: the surface of `hutch.Sandbox`, awaitable.

    sb = await hutch.AsyncSandbox.create(memory="512M")
    async with sb:
        p = await sb.exec("python3", "-c", "print(1)")
        async for line in p.stdout:
            print(line, end="")
        assert await p.wait() == 0

Everything that is not I/O (spec building, error mapping, frame decoding) is
shared with the blocking class; a test keeps the two in parity.
"""

from __future__ import annotations

import asyncio
import builtins   # `list` in the class body is the classmethod; annotations name the built-in
import time

from hutch._core.errors import InvalidSpecError, NotFoundError, SandboxLostError
from hutch.sandbox import _build, _client, _ensure, _provided
from hutch.sandbox._files import AsyncFiles
from hutch.sandbox._interp import AsyncInterpreter
from hutch.sandbox._process import AsyncProcess
from hutch.sandbox._sbfile import SandboxFile
from hutch.sandbox._spec import DEFAULT_CPU, DEFAULT_DISK, DEFAULT_MEMORY, DEFAULT_PIDS, DEFAULT_TIMEOUT, DEFAULT_WORKDIR, Network
from hutch.sandbox._api import (
    DEFAULT_MAX_OUTPUT, ENDED, WAIT_POLL, ExecResult, NetworkLog, SandboxState, check_max_output, exec_body,
    pty_size, stdin_payload, tag_params, terminated_error,
)
from hutch.sandbox._terminal import AsyncPtyProcess
from hutch.sandbox.image import Image
from hutch.sandbox.interpreter import CodeContext, Execution
from hutch.sandbox.sandbox import build_spec
from hutch.sandbox.snapshot import Snapshot


class AsyncSandbox(SandboxState):
    """A running (or ended) sandbox, awaitable. Make one with `await AsyncSandbox.create()`."""

    def __init__(self, client: "_client.AsyncClient", info: dict) -> None:
        self._client = client
        self._info = info
        self.id: str = info["id"]
        self.files = AsyncFiles(client, self.id)
        self._interp: AsyncInterpreter | None = None

    # ------------------------------------------------------------ lifecycle

    @classmethod
    async def create(cls, *command: str, image: "Image | str | None" = None, mounts=(), cpu: float = DEFAULT_CPU,
                     memory: "int | str" = DEFAULT_MEMORY, pids: int = DEFAULT_PIDS, disk: "int | str" = DEFAULT_DISK,
                     timeout: "float | None" = DEFAULT_TIMEOUT, idle_timeout: "float | None" = None,
                     workdir: str = DEFAULT_WORKDIR, env: "dict | None" = None, tags: "dict | None" = None,
                     name: "str | None" = None, network=None, detach: bool = False,
                     runtime: str = "native", on_idle: str = "terminate") -> "AsyncSandbox":
        """Start a sandbox and return it once it runs (see `hutch.Sandbox.create`)."""
        image = Image.of(image)
        if image.steps:   # an Image defined in Python: build what is not cached yet (with progress)
            image = await asyncio.to_thread(_build.build, image, say_cached=False)
        mounts, provided = _provided.prepare(memory, mounts)  # e.g. hutch.MemoryMount
        with provided:
            spec = build_spec(command, image=image, mounts=mounts, cpu=cpu, memory=memory, pids=pids, disk=disk,
                              timeout=timeout, idle_timeout=idle_timeout, workdir=workdir, env=env, tags=tags,
                              name=name, network=network, detach=detach, runtime=runtime, on_idle=on_idle)
            body = {"spec": spec.to_dict(reveal=True)}

            async def attempt(c):   # on the daemon that will run it: one daemon, or the node a fleet placed it on
                await _ensure.aensure_image(c, spec.image)
                return await c.json("POST", "/v1/sandboxes", json=body)
            client, info = await _client.default_async_client().create_sandbox(attempt)
            sb = cls(client, info)  # type: ignore[arg-type]  # the create's answer is the sandbox's info dict
            try:
                if not spec.detach:
                    if client.ep.url:
                        await asyncio.to_thread(_client.hold_lease, client.ep, sb.id)
                    else:   # a local socket connects at once
                        _client.hold_lease(client.ep, sb.id)
                provided.started(sb.id, cgroups=sb._info.get("cgroups"), disk=spec.limits.disk)
            except BaseException:
                await sb.terminate()
                raise
        return sb

    @classmethod
    async def from_file(cls, path, *, environ=None, **overrides) -> "AsyncSandbox":
        """Create a sandbox declared in a sandbox file (TOML; docs/sandbox-file.md) and return it once it runs.

        Keyword arguments are `create()`'s (and `command=[...]`), each replacing the file's value. The file is
        validated first: a `hutch.SandboxFileError` names its file, line and key, and the fix. What the file
        takes from the environment (`{ from_env = "VAR" }`, credentials) is read from `environ` (default
        os.environ): a file you did not write gets only the variables you give it.

        Example: `hutch.AsyncSandbox.from_file("sandbox.toml", timeout=60)`
        """
        command, kw = SandboxFile.load(path).create_kwargs(environ=environ, **overrides)
        return await cls.create(*command, **kw)

    @classmethod
    async def from_id(cls, sandbox_id: str) -> "AsyncSandbox":
        """Attach to an existing sandbox by id or name (for example one created with `detach=True`)."""
        client = await _client.default_async_client().owner(sandbox_id)
        return cls(client, await client.json("GET", f"/v1/sandboxes/{sandbox_id}"))

    @classmethod
    async def list(cls, *, tags: "dict | None" = None) -> "list[AsyncSandbox]":
        """The sandboxes on this host (on every node of a fleet) whose tags include all of `tags`."""
        return [cls(c, info) for c, info in await _client.default_async_client().list_sandboxes(tag_params(tags))]

    async def terminate(self) -> None:
        """End the sandbox now; returns once every resource it had is gone. Harmless if it already ended."""
        try:
            self._info = await self._client.json("POST", f"/v1/sandboxes/{self.id}/terminate")
        except NotFoundError:
            pass
        except SandboxLostError:   # gone with its node: nothing is left to end
            self._info = {**self._info, "status": "lost"}
        finally:
            _client.release_lease(self.id)

    async def snapshot_memory(self) -> Snapshot:
        """Processes, memory and filesystem into a `hutch.Snapshot` (see `hutch.Sandbox.snapshot_memory`)."""
        return Snapshot.from_json(await self._client.json("POST", f"/v1/sandboxes/{self.id}/snapshot-memory"))

    @classmethod
    async def restore(cls, snapshot: "Snapshot | str", *, detach: bool = False,
                      tags: "dict | None" = None) -> "AsyncSandbox":
        """A new sandbox carrying on where the snapshot's sandbox was (see `hutch.Sandbox.restore`)."""
        snap = Snapshot.of(snapshot)
        client = await _client.default_async_client().for_restore(snap.id)   # a fleet: a node that has it
        sb = cls(client, await client.json("POST", f"/v1/memory-snapshots/{snap.id}/restore",
                                           json={"detach": detach, "tags": dict(tags or {})}))
        if not detach:
            await asyncio.to_thread(_client.hold_lease, client.ep, sb.id)
        return sb

    async def fork(self, n: int = 1, *, detach: bool = False) -> "builtins.list[AsyncSandbox]":
        """`n` running copies of this sandbox (see `hutch.Sandbox.fork`)."""
        d = await self._client.json("POST", f"/v1/sandboxes/{self.id}/fork", json={"n": n, "detach": detach})
        kids = [type(self)(self._client, info) for info in d["sandboxes"]]
        if not detach:
            for k in kids:
                await asyncio.to_thread(_client.hold_lease, self._client.ep, k.id)
        return kids

    async def pause(self) -> None:
        """Stop every process of the sandbox where it is, memory kept (see `hutch.Sandbox.pause`)."""
        self._info = await self._client.json("POST", f"/v1/sandboxes/{self.id}/pause")

    async def resume(self) -> None:
        """Let a paused sandbox run again (harmless if it runs)."""
        self._info = await self._client.json("POST", f"/v1/sandboxes/{self.id}/resume")

    async def wait(self, timeout: "float | None" = None) -> "int | None":
        """Wait until the sandbox ends and return its command's exit code (None if it had none).

        With `timeout`, returns None if it still runs after that many seconds (check `status`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_POLL if deadline is None else max(0.0, min(WAIT_POLL, deadline - time.monotonic()))
            self._info = await self._client.json("POST", f"/v1/sandboxes/{self.id}/wait", params={"timeout": left})
            if self._info.get("status") in ENDED:
                _client.release_lease(self.id)
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                return None

    async def poll(self) -> "int | None":
        """The exit code if the sandbox has ended (None if it had no command), else None."""
        self._info = await self._client.json("GET", f"/v1/sandboxes/{self.id}")
        return self._info.get("returncode") if self._info.get("status") in ENDED else None

    def _fetch_info(self) -> dict:
        # `status` is a property, so it cannot await: a blocking GET on a client of the same endpoint (well
        # under a millisecond on the local socket); `await sb.poll()` refreshes without blocking the loop.
        return _client.sync_client(self._client.ep).json("GET", f"/v1/sandboxes/{self.id}")

    async def set_network(self, network: "Network") -> None:
        """Replace the sandbox's egress policy as a whole while it runs.

        Open connections that the new policy forbids are reset at once; `Network.none()`
        removes the sandbox's network link altogether.
        """
        if not isinstance(network, Network):
            raise InvalidSpecError(f"network={network!r} is not a Network; use hutch.Network.none(), .allow(...) or .open().")
        await self._client.json("PUT", f"/v1/sandboxes/{self.id}/network", json={"network": network.to_dict(reveal=True)})

    async def snapshot_filesystem(self, *, name: "str | None" = None) -> Image:
        """Freeze everything the sandbox has written into a new image (see `hutch.Sandbox.snapshot_filesystem`)."""
        d = await self._client.json("POST", f"/v1/sandboxes/{self.id}/snapshot", json={"name": name} if name else {})
        return Image(d["ref"])

    async def network_log(self) -> NetworkLog:
        """The egress gateway's log of this sandbox (see `hutch.Sandbox.network_log`)."""
        return NetworkLog.from_json(await self._client.json("GET", f"/v1/sandboxes/{self.id}/network/log"))

    # ------------------------------------------------------------ commands

    async def exec(self, *argv: str, timeout: "float | None" = None, workdir: "str | None" = None,
                   env: "dict | None" = None, stdin: "bool | bytes | str" = True, text: bool = True,
                   stdout: bool = True, stderr: bool = True, user: str = "root",
                   pty: "bool | tuple[int, int]" = False) -> "AsyncProcess | AsyncPtyProcess":
        """Start `argv` in the sandbox and return its handle (similar to asyncio.subprocess.Process;
        flow control and stdout=/stderr= as in `Sandbox.exec`). `pty=True` (or (rows, cols)): on a terminal of
        its own, an `AsyncPtyProcess` (see `Sandbox.exec`)."""
        if pty is not False:
            if self._info.get("status") in ENDED:
                raise terminated_error(self.id, self._info)
            return await AsyncPtyProcess.start(self._client, self.id, argv, pty_size(pty), timeout=timeout,
                                               workdir=workdir, env=env, user=user)
        return await self._exec(argv, timeout, workdir, env, stdin, text, stdout, stderr, None, background=True,
                                user=user)

    async def run(self, *argv: str, check: bool = False, timeout: "float | None" = None,
                  workdir: "str | None" = None, env: "dict | None" = None, stdin: "bool | bytes | str" = False,
                  text: bool = True, max_output: "int | None" = DEFAULT_MAX_OUTPUT, user: str = "root") -> ExecResult:
        """Run `argv` to completion and return its stdout, stderr and returncode (see `Sandbox.run`,
        max_output included)."""
        p = await self._exec(argv, timeout, workdir, env, stdin, text, True, True, check_max_output(max_output),
                             background=False, user=user)
        result = await p.result()
        if check and result.returncode != 0:
            if result.reason == "sandbox_ended":   # why it ended under the command; its limits
                self._info = await self._client.json("GET", f"/v1/sandboxes/{self.id}")
            result.check(self._info)
        return result

    async def _exec(self, argv, timeout, workdir, env, stdin, text, stdout, stderr, max_output, *,
                    background: bool, user: str = "root") -> AsyncProcess:
        if self._info.get("status") in ENDED:   # the last answer: no request on the way to every exec
            raise terminated_error(self.id, self._info)
        is_open, data = stdin_payload(stdin)
        body = exec_body(argv, timeout=timeout, workdir=workdir, env=env, stdin=is_open, stdout=stdout, stderr=stderr,
                         max_output=max_output, user=user)
        resp = await self._client.request("POST", f"/v1/sandboxes/{self.id}/exec", json=body, stream=True)
        p = AsyncProcess(self._client, self.id, argv, resp, text=text, stdin_open=is_open, background=background,
                         max_output=max_output)
        if data is not None:
            p.stdin._open = False
            await self._client.request("POST", f"{p._base}/stdin", params={"eof": "1"}, content=data)
        return p

    # ------------------------------------------------------------ code interpreter

    async def run_code(self, code: str, *, context: "CodeContext | str | None" = None,
                       timeout: "float | None" = None, on_stdout=None, on_stderr=None, on_result=None,
                       on_error=None) -> Execution:
        """Run a cell of Python in the sandbox's stateful interpreter (see `hutch.Sandbox.run_code`); the
        callbacks may be plain functions or coroutine functions."""
        cbs = {"on_stdout": on_stdout, "on_stderr": on_stderr, "on_result": on_result, "on_error": on_error}
        return await self._code().run(code, context, timeout, cbs)

    async def create_code_context(self, cwd: "str | None" = None, language: str = "python") -> CodeContext:
        """Start another independent interpreter in this sandbox (see `hutch.Sandbox.create_code_context`)."""
        return await self._code().create_context(cwd, language)

    async def list_code_contexts(self) -> "builtins.list[CodeContext]":
        """The code contexts of this handle: the default one, then those made by create_code_context()."""
        return self._code().list_contexts()

    async def remove_code_context(self, context: "CodeContext | str") -> None:
        """End a context made by create_code_context(): its kernel stops and its state is gone."""
        await self._code().remove_context(context)

    def _code(self) -> AsyncInterpreter:
        if self.status in ENDED:
            raise terminated_error(self.id, self.info)
        if self._interp is None:
            self._interp = AsyncInterpreter(self)
        return self._interp

    # ------------------------------------------------------------ state

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.terminate()

    def __repr__(self) -> str:
        return f"<hutch.AsyncSandbox {self.id} {self._info.get('status')}>"
