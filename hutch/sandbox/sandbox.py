"""`hutch.Sandbox`: an isolated, ephemeral Linux environment for untrusted code.

    with hutch.Sandbox.create(timeout=300, memory="512M", cpu=1.0) as sb:
        p = sb.exec("python3", "-c", "print(sum(range(10)))")
        for line in p.stdout:
            print(line, end="")
        assert p.wait() == 0

A sandbox is declared once, at creation; the host daemon owns it. Unless
created with `detach=True`, it ends when the Python process that created it
ends, however that process ends. `hutch.AsyncSandbox` (hutch/sandbox/aio.py)
is the same surface, awaitable.
"""

from __future__ import annotations

import builtins   # `list` in the class body is the classmethod; annotations name the built-in
import time

from hutch._core.errors import InvalidSpecError, NotFoundError, SandboxLostError
from hutch.sandbox import _build, _client, _ensure, _provided
from hutch.sandbox._files import Files
from hutch.sandbox._interp import Interpreter
from hutch.sandbox._process import Process
from hutch.sandbox._sbfile import SandboxFile
from hutch.sandbox._spec import (
    Network,
    DEFAULT_CPU, DEFAULT_DISK, DEFAULT_MEMORY, DEFAULT_PIDS, DEFAULT_TIMEOUT, DEFAULT_WORKDIR, SandboxSpec,
)
from hutch.sandbox._api import (
    DEFAULT_MAX_OUTPUT, ENDED, WAIT_POLL, ExecResult, NetworkLog, SandboxState, check_max_output,
    exec_body, pty_size, stdin_payload, tag_params, terminated_error,
)
from hutch.sandbox._terminal import PtyProcess
from hutch.sandbox.image import Image
from hutch.sandbox.interpreter import CodeContext, Execution
from hutch.sandbox.snapshot import Snapshot


def build_spec(command, *, image, mounts, cpu, memory, pids, disk, timeout, idle_timeout, workdir, env, tags,
               name, network, detach, runtime="native", on_idle="terminate") -> SandboxSpec:
    """create()'s arguments -> a validated SandboxSpec (shared by Sandbox and AsyncSandbox)."""
    return SandboxSpec.build(
        command, image=Image.of(image).ref, mounts=mounts, network=network, memory=memory, cpu=cpu, pids=pids,
        disk=disk, timeout=timeout, idle_timeout=idle_timeout, workdir=workdir, env=env, tags=tags, name=name,
        detach=detach, runtime=runtime, on_idle=on_idle,
    )


