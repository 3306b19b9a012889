"""Bearer tokens: read from a file or the environment, never from argv; compared in constant time.

argv is in /proc/<pid>/cmdline, which every user can read, so a token is never
taken from the command line. A token file that others than its owner may read, or
whose owner is another user than the reader (or root), is refused (not merely
warned about): whoever holds the daemon's token is root on its host, and a
warning in a log is easily missed.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

from hutch._core.errors import ConfigError
from hutch._core.settings import Setting

#: Shortest token accepted.
MIN_TOKEN_CHARS = 16
#: Largest token file read.
MAX_TOKEN_FILE = 4096


def from_env_or_file(env: Setting, file_env: Setting | None = None) -> str | None:
    """The token in the environment variable `env`, else in the file named by `file_env`, else None."""
    value = env.raw()
    if value:
        return check_token(value.strip(), f"${env.name}")
    path = file_env.get() if file_env is not None else None
    if file_env is not None and path:
        return read_token_file(path, f"${file_env.name}")
    return None


def read_token_file(path: str | os.PathLike, what: str = "--token-file", *, min_chars: int = MIN_TOKEN_CHARS) -> str:
    """The token in `path` (surrounding whitespace stripped); refused if others than its owner may read it.
    `min_chars`: for a key hutch does not make itself (an API key), what its owner chose may be shorter."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{what} {p}: cannot read it ({e.strerror}); write the token there, e.g. "
                          f"`openssl rand -hex 32 > {p} && chmod 600 {p}`.") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {p} is not a regular file; write the token into a file.")
        me = os.geteuid()
        if st.st_uid not in (0, me):   # 0600 keeps out all but its owner, who wrote the token (or may change it)
            raise ConfigError(f"{what} {p} belongs to uid {st.st_uid}, who may read or change the token, and whoever "
                              f"holds it may drive hutch: `chown {'root' if me == 0 else me} {p}`.")
        if st.st_mode & 0o077:
            raise ConfigError(f"{what} {p} may be read by other users (mode {stat.S_IMODE(st.st_mode):04o}), "
                              f"and whoever reads the token may drive hutch: `chmod 600 {p}`.")
        data = os.read(fd, MAX_TOKEN_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE:
        raise ConfigError(f"{what} {p} is larger than 4 KiB; it must hold just the token.")
    return check_token(data.decode("utf-8", "replace").strip(), f"{what} {p}", min_chars)


def check_token(token: str, where: str, min_chars: int = MIN_TOKEN_CHARS) -> str:
    if len(token) < min_chars or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"the token in {where} must be at least {min_chars} printable characters "
                          "without spaces" + ("; make one with `openssl rand -hex 32`." if min_chars > 1 else "."))
    return token


def token_matches(header: str | None, token: str) -> bool:
    """Is `header` exactly "Bearer <token>"? Constant time in the token's content."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


__all__ = ["MIN_TOKEN_CHARS", "check_token", "from_env_or_file", "read_token_file", "token_matches"]
