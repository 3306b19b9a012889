"""The daemon's listeners under abuse: slow and idle connections are closed, a TCP flood neither starves
the Unix socket's clients nor fills the disk with log."""

from __future__ import annotations

import os
import select
import socket
import ssl
import statistics
import struct
import time
from pathlib import Path

import pytest

import hutch
from sdk_support import RUN_TAG, start_remote, stop_remote

HEADER_TIMEOUT, IDLE_TIMEOUT = 1.0, 2.0


@pytest.fixture
def tight(remote_dir):
    """A daemon whose request heads get HEADER_TIMEOUT and idle connections IDLE_TIMEOUT."""
    r = start_remote(remote_dir, "--header-timeout", str(HEADER_TIMEOUT), "--idle-timeout", str(IDLE_TIMEOUT))
    try:
        yield r
    finally:
        stop_remote(r)


def _closed_after(s: socket.socket, t0: float, limit: float = 10.0, trickle: bytes = b"") -> float:
    """Seconds from t0 until the peer closed `s` (sending `trickle` a byte every 0.2 s meanwhile)."""
    s.settimeout(0.2)
    deadline = t0 + limit
    i = 0
    while time.monotonic() < deadline:
        try:
            if trickle:
                s.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
                i += 1
            data = s.recv(65536)
            if not data:
                return time.monotonic() - t0
        except (socket.timeout, ssl.SSLWantReadError):
            continue
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            return time.monotonic() - t0
    raise AssertionError(f"the connection was still open after {limit} s")


def _tls(r, raw: socket.socket) -> ssl.SSLSocket:
    return ssl.create_default_context(cafile=str(r.cert)).wrap_socket(raw, server_hostname="127.0.0.1")


def test_slow_and_silent_request_heads_are_cut_off(tight):
    t0 = time.monotonic()   # TCP, not even a TLS handshake
    s = socket.create_connection(("127.0.0.1", tight.port), timeout=5)
    assert _closed_after(s, t0) < HEADER_TIMEOUT + 1.5
    s.close()
    t0 = time.monotonic()   # TLS, then a head that never ends (slow loris)
    s = _tls(tight, socket.create_connection(("127.0.0.1", tight.port), timeout=5))
    s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
    took = _closed_after(s, t0, trickle=b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n")
    assert took < HEADER_TIMEOUT + 1.5, took
    s.close()
    u = socket.socket(socket.AF_UNIX)   # the Unix socket too (root is served, but not forever)
    u.connect(str(tight.run_dir / "run" / "hutch.sock"))
    u.sendall(b"GET /v1/health HTTP/1.1\r\n")
    t0 = time.monotonic()
    assert _closed_after(u, t0, trickle=b"X-Slow: aaaaaaaa\r\n") < HEADER_TIMEOUT + 1.5
    u.close()
    assert "no complete request head" in tight.log.read_text()


def _get(s: socket.socket, token: str, path: str = "/v1/health") -> bytes:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(65536)
    return head


def test_idle_connections_are_closed_but_a_long_request_is_not(tight, busybox_root):
    s = _tls(tight, socket.create_connection(("127.0.0.1", tight.port), timeout=5))
    assert _get(s, tight.token).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert _get(s, tight.token).startswith(b"HTTP/1.1 200")   # kept alive between requests ...
    took = _closed_after(s, t0)                               # ... until it idles IDLE_TIMEOUT
    assert IDLE_TIMEOUT - 0.5 < took < IDLE_TIMEOUT + 1.5, took
    s.close()
    os.environ.update(HUTCH_URL=tight.url, HUTCH_TOKEN_FILE=str(tight.token_file), HUTCH_FINGERPRINT=tight.fingerprint,
                      HUTCH_SOCKET=str(tight.run_dir / "no-such.sock"))
    os.environ.pop("HUTCH_TOKEN", None)
    with hutch.Sandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG) as sb:
        # longer than both timeouts, silent all along: a request in progress is never cut
        r = sb.run("sleep", str(IDLE_TIMEOUT + HEADER_TIMEOUT + 0.5))
        assert r.returncode == 0
        time.sleep(IDLE_TIMEOUT + 0.5)    # the SDK's pooled connection was closed meanwhile: it reconnects
        assert sb.run("echo", "again").stdout == "again\n"
        assert sb.status == "running"     # and its lease (a request in progress) held all along


def _flood(port: int, count: int, addresses: int = 40) -> list[socket.socket]:
    """`count` TCP connections to `port` from 127.0.0.2... (so that per-address caps do not stop it), left open."""
    out = []
    for i in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.bind((f"127.0.0.{2 + i % addresses}", 0))
        s.connect_ex(("127.0.0.1", port))   # not waited for: beyond the listen queue the SYNs just wait
        out.append(s)
    return out


def _unix_latencies(sock: Path, n: int) -> list[float]:
    from hutch.sandbox._client import Endpoint, _ping

    ep = Endpoint(socket_path=str(sock))
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        assert _ping(ep, 5.0), "a Unix-socket client was not served"
        out.append(time.monotonic() - t0)
    return out


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def starved(remote_dir):
    """A daemon limited to 512 descriptors (hard limit too), with the default caps (so fitted to the limit)."""
    os.environ.pop("HUTCH_URL", None)
    r = start_remote(remote_dir, "--header-timeout", "5", prefix=("prlimit", "--nofile=512:512"))
    try:
        yield r
    finally:
        stop_remote(r)