class Sandbox(SandboxState):
    """A running (or ended) sandbox. Make one with `Sandbox.create()`; find one with `from_id` or `list`."""

    def __init__(self, client: "_client.Client", info: dict) -> None:
        self._client = client
        self._info = info
        self.id: str = info["id"]
        self.files = Files(client, self.id)
        self._interp: Interpreter | None = None

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, *command: str, image: "Image | str | None" = None, mounts=(), cpu: float = DEFAULT_CPU,
               memory: "int | str" = DEFAULT_MEMORY, pids: int = DEFAULT_PIDS, disk: "int | str" = DEFAULT_DISK,
               timeout: "float | None" = DEFAULT_TIMEOUT, idle_timeout: "float | None" = None,
               workdir: str = DEFAULT_WORKDIR, env: "dict | None" = None, tags: "dict | None" = None,
               name: "str | None" = None, network=None, detach: bool = False,
               runtime: str = "native", on_idle: str = "terminate") -> "Sandbox":
        """Start a sandbox and return it once it runs.

        With `command`, the sandbox lives as long as that command; without one it waits for
        `exec` calls until terminated or timed out. `mounts` are `hutch.Mount` values (and mounts other
        parts provide, such as `hutch.MemoryMount`), `memory` the RAM limit, `network`
        a `hutch.Network` (default: none), `image` a `hutch.Image` (default: Debian with python3).
        Unless `detach=True`, the sandbox ends when this Python process ends. `runtime="gvisor"` runs it under
        gVisor (runsc: a kernel of its own; `snapshot_memory`, `restore` and `fork` need it); `on_idle="pause"`
        makes `idle_timeout` pause it instead of ending it (the next call resumes it).

        Example: `hutch.Sandbox.create(memory="1G", mounts=[hutch.Mount.bind("./data", "/data")])`
        """
        image = Image.of(image)
        if image.steps:   # an Image defined in Python: build what is not cached yet (with progress)
            image = _build.build(image, say_cached=False)
        mounts, provided = _provided.prepare(memory, mounts)  # e.g. hutch.MemoryMount
        with provided:
            spec = build_spec(command, image=image, mounts=mounts, cpu=cpu, memory=memory, pids=pids, disk=disk,
                              timeout=timeout, idle_timeout=idle_timeout, workdir=workdir, env=env, tags=tags,
                              name=name, network=network, detach=detach, runtime=runtime, on_idle=on_idle)
            body = {"spec": spec.to_dict(reveal=True)}

            def attempt(c):   # on the daemon that will run it: one daemon, or the node a fleet placed it on
                _ensure.ensure_image(c, spec.image)
                return c.json("POST", "/v1/sandboxes", json=body)
            client, info = _client.default_client().create_sandbox(attempt)
            sb = cls(client, info)  # type: ignore[arg-type]  # a fleet's client speaks the Client's calls
            try:
                if not spec.detach:
                    _client.hold_lease(client.ep, sb.id)
                provided.started(sb.id, cgroups=sb._info.get("cgroups"), disk=spec.limits.disk)
            except BaseException:
                sb.terminate()
                raise
        return sb

    @classmethod
    def from_file(cls, path, *, environ=None, **overrides) -> "Sandbox":
        """Create a sandbox declared in a sandbox file (TOML; docs/sandbox-file.md) and return it once it runs.

        Keyword arguments are `create()`'s (and `command=[...]`), each replacing the file's value. The file is
        validated first: a `hutch.SandboxFileError` names its file, line and key, and the fix. What the file
        takes from the environment (`{ from_env = "VAR" }`, credentials) is read from `environ` (default
        os.environ): a file you did not write gets only the variables you give it.

        Example: `hutch.Sandbox.from_file("sandbox.toml", timeout=60)`
        """
        command, kw = SandboxFile.load(path).create_kwargs(environ=environ, **overrides)
        return cls.create(*command, **kw)

    @classmethod
    def from_id(cls, sandbox_id: str) -> "Sandbox":
        """Attach to an existing sandbox by id or name (for example one created with `detach=True`)."""
        client = _client.default_client().owner(sandbox_id)
        return cls(client, client.json("GET", f"/v1/sandboxes/{sandbox_id}"))

    @classmethod
    def list(cls, *, tags: "dict | None" = None) -> "list[Sandbox]":
        """The sandboxes on this host (on every node of a fleet) whose tags include all of `tags`."""
        return [cls(c, info) for c, info in _client.default_client().list_sandboxes(tag_params(tags))]

    def terminate(self) -> None:
        """End the sandbox now; returns once every resource it had is gone. Harmless if it already ended."""
        try:
            self._info = self._client.json("POST", f"/v1/sandboxes/{self.id}/terminate")
        except NotFoundError:
            pass
        except SandboxLostError:   # gone with its node: nothing is left to end
            self._info = {**self._info, "status": "lost"}
        finally:
            _client.release_lease(self.id)

    def pause(self) -> None:
        """Stop every process of the sandbox where it is, memory kept, until `resume()` (or any call that runs
        something in it: exec, files). Its timeout goes on counting."""
        self._info = self._client.json("POST", f"/v1/sandboxes/{self.id}/pause")

    def resume(self) -> None:
        """Let a paused sandbox run again (harmless if it runs)."""
        self._info = self._client.json("POST", f"/v1/sandboxes/{self.id}/resume")

    def wait(self, timeout: "float | None" = None) -> "int | None":
        """Wait until the sandbox ends and return its command's exit code (None if it had none).

        With `timeout`, returns None if it still runs after that many seconds (check `status`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_POLL if deadline is None else max(0.0, min(WAIT_POLL, deadline - time.monotonic()))
            self._info = self._client.json("POST", f"/v1/sandboxes/{self.id}/wait", params={"timeout": left})
            if self._info.get("status") in ENDED:
                _client.release_lease(self.id)
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def poll(self) -> "int | None":
        """The exit code if the sandbox has ended (None if it had no command), else None. Never blocks."""
        self._info = self._fetch_info()
        return self._info.get("returncode") if self._info.get("status") in ENDED else None

    def _fetch_info(self) -> dict:
        return self._client.json("GET", f"/v1/sandboxes/{self.id}")

    def set_network(self, network: "Network") -> None:
        """Replace the sandbox's egress policy as a whole while it runs.

        Open connections that the new policy forbids are reset at once; `Network.none()`
        removes the sandbox's network link altogether.
        """
        if not isinstance(network, Network):
            raise InvalidSpecError(f"network={network!r} is not a Network; use hutch.Network.none(), .allow(...) or .open().")
        self._client.json("PUT", f"/v1/sandboxes/{self.id}/network", json={"network": network.to_dict(reveal=True)})

    def snapshot_filesystem(self, *, name: "str | None" = None) -> Image:
        """Freeze everything the sandbox has written (deletions included) into a new image and return it.

        `Sandbox.create(image=snap)` starts from this sandbox's image plus its writes. Snapshots are
        content-addressed (the same writes are stored once), survive daemon restarts, are kept by
        `hutch image prune`, and move between hosts with `snap.export(path)` / `hutch.Image.import_(path)`.
        Files written while the snapshot is taken may be caught half-written: snapshot a quiet sandbox.
        """
        d = self._client.json("POST", f"/v1/sandboxes/{self.id}/snapshot", json={"name": name} if name else {})
        return Image(d["ref"])

    def snapshot_memory(self) -> Snapshot:
        """Processes, memory and filesystem of this sandbox into a `hutch.Snapshot`; the sandbox runs on (it is
        stopped while the memory is written: ~0.1 s + 0.6 ms per MiB it holds). `runtime="gvisor"` only: a native
        sandbox raises UnsupportedError. Restore it with `Sandbox.restore(snap)`."""
        return Snapshot.from_json(self._client.json("POST", f"/v1/sandboxes/{self.id}/snapshot-memory"))

    @classmethod
    def restore(cls, snapshot: "Snapshot | str", *, detach: bool = False, tags: "dict | None" = None) -> "Sandbox":
        """A new sandbox carrying on where the snapshot's sandbox was: the same processes and memory, a copy of
        its filesystem, its own id, hostname and network attachment (under the snapshot's egress policy).
        Open connections are gone; programs that keep their own random state should re-seed it."""
        snap = Snapshot.of(snapshot)
        client = _client.default_client().for_restore(snap.id)   # a fleet's: a node holding it, or one it moves to
        sb = cls(client, client.json("POST", f"/v1/memory-snapshots/{snap.id}/restore",
                                     json={"detach": detach, "tags": dict(tags or {})}))
        if not detach:
            _client.hold_lease(client.ep, sb.id)
        return sb

    def fork(self, n: int = 1, *, detach: bool = False) -> "builtins.list[Sandbox]":
        """`n` running copies of this sandbox, each with its own filesystem and identity (a memory snapshot
        restored `n` times at once; `runtime="gvisor"` only). This sandbox runs on."""
        d = self._client.json("POST", f"/v1/sandboxes/{self.id}/fork", json={"n": n, "detach": detach})
        kids = [type(self)(self._client, info) for info in d["sandboxes"]]
        if not detach:
            for k in kids:
                _client.hold_lease(self._client.ep, k.id)
        return kids

    def network_log(self) -> NetworkLog:
        """The egress gateway's log of this sandbox: its decisions kept, oldest first, and counts of all.

        Iterate it for the decisions (dicts: time, name, address, port, protocol, verdict, reason);
        `dropped`, `refusals_by_reason`, `refusals_by_target` and `limits` count what it did not keep
        (see `hutch.NetworkLog`).
        """
        return NetworkLog.from_json(self._client.json("GET", f"/v1/sandboxes/{self.id}/network/log"))

    # ------------------------------------------------------------ commands

    def exec(self, *argv: str, timeout: "float | None" = None, workdir: "str | None" = None,
             env: "dict | None" = None, stdin: "bool | bytes | str" = True, text: bool = True,
             stdout: bool = True, stderr: bool = True, user: str = "root",
             pty: "bool | tuple[int, int]" = False) -> "Process | PtyProcess":
        """Start `argv` in the sandbox and return its handle (similar to subprocess.Popen).

        `timeout` ends the command (not the sandbox) after that many seconds. `stdin=True` opens a
        pipe for `p.stdin.write()`; bytes or str are sent and then closed; False gives no input.
        Output is text (UTF-8) unless `text=False`; `stdout=False` / `stderr=False` give the command
        /dev/null there instead (like subprocess.DEVNULL). `user="user"` runs it as the sandbox's unprivileged
        user (uid and gid 1000) instead of its root (which has no capabilities either). Output is flow-controlled as with OS pipes:
        at OUTPUT_BUFFER unread bytes of a stream (2 MiB) the command blocks until it is read, so read
        every stream you keep (see hutch.Process).

        `pty=True` (a 24 x 80 terminal, or `pty=(rows, cols)`) runs it on a terminal of its own, made inside
        the sandbox (colours, line editing, Ctrl-C, job control work as in a terminal) and returns a
        `hutch.PtyProcess`: `write()`, `read()`, `read_until()`, `resize(rows, cols)`, `wait()`; stdin,
        stdout, stderr and text do not apply (the terminal is all three, in bytes). On runtime="gvisor" the
        terminal is a pty of the sandbox's own on the host that gVisor gives the command: the same, except that
        `tty` there says "not a tty" (gVisor names it host:[N]), and a memory snapshot or fork is refused
        while one is open.

        Example: `for line in sb.exec("ls", "-l", "/").stdout: print(line, end="")`
        """
        if pty is not False:
            if self._info.get("status") in ENDED:
                raise terminated_error(self.id, self._info)
            return PtyProcess.start(self._client, self.id, argv, pty_size(pty), timeout=timeout, workdir=workdir,
                                    env=env, user=user)
        return self._exec(argv, timeout, workdir, env, stdin, text, stdout, stderr, None, background=True, user=user)

    def run(self, *argv: str, check: bool = False, timeout: "float | None" = None, workdir: "str | None" = None,
            env: "dict | None" = None, stdin: "bool | bytes | str" = False, text: bool = True,
            max_output: "int | None" = DEFAULT_MAX_OUTPUT, user: str = "root") -> ExecResult:
        """Run `argv` to completion and return its stdout, stderr and returncode.

        Keeps the first `max_output` bytes of each stream (DEFAULT_MAX_OUTPUT, 4 MiB; None keeps all);
        the rest is drained and dropped while the command runs on, and counted in the result's
        `stdout_dropped` / `stderr_dropped` (`truncated` is True then). With `check=True`, a non-zero
        exit raises `hutch.ExecError` carrying all of that.

        Example: `sb.run("python3", "-c", "print(1)", check=True).stdout == "1\\n"`
        """
        p = self._exec(argv, timeout, workdir, env, stdin, text, True, True, check_max_output(max_output),
                       background=False, user=user)
        result = p.result()
        if check and result.returncode != 0:
            # the sandbox's info says why it ended under the command, and holds the limits the error names
            result.check(self._fetch_info() if result.reason == "sandbox_ended" else self._info)
        return result

    def _exec(self, argv, timeout, workdir, env, stdin, text, stdout, stderr, max_output, *,
              background: bool, user: str = "root") -> Process:
        if self._info.get("status") in ENDED:   # the last answer: no request on the way to every exec
            raise terminated_error(self.id, self._info)
        is_open, data = stdin_payload(stdin)
        body = exec_body(argv, timeout=timeout, workdir=workdir, env=env, stdin=is_open, stdout=stdout, stderr=stderr,
                         max_output=max_output, user=user)
        resp = self._client.request("POST", f"/v1/sandboxes/{self.id}/exec", json=body, stream=True)
        p = Process(self._client, self.id, argv, resp, text=text, stdin_open=is_open, background=background,
                    max_output=max_output)
        if data is not None:
            p.stdin._open = False
            self._client.request("POST", f"{p._base}/stdin", params={"eof": "1"}, content=data)
        return p

    # ------------------------------------------------------------ code interpreter

    def run_code(self, code: str, *, context: "CodeContext | str | None" = None, timeout: "float | None" = None,
                 on_stdout=None, on_stderr=None, on_result=None, on_error=None) -> Execution:
        """Run a cell of Python in the sandbox's stateful interpreter (a Jupyter kernel) and return its Execution.

        State (variables, imports) persists between calls in one context. An error in the cell is in the
        result (`ex.error`: name, value, traceback), not raised. `timeout` interrupts the cell (the kernel and
        its state survive; `ex.error.name == "TimeoutError"`); a kernel that dies is reported as KernelDied
        and the next call runs in a fresh one (`ex.restarted`). `on_stdout`/`on_stderr` get each chunk of text
        as it is printed, `on_result` each Result (a chart), `on_error` the ExecutionError, all in this thread.
        The image needs ipykernel: `image=hutch.Image.code_interpreter()`.

        Example: `sb.run_code("x = 41"); sb.run_code("x + 1").text == "42"`
        """
        cbs = {"on_stdout": on_stdout, "on_stderr": on_stderr, "on_result": on_result, "on_error": on_error}
        return self._code().run(code, context, timeout, cbs)

    def create_code_context(self, cwd: "str | None" = None, language: str = "python") -> CodeContext:
        """Start another independent interpreter (its own kernel and variables) in this sandbox, working in
        `cwd` (made if missing; default: the sandbox's workdir). Pass it as `run_code(..., context=ctx)`."""
        return self._code().create_context(cwd, language)

    def list_code_contexts(self) -> "builtins.list[CodeContext]":
        """The code contexts of this handle: the default one, then those made by create_code_context()."""
        return self._code().list_contexts()

    def remove_code_context(self, context: "CodeContext | str") -> None:
        """End a context made by create_code_context(): its kernel stops and its state is gone."""
        self._code().remove_context(context)

    def _code(self) -> Interpreter:
        if self.status in ENDED:
            raise terminated_error(self.id, self.info)
        if self._interp is None:
            self._interp = Interpreter(self)
        return self._interp

    # ------------------------------------------------------------ state

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<hutch.Sandbox {self.id} {self._info.get('status')}>"
