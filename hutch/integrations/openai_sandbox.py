"""hutch as a sandbox backend of the OpenAI Agents SDK: a `SandboxAgent`'s shell, files and patches run in a
hutch sandbox.

    from agents import Runner, RunConfig
    from agents.sandbox import SandboxAgent, SandboxRunConfig
    from hutch.integrations.openai_sandbox import HutchSandboxClient, HutchSandboxClientOptions

    agent = SandboxAgent(name="dev", instructions="...", model=MODEL)
    cfg = RunConfig(sandbox=SandboxRunConfig(client=HutchSandboxClient(),
                                             options=HutchSandboxClientOptions(memory="1G")))
    Runner.run_sync(agent, "Write fizzbuzz.py and run it.", run_config=cfg)

The Runner makes one sandbox per run (hutch.Sandbox.create with the options: image, cpu, memory, timeout,
allowed domains) and ends it when the run ends, also when it fails; the daemon ends it if the process dies.
The manifest's root (/workspace by default) is made and every command runs there. A path the model gives
is confined to the workspace by the SDK's own checks, run inside the sandbox (symlinks resolved there).
Snapshots: persist_workspace / hydrate_workspace are a tar of the workspace, made and read in the sandbox.
Needs 'hutch[openai]'; no PTY (the SDK's shell tool then runs each command to its end).
"""

from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path
from typing import Any, Literal

import hutch
from hutch.integrations._common import MAX_FILE, TAG, require

_client, _base, _state, _snap, _types, _errors, _manifest, _rt = require(
    "openai", "agents.sandbox.session.sandbox_client", "agents.sandbox.session.base_sandbox_session",
    "agents.sandbox.session.sandbox_session_state", "agents.sandbox.snapshot", "agents.sandbox.types",
    "agents.sandbox.errors", "agents.sandbox.manifest", "agents.sandbox.session.runtime_helpers")
ExecResult, Manifest = _types.ExecResult, _manifest.Manifest

#: Bytes of each stream an exec keeps (the SDK's shell tool cuts what it shows the model further).
MAX_EXEC_OUTPUT = 1 << 20
_HYDRATE_TAR = "/tmp/.hutch-hydrate.tar"


class HutchSandboxClientOptions(_client.BaseSandboxClientOptions):
    """How each run's sandbox is made (hutch.Sandbox.create): `image` an image reference ("debian-slim",
    "image:<id>", a name from `hutch image ls`; default: hutch's default image), `allow_domains` the names
    it may reach (default: no network), `env` its environment, `tags` added to created_by=hutch-integrations."""

    type: Literal["hutch"] = "hutch"
    image: str | None = None
    cpu: float = 1.0
    memory: str = "1G"
    timeout: float = 1800.0
    allow_domains: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    tags: dict[str, str] | None = None


class HutchSandboxSessionState(_state.SandboxSessionState):
    type: Literal["hutch"] = "hutch"
    sandbox_id: str
    options: HutchSandboxClientOptions


def _create(options: HutchSandboxClientOptions):
    network = hutch.Network.allow(domains=list(options.allow_domains)) if options.allow_domains else None
    return hutch.Sandbox.create(image=options.image, cpu=options.cpu, memory=options.memory,
                                timeout=options.timeout, env=options.env, network=network,
                                tags={**(options.tags or {}), **TAG, "integration": "openai-agents"})


