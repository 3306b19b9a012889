"""HTTP to the hutch daemon: a Unix socket on this host, or TCP with a bearer token.

Which daemon: `HUTCH_URL` (http://host:port, with `HUTCH_TOKEN`) if set, else the
Unix socket `hutch._core.paths.daemon_socket()`. When nothing answers on the
socket, the client starts `python -m hutch serve` itself (detached, logging to
run_dir/daemon.log) and waits for it, so `Sandbox.create()` needs no set-up. A
lock file makes two clients that start at once spawn one daemon.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from hutch._core import paths
from hutch._core.errors import DaemonError
from hutch.sandbox._wire import error_from_answer

ENV_URL = "HUTCH_URL"
ENV_TOKEN = "HUTCH_TOKEN"
AUTOSTART_TIMEOUT = 20.0   # seconds to wait for a spawned daemon's socket
_CONNECT_TIMEOUT = 10.0
_UDS_BASE = "http://hutch"


class Endpoint:
    """Where the daemon is: a socket path, or a TCP url and token."""

    def __init__(self, url: str | None = None, token: str | None = None, socket_path: str | None = None):
        self.url = url if url is not None else os.environ.get(ENV_URL) or None
        self.token = token if token is not None else os.environ.get(ENV_TOKEN) or None
        self.socket = Path(socket_path) if socket_path else paths.daemon_socket()
        if self.url and not self.url.startswith(("http://", "https://")):
            raise DaemonError(f"{ENV_URL}={self.url!r} must be a URL like http://10.0.0.5:7450.")

    @property
    def base(self) -> str:
        return self.url.rstrip("/") if self.url else _UDS_BASE

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self) -> str:
        return self.url or f"unix:{self.socket}"

    def raw_connect(self, timeout: float = _CONNECT_TIMEOUT) -> socket.socket:
        """A plain connected socket (for the lease and health pings)."""
        if self.url:
            u = httpx.URL(self.url)
            s = socket.create_connection((u.host, u.port or 80), timeout=timeout)
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            try:
                s.connect(str(self.socket))
            except BaseException:
                s.close()
                raise
        return s

    def raw_request(self, method: str, path: str, *, close: bool = False) -> bytes:
        host = httpx.URL(self.url).netloc.decode() if self.url else "hutch"
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Length: 0"]
        if close:
            lines.append("Connection: close")
        lines += [f"{k}: {v}" for k, v in self.headers().items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _ping(ep: Endpoint, timeout: float = 2.0) -> bool:
    """True if a hutch daemon answers GET /v1/health."""
    try:
        s = ep.raw_connect(timeout)
    except OSError:
        return False
    try:
        s.sendall(ep.raw_request("GET", "/v1/health", close=True))
        head = s.recv(64)
        return head.startswith(b"HTTP/1.") and head[9:12] == b"200"
    except OSError:
        return False
    finally:
        s.close()


def ensure_daemon(ep: Endpoint) -> None:
    """Start a local daemon if none answers on the socket; safe when several clients race."""
    if ep.url:
        raise DaemonError(f"no hutch daemon answers at {ep.url}; start one there with `hutch serve --listen HOST:PORT --token T`.")
    sock, run = ep.socket, paths.run_dir()
    run.mkdir(parents=True, exist_ok=True)
    sock.parent.mkdir(parents=True, exist_ok=True)
    with open(run / "autostart.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # the loser of a race finds the winner's daemon below
        if _ping(ep):
            return
        log = run / "daemon.log"
        env = dict(os.environ, HUTCH_SOCKET=str(sock))
        # sh backgrounds the daemon and exits at once: the daemon is re-parented to init, in its own
        # session (setsid), so it outlives this client and leaves no zombie behind.
        out = subprocess.run(
            ["/bin/sh", "-c", '"$0" -m hutch serve >>"$1" 2>&1 </dev/null & echo $!', sys.executable, str(log)],
            env=env, cwd="/", start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False,
        ).stdout
        pid = int(out.strip() or 0)
        deadline = time.monotonic() + AUTOSTART_TIMEOUT
        while time.monotonic() < deadline:
            if _ping(ep, 1.0):
                return
            if pid and not _alive(pid):
                break
            time.sleep(0.02)
        if pid and not _alive(pid):
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise DaemonError(
                f"started `hutch serve` for {sock} but it exited" + (f" saying: {tail[0]}" if tail else "")
                + f"; see {log}, fix that, or start the daemon yourself with `hutch serve`."
            )
        raise DaemonError(
            f"started `hutch serve` for {sock} but it did not answer within {AUTOSTART_TIMEOUT:.0f} s; "
            f"see its log {log}, or start it yourself with `hutch serve`."
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unreachable(ep: Endpoint, e: Exception) -> DaemonError:
    return DaemonError(
        f"cannot reach the hutch daemon at {ep.describe()} ({e}); start it with `hutch serve`"
        + (" there." if ep.url else ", or unset HUTCH_SOCKET to use the default socket.")
    )


_TIMEOUT = httpx.Timeout(None, connect=_CONNECT_TIMEOUT)
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)


class Client:
    """Blocking HTTP client of the daemon (one per process and endpoint, thread-safe)."""

    def __init__(self, endpoint: Endpoint | None = None):
        self.ep = endpoint or Endpoint()
        transport = None if self.ep.url else httpx.HTTPTransport(uds=str(self.ep.socket))
        self.http = httpx.Client(base_url=self.ep.base, transport=transport, headers=self.ep.headers(),
                                 timeout=_TIMEOUT, limits=_LIMITS)

    def request(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        """Send a request; map error answers to hutch errors; start the local daemon if none runs."""
        for attempt in (0, 1):
            try:
                resp = self.http.send(self.http.build_request(method, path, **kw), stream=stream)
                break
            except httpx.ConnectError as e:
                if attempt or self.ep.url:
                    raise _unreachable(self.ep, e) from e
                ensure_daemon(self.ep)
            except httpx.TransportError as e:
                raise _unreachable(self.ep, e) from e
        if resp.status_code >= 400:
            try:
                body = resp.read()
            finally:
                resp.close()
            raise error_from_answer(resp.status_code, body)
        return resp

    def json(self, method: str, path: str, **kw):
        r = self.request(method, path, **kw)
        return r.json() if r.content else None


class AsyncClient:
    """The same as Client, awaitable (one per event loop and endpoint)."""

    def __init__(self, endpoint: Endpoint | None = None):
        self.ep = endpoint or Endpoint()
        transport = None if self.ep.url else httpx.AsyncHTTPTransport(uds=str(self.ep.socket))
        self.http = httpx.AsyncClient(base_url=self.ep.base, transport=transport, headers=self.ep.headers(),
                                      timeout=_TIMEOUT, limits=_LIMITS)

    async def request(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        import asyncio

        for attempt in (0, 1):
            try:
                resp = await self.http.send(self.http.build_request(method, path, **kw), stream=stream)
                break
            except httpx.ConnectError as e:
                if attempt or self.ep.url:
                    raise _unreachable(self.ep, e) from e
                await asyncio.to_thread(ensure_daemon, self.ep)
            except httpx.TransportError as e:
                raise _unreachable(self.ep, e) from e
        if resp.status_code >= 400:
            try:
                body = await resp.aread()
            finally:
                await resp.aclose()
            raise error_from_answer(resp.status_code, body)
        return resp

    async def json(self, method: str, path: str, **kw):
        r = await self.request(method, path, **kw)
        return r.json() if r.content else None


_lock = threading.Lock()
_clients: dict[tuple, Client] = {}
_aclients: dict[tuple, tuple] = {}


def _key() -> tuple:
    ep = Endpoint()
    return (os.getpid(), ep.url, ep.token, str(ep.socket)), ep


def default_client() -> Client:
    """The process's client for the endpoint the environment names now."""
    key, ep = _key()
    with _lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = Client(ep)
        return c


