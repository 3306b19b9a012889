"""hutch: a self-hosted runtime for AI agents that run code and remember.

Two wings share this package:

- sandboxes (`hutch.Sandbox`, `hutch.AsyncSandbox`, `hutch.Image`, `hutch.Mount`,
  `hutch.Network`): isolated, ephemeral Linux environments for untrusted code;
- memory (`hutch.Memory`): SMF, the Semantic Memory Filesystem, agent memory
  as plain Markdown files, symlinks and git, with a derived search index.

Names are imported lazily so that `import hutch` stays cheap (the sandbox start
server and the CLI import only what they use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hutch._core.errors import (
    ConfigError,
    DaemonError,
    EntityExistsError,
    EntityNotFoundError,
    Error,
    ExecError,
    ImageError,
    InvalidArchiveError,
    InvalidSpecError,
    MalformedEntityError,
    MalformedEntityWarning,
    MemoryStoreError,
    MissingExtraError,
    NetworkPolicyError,
    NotFoundError,
    OutOfMemoryError,
    QuotaExceededError,
    ReasonerWarning,
    SandboxError,
    SandboxFileError,
    SandboxLostError,
    SandboxTimeout,
    SearchIndexError,
    SnapshotLostError,
    StateError,
    StorePathError,
    UnsupportedError,
)

from hutch import _version

__version__ = _version.VERSION

# public name -> module that defines it (imported on first use)
_LAZY = {
    "AsyncProcess": "hutch.sandbox._process",
    "AsyncPtyProcess": "hutch.sandbox._terminal",
    "AsyncSandbox": "hutch.sandbox.aio",
    "AsyncSandboxPool": "hutch.sandbox.pool",
    "CheckIssue": "hutch.memory._entity",
    "CheckReport": "hutch.memory._entity",
    "CodeContext": "hutch.sandbox.interpreter",
    "EmbeddingProvider": "hutch.memory._index._embed",
    "Entity": "hutch.memory._entity",
    "ExecResult": "hutch.sandbox._api",
    "Execution": "hutch.sandbox.interpreter",
    "ExecutionError": "hutch.sandbox.interpreter",
    "FileInfo": "hutch.sandbox._files",
    "Hit": "hutch.memory._index._search",
    "Image": "hutch.sandbox.image",
    "IndexReport": "hutch.memory._index._search",
    "Logs": "hutch.sandbox.interpreter",
    "Memory": "hutch.memory._store",
    "MemoryMount": "hutch.fuse._sandbox",
    "MiniLMProvider": "hutch.memory._index._embed",
    "Mount": "hutch.sandbox._spec",
    "Neighbor": "hutch.memory._entity",
    "Network": "hutch.sandbox._spec",
    "NetworkLog": "hutch.sandbox._api",
    "OpenAIEmbeddings": "hutch.memory._index._embed",
    "OpenAIExtractor": "hutch.memory._extract",
    "OpenAIReasoner": "hutch.memory._index._reason",
    "Process": "hutch.sandbox._process",
    "PtyProcess": "hutch.sandbox._terminal",
    "Result": "hutch.sandbox.interpreter",
    "Sandbox": "hutch.sandbox.sandbox",
    "SandboxFile": "hutch.sandbox._sbfile",
    "SandboxPool": "hutch.sandbox.pool",
    "Secret": "hutch.sandbox._spec",
    "Snapshot": "hutch.sandbox.snapshot",
    "Version": "hutch.memory._entity",
    "Volume": "hutch.sandbox.volume",
    "connect": "hutch.sandbox._client",
}

if TYPE_CHECKING:  # pragma: no cover
    from hutch.fuse._sandbox import MemoryMount
    from hutch.memory._entity import CheckIssue, CheckReport, Entity, Neighbor, Version
    from hutch.memory._extract import OpenAIExtractor
    from hutch.memory._index._embed import EmbeddingProvider, MiniLMProvider, OpenAIEmbeddings
    from hutch.memory._index._reason import OpenAIReasoner
    from hutch.memory._index._search import Hit, IndexReport
    from hutch.memory._store import Memory
    from hutch.sandbox._api import ExecResult, NetworkLog
    from hutch.sandbox._client import connect
    from hutch.sandbox._files import FileInfo
    from hutch.sandbox._process import AsyncProcess, Process
    from hutch.sandbox._spec import Mount, Network, Secret
    from hutch.sandbox._sbfile import SandboxFile
    from hutch.sandbox._terminal import AsyncPtyProcess, PtyProcess
    from hutch.sandbox.aio import AsyncSandbox
    from hutch.sandbox.image import Image
    from hutch.sandbox.interpreter import CodeContext, Execution, ExecutionError, Logs, Result
    from hutch.sandbox.pool import AsyncSandboxPool, SandboxPool
    from hutch.sandbox.sandbox import Sandbox
    from hutch.sandbox.snapshot import Snapshot
    from hutch.sandbox.volume import Volume

def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hutch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# every public name, sorted (a literal, so that linters see what the errors' and the lazy names' imports are for;
# tests/test_public_api.py checks it against errors.__all__ and _LAZY)
__all__ = [
    "AsyncProcess", "AsyncPtyProcess", "AsyncSandbox", "AsyncSandboxPool", "CheckIssue", "CheckReport", "CodeContext",
    "ConfigError", "DaemonError", "EmbeddingProvider", "Entity", "EntityExistsError", "EntityNotFoundError", "Error",
    "ExecError", "ExecResult", "Execution", "ExecutionError", "FileInfo", "Hit", "Image", "ImageError", "IndexReport",
    "InvalidArchiveError", "InvalidSpecError", "Logs", "MalformedEntityError", "MalformedEntityWarning", "Memory",
    "MemoryMount", "MemoryStoreError", "MiniLMProvider", "MissingExtraError", "Mount", "Neighbor", "Network",
    "NetworkLog", "NetworkPolicyError", "NotFoundError", "OpenAIEmbeddings", "OpenAIExtractor", "OpenAIReasoner",
    "OutOfMemoryError", "Process", "PtyProcess", "QuotaExceededError", "ReasonerWarning", "Result", "Sandbox",
    "SandboxError", "SandboxFile", "SandboxFileError", "SandboxLostError", "SandboxPool", "SandboxTimeout",
    "SearchIndexError", "Secret", "Snapshot", "SnapshotLostError", "StateError", "StorePathError", "UnsupportedError", "Version", "Volume",
    "connect",
]
