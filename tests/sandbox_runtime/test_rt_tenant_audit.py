"""The audit log of `hutch serve --audit-log` (daemon/tenants.py AuditLog) is a file no tenant can write: it
is refused in a directory others may write, inside the volumes (which sandboxes write), at a symlink or at a
file that is not root's; it is root's 0600 however it was found; its records are JSON lines whose fields
(the ids a caller chose among them) cannot break a line; it rotates by size keeping `keep` old files."""

from __future__ import annotations

import json
import os

import pytest

from hutch._core.errors import ConfigError
from hutch.sandbox._host.daemon.tenants import AuditLog


@pytest.fixture
def state(tmp_path, monkeypatch):
    s = tmp_path / "state"
    s.mkdir(mode=0o700)
    monkeypatch.setenv("HUTCH_STATE_DIR", str(s))
    return s


def test_a_log_others_could_write_is_refused(tmp_path, state):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="may be written by others than root"):
        AuditLog(shared / "audit.jsonl")
    assert not (shared / "audit.jsonl").exists()

    vol = state / "volumes" / "v1"
    vol.mkdir(parents=True, mode=0o700)
    with pytest.raises(ConfigError, match="inside the volumes"):
        AuditLog(vol / "audit.jsonl")
    with pytest.raises(ConfigError, match="inside the volumes"):
        AuditLog(state / "volumes" / ".stores" / "acme" / "audit.jsonl")
    assert not (vol / "audit.jsonl").exists()

    logs = tmp_path / "log"
    logs.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (logs / "audit.jsonl").symlink_to(target)
    with pytest.raises(ConfigError, match="not a symlink"):   # never followed: the file it names is not touched
        AuditLog(logs / "audit.jsonl")
    assert target.read_text() == "keep\n"
    (logs / "audit.jsonl").unlink()

    (logs / "audit.jsonl").write_text("")
    os.chown(logs / "audit.jsonl", 1000, 1000)
    with pytest.raises(ConfigError, match="not a regular file of root's"):
        AuditLog(logs / "audit.jsonl")


def test_records_are_root_s_0600_json_lines_that_fields_cannot_break(tmp_path, state):
    logs = tmp_path / "log"
    logs.mkdir(mode=0o700)
    p = logs / "audit.jsonl"
    p.write_text("")
    os.chmod(p, 0o644)   # found readable by others: made private
    log = AuditLog(p)
    try:
        assert p.stat().st_mode & 0o777 == 0o600 and p.stat().st_uid == 0
        forged = 'x"}\n{"time": 1, "tenant": null, "action": "DELETE /v1/images/{key}", "id": "y", "outcome": "ok'
        log.write("acme", "POST /v1/sandboxes/{id}/terminate", forged, "404 NotFoundError")
        log.write("acme", "POST /nope\n{}", "\u2028\x00", "404 NotFoundError")
    finally:
        log.close()
    lines = p.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 3
    recs = [json.loads(x) for x in lines[:-1]]
    assert [r["tenant"] for r in recs] == ["acme", "acme"] and recs[0]["id"] == forged


def test_rotation_keeps_keep_old_files(tmp_path, state):
    logs = tmp_path / "log"
    logs.mkdir(mode=0o700)
    p = logs / "audit.jsonl"
    log = AuditLog(p, max_bytes=1000, keep=2)
    try:
        for i in range(100):
            log.write("acme", "POST /v1/sandboxes", f"{i:012d}", "ok")
    finally:
        log.close()
    old1, old2 = p.with_name("audit.jsonl.1"), p.with_name("audit.jsonl.2")
    assert old1.exists() and old2.exists() and not p.with_name("audit.jsonl.3").exists()
    ids = [json.loads(x)["id"] for f in (old2, old1, p) for x in f.read_text().splitlines()]
    assert ids == [f"{i:012d}" for i in range(100 - len(ids), 100)]   # the newest, in order, none torn
    for f in (old2, old1, p):
        assert f.stat().st_size <= 1000 and f.stat().st_mode & 0o777 == 0o600