def test_a_tcp_flood_past_the_descriptor_limit_does_not_starve_unix_clients(starved):
    sock = starved.run_dir / "run" / "hutch.sock"
    quiet = _unix_latencies(sock, 20)
    conns = _flood(starved.port, 1500)
    try:
        time.sleep(1.0)   # the daemon accepts what its caps allow
        loud = _unix_latencies(sock, 50)
        fds = _fds(starved.proc.pid)
    finally:
        for s in conns:
            s.close()
    p99 = sorted(loud)[int(len(loud) * 0.99) - 1]
    print(f"unix health ping: quiet median {statistics.median(quiet) * 1e3:.1f} ms; under a flood of "
          f"{len(conns)} TCP connections median {statistics.median(loud) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms; "
          f"daemon descriptors {fds}/512")
    # every ping of the flood was answered (each within _ping's 5 s: a starved socket fails it, not a slow one);
    # the latencies are printed above, not asserted: bench/listen.py measures them, beside no flood
    assert len(loud) == 50, loud
    assert fds < 400, fds   # TCP got at most its share; the Unix socket's room stayed free


def test_the_log_stays_bounded_under_a_flood(starved):
    before = starved.log.stat().st_size
    ctx = ssl.create_default_context(cafile=str(starved.cert))
    t_end = time.monotonic() + 6
    held = _flood(starved.port, 1200)
    churned = 0
    try:
        while time.monotonic() < t_end:
            for i in range(20):   # connect and hang up, from one address: over the per-address cap
                try:
                    socket.create_connection(("127.0.0.1", starved.port), timeout=0.5).close()
                    churned += 1
                except OSError:
                    pass
            try:   # a TLS request with a wrong token
                with socket.create_connection(("127.0.0.1", starved.port), timeout=0.5) as raw, \
                        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n")
                    s.recv(100)
            except (OSError, ssl.SSLError):
                pass
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    grown = starved.log.stat().st_size - before
    print(f"log grew {grown} bytes during a 6 s flood ({len(held)} held, {churned} churned connections)")
    assert grown < 64 * 1024, starved.log.read_text()[-3000:]
    assert _unix_latencies(starved.run_dir / "run" / "hutch.sock", 3)


def test_a_reset_before_the_handshake_leaves_no_socket_open():
    """CPython 3.11's SSLSocket._create closes nothing when the peer reset the connection before the handshake
    (getpeername says ENOTCONN, its recv(1) raises ECONNRESET; the plain socket is detached by then), which is
    what a daemon does beyond its per-address cap: the SDK closes that TLS socket itself, or each retry left a
    descriptor to the collector (a ResourceWarning that failed the tests below under load)."""
    from hutch.sandbox._remote import wrap_client

    with socket.create_server(("127.0.0.1", 0)) as srv:
        raw = socket.create_connection(srv.getsockname(), timeout=5)
        conn, _ = srv.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()   # a reset, as the daemon's cap sends
        arrived = select.poll()
        arrived.register(raw, select.POLLERR | select.POLLHUP)
        assert arrived.poll(10_000), "no reset arrived"   # polled, not read: the error stays for the handshake
        fd, inode = raw.fileno(), os.fstat(raw.fileno()).st_ino
        with pytest.raises(ConnectionResetError) as failed:
            wrap_client(ssl.create_default_context(), raw, "127.0.0.1")
        assert failed.traceback   # the error, and the frames that held the TLS socket, are alive here
        try:
            still = os.fstat(fd).st_ino == inode
        except OSError:
            still = False
        assert not still, f"descriptor {fd} (the reset connection) is still open"


def test_a_burst_of_clients_from_one_address_is_served(remote_dir, busybox_root):
    """The per-address cap of unauthenticated connections resets what is beyond it; the SDK retries a reset
    during the TLS handshake (nothing was sent yet), so a burst of clients from one host (a platform's
    workers) is served, not failed: bench/load.py's 50 clients lost 17 of 200 cycles before."""
    import threading

    r = start_remote(remote_dir, "--max-tcp-per-peer", "2")
    try:
        os.environ.update(HUTCH_URL=r.url, HUTCH_TOKEN_FILE=str(r.token_file), HUTCH_FINGERPRINT=r.fingerprint,
                          HUTCH_SOCKET=str(r.run_dir / "no-such.sock"))
        os.environ.pop("HUTCH_TOKEN", None)
        image = hutch.Image.from_directory(busybox_root)
        n = 16
        start, errors, done = threading.Barrier(n), [], []

        def client():
            start.wait()
            try:
                hutch.Sandbox.list()   # all at once: an empty pool opens n connections together
                with hutch.Sandbox.create(image=image, tags=RUN_TAG) as sb:   # and n leases
                    assert sb.run("true").returncode == 0
                done.append(1)
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=client) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert len(done) == n
        assert "unauthenticated connections" in Path(r.log).read_text()   # the cap did reset some
    finally:
        stop_remote(r)


def test_a_cap_that_stays_full_names_itself(remote_dir):
    """While the address's unauthenticated connections stay at the cap, the SDK's retries run out and the
    error names the cap to raise (not "start the daemon")."""
    r = start_remote(remote_dir, "--max-tcp-per-peer", "2", "--header-timeout", "60")
    held = [socket.create_connection(("127.0.0.1", r.port), timeout=5) for _ in range(2)]   # never speak TLS
    try:
        time.sleep(0.3)
        os.environ.update(HUTCH_URL=r.url, HUTCH_TOKEN_FILE=str(r.token_file), HUTCH_FINGERPRINT=r.fingerprint,
                          HUTCH_SOCKET=str(r.run_dir / "no-such.sock"))
        os.environ.pop("HUTCH_TOKEN", None)
        t0 = time.monotonic()
        with pytest.raises(hutch.DaemonError, match="max-tcp-per-peer"):
            hutch.Sandbox.list()
        assert 3 < time.monotonic() - t0 < 30   # it retried with backoff first (the upper bound: a hang guard)
    finally:
        for s in held:
            s.close()
        stop_remote(r)
