"""Host binds and volumes: nothing a sandbox writes through them makes a host user root.

Every bind, volume and tmpfs is nosuid and nodev inside; what root inside writes through a writable bind
lands as an unprivileged host id (the sandbox's own, or the owner the operator named), through a volume as
the one volume id every sandbox shares. Each test runs against both kinds of daemon: the default (a user
namespace per sandbox) and HUTCH_USERNS=0 (root inside is host root without capabilities).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import hutch_testing
import pytest

from rt_support import Api, Daemon

from hutch.sandbox._host.native.idmap import SANDBOX_HOST_IDS, ID_COUNT, VOLUME_ID_BASE


@pytest.fixture(scope="module", params=["userns", "host-root"])
def bdaemon(request, tmp_path_factory):
    """A daemon of each kind, with a private state dir (its volumes live there)."""
    base = tmp_path_factory.mktemp(f"binds-{request.param}")
    env = {"HUTCH_STATE_DIR": str(base / "state")}
    if request.param == "host-root":
        env["HUTCH_USERNS"] = "0"
    d = Daemon(base / "run", env=env)
    d.state_dir = base / "state"
    d.kind = request.param
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()


@pytest.fixture(params=["native", "gvisor"])
def bapi(request, bdaemon):
    if request.param == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed (scripts/setup.sh)")
    a = Api(bdaemon.sock, bdaemon.run_dir)
    a.runtime = request.param
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def shared_dir():
    """A directory every host user can reach (pytest's own are 0700): /tmp/hutch-bind-*/share, mode 1777."""
    top = Path(tempfile.mkdtemp(prefix="hutch-bind-", dir="/tmp"))
    try:
        top.chmod(0o755)
        share = top / "share"
        share.mkdir()
        share.chmod(0o1777)
        yield share
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def host_user():
    """A throwaway unprivileged host account (the second user an attack needs), removed afterwards."""
    with hutch_testing.host_user() as user:
        yield user


def _bind(source, target, readonly=False, owner=None) -> dict:
    return {"kind": "bind", "source": str(source), "target": target, "readonly": readonly, "size": None,
            "owner": owner}


def _volume(name, target, readonly=False) -> dict:
    return {"kind": "volume", "source": name, "target": target, "readonly": readonly, "size": None}


@pytest.fixture
def volume(bapi):
    name = f"binds-{os.urandom(3).hex()}"
    r = bapi.http.post("/v1/volumes", json={"name": name, "create": True})
    assert r.status_code == 200, r.text
    try:
        yield name
    finally:
        bapi.http.delete(f"/v1/volumes/{name}", params={"force": "1"})


def test_a_setuid_file_planted_through_a_writable_bind_makes_no_host_user_root(bapi, image, py_mounts,
                                                                               shared_dir, host_user):
    sid = bapi.create(image, mounts=py_mounts + [_bind(shared_dir, "/share")])["id"]
    out, err, res = bapi.sh(sid, "cp /usr/bin/id /share/id && chmod 6755 /share/id && echo planted")
    assert out == "planted\n", out + err
    if bapi.runtime == "gvisor":   # its gofer holds the file open for writing while the sandbox runs (ETXTBSY)
        bapi.terminate(sid)
    st = os.stat(shared_dir / "id")
    assert st.st_uid != 0 and st.st_gid != 0, f"the planted file is owned by {st.st_uid}:{st.st_gid} on the host"
    assert st.st_mode & 0o6000 == 0o6000   # the bits are there: they just name nobody worth becoming
    assert st.st_uid in SANDBOX_HOST_IDS and st.st_gid in SANDBOX_HOST_IDS   # an id of the sandbox's own, no host user's
    # the attack itself: another host user runs it; the setuid bit gives it that unprivileged id, never root's
    r = subprocess.run([str(shared_dir / "id"), "-u"], user=host_user.pw_uid, group=host_user.pw_gid,
                       capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "0" and int(r.stdout) in (host_user.pw_uid, st.st_uid), r.stdout


def test_host_files_in_a_writable_bind_keep_their_owners(bapi, image, shared_dir):
    """Root inside is a stranger to what host users own there: it may read it as others may, not change it."""
    (shared_dir / "hosts").write_text("host root's\n")
    (shared_dir / "hosts").chmod(0o644)
    (shared_dir / "dir").mkdir(mode=0o755)
    sid = bapi.create(image, mounts=[_bind(shared_dir, "/share")])["id"]
    out, err, _ = bapi.sh(sid, "cat /share/hosts; stat -c %u /share/hosts; "
                               "(echo pwned >> /share/hosts) 2>/dev/null && echo appended; "
                               "rm -f /share/hosts 2>/dev/null; touch /share/dir/x 2>/dev/null && echo wrote; "
                               "chmod 777 /share/dir 2>/dev/null && echo chmodded; echo mine > /share/mine && echo end")
    lines = out.split("\n")
    assert lines[0] == "host root's" and lines[1] != "0" and lines[2:] == ["end", ""], out + err
    assert (shared_dir / "hosts").read_text() == "host root's\n" and not (shared_dir / "dir" / "x").exists()
    assert oct((shared_dir / "dir").stat().st_mode & 0o777) == "0o755"
    assert (shared_dir / "mine").stat().st_uid in SANDBOX_HOST_IDS


def test_every_mount_inside_is_nosuid_and_nodev(bapi, bdaemon, image, shared_dir, volume, tmp_path):
    """(Each bind, volume and tmpfs; the root too, natively.)"""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounts = [_bind(shared_dir, "/rw"), _bind(ro, "/ro", readonly=True), _volume(volume, "/vol"),
              _volume(volume, "/volro", readonly=True),
              {"kind": "tmpfs", "target": "/t", "size": 1 << 20, "readonly": False, "source": None}]
    mounts[-1]["size"] = 4 << 20
    sid = bapi.create(image, mounts=mounts)["id"]
    out, err, _ = bapi.sh(sid, "cat /proc/self/mountinfo")
    opts = {}
    for line in out.splitlines():
        f = line.split()
        opts[f[4]] = set(f[5].split(","))   # the mount point's per-mount options
    if bapi.runtime == "gvisor" and bdaemon.kind == "userns":   # (without one, user="user" is refused)
        # gVisor shows no nosuid/nodev (runsc drops them) and has no host devices to open; what nosuid is for
        # holds for every mount, the root too: a setuid-root file does not make the sandbox's user root
        for d in ("/rw", "/vol", "/t", "/"):
            out, err, _ = bapi.sh(sid, f"mkdir -p {d}/s && cp /bin/busybox {d}/s/busybox && chmod 4755 "
                                       f"{d}/s/busybox && chmod 755 {d}/s && echo ok")
            assert out == "ok\n", (d, out, err)
            out, err, _ = bapi.sh(sid, f"{d}/s/busybox id -u", user="user")
            assert out == "1000\n", (d, out, err)
        bapi.sh(sid, "rm -rf /rw/s /vol/s")
    elif bapi.runtime != "gvisor":
        for target in ("/", "/rw", "/ro", "/vol", "/volro", "/t", "/dev/shm"):
            assert {"nosuid", "nodev"} <= opts[target], (target, opts.get(target))
    for target in ("/ro", "/volro"):
        assert "ro" in opts[target], (target, opts[target])
    for target in ("/rw", "/vol", "/t"):
        assert "rw" in opts[target], (target, opts[target])
    out, err, _ = bapi.sh(sid, "touch /volro/x 2>/dev/null && echo wrote; touch /ro/x 2>/dev/null && echo wrote; "
                               "echo end")
    assert out == "end\n", out


def test_a_volume_is_shared_between_sandboxes_as_the_volume_id(bapi, bdaemon, image, volume):
    a = bapi.create(image, mounts=[_volume(volume, "/data")])["id"]
    b = bapi.create(image, mounts=[_volume(volume, "/mnt/v")])["id"]
    out, err, _ = bapi.sh(a, "echo from-a > /data/f && mkdir /data/d && echo x > /data/d/x && chmod 600 /data/f "
                             "&& echo ok")
    assert out == "ok\n", err
    out, err, _ = bapi.sh(b, "cat /mnt/v/f; stat -c %u:%g /mnt/v/f; echo from-b > /mnt/v/f; rm /mnt/v/d/x; "
                             "echo y > /mnt/v/d/y && echo ok")
    assert out == "from-a\n0:0\nok\n", out + err
    out, err, _ = bapi.sh(a, "cat /data/f; ls /data/d")
    assert out == "from-b\ny\n", out + err
    data = bdaemon.state_dir / "volumes" / volume
    for p in (data, data / "f", data / "d", data / "d" / "y"):
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (VOLUME_ID_BASE, VOLUME_ID_BASE), (p, st.st_uid, st.st_gid)
    assert oct((bdaemon.state_dir / "volumes").stat().st_mode & 0o777) == "0o700"
    # what the host writes through the volume API is root's inside, and a sandbox may overwrite it
    r = bapi.http.put(f"/v1/volumes/{volume}/files/write", params={"path": "/sub/host.txt", "mode": "4755"},
                      content=b"from the host\n")
    assert r.status_code < 300, r.text
    st = os.stat(data / "sub" / "host.txt")
    assert (st.st_uid, st.st_mode & 0o7000) == (VOLUME_ID_BASE, 0), (st.st_uid, oct(st.st_mode))
    out, err, _ = bapi.sh(b, "cat /mnt/v/sub/host.txt; echo over > /mnt/v/sub/host.txt; cat /mnt/v/sub/host.txt")
    assert out == "from the host\nover\n", out + err


def test_a_volume_of_an_earlier_version_is_given_the_volume_ids(bapi, bdaemon, image):
    """Volumes made when sandboxes wrote them as host root: shifted once, then usable as before."""
    name = f"old-{os.urandom(3).hex()}"
    old = bdaemon.state_dir / "volumes" / name
    (old / "d").mkdir(parents=True)
    (old / "d" / "f").write_text("old\n")
    (old / "d" / "g").write_text("old\n")
    (old / "suid").write_text("#!/bin/sh\n")
    os.chmod(old / "suid", 0o4755)
    os.chown(old / "d" / "f", 1000, 1000)
    try:
        sid = bapi.create(image, mounts=[_volume(name, "/v")])["id"]
        out, err, _ = bapi.sh(sid, "stat -c %u:%g /v/d /v/d/f; echo new >> /v/d/g && cat /v/d/g")
        assert out == "0:0\n1000:1000\nold\nnew\n", out + err
        assert os.stat(old).st_uid == VOLUME_ID_BASE and os.stat(old / "d" / "f").st_uid == VOLUME_ID_BASE + 1000
        assert os.stat(old / "suid").st_mode & 0o7000 == 0
    finally:
        bapi.http.delete(f"/v1/volumes/{name}", params={"force": "1"})


def test_owner_makes_a_host_user_root_of_the_bind(bapi, image, shared_dir, host_user, py_mounts):
    uid, gid = host_user.pw_uid, host_user.pw_gid
    work = shared_dir / "work"
    work.mkdir(mode=0o755)
    (work / "theirs").write_text("theirs\n")
    (work / "roots").write_text("root's\n")
    os.chown(work, uid, gid)
    os.chown(work / "theirs", uid, gid)
    sid = bapi.create(image, mounts=[_bind(work, "/w", owner=[uid, gid])])["id"]
    out, err, _ = bapi.sh(sid, "stat -c %u:%g /w /w/theirs; stat -c %u /w/roots; echo more >> /w/theirs; "
                               "mkdir /w/sub && echo new > /w/sub/new; (echo x >> /w/roots) 2>/dev/null && echo bad; "
                               "echo end")
    lines = out.split("\n")
    assert lines[:2] == ["0:0", "0:0"] and lines[2] != "0" and lines[3:] == ["end", ""], out + err
    assert (work / "theirs").read_text() == "theirs\nmore\n" and (work / "roots").read_text() == "root's\n"
    for p in (work / "sub", work / "sub" / "new"):
        assert (p.stat().st_uid, p.stat().st_gid) == (uid, gid), p
    # owner="root": what the sandbox writes is host root's, because the operator said so
    rootdir = shared_dir / "rootdir"
    rootdir.mkdir(mode=0o755)
    sid = bapi.create(image, mounts=[_bind(rootdir, "/r", owner=[0, 0])])["id"]
    out, err, _ = bapi.sh(sid, "echo r > /r/f && stat -c %u /r/f")
    assert out == "0\n", err
    assert (rootdir / "f").stat().st_uid == 0


def test_owner_is_validated(bapi, image, shared_dir, tmp_path):
    import hutch

    for bad in ("nobody", -1, True, (1, 2, 3), 2**32):
        with pytest.raises(hutch.ConfigError, match="owner="):
            hutch.Mount.bind(shared_dir, "/s", readonly=False, owner=bad)
    with pytest.raises(hutch.ConfigError, match="readonly=False"):
        hutch.Mount.bind(shared_dir, "/s", owner=1000)
    assert hutch.Mount.bind(shared_dir, "/s", readonly=False, owner="root").owner == (0, 0)
    assert hutch.Mount.bind(shared_dir, "/s", readonly=False, owner=1000).owner == (1000, 1000)
    assert hutch.Mount.bind(shared_dir, "/s", readonly=False, owner=(1000, 100)).owner == (1000, 100)
    for owner, readonly in (([VOLUME_ID_BASE, 0], False), ([SANDBOX_HOST_IDS.stop - 1, 5], False), ([1000, 1000], True),
                            (["x", 1], False), ([1], False)):
        code, body = bapi.create_error(image, mounts=[_bind(shared_dir, "/s", readonly=readonly, owner=owner)])
        assert code == 400 and body["error"] == "InvalidSpecError", (owner, body)
        assert "owner" in body["message"], body
    assert ID_COUNT == 65536


def test_swap_maps_map_every_id_once_each_way():
    """The helper namespaces' maps (pure): a and b swapped, every other id itself, no id twice either side."""
    from hutch.sandbox._host.native.plan import MAX_ID, swap_map

    for a, b, n in ((VOLUME_ID_BASE, 1_000_000_000, ID_COUNT), (1000, 1_000_065_536, 1), (0, 1_000_000_000, 1),
                    (1_000_000_000, 0, ID_COUNT), (7, 7, 1)):
        lines = [tuple(map(int, ln.split())) for ln in swap_map(a, b, n).splitlines()]
        assert len(lines) <= 5
        for side in (0, 1):
            spans = sorted((ln[side], ln[side] + ln[2]) for ln in lines)
            assert spans[0][0] == 0 and spans[-1][1] == MAX_ID + 1
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), spans
        def to(i):
            return next(o + i - s for s, o, c in lines if s <= i < s + c)
        other = next(i for i in (12345, 500_000_000, MAX_ID) if not (a <= i < a + n or b <= i < b + n))
        assert to(a) == b and to(a + n - 1) == b + n - 1 and to(b) == a and to(other) == other
