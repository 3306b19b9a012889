"""The exception tree of hutch. Every error hutch raises derives from `Error`.

    Error
    ├── ConfigError            bad input to a constructor or call: the message names the fix
    │   ├── InvalidSpecError   a sandbox or option spec that cannot be honoured
    │   │   └── SandboxFileError   ... read from a sandbox file: carries path, line, key
    │   ├── NetworkPolicyError an egress policy entry is invalid; names the entry
    │   └── UnsupportedError   not on this runtime or host (a memory snapshot of a native sandbox); names the one that has it
    ├── NotFoundError          a sandbox, image, entity, volume ... that does not exist
    │   └── SnapshotLostError  a memory snapshot whose only holder, a fleet node, is gone
    ├── StateError             an operation on something in the wrong state (exec on a terminated sandbox)
    ├── SandboxError           a sandbox failed to start or broke while running
    │   ├── SandboxLostError   the fleet node that ran it is gone (its sandboxes with it): status "lost"
    │   ├── ImageError         an image could not be found or built
    │   │   └── InvalidArchiveError   an image archive refused on import (also a ConfigError: 400)
    │   └── ExecError          a command did not succeed (carries argv, stdout, stderr, returncode, reason)
    │       ├── SandboxTimeout     ... because it, or its sandbox, ran past a timeout and was killed
    │       └── OutOfMemoryError   ... because the kernel killed it at its sandbox's memory limit
    ├── DaemonError            the host daemon could not be reached or answered badly
    ├── QuotaExceededError     a tenant's quota would be exceeded (HTTP 429): carries quota, limit, used
    ├── MissingExtraError      a wing imported without its extra installed (also an ImportError): names the pip line
    └── MemoryStoreError       the SMF store: bad files, dangling links, conflicts
        ├── SearchIndexError   the derived search index could not be built or read
        ├── EntityNotFoundError   no such entity (also a NotFoundError)
        ├── EntityExistsError     put() of an entity that exists: update/supersede instead
        ├── MalformedEntityError  an entity file with missing or bad front matter (carries .path)
        └── StorePathError        an invalid name or a path escaping the store (also a ConfigError)

    MalformedEntityWarning     (a UserWarning, not an error) search left out entity files it cannot read
    ReasonerWarning            (a UserWarning, not an error) search answered without its failing reasoner

Messages are full sentences that say what went wrong and how to fix it.
"""

from __future__ import annotations


class Error(Exception):
    """Root of every error raised by hutch."""


class ConfigError(Error, ValueError):
    """Bad input to a constructor or call; the message names the fix."""


class InvalidSpecError(ConfigError):
    """A sandbox specification that cannot be honoured."""


class SandboxFileError(InvalidSpecError):
    """A sandbox file that cannot be read or honoured; the message starts `file:line: key:` and names the fix.
    Carries `path`, `line` (None when the whole file is at fault) and `key` (a dotted path like `limits.memory`)."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.line = line
        self.key = key


class UnsupportedError(ConfigError):
    """The call is not available on this sandbox's runtime or on this host; the message names what has it
    (a memory snapshot needs `runtime="gvisor"`)."""


class NotFoundError(Error, LookupError):
    """A named thing (sandbox, image, entity, volume) does not exist."""


class SnapshotLostError(NotFoundError):
    """A memory snapshot lived only on a fleet node that is gone (its Ray node died, or its daemon does not answer):
    the message names the node. It comes back if that node returns with its state directory; export the
    snapshots you need to keep (`Snapshot.export`) and import them elsewhere (docs/fleet.md)."""


class StateError(Error):
    """An operation on something in the wrong lifecycle state."""


class SandboxError(Error):
    """A sandbox failed to start or broke while running."""


class SandboxLostError(SandboxError):
    """The fleet node that ran this sandbox is gone (its Ray node died or its daemon stopped), and the sandbox with
    it: its status is "lost". Create a new one; the fleet places it on a node that is up (docs/fleet.md)."""


class ImageError(SandboxError):
    """An image could not be found or built. A failed build step carries `step`, `output`, `returncode`."""

    def __init__(self, message: str, *, step: str | None = None, output: str = "", returncode: int | None = None):
        super().__init__(message)
        self.step = step
        self.output = output
        self.returncode = returncode


class InvalidArchiveError(ImageError, ConfigError):
    """An image archive given to import that is not one `export` makes, or is over a limit; nothing was stored."""


class ExecError(SandboxError):
    """A command did not succeed (`run(check=True)`). Carries its result: argv, stdout, stderr, returncode, the
    bytes of each stream dropped beyond run()'s max_output (`truncated` if any), and `reason` (exited, signaled,
    killed, timeout, oom, sandbox_ended) with the sandbox's id and, when the sandbox ended under the command,
    its status (`sandbox_status`)."""

    def __init__(self, message: str, *, argv=(), stdout=b"", stderr=b"", returncode=None,
                 stdout_dropped: int = 0, stderr_dropped: int = 0, reason: str | None = None,
                 sandbox_id: str | None = None, sandbox_status: str | None = None):
        super().__init__(message)
        self.argv = tuple(argv)
        self.stdout = stdout
        self.stderr = stderr
        self.returncode = returncode
        self.stdout_dropped = stdout_dropped
        self.stderr_dropped = stderr_dropped
        self.reason = reason
        self.sandbox_id = sandbox_id
        self.sandbox_status = sandbox_status

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_dropped or self.stderr_dropped)


class SandboxTimeout(ExecError):
    """A command was killed because it (exec `timeout=`) or its sandbox (`timeout=`, `idle_timeout=`) ran past
    a timeout. Carries the command's result, as ExecError."""


