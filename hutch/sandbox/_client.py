"""HTTP to the hutch daemon: a Unix socket on this host, or TCP with TLS and a bearer token.

Which daemon: `HUTCH_URL` (https://host:port, with `HUTCH_TOKEN` or `HUTCH_TOKEN_FILE`,
verified by `HUTCH_FINGERPRINT` or `HUTCH_CA`: _remote.py) if set, else the Unix
socket `hutch._core.paths.daemon_socket()`. When nothing answers on the socket, a
root client starts `python -m hutch serve` itself (detached, logging to
run_dir/daemon.log) and waits for it, so `Sandbox.create()` needs no set-up. A
lock file makes two clients that start at once spawn one daemon. Another user
needs a daemon started with `--group` naming a group of theirs.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import json
import os
import random
import re
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from urllib.parse import quote

import httpx

from hutch._core import paths, settings
from hutch._core.atomic import replace_file
from hutch._core.errors import DaemonError, NotFoundError, QuotaExceededError, SandboxLostError, SnapshotLostError
from hutch._core.tokens import from_env_or_file
from hutch.sandbox import _fleet
from hutch.sandbox._remote import Remote
from hutch.sandbox._remote import (CONNECT_BACKOFF, cap_hint, close_unmade_tls, reset_while_connecting,
                                   unverified_hint, verification_failure)
from hutch.sandbox._api import error_from_answer
AUTOSTART_TIMEOUT = 20.0   # seconds to wait for a spawned daemon's socket
_CONNECT_TIMEOUT = 10.0
_UDS_BASE = "http://hutch"


#: what hutch.connect() named: it wins over HUTCH_URL for this process
_connected: dict[str, object] = {}


def connect(url: str, *, token: str | None = None, token_file: "str | os.PathLike | None" = None) -> None:
    """Point this process's sandboxes at another daemon, or at a fleet (over HUTCH_URL and the local socket).

    `url`: ``ray://auto`` (the hutch fleet of the Ray cluster this host is part of), ``ray://HEAD:10001`` (one
    reached through Ray Client), ``https://HOST:PORT`` (one remote daemon; `token`, else HUTCH_TOKEN /
    HUTCH_TOKEN_FILE, and HUTCH_FINGERPRINT or HUTCH_CA verify it), or ``unix:/path/to.sock`` (a daemon of this
    host; a tenant's `token` scopes the calls to that tenant, as on TCP; on a fleet too, whose daemons serve
    `hutch fleet up --tenants FILE`).
    `token_file`: a file (mode 0600) holding the token, instead of `token`.

    Example: `hutch.connect("ray://auto"); hutch.Sandbox.create()` (placed on a node of the fleet, docs/fleet.md)
    """
    if not isinstance(url, str) or not url.startswith(("ray://", "https://", "http://", "unix:")):
        from hutch._core.errors import ConfigError

        raise ConfigError(f"connect({url!r}): give ray://auto, ray://HEAD:PORT, https://HOST:PORT or unix:/path.")
    if token is not None and token_file is not None:
        from hutch._core.errors import ConfigError

        raise ConfigError("connect(): give token= or token_file=, not both.")
    from hutch._core.tokens import check_token, read_token_file

    if token_file is not None:
        token = read_token_file(token_file, "connect(token_file=)")
    elif token is not None:
        token = check_token(token, "connect(token=)")
    if url.startswith("unix:"):
        _connected.clear()
        _connected.update(socket=url[5:], token=token)
        return
    if url.startswith(("https://", "http://")):
        Remote.from_env(url, token)   # refuse a bad one now, not at the first call
    _connected.clear()
    _connected.update(url=url, token=token)


def disconnect() -> None:
    """Undo connect(), drop the process's fleet clients and leave Ray if the SDK joined it (see _fleet.disconnect)."""
    _connected.clear()
    with _lock:
        for k in [k for k, c in _clients.items() if isinstance(c, FleetClient)]:
            del _clients[k]
        for k in [k for k, (_, c, *_) in _aclients.items() if isinstance(c, AsyncFleetClient)]:
            del _aclients[k]
    _fleet.disconnect()