def default_async_client() -> AsyncClient:
    """The event loop's async client for the endpoint the environment names now."""
    import asyncio

    key, ep = _key()
    loop = asyncio.get_running_loop()
    key = key + (id(loop),)
    with _lock:
        for k in [k for k, (lp, _) in _aclients.items() if lp.is_closed()]:
            del _aclients[k]   # clients of finished event loops (asyncio.run in a loop)
        entry = _aclients.get(key)
        if entry is None:
            entry = _aclients[key] = (loop, AsyncClient(ep))
        return entry[1]


# Leases: one open connection per non-detached sandbox this process created. The kernel closes
# them when the process dies, however it dies, and the daemon then ends the sandbox.
_leases: dict[str, socket.socket] = {}


def hold_lease(ep: Endpoint, sandbox_id: str) -> None:
    s = ep.raw_connect()
    try:
        s.sendall(ep.raw_request("GET", f"/v1/sandboxes/{sandbox_id}/lease"))
    except BaseException:
        s.close()
        raise
    with _lock:
        old = _leases.pop(sandbox_id, None)
        _leases[sandbox_id] = s
    if old is not None:
        old.close()


def release_lease(sandbox_id: str) -> None:
    with _lock:
        s = _leases.pop(sandbox_id, None)
    if s is not None:
        s.close()
