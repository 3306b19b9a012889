"""With HUTCH_USERNS=1, root in a sandbox is host uid HOST_ID_BASE, never host root."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rt_support import Api, Daemon, host_state, leftovers
from test_rt_isolation import MUST_FAIL, PROBE

from hutch.sandbox._native._idmap import HOST_ID_BASE, mounts_under


@pytest.fixture(scope="module")
def userns_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("uns") / "run", env={"HUTCH_USERNS": "1"})
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()
        left = mounts_under(d.run_dir)
        assert left == [], f"layer views left mounted: {left}"


@pytest.fixture
def uapi(userns_daemon):
    a = Api(userns_daemon.sock, userns_daemon.run_dir)
    try:
        yield a
    finally:
        a.close()


def _host_uids(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(x) for x in line.split()[1:]}
    return set()


def test_sandbox_root_is_an_unprivileged_host_uid(uapi, userns_daemon, image, busybox_root):
    sid = uapi.create(image)["id"]
    out, _, _ = uapi.sh(sid, "id -u; cat /proc/self/uid_map; sleep 0.01")
    assert out.split()[:4] == ["0", "0", str(HOST_ID_BASE), "65536"]
    state = host_state(userns_daemon, sid)
    assert {u for pid in state["pids"] for u in _host_uids(pid)} == {HOST_ID_BASE}
    # the image is owned by root inside (idmapped layers), writable through the overlay
    out, err, res = uapi.sh(sid, "stat -c %u /etc/marker; echo more >> /etc/marker && cat /etc/marker")
    assert out == "0\nsandbox image\nmore\n", err
    assert (busybox_root / "etc" / "marker").read_text() == "sandbox image\n"
    r = uapi.http.put(f"/v1/sandboxes/{sid}/files/write", params={"path": "/home/user/f.txt"}, content=b"data")
    assert r.status_code == 204
    assert uapi.sh(sid, "cat /home/user/f.txt")[0] == "data"
    uapi.terminate(sid)
    assert leftovers(state) == []


def test_escape_probe_with_userns(uapi, image, py_mounts):
    sid = uapi.create(image, mounts=py_mounts)["id"]
    out, err, res = uapi.exec(sid, "/usr/bin/python3", "-S", "-c", PROBE)
    assert res["returncode"] == 0, err
    got = json.loads(out)
    assert {k: got[k] for k in MUST_FAIL if got[k] == 0} == {}


def test_binds_are_idmapped_so_root_inside_owns_what_host_root_owns(uapi, userns_daemon, image, tmp_path):
    (tmp_path / "secret").write_text("host root file")
    (tmp_path / "secret").chmod(0o600)
    ro = tmp_path / "ro"
    ro.mkdir()
    sid = uapi.create(image, mounts=[{"kind": "bind", "source": str(tmp_path), "target": "/data",
                                       "readonly": False, "size": None},
                                      {"kind": "bind", "source": str(ro), "target": "/ro",
                                       "readonly": True, "size": None}])["id"]
    out, err, res = uapi.sh(sid, "cat /data/secret; echo; stat -c %u /data/secret; echo new > /data/new; "
                                 "touch /ro/x 2>/dev/null || echo refused")
    assert out == "host root file\n0\nrefused\n", out + err
    assert not (ro / "x").exists()
    assert (tmp_path / "new").read_text() == "new\n" and (tmp_path / "new").stat().st_uid == 0
    assert [m for m in mounts_under(userns_daemon.run_dir / "layers") if "/b-" in m] == [], "bind views are dropped"