class Endpoint:
    """Where the daemon is: a socket path, or a TCP daemon (`remote`: its https url, token and TLS check),
    or a fleet (`fleet_url`: ray://...; hutch/sandbox/_fleet.py). `node`: the fleet node this daemon is."""

    def __init__(self, url: str | None = None, token: str | None = None, socket_path: str | None = None, *,
                 remote: Remote | None = None, node: str | None = None):
        if url is None and remote is None and socket_path is None and _connected:
            url, token, socket_path = _connected.get("url"), _connected.get("token"), _connected.get("socket")
        self.url = remote.url if remote else url if url is not None else settings.URL.get()
        self.fleet_url = self.url if _fleet.is_fleet_url(self.url) else None
        if self.fleet_url:
            self.url = None
        self.node = node
        self.restarted = None   # a fleet node's: () -> whether its daemon is no longer the one this reached
        self.fetch_image = None   # a fleet node's: (ref) -> bring the image from another node (_fleet.fetch_image)
        self.socket = Path(socket_path) if socket_path else paths.daemon_socket()
        self.remote = remote or (Remote.from_env(self.url, token) if self.url else None)
        # on the socket too: a tenant's token scopes its calls (without one, the socket's peers are the operator);
        # HUTCH_TOKEN(_FILE) goes there when the socket is the environment's choice, not an explicit one's
        from_env = socket_path is None and not self.fleet_url
        self.token = self.remote.token if self.remote else (
            token if token is not None else from_env_or_file(settings.TOKEN, settings.TOKEN_FILE) if from_env else None)

    @property
    def base(self) -> str:
        return self.url.rstrip("/") if self.url else _UDS_BASE

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self) -> str:
        where = self.url or f"unix:{self.socket}"
        return f"fleet node {self.node} ({where})" if self.node else self.fleet_url or where

    def raw_connect(self, timeout: float = _CONNECT_TIMEOUT) -> socket.socket:
        """A plain connected socket (for the lease and health pings)."""
        if self.remote:
            s = self.remote.connect(timeout)
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


def _probe(ep: Endpoint, timeout: float = 2.0) -> tuple[bool, str]:
    """(answered, problem): whether a hutch daemon answers GET /v1/health, and why it cannot start
    sandboxes now ("" when it can)."""
    try:
        s = ep.raw_connect(timeout)
    except OSError:
        return False, ""
    try:
        s.sendall(ep.raw_request("GET", "/v1/health", close=True))
        data = b""
        while len(data) < 1 << 16 and (chunk := s.recv(4096)):   # Connection: close ends the answer
            data += chunk
    except OSError:
        return False, ""
    finally:
        s.close()
    if not data.startswith(b"HTTP/1."):
        return False, ""
    if data[9:12] == b"200":
        return True, ""
    try:
        why = json.loads(data.partition(b"\r\n\r\n")[2])["message"]
    except (ValueError, KeyError, TypeError):
        why = f"GET /v1/health answered {data[9:12].decode(errors='replace')}"
    return True, str(why)


def _ping(ep: Endpoint, timeout: float = 2.0) -> bool:
    """True if a hutch daemon answers GET /v1/health and can start sandboxes."""
    answered, problem = _probe(ep, timeout)
    return answered and not problem


def _unhealthy(sock: Path, problem: str, log: Path) -> DaemonError:
    # Not a reason to start another daemon: this one holds the run directory and the socket.
    return DaemonError(f"the hutch daemon on {sock} answers, but {problem} (the log of a daemon the SDK started: "
                       f"{log}). Fix what it names, or restart that daemon (`hutch serve`).")