class HutchSandboxSession(_base.BaseSandboxSession):
    """One hutch sandbox behind the SDK's session API (exec, read, write; the rest the SDK builds on them)."""

    state: HutchSandboxSessionState

    def __init__(self, *, state: HutchSandboxSessionState, sandbox) -> None:
        self.state = state
        self.sandbox = sandbox

    @property
    def _root(self) -> str:
        return str(self.state.manifest.root)

    def _runtime_helpers(self):
        return (_rt.RESOLVE_WORKSPACE_PATH_HELPER,)

    async def _validate_path_access(self, path: Path | str, *, for_write: bool = False) -> Path:
        return await self._validate_remote_path_access(path, for_write=for_write)

    async def _prepare_backend_workspace(self) -> None:
        await asyncio.to_thread(self.sandbox.files.mkdir, self._root, parents=True)

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        argv = [str(c) for c in command]
        env = await self.state.manifest.environment.resolve()
        try:
            r = await asyncio.to_thread(self.sandbox.run, *argv, timeout=timeout, workdir=self._root,
                                        env=env or None, text=False, max_output=MAX_EXEC_OUTPUT)
        except hutch.NotFoundError as e:   # no such program: what a shell would answer
            return ExecResult(stdout=b"", stderr=f"{e}\n".encode(), exit_code=127)
        except hutch.Error as e:
            raise _errors.ExecTransportError(command=tuple(argv), cause=e) from e
        if r.reason == "timeout":
            raise _errors.ExecTimeoutError(command=tuple(argv), timeout_s=timeout)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.returncode)

    async def read(self, path: Path | str, *, user=None) -> io.IOBase:
        p = await (self._check_read_with_exec(path, user=user) if user is not None else
                   self._validate_path_access(path))
        try:
            info = await asyncio.to_thread(self.sandbox.files.stat, str(p))
            if info.size > MAX_FILE:
                raise _errors.WorkspaceArchiveReadError(path=Path(str(p)), context={"reason": "file_too_large",
                                                                                      "size": info.size})
            return io.BytesIO(await asyncio.to_thread(self.sandbox.files.read, str(p)))
        except hutch.NotFoundError as e:
            raise _errors.WorkspaceReadNotFoundError(path=Path(str(p)), cause=e) from e
        except hutch.Error as e:
            raise _errors.WorkspaceArchiveReadError(path=Path(str(p)), cause=e) from e

    async def write(self, path: Path | str, data: io.IOBase, *, user=None) -> None:
        if user is not None:
            await self._check_write_with_exec(path, user=user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode()
        if not isinstance(payload, (bytes, bytearray)):
            raise _errors.WorkspaceWriteTypeError(path=Path(str(path)), actual_type=type(payload).__name__)
        p = await self._validate_path_access(path, for_write=True)
        try:
            await asyncio.to_thread(self.sandbox.files.write, str(p), bytes(payload))
        except hutch.Error as e:
            raise _errors.WorkspaceArchiveWriteError(path=Path(str(p)), cause=e) from e

    async def running(self) -> bool:
        try:
            return await asyncio.to_thread(self.sandbox.poll) is None
        except hutch.Error:
            return False

    async def persist_workspace(self) -> io.IOBase:
        r = await asyncio.to_thread(self.sandbox.run, "tar", "-C", self._root, "-cf", "-", ".", text=False,
                                    max_output=None)
        if r.returncode != 0:
            raise _errors.WorkspaceArchiveReadError(path=Path(self._root), context={
                "reason": "tar_failed", "stderr": r.stderr.decode(errors="replace")[-2000:]})
        return io.BytesIO(r.stdout)

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        payload = data.read()
        await asyncio.to_thread(self.sandbox.files.write, _HYDRATE_TAR, payload)
        r = await asyncio.to_thread(self.sandbox.run, "sh", "-c", 'mkdir -p "$1" && tar -C "$1" -xf "$2"; s=$?; '
                                    'rm -f "$2"; exit $s', "hydrate", self._root, _HYDRATE_TAR)
        if r.returncode != 0:
            raise _errors.WorkspaceArchiveWriteError(path=Path(self._root), context={
                "reason": "untar_failed", "stderr": r.stderr[-2000:]})

    async def _shutdown_backend(self) -> None:
        await asyncio.to_thread(self.sandbox.terminate)


class HutchSandboxClient(_client.BaseSandboxClient[HutchSandboxClientOptions | None]):
    """Makes, resumes and deletes the hutch sandboxes of SandboxAgent runs."""

    backend_id = "hutch"
    supports_default_options = True

    async def create(self, *, snapshot=None, manifest=None, options: HutchSandboxClientOptions | None = None):
        manifest = self._validate_manifest_for_create(manifest if manifest is not None else Manifest())
        options = options or HutchSandboxClientOptions()
        sb = await asyncio.to_thread(_create, options)
        sid = uuid.uuid4()
        state = HutchSandboxSessionState(session_id=sid, manifest=manifest, sandbox_id=sb.id, options=options,
                                         snapshot=_snap.resolve_snapshot(snapshot, str(sid)))
        return self._wrap_session(HutchSandboxSession(state=state, sandbox=sb))

    async def delete(self, session):
        inner = getattr(session, "_inner", session)
        if isinstance(inner, HutchSandboxSession):
            await asyncio.to_thread(inner.sandbox.terminate)
        return session

    async def resume(self, state):
        if not isinstance(state, HutchSandboxSessionState):
            raise TypeError("HutchSandboxClient.resume expects a HutchSandboxSessionState.")
        sb, preserved = None, False
        try:
            sb = await asyncio.to_thread(hutch.Sandbox.from_id, state.sandbox_id)
            preserved = sb.poll() is None
        except hutch.NotFoundError:
            pass
        if not preserved:   # gone: a new one, hydrated from the snapshot by start()
            sb = await asyncio.to_thread(_create, state.options)
            state.sandbox_id, state.workspace_root_ready = sb.id, False
        inner = HutchSandboxSession(state=state, sandbox=sb)
        inner._set_start_state_preserved(preserved, system=preserved)
        return self._wrap_session(inner)

    def deserialize_session_state(self, payload: dict[str, object]) -> Any:
        return self._deserialize_session_state_payload(payload, HutchSandboxSessionState)
