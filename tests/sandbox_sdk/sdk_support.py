"""Shared by the SDK suite's conftest and tests (a unique module name: the tests/ tree has several conftests)."""

import uuid

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"sdk-{uuid.uuid4().hex[:8]}"}

import hashlib
import time

MB = 1 << 20


def sandbox_file_size(sb, path: str) -> int:
    return int(sb.run("stat", "-c", "%s", path).stdout)


def slow_read_of_random_bytes(sb, total: int = 20_000_000, unread_max: int = 12 * MB) -> None:
    """A reader that pauses holds the command back (it has not written everything after a 1 s pause) and
    still gets every byte, in order: the sha256 of what it read is that of what the command wrote.

    `unread_max`: what the buffers on the way may hold (SDK, sockets, daemon, pipe); TCP's grow larger."""
    p = sb.exec("sh", "-c", f"head -c {total} /dev/urandom | tee /tmp/data", text=False)
    first = p.stdout.readline()
    time.sleep(1.0)
    size = sandbox_file_size(sb, "/tmp/data")
    assert size < unread_max, f"the command wrote {size} bytes while the reader slept: nothing held it back"
    digest, n = hashlib.sha256(first), len(first)
    for chunk in p.stdout:
        digest.update(chunk)
        n += len(chunk)
        if n % (2 * MB) < len(chunk):
            time.sleep(0.05)
    assert p.wait() == 0 and n == total
    assert digest.hexdigest() == sb.run("sha256sum", "/tmp/data").stdout.split()[0]


def blocked_writer_then_kill(sb, unread_max: int = 12 * MB) -> None:
    """Output nobody reads blocks the command (flow control); wait() after kill() returns all the same."""
    p = sb.exec("sh", "-c", "head -c 60000000 /dev/zero | tee /tmp/z", text=False)
    time.sleep(1.0)
    size = sandbox_file_size(sb, "/tmp/z")
    assert size < unread_max, f"{size} bytes written with nobody reading: the output was not flow-controlled"
    assert p.poll() is None
    p.kill()
    t0 = time.monotonic()
    assert p.wait() == -9 and p.reason == "killed"
    assert time.monotonic() - t0 < 5
