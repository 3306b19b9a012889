"""The tenants' ownership file (state_dir()/tenant-owners.json, daemon/tenants.py Owners), which every daemon of
a state dir shares: writers in separate processes hammering it at once lose no record (a flock around each
read-modify-write, the file read again under it, an atomic rename); a file that is bad (not JSON, wrong
shapes, too large, not the daemon's private file, a symlink) is refused with an error naming it and the fix,
and left exactly as it was; a daemon with tenants refuses to start on one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hutch._core.errors import ConfigError, DaemonError
from hutch.sandbox._host.daemon import tenants as T

from rt_support import REPO

# one writer: waits for the go file, then records its images (some with a second holder, the shared one), its
# memory snapshots, and drops every third image again, each change a read-modify-write of its own
WRITER = r"""
import os, sys, time
from pathlib import Path
from hutch.sandbox._host.daemon.tenants import Owners
path, me, n, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
while not go.exists():
    time.sleep(0.001)
o = Owners(path)
for i in range(n):
    o.own("images", f"{me}-img-{i}", me)
    o.own("images", "shared", me)
    o.own("memsnaps", f"{me}-snap-{i}", me)
    if i % 3 == 0:
        assert o.disown("images", f"{me}-img-{i}", me)
print("ok")
"""


def _writers(path: Path, names: list[str], n: int, tmp: Path) -> None:
    go = tmp / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), me, str(n), str(go)], cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in names]
    try:
        time.sleep(0.5)   # every writer imported and waiting
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out == "ok\n", err[-3000:]


def test_writers_in_separate_processes_lose_no_record(tmp_path):
    path = tmp_path / "state" / "tenant-owners.json"
    names, n = ["ta", "tb", "tc"], 150
    reader = T.Owners(path)   # a daemon's view from before: it follows the file as the others change it
    assert reader.images == {} and reader.memsnaps == {}
    _writers(path, names, n, tmp_path)
    doc = json.loads(path.read_text())
    want_images = {f"{me}-img-{i}": [me] for me in names for i in range(n) if i % 3}
    got_shared = doc["images"].pop("shared")
    assert sorted(got_shared) == names
    assert doc["images"] == want_images
    assert doc["memory_snapshots"] == {f"{me}-snap-{i}": me for me in names for i in range(n)}
    assert oct(path.stat().st_mode & 0o777) == "0o600" and path.stat().st_uid == os.geteuid()
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".tmp-")]   # no temp file left
    assert len(reader.memsnaps) == len(names) * n and reader.of("images", "tb") == {
        k for k in want_images if k.startswith("tb-")} | {"shared"}
    assert reader.disown("images", "shared", "ta") is False   # tb and tc hold it still
    assert sorted(json.loads(path.read_text())["images"]["shared"]) == ["tb", "tc"]


def _bad_cases(path: Path):
    """(what, how to make the bad file, a word its error must carry)."""
    def write(data: bytes, mode=0o600):
        def make():
            path.write_bytes(data)
            os.chmod(path, mode)
        return make

    def link():
        (path.parent / "elsewhere.json").write_text('{"images": {}}')
        path.symlink_to("elsewhere.json")
    return [
        ("not JSON", write(b'{"images": {"x": ["ta"]'), "not a file of ownership records"),
        ("not UTF-8", write(b'\xff\xfe'), "not a file of ownership records"),
        ("an unknown key", write(b'{"images": {}, "owners": {}}'), "not a file of ownership records"),
        ("holders not a list", write(b'{"images": {"x": 3}}'), "not a node id and a list of tenant names"),
        ("a bad tenant name", write(b'{"memory_snapshots": {"s": "../root"}}'), "not a snapshot id and a tenant"),
        ("a snapshot's record of other keys", write(b'{"memory_snapshots": {"s": {"tenant": "ta", "path": "/"}}}'),
         "not a snapshot id and a tenant"),
        ("a snapshot's image not a name", write(b'{"memory_snapshots": {"s": {"tenant": "ta", "image": 3}}}'),
         "not a snapshot id and a tenant"),
        ("too large", write(b'{"images": {' + b" " * T.MAX_OWNERS + b'}}'), f"larger than {T.MAX_OWNERS} bytes"),
        ("deeply nested", write(b"[" * 100000 + b"]" * 100000), "not a file of ownership records"),
        ("writable by others", write(b'{"images": {}}', 0o666), "chmod 600"),
        ("a symlink", link, "cannot be read"),
    ]


def test_a_bad_file_is_refused_with_the_fix_and_left_as_it_was(tmp_path):
    path = tmp_path / "tenant-owners.json"
    for what, make, word in _bad_cases(path):
        for p in path.parent.iterdir():
            p.unlink()
        make()
        before = os.readlink(path) if path.is_symlink() else path.read_bytes()
        with pytest.raises(ConfigError) as e:   # at a daemon's start
            T.Owners(path)
        assert str(path) in str(e.value) and word in str(e.value), (what, str(e.value))
        assert "move it away" in str(e.value), what
        after = os.readlink(path) if path.is_symlink() else path.read_bytes()
        assert after == before, what


def test_a_file_that_turns_bad_keeps_the_last_good_view_and_refuses_writes(tmp_path, capfd):
    path = tmp_path / "tenant-owners.json"
    o = T.Owners(path)
    o.own("images", "img1", "ta")
    o.own("memsnaps", "snap1", "ta")
    for what, make, word in _bad_cases(path):
        for p in path.parent.iterdir():
            if p.name != "tenant-owners.json.lock":
                p.unlink()
        make()
        before = os.readlink(path) if path.is_symlink() else path.read_bytes()
        assert o.images == {"img1": ["ta"]} and o.memsnaps == {"snap1": "ta"}, what   # the last good view
        assert o.refused and word in o.refused, (what, o.refused)
        with pytest.raises(DaemonError) as e:   # a write would lose what the file holds: refused, 503
            o.own("images", "img2", "tb")
        assert str(path) in str(e.value) and word in str(e.value), what
        after = os.readlink(path) if path.is_symlink() else path.read_bytes()
        assert after == before and o.images == {"img1": ["ta"]}, what
    assert "is not a file of ownership records" in capfd.readouterr().err   # the daemon's log says so
    path.unlink()
    path.write_text(json.dumps({"images": {"img1": "ta"}}))   # the first files' form: one holder, a string
    os.chmod(path, 0o600)
    o.own("images", "img1", "tb")
    assert o.refused is None and json.loads(path.read_text()) == {"images": {"img1": ["ta", "tb"]},
                                                                  "memory_snapshots": {}}


def test_a_daemon_with_tenants_refuses_to_start_on_a_bad_file(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    bad = b'{"images": {"abc": ["ta"]}, "memory_snapshots": '
    (state / "tenant-owners.json").write_bytes(bad)
    os.chmod(state / "tenant-owners.json", 0o600)
    tf = tmp_path / "tenants.json"
    T.add(tf, "ta", T.Quotas())
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", "from hutch.sandbox._host.daemon import serve; "
                        f"serve(tenants={str(tf)!r})"], cwd=str(REPO), capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, HUTCH_STATE_DIR=str(state), HUTCH_RUN_DIR=str(run),
                                HUTCH_SOCKET=str(run / "hutch.sock")))
    assert r.returncode != 0
    assert "tenant-owners.json" in r.stderr and "not a file of ownership records" in r.stderr, r.stderr[-3000:]
    assert (state / "tenant-owners.json").read_bytes() == bad
