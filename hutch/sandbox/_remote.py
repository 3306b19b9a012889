"""How the SDK reaches a daemon over TCP: https only, its certificate verified, a token from env or file.

    HUTCH_URL=https://host:7450
    HUTCH_TOKEN=...            or HUTCH_TOKEN_FILE=/path (mode 0600)
    HUTCH_FINGERPRINT=AB:CD:.. (the SHA-256 `hutch serve` prints)  or  HUTCH_CA=/path/ca.pem

A pin is checked before anything is sent: one probe handshake reads the server's
certificate and compares its SHA-256 with the pin; from then on every connection
verifies the server against exactly that certificate (it is the context's only
trust anchor), so the token only ever goes to the holder of its key. With HUTCH_CA
the chain and the host name are verified against that file; with neither, against
the system's CAs. A server that cannot be verified is refused, naming both variables.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from hutch._core import settings
from hutch._core.errors import DaemonError
from hutch._core.tokens import from_env_or_file

ENV_URL = settings.URL.name
ENV_TOKEN = settings.TOKEN.name
ENV_TOKEN_FILE = settings.TOKEN_FILE.name
ENV_CA = settings.CA.name
ENV_FINGERPRINT = settings.FINGERPRINT.name
PROBE_TIMEOUT = 10.0


def _pin(value: str) -> str:
    h = value.strip().lower()
    if h.startswith("sha256:"):
        h = h[7:]
    h = h.replace(":", "")
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise DaemonError(f"{ENV_FINGERPRINT}={value!r} is not a SHA-256 fingerprint; give the one `hutch serve` "
                          "prints (or `hutch tls-fingerprint` on the daemon's host), like AB:CD:...")
    return h


def unverified_hint(url: str) -> str:
    return (f"the hutch daemon at {url} could not be verified: pin its certificate with {ENV_FINGERPRINT}=<the "
            f"SHA-256 `hutch serve` prints, or `hutch tls-fingerprint` on its host>, or name the CA (or the "
            f"certificate itself) that signs it in {ENV_CA}=/path/ca.pem")


@dataclass(frozen=True)
class Remote:
    """A TCP daemon: its https URL, the token, and how its certificate is verified."""

    url: str
    host: str
    port: int
    token: str | None = None
    ca: str | None = None
    fingerprint: str | None = None

    @classmethod
    def from_env(cls, url: str, token: str | None = None) -> "Remote":
        import httpx

        if url.startswith("http://"):
            raise DaemonError(f"{ENV_URL}={url!r} is plain http, but the daemon's TCP listener speaks TLS only (the "
                              "token must not cross the network in the clear): use https://HOST:PORT, and pin the "
                              f"daemon with {ENV_FINGERPRINT} (`hutch serve --listen` prints it) or {ENV_CA}.")
        if not url.startswith("https://"):
            raise DaemonError(f"{ENV_URL}={url!r} must be a URL like https://10.0.0.5:7450.")
        u = httpx.URL(url)
        if not u.host:
            raise DaemonError(f"{ENV_URL}={url!r} names no host; give https://HOST:PORT.")
        if token is None:
            token = from_env_or_file(settings.TOKEN, settings.TOKEN_FILE)
        if not token:
            raise DaemonError(f"{ENV_URL} names a remote daemon, which needs its token: set {ENV_TOKEN_FILE} to a file "
                              f"holding it (mode 0600) or {ENV_TOKEN}.")
        fp = settings.FINGERPRINT.get()
        ca_path = settings.CA.get()
        ca = str(ca_path) if ca_path is not None else None
        if ca is not None and not os.path.isfile(ca):
            raise DaemonError(f"{ENV_CA}={ca!r} is not a file; give a PEM file of the CA (or of the daemon's certificate).")
        return cls(url, u.host, u.port or 443, token, ca, _pin(fp) if fp else None)

    def ssl_context(self) -> ssl.SSLContext:
        """The verifying context for this daemon (made once per process and endpoint; a pin probes once)."""
        key = (self.host, self.port, self.ca, self.fingerprint)
        with _lock:
            ctx = _contexts.get(key)
        if ctx is None:
            ctx = self._make_context()
            with _lock:
                _contexts[key] = ctx
        return ctx

    def _make_context(self) -> ssl.SSLContext:
        if self.fingerprint:
            der = self._probe()
            got = hashlib.sha256(der).hexdigest()
            if got != self.fingerprint:
                raise DaemonError(f"the daemon at {self.url} presented a certificate whose SHA-256 is {_fmt(got)}, not "
                                  f"the {ENV_FINGERPRINT} pin {_fmt(self.fingerprint)}: nothing was sent to it. If its "
                                  f"certificate changed, pin the new one; otherwise someone is in between (and {ENV_CA} "
                                  "is the other way to verify it).")
            ctx = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
            ctx.check_hostname = False   # the pin names the server; its certificate need not name the address used
        elif self.ca:
            try:
                ctx = ssl.create_default_context(cafile=self.ca)
            except (OSError, ssl.SSLError) as e:
                raise DaemonError(f"{ENV_CA}={self.ca!r} is not a PEM certificate file ({e}).") from e
        else:
            ctx = ssl.create_default_context()
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN   # a leaf certificate may be the trust anchor itself
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def _probe(self) -> bytes:
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE   # only to read the certificate; it is compared with the pin below

        def once() -> bytes:
            with socket.create_connection((self.host, self.port), timeout=PROBE_TIMEOUT) as raw:
                with wrap_client(probe, raw, self.host) as s:
                    return s.getpeercert(binary_form=True)
        try:
            return self._retrying(once)
        except (OSError, ssl.SSLError) as e:
            raise DaemonError(f"cannot reach the hutch daemon at {self.url} ({e}); start it there with "
                              "`hutch serve --listen HOST:PORT --token-file PATH`.") from e

    def connect(self, timeout: float) -> socket.socket:
        """A TLS socket to the daemon, verified (for the lease and health pings)."""
        def once() -> socket.socket:
            raw = socket.create_connection((self.host, self.port), timeout=timeout)
            try:
                return wrap_client(self.ssl_context(), raw, self.host)
            except ssl.SSLCertVerificationError as e:
                raise DaemonError(f"{unverified_hint(self.url)} ({e.verify_message}).") from e
        return self._retrying(once)

    def _retrying(self, once):
        """`once()`, again after a connection reset before the handshake ended (the daemon's cap of
        unauthenticated connections per address, CONNECT_BACKOFF); past the backoff, an error naming the cap."""
        for delay in (*CONNECT_BACKOFF, None):
            try:
                return once()
            except (OSError, ssl.SSLError) as e:
                if not reset_while_connecting(e):
                    raise
                if delay is None:
                    raise DaemonError(cap_hint(self.url, e)) from e
            time.sleep(delay * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")


def wrap_client(ctx: ssl.SSLContext, raw: socket.socket, host: str) -> ssl.SSLSocket:
    """`ctx.wrap_socket(raw)` (the handshake done), or its error with the connection closed: `raw` and the
    TLS socket made of it (close_unmade_tls)."""
    try:
        return ctx.wrap_socket(raw, server_hostname=host)
    except BaseException as e:
        close_unmade_tls(e)
        raw.close()
        raise


def close_unmade_tls(e: BaseException | None) -> None:
    """Close the TLS socket a failed wrap_socket left open in `e` or an error it came from. CPython 3.11's
    SSLSocket._create closes nothing when the peer reset the connection before the handshake (getpeername
    says ENOTCONN, its recv(1) raises ECONNRESET; the plain socket is detached by then), which is what a
    daemon does to connections beyond its per-address cap: that socket, still in _create's frame of the
    error's traceback, is closed here, or each retry (ours or httpx's connect) left a descriptor to the
    collector."""
    seen = 0
    while e is not None and seen < 10:
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is _SSL_CREATE:
                made = tb.tb_frame.f_locals.get("self")
                if isinstance(made, ssl.SSLSocket):
                    made.close()
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
        seen += 1


_SSL_CREATE = ssl.SSLSocket._create.__func__.__code__


def cap_hint(url: str, e: BaseException) -> str:
    return (f"the hutch daemon at {url} reset every connection for {sum(CONNECT_BACKOFF):.0f} s ({e}): more "
            "clients from this address are connecting at once than its --max-tcp-per-peer allows; raise that "
            "cap, or open fewer connections at once.")


#: Seconds between attempts to connect when the daemon reset the connection during the TLS handshake: its
#: listener resets a peer's connections beyond its cap of unauthenticated ones (docs/api.md), so a burst of
#: clients from one address (a platform's host, a NAT) retries rather than fails. Nothing was sent yet, so
#: any request may be retried.
CONNECT_BACKOFF = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 2.0, 3.0)


def reset_while_connecting(e: BaseException) -> bool:
    """Whether `e` (or a cause of it) is a connection reset or closed by the peer during the handshake."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, (ConnectionResetError, ConnectionAbortedError, ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def verification_failure(e: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification error somewhere in `e`'s causes, if that is why a connection failed."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, ssl.SSLCertVerificationError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _fmt(h: str) -> str:
    h = h.upper()
    return ":".join(h[i:i + 2] for i in range(0, len(h), 2))


_lock = threading.Lock()
_contexts: dict[tuple, ssl.SSLContext] = {}

__all__ = ["CONNECT_BACKOFF", "ENV_CA", "ENV_FINGERPRINT", "ENV_TOKEN", "ENV_TOKEN_FILE", "ENV_URL", "Remote",
           "cap_hint", "close_unmade_tls", "reset_while_connecting", "unverified_hint", "verification_failure", "wrap_client"]