def ensure_daemon(ep: Endpoint) -> None:
    """Start a local daemon if none answers on the socket; safe when several clients race."""
    if ep.url:
        raise DaemonError(f"no hutch daemon answers at {ep.url}; start one there with "
                          "`hutch serve --listen HOST:PORT --token-file PATH`.")
    sock, run = ep.socket, paths.run_dir()
    if os.geteuid() != 0:
        raise DaemonError(f"no hutch daemon answers on {sock}, and only root can start one: run `sudo hutch serve "
                          "--group GROUP` with a group of yours (or set HUTCH_SOCKET to a daemon's socket).")
    paths.owned_by_root(run)   # its lock and the daemon's log are opened by path: nobody else's links there
    run.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths.owned_by_root(run)
    sock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(run / "autostart.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # the loser of a race finds the winner's daemon below
        log = run / "daemon.log"
        answered, problem = _probe(ep)
        if answered:
            if problem:
                raise _unhealthy(sock, problem, log)
            return
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
            answered, problem = _probe(ep, 1.0)
            if answered:
                if problem:
                    raise _unhealthy(sock, problem, log)
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


def _no_autostart_for(ep: Endpoint, path: str) -> None:
    """A call about one sandbox, with no daemon on the local socket, starts none: a new daemon would not know that
    sandbox, and the one that ran it took it along when it ended (the zygote dies with the daemon, every init with
    the zygote: PDEATHSIG). So the sandbox is gone, which is what the caller learns."""
    rest = path[len("/v1/sandboxes/"):] if path.startswith("/v1/sandboxes/") else ""
    if rest:
        sid = rest.split("/", 1)[0]
        raise NotFoundError(f"sandbox {sid} is gone: no hutch daemon answers on {ep.socket}, and the daemon that ran "
                            "it ended its sandboxes when it stopped (create a new one; `hutch serve` starts a daemon).")


def _denied(e: BaseException) -> bool:
    """Did connecting fail because the socket (or its directory) is not ours to use?"""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lost_node(ep: Endpoint, path: str, e: BaseException) -> DaemonError:
    """A fleet node's daemon that cannot be reached: its sandboxes are lost (they die with their daemon)."""
    rest = path[len("/v1/sandboxes/"):] if path.startswith("/v1/sandboxes/") else ""
    if rest:
        sid = rest.split("/", 1)[0].split("?", 1)[0]
        return SandboxLostError(f"sandbox {sid} is lost: its {ep.describe()} does not answer ({e}); the node or "
                                "its daemon is gone, and its sandboxes with it. Create a new one.")
    if ep.node and (snap := _snapshot_of(path)):
        return SnapshotLostError(f"memory snapshot {snap} is on {ep.describe()}, which does not answer ({e}): the "
                                 "node or its daemon is gone, and the snapshot with it unless another node holds a "
                                 "copy (found once the fleet marks the node unhealthy: `hutch fleet ls`). Export "
                                 "the snapshots you need to keep (`snap.export(path)`) and import them elsewhere.")
    return DaemonError(f"the {ep.describe()} does not answer ({e}); `hutch fleet ls` shows the fleet's health.")


def _unreachable(ep: Endpoint, e: Exception) -> DaemonError:
    if verification_failure(e) is not None:
        return DaemonError(f"{unverified_hint(ep.url)} ({verification_failure(e).verify_message}).")
    if _denied(e):
        return DaemonError(f"you may not connect to the hutch daemon's socket {ep.socket} (permission denied): it "
                           "serves root and the members of the group it was started with (`hutch serve --group "
                           "NAME`); ask its operator to add you to that group.")
    if ep.url and reset_while_connecting(e):   # retried with backoff already (Client.request)
        return DaemonError(cap_hint(ep.url, e))
    return DaemonError(
        f"cannot reach the hutch daemon at {ep.describe()} ({e}); start it with `hutch serve`"
        + (" there." if ep.url else ", or unset HUTCH_SOCKET to use the default socket.")
    )


_TIMEOUT = httpx.Timeout(None, connect=_CONNECT_TIMEOUT)
_NODE_TIMEOUT = httpx.Timeout(None, connect=_fleet.NODE_CONNECT_TIMEOUT)
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
_KEEP_IDLE = 64            # idle keep-alive connections kept per client
_QUICK_KW = frozenset({"params", "json", "content"})
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9/_.:~-]*")
_READ = 1 << 16


