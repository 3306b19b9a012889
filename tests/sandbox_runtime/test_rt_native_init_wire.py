"""The C init's reading of its socket, under AddressSanitizer and UBSan: whatever arrives (not JSON, nesting past
its bound, strings no file name can hold, numbers out of range, fields of the wrong type, a memfd that is not
there or holds garbage, more descriptors than a message carries), it answers what it can, drops the rest, and
keeps serving; nothing overflows.

It runs on the host here, outside any sandbox, and is only sent calls that touch nothing (stats of a path that
does not exist, malformed execs that are refused before anything starts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from hutch.sandbox._host.native import initwire

SOURCE = Path(__file__).resolve().parents[2] / "hutch/sandbox/_host/native/initd.c"


@pytest.fixture(scope="module")
def asan_init(tmp_path_factory) -> Path:
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed (scripts/debian-packages.txt lists it)")
    out = tmp_path_factory.mktemp("initd") / "hutch-init-asan"
    r = subprocess.run(["gcc", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                        "-Wall", "-Wextra", "-Werror", "-o", str(out), str(SOURCE)], capture_output=True, text=True)
    if r.returncode != 0 and "libasan" in r.stderr + r.stdout:
        pytest.skip(f"no AddressSanitizer runtime here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr
    return out


class Init:
    def __init__(self, binary: Path, log: Path):
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.settimeout(10)
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([str(binary), str(theirs.fileno()), "-1", "0"], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     env={"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=99",
                                          "UBSAN_OPTIONS": "halt_on_error=1:exitcode=98"})
        theirs.close()
        assert json.loads(self.ours.recv(70000)) == {"op": "ready"}
        self.rid = 0

    def send(self, data: bytes, fds=()) -> None:
        socket.send_fds(self.ours, [data], list(fds)) if fds else self.ours.send(data)

    def call(self, msg: dict) -> dict:
        self.rid += 1
        initwire.send(self.ours, {**msg, "rid": self.rid})   # past MAX_PACKET in a memfd, as the daemon sends
        reply, fds = initwire.recv(self.ours)
        for fd in fds:
            os.close(fd)
        assert reply["rid"] == self.rid, reply
        return reply

    def alive(self) -> dict:
        """A call that must still be answered: the init kept serving."""
        r = self.call({"op": "stat", "path": "/nonexistent-hutch-wire-test/x"})
        assert r["ok"] is False and r["error"] == "NotFoundError", r
        return r

    def close(self) -> int:
        self.ours.close()
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def test_whatever_arrives_it_keeps_serving_and_nothing_overflows(asan_init, tmp_path):
    log = tmp_path / "init.log"
    init = Init(asan_init, log)
    try:
        init.alive()
        garbage = [b"not json", b"[]", b"{", b"{\"op\":", b"\"str\"", b"{\"a\":1}x", b"[" * 100_000,
                   b"{\"a\":" * 1000 + b"1" + b"}" * 1000, b"{\"op\":\"stat\",\"path\":\"\\u12\"}",
                   b"{\"op\":\"stat\",\"path\":\"\\x\"}", b"{\"n\":1e999999999}", b"{\"n\":-}", b"{\"n\":1\x00}",
                   b"{\"s\":\"" + b"A" * 60_000 + b"\"}", b"{\"_memfd\":1}", b"\xff\xfe", b"{\"op\":\"\x00\"}"]
        for data in garbage:
            init.send(data)
        init.alive()
        # a memfd that holds garbage, and one too big to be a message's
        for content in (b"{{{{", b"[" * 1000, b"{\"op\":\"stat\"}"):
            mfd = os.memfd_create("t")
            os.write(mfd, content)
            os.lseek(mfd, 0, 0)
            init.send(b"{\"_memfd\":1}", [mfd])
            os.close(mfd)
        init.alive()
        # more descriptors than a message may carry: the extra ones are closed, not leaked or overflowed
        pipes = [os.pipe() for _ in range(6)]
        init.send(json.dumps({"op": "nothing"}).encode(), [fd for p in pipes for fd in p][:12])
        for p in pipes:
            for fd in p:
                os.close(fd)
        init.alive()
        # well-formed messages with fields of the wrong type or out of range: refused with a reply
        for msg in ({"op": "exec"}, {"op": "exec", "argv": [1], "env": {}, "cwd": "/", "streams": [0, 0, 0], "eid": "e"},
                    {"op": "exec", "argv": ["x"], "env": {"A": 1}, "cwd": "/", "streams": [0, 0, 0], "eid": "e"},
                    {"op": "exec", "argv": ["x"], "env": {}, "cwd": "/", "streams": [0, 0], "eid": "e"},
                    {"op": "exec", "argv": ["x"], "env": {}, "cwd": "/", "streams": [0, 0, 0], "eid": "e",
                     "pty": [1 << 40, 2]},
                    {"op": "exec", "argv": ["x"], "env": {}, "cwd": "/", "streams": [0, 0, 0], "eid": "e",
                     "uid": -5},
                    {"op": "exec", "argv": ["a\u0000b"], "env": {}, "cwd": "/", "streams": [0, 0, 0], "eid": "e"},
                    {"op": "exec", "argv": ["x"], "env": {"": "v"}, "cwd": "/", "streams": [0, 0, 0], "eid": "e"},
                    {"op": "exec", "argv": ["\udcff\ud800"], "env": {}, "cwd": "/", "streams": [0, 0, 0], "eid": "e"},
                    {"op": "stat"}, {"op": "stat", "path": 5}, {"op": "stat", "path": "/a\u0000b"},
                    {"op": "write_open", "path": "/nonexistent-hutch-wire-test/x", "mode": "x"},
                    {"op": "write_commit", "path": "/x"}, {"op": "write_abort"}, {"op": "kill", "eid": 5},
                    {"op": "no such op"}, {"op": 7}, {"op": "remove", "path": "///"},
                    {"op": "stat", "path": "/" + "a" * 70_000}, {"op": "mkdir", "path": "/nonexistent-hutch-wire-test/" + "b/" * 5000}):
            try:
                r = init.call(msg)
            except TimeoutError:
                raise AssertionError(f"no answer to {str(msg)[:200]}") from None
            assert r["ok"] is False and r["error"] in ("ConfigError", "NotFoundError", "SandboxError"), (msg, r)
        r = init.call({"op": "remove", "path": "/"})
        assert r["error"] == "ConfigError" and "Operation not permitted" in r["message"], r
        init.alive()
    finally:
        code = init.close()
    text = log.read_text(errors="replace")
    assert "AddressSanitizer" not in text and "runtime error" not in text, text[-3000:]
    assert code == 0, (code, text[-3000:])   # end of file on its socket: it exits 0, as pid 1 ending the sandbox
