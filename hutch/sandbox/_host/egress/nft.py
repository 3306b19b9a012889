"""libnftables in-process through ctypes: one netlink transaction per call, no `nft` process.

A Nft context binds its netlink socket in the network namespace of the thread
that first runs a command, so callers create one per namespace (see _netns).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from hutch._core.errors import SandboxError

_lib = None
_lib_lock = threading.Lock()


def _load():
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
            except OSError as e:
                raise SandboxError(
                    "libnftables is not installed; install the Debian package libnftables1 "
                    "(scripts/setup.sh does this)."
                ) from e
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            _lib = lib
        return _lib


def available() -> bool:
    """True when libnftables can be loaded."""
    try:
        _load()
        return True
    except SandboxError:
        return False


class Nft:
    """One libnftables context. `run(text)` applies a whole script as one atomic transaction."""

    def __init__(self):
        self._lib = _load()
        self._ctx = self._lib.nft_ctx_new(0)
        if not self._ctx:
            raise SandboxError("libnftables could not create a context; is the nf_tables module available?")
        self._lib.nft_ctx_buffer_output(self._ctx)
        self._lib.nft_ctx_buffer_error(self._ctx)

    def run(self, script: str) -> str:
        """Run an nft script (several commands are one transaction). Raises SandboxError on failure."""
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, script.encode())
        out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
        err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise SandboxError(f"nftables refused a rule set: {err.decode(errors='replace').strip()}")
        return out.decode(errors="replace")

    def close(self) -> None:
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
