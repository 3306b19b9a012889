"""The sandbox's trust store learns its egress CA (credentials brokered at the gateway, egress/broker.py).

The CA's certificate is appended to the image's bundle at the path Debian, Ubuntu and Alpine's OpenSSL read
by default, and written alone beside it; the variables in CA_ENV point the clients that keep their own
bundle (requests, curl, Node, git) at them. The files are written by the sandbox's init, inside the sandbox
and as its root, through the same calls as `sb.files.write`: a hostile image's symlinks lead nowhere on the
host. Only the certificate enters the sandbox; the key stays in the gateway's memory.
"""

from __future__ import annotations

import os

BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
OWN = "/etc/hutch/egress-ca.pem"
MAX_BUNDLE = 4 << 20     # bytes of the image's bundle read back; a larger one is replaced, not read
CA_ENV = {"SSL_CERT_FILE": BUNDLE, "REQUESTS_CA_BUNDLE": BUNDLE, "CURL_CA_BUNDLE": BUNDLE,
          "GIT_SSL_CAINFO": BUNDLE, "NODE_EXTRA_CA_CERTS": OWN}


class InstallError(Exception):
    """The init refused a file call."""


async def _call(sb, op: str, path: str, **kw):
    """A file call to the sandbox's init, also while it starts (before its command runs)."""
    reply, fds = await sb.channel.request({"op": op, "path": path, **kw})
    if not reply["ok"]:
        for fd in fds:
            os.close(fd)
        raise InstallError(f"{op} {path}: {reply.get('message') or reply.get('error') or 'refused'}")
    return reply, fds


async def install_ca(sb, pem: bytes) -> None:
    """Add `pem` to the sandbox's trust store (the bundle and OWN) and its commands' environment."""
    existing = b""
    try:
        reply, fds = await _call(sb, "read", BUNDLE)
    except InstallError:   # no bundle in the image (or not a file): ours alone
        pass
    else:
        try:
            if reply["size"] <= MAX_BUNDLE:
                existing = _read_all(fds[0], MAX_BUNDLE)
        finally:
            for fd in fds:
                os.close(fd)
    if existing and not existing.endswith(b"\n"):
        existing += b"\n"
    own = b""
    try:
        reply, fds = await _call(sb, "read", OWN)
        try:
            own = _read_all(fds[0], MAX_BUNDLE)
        finally:
            for fd in fds:
                os.close(fd)
    except InstallError:   # the first CA of this sandbox
        pass
    await _write(sb, BUNDLE, existing + pem)
    await _write(sb, OWN, own + pem)
    sb.egress_env = dict(CA_ENV)


def _read_all(fd: int, limit: int) -> bytes:
    out = b""
    while len(out) < limit and (chunk := os.pread(fd, min(65536, limit - len(out)), len(out))):
        out += chunk
    return out


async def _write(sb, path: str, data: bytes) -> None:
    reply, fds = await _call(sb, "write_open", path, mode=0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fds[0], view):]
    except BaseException:
        os.close(fds[0])
        await _call(sb, "write_abort", path, tmp=reply["tmp"])
        raise
    os.close(fds[0])
    await _call(sb, "write_commit", path, tmp=reply["tmp"])