class OutOfMemoryError(ExecError):
    """A command was killed by the kernel because its sandbox hit its memory limit (`memory=`). Carries the
    command's result, as ExecError."""


class DaemonError(Error):
    """The host daemon could not be reached, or answered with an error."""


class QuotaExceededError(Error):
    """A tenant's quota, or the daemon's own cap (`hutch serve --max-sandboxes`: quota "host_sandboxes"), would be
    exceeded (the daemon answers 429); nothing was made, and the call may be retried. Carries `quota` (its name:
    sandboxes, cpu, memory, disk, creates_per_second, egress_bytes_per_day, host_sandboxes), `limit` and `used`."""

    def __init__(self, message: str, *, quota: str | None = None, limit=None, used=None):
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.used = used


class MissingExtraError(Error, ImportError):
    """A wing was imported without the optional dependencies it needs; the message is the one line that names
    its extra: "hutch.memory needs the 'memory' extra: pip install 'hutch[memory]'"."""


class NetworkPolicyError(ConfigError):
    """An egress policy entry is invalid; the message names the entry."""


class MemoryStoreError(Error):
    """The SMF store: bad files, dangling links, conflicting writes."""


class SearchIndexError(MemoryStoreError):
    """The derived search index could not be built or read."""


class EntityNotFoundError(MemoryStoreError, NotFoundError):
    """No entity with that id exists in the store (or in the `as_of` view asked)."""


class EntityExistsError(MemoryStoreError):
    """`put` of an entity that already exists; use `update`, `supersede` or `exist_ok=True`."""


class MalformedEntityError(MemoryStoreError):
    """An entity file (often hand-edited) has no or malformed front matter. Carries `path`."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class StorePathError(MemoryStoreError, ConfigError):
    """A class, slug, relation or path that is invalid or would escape the store."""


class MalformedEntityWarning(UserWarning):
    """Search left out entity files whose front matter is malformed (named once per process; `check()` says
    what is wrong with each). A warning, not an error: the rest of the store answers."""


class ReasonerWarning(UserWarning):
    """Search's optional reasoner (an LLM endpoint) failed, so search answered as without it: once per outage
    (`doctor().reasoner_error` keeps the last failure). A warning, not an error: the hits are plain search's."""


__all__ = [
    "ConfigError",
    "DaemonError",
    "EntityExistsError",
    "EntityNotFoundError",
    "Error",
    "ExecError",
    "ImageError",
    "InvalidArchiveError",
    "InvalidSpecError",
    "MalformedEntityError",
    "MemoryStoreError",
    "MissingExtraError",
    "NetworkPolicyError",
    "NotFoundError",
    "OutOfMemoryError",
    "QuotaExceededError",
    "SandboxError",
    "SandboxFileError",
    "SandboxLostError",
    "SandboxTimeout",
    "SearchIndexError",
    "SnapshotLostError",
    "StateError",
    "StorePathError",
    "UnsupportedError",
]