class _UnixTransport(httpx.BaseTransport):
    """HTTP/1.1 to the local daemon over its Unix socket, with keep-alive connections.

    Does what httpcore and h11 did for this client at a fraction of the CPU (every create, exec and
    terminate passes here: about half the client's time went to them): one peer, our own daemon,
    speaking plain HTTP/1.1 with Content-Length or chunked bodies.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[tuple[socket.socket, object]] = []
        self._lock = threading.Lock()
        # the idle connections close with the transport, also when it is only collected or the process exits
        # (a process's cached clients live until then): not left for the garbage collector to warn about
        weakref.finalize(self, _drop_all, self._idle)

    def _connection(self) -> tuple[tuple[socket.socket, object], bool]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                # an idle connection that reads as ready was closed by the daemon (or holds junk): drop it
                poll = select.poll()   # not select(): a process with many leases has fds above 1023
                poll.register(conn[0], select.POLLIN)
                if not poll.poll(0):
                    return conn, True
                _drop(conn)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(_CONNECT_TIMEOUT)
            s.connect(self.path)
            s.settimeout(None)
        except OSError as e:
            s.close()
            raise httpx.ConnectError(f"{self.path}: {e}") from e
        return (s, s.makefile("rb", buffering=_READ)), False

    def _release(self, conn) -> None:
        with self._lock:
            if len(self._idle) < _KEEP_IDLE:
                self._idle.append(conn)
                return
        _drop(conn)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
        head += [b"%s: %s\r\n" % kv for kv in request.headers.raw]
        head.append(b"\r\n")
        chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
        body = request.stream if chunked else [b"".join(request.stream)]
        return self.exchange(request.method, b"".join(head), body, chunked)

    def quick(self, method: str, path: str, kw: dict) -> httpx.Response | None:
        """The request made straight from its parts, without an httpx.Request (parsing its URL twice and
        the cookie jar were most of what httpx still cost per call); None when `kw` holds more than a
        plain path, simple query parameters and a JSON or bytes body: httpx then makes the request."""
        if not kw.keys() <= _QUICK_KW or not _PLAIN_PATH.fullmatch(path):
            return None
        target = path
        params = kw.get("params")
        if params:
            pairs = []
            for k, v in (params.items() if isinstance(params, dict) else params):
                if isinstance(v, bool) or not isinstance(v, (str, int, float)) or not isinstance(k, str):
                    return None
                pairs.append(f"{quote(k, safe='')}={quote(str(v), safe='')}")
            target += "?" + "&".join(pairs)
        extra = ""
        if "json" in kw:
            body = json.dumps(kw["json"], ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            extra = "Content-Type: application/json\r\n"
        elif "content" in kw:
            body = kw["content"]
            if not isinstance(body, bytes):
                return None
        else:
            body = b""
        head = (f"{method} {target} HTTP/1.1\r\nHost: hutch\r\nAccept: */*\r\n{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        return self.exchange(method, head, [body], False)

    def exchange(self, method: str, head: bytes, body, chunked: bool) -> httpx.Response:
        """Send a request (`head`: request line and headers; `body`: its pieces) and read the answer's head."""
        for attempt in (0, 1):
            conn, reused = self._connection()
            sock, rfile = conn
            try:
                if chunked or len(body[0]) > _READ:   # a big body is not copied to join it to the head
                    sock.sendall(head)
                    if not chunked:
                        sock.sendall(body[0])
                else:
                    sock.sendall(head + body[0])
                if chunked:
                    for piece in body:
                        if piece:
                            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    sock.sendall(b"0\r\n\r\n")
                status_line = rfile.readline()
                if not status_line:
                    raise ConnectionResetError("the daemon closed the connection")
            except OSError as e:
                _drop(conn)
                if reused and attempt == 0 and not chunked:   # a keep-alive connection the daemon had closed
                    continue
                raise httpx.ReadError(f"{self.path}: {e}") from e
            break
        try:
            version, status, reason = (status_line.rstrip(b"\r\n").split(b" ", 2) + [b""])[:3]
            headers = []
            while (line := rfile.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = line.partition(b":")
                headers.append((k.strip(), v.strip()))
            code = int(status)
        except (OSError, ValueError) as e:
            _drop(conn)
            raise httpx.RemoteProtocolError(f"bad answer from the daemon: {e}") from e
        stream = _Body(self, conn, headers, no_body=method == "HEAD" or code in (204, 304) or code < 200)
        return httpx.Response(code, headers=headers, stream=stream,
                              extensions={"http_version": version, "reason_phrase": reason})

    def close(self) -> None:
        with self._lock:
            idle = self._idle[:]
            self._idle.clear()   # the same list: the finalizer holds it
        for conn in idle:
            _drop(conn)


def _drop_all(idle: list) -> None:
    while idle:
        _drop(idle.pop())


def _drop(conn) -> None:
    """Close a connection now (its file first: the socket's fd stays open while a makefile() holds it)."""
    conn[1].close()
    conn[0].close()


class _Body(httpx.SyncByteStream):
    """A response body read off its connection; the connection goes back to the pool once it is all read."""

    def __init__(self, transport: _UnixTransport, conn, headers, no_body: bool) -> None:
        self.t, self.conn, self.done = transport, conn, False
        h = {k.lower(): v for k, v in headers}
        self.keep = h.get(b"connection", b"").lower() != b"close"
        self.chunked = b"chunked" in h.get(b"transfer-encoding", b"").lower()
        self.length = 0 if no_body else int(h[b"content-length"]) if b"content-length" in h else None
        if self.length is None and not self.chunked:
            self.keep = False   # the body ends when the daemon closes the connection

    def __iter__(self):
        rfile = self.conn[1]
        try:
            if self.chunked:
                while True:
                    size = int(rfile.readline().split(b";", 1)[0], 16)
                    if size == 0:
                        while rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    data = rfile.read(size)
                    rfile.read(2)
                    if len(data) < size:
                        raise httpx.RemoteProtocolError("the daemon closed the connection in the middle of an answer")
                    yield data
            elif self.length is not None:
                left = self.length
                while left > 0:
                    data = rfile.read1(min(left, _READ))
                    if not data:
                        raise httpx.RemoteProtocolError("the daemon closed the connection in the middle of an answer")
                    left -= len(data)
                    yield data
            else:
                while data := rfile.read1(_READ):
                    yield data
            self.done = True
        except OSError as e:
            raise httpx.ReadError(str(e)) from e
        except ValueError as e:
            raise httpx.RemoteProtocolError(f"bad chunk from the daemon: {e}") from e
        finally:
            self.close()

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if self.done and self.keep:
            self.t._release(conn)
        else:   # not read to the end: the connection's state is unknown
            _drop(conn)


class Client:
    """Blocking HTTP client of the daemon (one per process and endpoint, thread-safe)."""

    def __init__(self, endpoint: Endpoint | None = None):
        self.ep = endpoint or Endpoint()
        transport = None if self.ep.url else _UnixTransport(str(self.ep.socket))
        self.http = httpx.Client(base_url=self.ep.base, transport=transport, headers=self.ep.headers(),
                                 timeout=_NODE_TIMEOUT if self.ep.node else _TIMEOUT, limits=_LIMITS,
                                 verify=_verify(self.ep))
        # the local socket's common calls skip httpx's request building (see _UnixTransport.quick)
        self._quick = transport if transport is not None and not self.ep.headers() else None

    def request(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        """Send a request; map error answers to hutch errors; start the local daemon if none runs."""
        quick = self._quick
        backoff = iter(CONNECT_BACKOFF)
        for attempt in itertools.count():
            try:
                resp = quick.quick(method, path, kw) if quick is not None else None
                if resp is None:
                    resp = self.http.send(self.http.build_request(method, path, **kw), stream=stream)
                elif not stream:
                    resp.read()
                break
            except httpx.ConnectError as e:
                close_unmade_tls(e)   # httpx's connect: the same CPython leak as Remote.connect's
                if self.ep.url and reset_while_connecting(e) and (delay := next(backoff, None)) is not None:
                    time.sleep(delay * random.uniform(0.5, 1.5))   # the listener's per-address cap: nothing was sent
                    continue
                if self.ep.node:
                    raise _lost_node(self.ep, path, e) from e
                if attempt or self.ep.url or _denied(e):
                    raise _unreachable(self.ep, e) from e
                _no_autostart_for(self.ep, path)
                ensure_daemon(self.ep)
            except httpx.TransportError as e:
                if self.ep.node:
                    raise _lost_node(self.ep, path, e) from e
                raise _unreachable(self.ep, e) from e
        if resp.status_code >= 400:
            try:
                body = resp.read()
            finally:
                resp.close()
            if resp.status_code == 404 and self.ep.restarted is not None and path.startswith("/v1/sandboxes/") \
                    and self.ep.restarted():
                raise _lost_node(self.ep, path, "its daemon was restarted since")
            raise error_from_answer(resp.status_code, body)
        return resp

    def json(self, method: str, path: str, **kw):
        r = self.request(method, path, **kw)
        return r.json() if r.content else None

    def download(self, path: str, dest: "str | os.PathLike") -> None:
        """GET `path` streamed into the file `dest`, whole or not at all: written beside it under a temporary
        name and renamed into place once complete (an error or an interrupt removes the partial file)."""
        with replace_file(Path(dest).resolve(), mode=None, fsync_file=False, fsync_dir=False) as f:
            resp = self.request("GET", path, stream=True)
            try:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)
            finally:
                resp.close()

    # the three calls a fleet answers differently (FleetClient): where a sandbox is made, found, listed

    def create_sandbox(self, attempt) -> "tuple[Client, object]":
        """`attempt(client)` (ensure the image, POST the create) on this daemon: (this client, its answer)."""
        return self, attempt(self)

    def owner(self, sandbox_id: str) -> "Client":
        """The client of the daemon that runs `sandbox_id`."""
        return self

    def list_sandboxes(self, params) -> "list[tuple[Client, dict]]":
        return [(self, info) for info in self.json("GET", "/v1/sandboxes", params=params)["sandboxes"]]

    def for_snapshot(self, snapshot_id: str) -> "Client":
        """The client of the daemon that holds memory snapshot `snapshot_id`."""
        return self

    def for_restore(self, snapshot_id: str) -> "Client":
        """The client of the daemon a restore of memory snapshot `snapshot_id` goes to (a fleet's: a node that
        holds it, or one it is moved to)."""
        return self


class FleetClient:
    """The client of a fleet (ray://...): sandboxes are made on a placed node, then spoken to on their own node's
    Client; calls about no sandbox (images, volumes, doctor) go to the fleet's first healthy node."""

    def __init__(self, endpoint: Endpoint):
        self.ep = endpoint
        self.fleet = _fleet.fleet(endpoint.fleet_url, node_client, token=endpoint.token)

    def create_sandbox(self, attempt):
        return self.fleet.create(attempt)

    def owner(self, sandbox_id: str) -> Client:
        return self.fleet.owner(sandbox_id)

    def for_snapshot(self, snapshot_id: str) -> Client:
        return self.fleet.client(self.fleet.snapshot_node(snapshot_id))

    def for_restore(self, snapshot_id: str) -> Client:
        return self.fleet.client(self.fleet.restore_node(snapshot_id))

    def list_sandboxes(self, params) -> "list[tuple[Client, dict]]":
        out = []
        for c, answer in self.fleet.fan_out(lambda c: c.json("GET", "/v1/sandboxes", params=params)):
            out += [(c, info) for info in answer["sandboxes"]]
        return out

    def request(self, method: str, path: str, **kw):
        if method == "DELETE" and _snapshot_of(path):
            return self._delete_snapshot(path, **kw)
        return self._route(path).request(method, path, **kw)

    def json(self, method: str, path: str, **kw):
        if method == "GET" and path == "/v1/memory-snapshots":
            return _merge_snapshots(a for _, a in self.fleet.fan_out(lambda c: c.json(method, path, **kw)))
        if method == "DELETE" and _snapshot_of(path):
            self._delete_snapshot(path, **kw)
            return None
        return self._route(path).json(method, path, **kw)

    def download(self, path: str, dest: "str | os.PathLike") -> None:
        self._route(path).download(path, dest)

    def _delete_snapshot(self, path: str, **kw):
        """A memory snapshot is deleted on every node that holds it (a restore may have moved it to others)."""
        answers = self.fleet.fan_out(lambda c: c.request("DELETE", path, **kw), strict=False)
        self.fleet._snapshots.pop(_snapshot_of(path), None)
        return _one_deleted([a for _, a in answers])

    def _route(self, path: str) -> Client:
        if path.startswith("/v1/sandboxes/"):
            return self.fleet.owner(path[len("/v1/sandboxes/"):].split("/", 1)[0])
        sid = _snapshot_of(path)
        if sid:
            return self.for_snapshot(sid)
        return self.fleet.home()


def _merge_snapshots(answers) -> dict:
    """The fleet's memory snapshots: every node's, one entry per id (a moved snapshot is on several nodes)."""
    seen: dict[str, dict] = {}
    for a in answers:
        for snap in a["snapshots"]:
            seen.setdefault(snap["id"], snap)
    return {"snapshots": sorted(seen.values(), key=lambda s: s["id"])}


def _one_deleted(answers: list):
    """The answer of a delete sent to every node: the first success; else the first error that is not a
    NotFoundError (a node that could not delete its copy), else NotFoundError (no node had it)."""
    ok = [a for a in answers if not isinstance(a, Exception)]
    errs = [a for a in answers if isinstance(a, Exception) and not isinstance(a, NotFoundError)]
    if errs:
        raise errs[0]
    if ok:
        return ok[0]
    raise next((a for a in answers if isinstance(a, NotFoundError)), NotFoundError("no such memory snapshot"))


def _snapshot_of(path: str) -> str:
    """The memory snapshot a path is about (`/v1/memory-snapshots/ID[/...]`, not the import), else ""."""
    if not path.startswith("/v1/memory-snapshots/"):
        return ""
    sid = path[len("/v1/memory-snapshots/"):].split("/", 1)[0]
    return "" if sid == "import" else sid


def node_endpoint(node: "_fleet.Node", token: str | None = None) -> Endpoint:
    """How this process reaches a fleet node's daemon: its Unix socket when the node runs on this host (the same
    boot) and the socket lets us in, else its TLS listener with the fleet's token, its certificate pinned.
    `token`: a tenant's (hutch.connect("ray://auto", token=...)), sent instead: the calls are that tenant's."""
    if node.socket and node.boot_id and node.boot_id == _fleet.local_boot_id() and os.access(node.socket, os.W_OK):
        return Endpoint(url="", token=token, socket_path=node.socket, node=node.key)
    if not node.url:
        raise DaemonError(f"fleet node {node.name} ({node.key}) runs on another host and has no TCP listener; start "
                          "the fleet with `hutch fleet up --listen`.")
    u = httpx.URL(node.url)
    return Endpoint(remote=Remote(node.url, u.host, u.port or 443, token or node.token, None,
                                  node.fingerprint or None), node=node.key)


def node_client(node: "_fleet.Node", token: str | None = None) -> Client:
    return Client(node_endpoint(node, token))


class AsyncClient:
    """The same as Client, awaitable (one per event loop and endpoint)."""

    def __init__(self, endpoint: Endpoint | None = None):
        self.ep = endpoint or Endpoint()
        transport = None if self.ep.url else httpx.AsyncHTTPTransport(uds=str(self.ep.socket))
        self.http = httpx.AsyncClient(base_url=self.ep.base, transport=transport, headers=self.ep.headers(),
                                      timeout=_NODE_TIMEOUT if self.ep.node else _TIMEOUT, limits=_LIMITS,
                                      verify=_verify(self.ep))

    async def request(self, method: str, path: str, *, stream: bool = False, **kw) -> httpx.Response:
        import asyncio

        backoff = iter(CONNECT_BACKOFF)
        for attempt in itertools.count():
            try:
                resp = await self.http.send(self.http.build_request(method, path, **kw), stream=stream)
                break
            except httpx.ConnectError as e:
                close_unmade_tls(e)   # httpx's connect: the same CPython leak as Remote.connect's
                if self.ep.url and reset_while_connecting(e) and (delay := next(backoff, None)) is not None:
                    await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                    continue
                if self.ep.node:
                    raise _lost_node(self.ep, path, e) from e
                if attempt or self.ep.url or _denied(e):
                    raise _unreachable(self.ep, e) from e
                _no_autostart_for(self.ep, path)
                await asyncio.to_thread(ensure_daemon, self.ep)
            except httpx.TransportError as e:
                if self.ep.node:
                    raise _lost_node(self.ep, path, e) from e
                raise _unreachable(self.ep, e) from e
        if resp.status_code >= 400:
            try:
                body = await resp.aread()
            finally:
                await resp.aclose()
            if resp.status_code == 404 and self.ep.restarted is not None and path.startswith("/v1/sandboxes/") \
                    and await asyncio.to_thread(self.ep.restarted):
                raise _lost_node(self.ep, path, "its daemon was restarted since")
            raise error_from_answer(resp.status_code, body)
        return resp

    async def json(self, method: str, path: str, **kw):
        r = await self.request(method, path, **kw)
        return r.json() if r.content else None

    async def create_sandbox(self, attempt) -> "tuple[AsyncClient, object]":
        return self, await attempt(self)

    async def owner(self, sandbox_id: str) -> "AsyncClient":
        return self

    async def list_sandboxes(self, params) -> "list[tuple[AsyncClient, dict]]":
        d = await self.json("GET", "/v1/sandboxes", params=params)
        return [(self, info) for info in d["sandboxes"]]

    async def for_snapshot(self, snapshot_id: str) -> "AsyncClient":
        return self

    async def for_restore(self, snapshot_id: str) -> "AsyncClient":
        return self


class AsyncFleetClient:
    """FleetClient, awaitable (one per event loop): the placement and table are the process's Fleet's, the
    node clients AsyncClients of this loop."""

    def __init__(self, endpoint: Endpoint):
        self.ep = endpoint
        self.fleet = _fleet.fleet(endpoint.fleet_url, node_client, token=endpoint.token)
        self._nodes: dict[tuple, AsyncClient] = {}

    @property
    def http(self) -> "AsyncFleetClient":   # what _closed_with_loop closes: every node client of this loop
        return self

    async def aclose(self) -> None:
        for c in list(self._nodes.values()):
            await c.http.aclose()

    def node(self, n: "_fleet.Node") -> AsyncClient:
        k = (n.key, n.socket, n.url, n.fingerprint, n.started)
        c = self._nodes.get(k)
        if c is None:
            c = self._nodes[k] = AsyncClient(node_endpoint(n, self.fleet.token))
            sync = self.fleet.client(n).ep
            c.ep.restarted, c.ep.fetch_image = sync.restarted, sync.fetch_image
        return c

    async def create_sandbox(self, attempt):
        import asyncio

        skip: set[str] = set()
        last = None
        tries = 0
        while tries < _fleet.CREATE_ATTEMPTS:   # as Fleet.create: a full node is skipped, not counted as a try
            n, why = await asyncio.to_thread(self.fleet.placed, skip)
            if n is None:
                raise last or why
            c = self.node(n)
            try:
                return c, await attempt(c)
            except QuotaExceededError as e:
                if not self.fleet.full(n.key, e):
                    raise
                skip.add(n.key)
                last = e
            except (SandboxLostError, DaemonError) as e:
                skip.add(n.key)
                last = e
                tries += 1
        raise last

    async def owner(self, sandbox_id: str) -> AsyncClient:
        import asyncio

        return self.node(await asyncio.to_thread(self.fleet.owner_node, sandbox_id))

    async def list_sandboxes(self, params) -> "list[tuple[AsyncClient, dict]]":
        import asyncio

        nodes = [n for n in (await asyncio.to_thread(self.fleet.nodes)).values() if n.healthy]
        answers = await asyncio.gather(*(self.node(n).json("GET", "/v1/sandboxes", params=params) for n in nodes))
        return [(self.node(n), info) for n, d in zip(nodes, answers) for info in d["sandboxes"]]

    async def request(self, method: str, path: str, **kw):
        if method == "DELETE" and _snapshot_of(path):
            return await self._delete_snapshot(path, **kw)
        return await (await self._route(path)).request(method, path, **kw)

    async def json(self, method: str, path: str, **kw):
        import asyncio

        if method == "GET" and path == "/v1/memory-snapshots":
            nodes = [n for n in (await asyncio.to_thread(self.fleet.nodes)).values() if n.healthy]
            return _merge_snapshots(await asyncio.gather(*(self.node(n).json(method, path, **kw) for n in nodes)))
        if method == "DELETE" and _snapshot_of(path):
            await self._delete_snapshot(path, **kw)
            return None
        return await (await self._route(path)).json(method, path, **kw)

    async def _delete_snapshot(self, path: str, **kw):
        import asyncio

        nodes = [n for n in (await asyncio.to_thread(self.fleet.nodes)).values() if n.healthy]
        answers = await asyncio.gather(*(self.node(n).request("DELETE", path, **kw) for n in nodes),
                                       return_exceptions=True)
        self.fleet._snapshots.pop(_snapshot_of(path), None)
        return _one_deleted(list(answers))

    async def _route(self, path: str) -> AsyncClient:
        import asyncio

        if path.startswith("/v1/sandboxes/"):
            return await self.owner(path[len("/v1/sandboxes/"):].split("/", 1)[0])
        sid = _snapshot_of(path)
        if sid:
            return await self.for_snapshot(sid)
        return self.node(await asyncio.to_thread(self.fleet.home_node))

    async def for_snapshot(self, snapshot_id: str) -> AsyncClient:
        import asyncio

        return self.node(await asyncio.to_thread(self.fleet.snapshot_node, snapshot_id))

    async def for_restore(self, snapshot_id: str) -> AsyncClient:
        import asyncio

        return self.node(await asyncio.to_thread(self.fleet.restore_node, snapshot_id))


def _verify(ep: Endpoint):
    """httpx's `verify` for this endpoint: the remote daemon's verifying context (the Unix socket needs none)."""
    return ep.remote.ssl_context() if ep.remote else True


_lock = threading.Lock()
_clients: dict[tuple, Client] = {}
_aclients: dict[tuple, tuple] = {}


def _key() -> tuple:
    ep = Endpoint()
    r = ep.remote
    return (os.getpid(), ep.url, ep.fleet_url, ep.token, str(ep.socket), r and r.ca, r and r.fingerprint), ep


def default_client() -> "Client | FleetClient":
    """The process's client for the endpoint hutch.connect() or the environment names now."""
    key, ep = _key()
    with _lock:
        c = _clients.get(key)
    if c is None:
        c = FleetClient(ep) if ep.fleet_url else Client(ep)   # a fleet joins Ray: not under the lock
        with _lock:
            c = _clients.setdefault(key, c)
    return c


def sync_client(ep: Endpoint) -> Client:
    """The process's blocking client of endpoint `ep` (what an async object uses where it cannot await)."""
    key = (os.getpid(), ep.url, ep.token, str(ep.socket))
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
        for k in [k for k, (lp, *_) in _aclients.items() if lp.is_closed()]:
            _finish(_aclients.pop(k)[2])   # clients of finished event loops (asyncio.run in a loop)
        entry = _aclients.get(key)
    if entry is None:
        c = AsyncFleetClient(ep) if ep.fleet_url else AsyncClient(ep)   # a fleet joins Ray: not under the lock
        with _lock:
            entry = _aclients.get(key)
            if entry is None:
                entry = _aclients[key] = (loop, c, _closed_with_loop(c))
    return entry[1]


def _closed_with_loop(client: AsyncClient):
    """Close `client`'s connections when its event loop shuts down: an async generator, started here, that the
    loop finalizes in `shutdown_asyncgens()` (asyncio.run does so before closing the loop). The caller keeps
    the generator (the loop holds it weakly). Otherwise each finished loop left its pooled connections open
    (ResourceWarning: unclosed socket)."""

    import asyncio

    loop = asyncio.get_running_loop()

    async def closer():
        try:
            yield
        finally:
            if not loop.is_closed():
                await client.http.aclose()

    gen = closer()
    _finish(gen.__anext__())   # the loop's firstiter hook registers the generator; it runs to its yield
    return gen


def _finish(gen_or_step) -> None:
    """Drive an awaitable that awaits nothing to its end: the closer's first step, or (given the generator,
    its loop closed without shutting its generators down) its close, which then skips the await, so the
    generator is not left for the closed loop's finalizer hook."""
    step = gen_or_step.aclose() if hasattr(gen_or_step, "aclose") else gen_or_step
    try:
        step.send(None)
    except StopIteration:
        pass


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


def _close_at_exit() -> None:
    """At interpreter exit: close this process's cached clients (their pooled connections), its fleets' node
    clients and its leases (the daemon ends those sandboxes, as when the kernel closed them), instead of leaving
    the sockets to the last garbage collection (ResourceWarning: unclosed socket). Closing sends nothing and
    waits for nothing, so a daemon that is gone or stopped cannot hold the exit up."""
    pid = os.getpid()
    with _lock:
        clients = [c for k, c in _clients.items() if k[0] == pid and not isinstance(c, FleetClient)]
        _clients.clear()
        leases = list(_leases.values())
        _leases.clear()
    for c in clients:
        try:
            c.http.close()
        except Exception:  # noqa: BLE001 - at exit: nothing to tell, nothing to retry
            pass
    _fleet.close_all()
    for s in leases:
        try:
            s.close()
        except OSError:
            pass


atexit.register(_close_at_exit)
