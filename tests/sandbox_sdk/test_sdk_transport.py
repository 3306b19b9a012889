"""The client's own HTTP/1.1 transport for the daemon's Unix socket, against a scripted server on a real socket:
keep-alive reuse, a connection the server closed while idle, chunked bodies both ways, an answer read only in part."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from hutch.sandbox._client import _UnixTransport


class Server:
    """Accepts connections on a Unix socket; answers each request with the next scripted reply."""

    def __init__(self, path: str, replies: list[tuple[bytes, bool]]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.replies = list(replies)         # (raw answer, close the connection after it)
        self.requests: list[bytes] = []
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                f = conn.makefile("rb")
                while self.replies:
                    head = b""
                    while (line := f.readline()) not in (b"\r\n", b""):
                        head += line
                    if not head:
                        break
                    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                                   if h.lower().startswith(b"content-length:")), 0)
                    body = f.read(length) if length else b""
                    if b"chunked" in head.lower():
                        while (size := int(f.readline(), 16)):
                            body += f.read(size)
                            f.readline()
                        f.readline()
                    self.requests.append(head + b"\r\n" + body)
                    answer, close = self.replies.pop(0)
                    conn.sendall(answer)
                    if close:
                        break
                f.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "t.sock")


def client(path: str) -> httpx.Client:
    return httpx.Client(base_url="http://hutch", transport=_UnixTransport(path))


def test_keep_alive_reuse_and_chunked_bodies(sock_path):
    srv = Server(sock_path, [(OK, False), (CHUNKED, False), (OK, False)])
    try:
        with client(sock_path) as c:
            assert c.get("/a").json() == {}
            assert c.get("/b").content == b"hello world"
            r = c.post("/c", content=iter([b"ab", b"", b"cde"]))   # a generator: sent chunked
            assert r.status_code == 200
        assert srv.connections == 1                                   # one connection for all three
        assert srv.requests[2].endswith(b"\r\n\r\nabcde")
    finally:
        srv.close()


def test_a_connection_closed_while_idle_is_replaced(sock_path):
    srv = Server(sock_path, [(OK, True), (OK, False)])   # the server hangs up after the first answer
    try:
        with client(sock_path) as c:
            assert c.get("/a").status_code == 200
            srv.thread.join(0.5)
            assert c.post("/b", json={"x": 1}).status_code == 200
        assert srv.connections == 2
        assert srv.requests[1].endswith(b'{"x":1}') or srv.requests[1].endswith(b'{"x": 1}')
    finally:
        srv.close()


def test_an_answer_read_in_part_never_returns_its_connection(sock_path):
    srv = Server(sock_path, [(CHUNKED, False), (OK, False)])
    try:
        with client(sock_path) as c:
            with c.stream("GET", "/a") as r:
                assert next(r.iter_raw()) == b"hello"       # the rest stays unread
            assert c.get("/b").json() == {}
        assert srv.connections == 2
    finally:
        srv.close()


def test_no_daemon_is_a_connect_error(sock_path):
    with client(sock_path) as c, pytest.raises(httpx.ConnectError):
        c.get("/v1/health")


def test_quick_requests_encode_like_httpx_and_defer_the_rest(sock_path):
    srv = Server(sock_path, [(OK, False), (OK, False)])
    try:
        t = _UnixTransport(sock_path)
        r = t.quick("POST", "/v1/x/files/remove", {"params": [("path", "/a b+c/é"), ("recursive", 1)],
                                                     "json": {"k": "ü"}})
        assert r.read() == b"{}" and r.status_code == 200
        line = srv.requests[0].split(b"\r\n", 1)[0]
        assert line == b"POST /v1/x/files/remove?path=%2Fa%20b%2Bc%2F%C3%A9&recursive=1 HTTP/1.1"
        assert srv.requests[0].endswith('{"k":"ü"}'.encode())
        assert t.quick("GET", "/v1/x", {"params": {"flag": True}}) is None      # httpx spells booleans
        assert t.quick("GET", "/v1/a b", {}) is None                            # a path to quote
        assert t.quick("PUT", "/v1/x", {"content": iter([b"a"])}) is None       # a streamed body
        with httpx.Client(base_url="http://hutch", transport=t) as c:           # what httpx sends instead
            assert c.get("/v1/x", params={"path": "/a b+c/é"}).status_code == 200
        assert srv.requests[1].split(b"\r\n", 1)[0] == b"GET /v1/x?path=%2Fa+b%2Bc%2F%C3%A9 HTTP/1.1"
    finally:
        srv.close()
