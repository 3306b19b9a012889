"""What the fuzzer (test_rt_fuzz.py) found, one test per class of bad input: each answered 4xx with a hutch
error that names the fix, where the daemon answered 500, hung, or took it and failed later."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request

from hutch._core.errors import ConfigError
from rt_support import Api, private_state_daemon

MAX_JSON_BODY = 8 << 20   # hutch.sandbox._host.daemon.http's (imported below, where the code has it)


def _error(r: httpx.Response, status: int, name: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == name, body
    for w in words:
        assert w in body["message"], body


def _raw(api, path: str, data: bytes) -> httpx.Response:
    return api.http.post(path, content=data, headers={"Content-Type": "application/json"})


def test_json_bodies_refuse_nan_infinity_deep_nesting_and_oversize(api, image):
    spec = {"image": image, "detach": True}
    for literal in (b"NaN", b"Infinity", b"-Infinity"):   # Python's json takes them; JSON has none
        body = json.dumps({"spec": {**spec, "timeout": 1}}).encode().replace(b": 1}", b": " + literal + b"}")
        _error(_raw(api, "/v1/sandboxes", body), 400, "ConfigError", "not JSON")
    _error(_raw(api, "/v1/sandboxes", b"[" * 100000 + b"]" * 100000), 400, "ConfigError", "not JSON")
    _error(_raw(api, "/v1/sandboxes", b'{"spec": "' + b"x" * (MAX_JSON_BODY + 1) + b'"}'), 400, "ConfigError",
           "larger than")
    sid = api.create(image)["id"]
    body = json.dumps({"argv": ["true"], "timeout": 1}).encode().replace(b": 1}", b": NaN}")
    _error(_raw(api, f"/v1/sandboxes/{sid}/exec", body), 400, "ConfigError", "not JSON")


def test_long_polls_refuse_nan_infinity_and_negative_timeouts(api, daemon, image):
    sid = api.create(image)["id"]
    for t in ("nan", "inf", "1e400", "-1", "soon"):
        # hung before: the request's own timeout is the hang guard (a wait on an infinite timeout never answers)
        r = api.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": t}, timeout=30)
        _error(r, 400, "ConfigError", "seconds")
    assert api.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": "0"}).json()["status"] == "running"
    # the refusal came after the wait's coroutine was made, which then was never awaited
    assert "was never awaited" not in Path(daemon.log).read_text(errors="replace")


def test_a_long_poll_is_capped():
    from hutch.sandbox._host.daemon.http import MAX_LONG_POLL, query_seconds

    assert query_seconds(make_mocked_request("POST", "/w?timeout=1e9")) == MAX_LONG_POLL
    assert query_seconds(make_mocked_request("POST", "/w")) == MAX_LONG_POLL
    assert query_seconds(make_mocked_request("POST", "/w?timeout=0.5")) == 0.5
    with pytest.raises(ConfigError):
        query_seconds(make_mocked_request("POST", "/w?timeout=nan"))


def test_flags_and_modes_are_strict(api, image):
    sid = api.create(image)["id"]
    base = f"/v1/sandboxes/{sid}/files"
    assert api.http.post(f"{base}/mkdir", params={"path": "/home/user/d"}).status_code == 204
    # "banana" was taken for false, so the remove below would have been refused for another reason
    _error(api.http.post(f"{base}/remove", params={"path": "/home/user/d", "recursive": "banana"}), 400,
           "ConfigError", "recursive=")
    for mode in ("0644\n", "77777", "-1", "+644", "0o644"):
        _error(api.http.put(f"{base}/write", params={"path": "/home/user/m", "mode": mode}, content=b"x"), 400,
               "ConfigError", "mode=")
    assert api.http.post("/v1/volumes", json={"name": "fuzzmodes", "create": True}).status_code == 200
    try:
        r = api.http.put("/v1/volumes/fuzzmodes/files/write", params={"path": "/m", "mode": "77777"}, content=b"x")
        _error(r, 400, "ConfigError", "mode=")   # was masked to 7777: setuid, setgid and sticky bits set
    finally:
        api.http.delete("/v1/volumes/fuzzmodes", params={"force": 1})


def test_specs_refuse_nul_nonfinite_absurd_sizes_and_non_list_ports(api, image):
    for extra, words in [
        ({"workdir": "/srv/a\u0000b"}, "workdir"),                  # was a 500 from the init's chdir
        ({"env": [["A", "x\u0000y"]]}, "NUL"),                       # was taken; every exec then failed
        ({"mounts": [{"kind": "tmpfs", "target": "/t\u0000"}]}, "target"),
        ({"limits": {"memory": 10**30}}, "1 PiB"),                   # the kernel takes it as no limit
        ({"limits": {"disk": 10**30}}, "1 PiB"),                     # was a 500 "disk full"
        ({"limits": {"memory": "99999999T"}}, "1 PiB"),
        ({"mounts": [{"kind": "tmpfs", "target": "/t", "size": 10**30}]}, "1 PiB"),
        ({"env": [[["A"], "x"]]}, "pairs"),                           # was a 500: unhashable list as a key
        ({"tags": [[{"k": 1}, "v"]]}, "pairs"),
    ]:
        code, body = api.create_error(image, **extra)
        assert (code, body["error"]) == (400, "InvalidSpecError") and words in body["message"], (extra, body)
    for caps in (True, 5, "CHOWN", [["CHOWN"]]):                     # True and 5 were a 500 TypeError
        code, body = api.create_error(image, capabilities=caps)
        assert (code, body["error"]) == (400, "InvalidSpecError") and "capabilities" in body["message"], (caps, body)
    for ports in (5, 5.5, "443", {"443": 1}):                        # 5 and 5.5 were a 500 TypeError
        code, body = api.create_error(image, network={"mode": "allow", "domains": ["example.com"], "ports": ports})
        assert (code, body["error"]) == (400, "NetworkPolicyError") and "lists" in body["message"], (ports, body)


def test_exec_refuses_nonfinite_timeouts(api, image):
    sid = api.create(image)["id"]
    for t in (-1, True, 0, "1"):   # True was taken for 1 second
        r = api.http.post(f"/v1/sandboxes/{sid}/exec", content=json.dumps({"argv": ["true"], "timeout": t}).encode())
        _error(r, 400, "ConfigError", "timeout")


def test_names_with_a_trailing_newline_are_refused(api, image):
    # `$` matches before a trailing newline: "abc\n" made a volume directory of that name
    _error(api.http.post("/v1/volumes", json={"name": "fuzzvol\n", "create": True}), 400, "ConfigError", "volume name")
    assert "fuzzvol\n" not in [v["name"] for v in api.http.get("/v1/volumes").json()["volumes"]]
    code, body = api.create_error(image, name="box\n")
    assert (code, body["error"]) == (400, "InvalidSpecError")
    sid = api.create(image)["id"]
    _error(api.http.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "../../x\n"}), 400, "ConfigError",
           "image name")
    node = "ab" * 32
    for bad in ({"name": "n\n"}, {"env": {"A": "x\u0000"}}, {"workdir": "rel"}, {"kind": "base"}):
        r = api.http.post("/v1/images/nodes", json={"id": node, "parent": image, **bad})
        _error(r, 400, "ConfigError", "image")
    _error(api.http.post("/v1/images/nodes", json={"id": node + "\n", "parent": image}), 400, "ConfigError",
           "64 hex digits")


def test_a_busy_path_is_a_state_error(api, image):
    sid = api.create(image)["id"]
    r = api.http.post(f"/v1/sandboxes/{sid}/files/remove", params={"path": "/dev/zero"})   # a bind of the device
    _error(r, 409, "StateError", "mount point")


def test_export_and_import_of_bad_input_on_a_fresh_host(tmp_path):
    with private_state_daemon(tmp_path) as d:   # no layer store yet: export was a 500 FileNotFoundError
        c = httpx.Client(transport=httpx.HTTPTransport(uds=str(d.sock)), base_url="http://h", timeout=30)
        _error(c.get("/v1/images/0/export"), 404, "NotFoundError", "no image")
        _error(c.get(f"/v1/images/{'ab' * 32}/export"), 404, "NotFoundError")
        for junk in (b"", b"\x00" * 1024, b"not a tar at all"):   # was 500 ImageError: the client's input is bad
            _error(c.post("/v1/images/import", content=junk), 400, "InvalidArchiveError", "archive")
        c.close()


def _raw_answer(sock, request: bytes) -> tuple[int, str, dict]:
    """Send bytes as they are; the status, content type and JSON body of the one answer (the daemon closes)."""
    sock.settimeout(20)
    sock.sendall(request)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers.get("content-type", ""), json.loads(body)


UNREADABLE = [
    b"GET /v1/health?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: hutch\r\n\r\n",            # request line over 8 KiB
    b"GET /v1/health HTTP/1.1\r\nHost: hutch\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",   # a header over 8 KiB
    b"G\x01T /v1/health HTTP/1.1\r\nHost: hutch\r\n\r\n",                               # not a method
    b"POST /v1/sandboxes HTTP/1.1\r\nHost: hutch\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nabcde",
    b"POST /v1/sandboxes HTTP/1.1\r\nHost: hutch\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


def test_requests_aiohttp_cannot_parse_get_the_apis_json_error(daemon, api):
    """aiohttp answers these before the app (or its middleware) runs: the daemon's handler answers them as JSON."""
    import socket
    import ssl

    for req in UNREADABLE:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(daemon.sock))
            status, ctype, body = _raw_answer(s, req)
        assert status == 400 and ctype.startswith("application/json"), (req[:40], status, ctype, body)
        assert body["error"] == "ConfigError" and "could not be read as HTTP" in body["message"], body
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", daemon.port)) as raw, ctx.wrap_socket(raw) as s:
        status, ctype, body = _raw_answer(s, UNREADABLE[0])   # no token could be read either: refused all the same
    assert status == 400 and body["error"] == "ConfigError", body
    assert api.http.get("/v1/health").status_code == 200


def test_a_full_host_disk_is_a_json_error_and_leaves_nothing(tmp_path):
    """The volumes' directory on a small filesystem of the test's own: a write that does not fit is 503
    DaemonError naming the full disk, its temp file is gone, and what fits is still written."""
    import subprocess

    vols = tmp_path / "state" / "volumes"
    vols.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0711", "hutch-test-full", str(vols)], check=True)
    try:
        with private_state_daemon(tmp_path) as d:
            api = Api(d.sock, d.run_dir)
            try:
                assert api.http.post("/v1/volumes", json={"name": "small", "create": True}).status_code == 200
                r = api.http.put("/v1/volumes/small/files/write", params={"path": "/big.bin"}, content=b"x" * (8 << 20))
                _error(r, 503, "DaemonError", "disk is full", "Free space")
                assert not [p for p in vols.rglob("*") if p.is_file()], list(vols.rglob("*"))   # no temp file left
                r = api.http.put("/v1/volumes/small/files/write", params={"path": "/ok.txt"}, content=b"fits")
                assert r.status_code == 204, r.text
            finally:
                api.close()
    finally:
        subprocess.run(["umount", str(vols)], check=True)
