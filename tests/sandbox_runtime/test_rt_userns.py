"""User namespaces (the default): root in a sandbox is uid 0 inside and an unprivileged host uid of a range
of its own outside; HUTCH_USERNS=0 opts out."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from rt_support import Api, Daemon, host_state, leftovers, private_state_daemon
from test_rt_isolation import MUST_FAIL, PROBE

from hutch.sandbox._host.native.idmap import HOST_ID_BASE, ID_COUNT, RANGE_LOCK, mounts_under


@pytest.fixture(scope="module")
def state_daemon(tmp_path_factory):
    """A daemon with the default settings and a private state dir (snapshots land there)."""
    if os.environ.get("HUTCH_USERNS") == "0":
        pytest.skip("HUTCH_USERNS=0: this run opted out of user namespaces")
    with private_state_daemon(tmp_path_factory.mktemp("uns")) as d:
        yield d
    left = mounts_under(d.run_dir)
    assert left == [], f"mounts left under the run dir: {left}"


@pytest.fixture
def uapi(state_daemon):
    a = Api(state_daemon.sock, state_daemon.run_dir)
    try:
        yield a
    finally:
        a.close()


def _host_ids(pid: int) -> tuple[set[int], set[int]]:
    uids = gids = set()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:]}
        elif line.startswith("Gid:"):
            gids = {int(x) for x in line.split()[1:]}
    return uids, gids


def _init_pid(state: dict) -> int:
    """The host pid of the sandbox's pid 1."""
    for pid in state["pids"]:
        nspid = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("NSpid:")]
        if nspid and nspid[0].split()[-1] == "1":
            return pid
    raise AssertionError(f"no init among {state['pids']}")


def _base(api: Api, sid: str) -> int:
    """The host id of the sandbox's root, from its uid_map, checked to be a range of the layout."""
    out, _, _ = api.sh(sid, "id -u; cat /proc/self/uid_map /proc/self/gid_map")
    f = out.split()
    assert f[0] == "0" and f[1:4] == f[4:7] and f[1] == "0" and f[3] == str(ID_COUNT), out
    base = int(f[2])
    assert base >= HOST_ID_BASE and (base - HOST_ID_BASE) % ID_COUNT == 0, out
    return base


def _range_free(base: int) -> bool:
    """Whether no daemon holds range `base` (probed by taking and dropping its lock byte)."""
    k = (base - HOST_ID_BASE) // ID_COUNT
    fd = os.open(RANGE_LOCK, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, k)
    except OSError:
        return False
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, k)
        return True
    finally:
        os.close(fd)


def test_default_root_is_uid_0_inside_and_unprivileged_on_the_host(uapi, state_daemon, image, busybox_root):
    sid = uapi.create(image)["id"]
    base = _base(uapi, sid)
    state = host_state(state_daemon, sid)
    # real and effective: the sandbox's root; saved: its user (uid 1000 inside), for exec(user="user")
    assert _host_ids(_init_pid(state)) == ({base, base + 1000}, {base, base + 1000})
    uapi.sh(sid, "sleep 0.01")
    for pid in state["pids"]:
        ids = _host_ids(pid)
        assert ids[0] and all(base <= i < base + ID_COUNT for i in ids[0] | ids[1]), (pid, ids)
    # the image is owned by root inside (idmapped layers), writable through the overlay
    out, err, res = uapi.sh(sid, "stat -c %u:%g /etc/marker; echo more >> /etc/marker && cat /etc/marker")
    assert out == "0:0\nsandbox image\nmore\n", err
    assert (busybox_root / "etc" / "marker").read_text() == "sandbox image\n"
    r = uapi.http.put(f"/v1/sandboxes/{sid}/files/write", params={"path": "/home/user/f.txt"}, content=b"data")
    assert r.status_code == 204
    assert uapi.sh(sid, "cat /home/user/f.txt; stat -c %u /home/user/f.txt")[0] == "data0\n"
    # an image directory removed and made again (overlay's opaque marker, user.overlay.* in a user namespace)
    out, err, _ = uapi.sh(sid, "rm -rf /root && mkdir -p /root/x && ls /root")
    assert out == "x\n", err
    uapi.terminate(sid)
    assert leftovers(state) == []


def _signal_as(uid: int, pid: int) -> int:
    """kill(pid, 0) from a host process running as `uid` (as a process that escaped a sandbox would):
    0 if allowed, else the errno."""
    child = os.fork()
    if child == 0:
        code = 100
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(pid, 0)
            code = 0
        except OSError as e:
            code = e.errno
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def test_each_sandbox_has_its_own_range_given_back_at_the_end(uapi, state_daemon, image):
    a, b = uapi.create(image)["id"], uapi.create(image)["id"]
    ba, bb = _base(uapi, a), _base(uapi, b)
    assert ba != bb   # an escaped process of one is not the same host user as the other's
    init_a, init_b = _init_pid(host_state(state_daemon, a)), _init_pid(host_state(state_daemon, b))
    assert _signal_as(ba, init_a) == 0               # the check itself works: its own processes, yes
    assert _signal_as(ba, init_b) == errno.EPERM     # another sandbox's, no
    assert _signal_as(bb, init_a) == errno.EPERM
    assert not _range_free(ba) and not _range_free(bb)
    uapi.terminate(a)
    assert _range_free(ba)
    assert not _range_free(bb)
    uapi.terminate(b)
    assert _range_free(bb)


def test_escape_probe_with_userns(uapi, image, py_mounts):
    sid = uapi.create(image, mounts=py_mounts)["id"]
    out, err, res = uapi.exec(sid, "/usr/bin/python3", "-S", "-c", PROBE)
    assert res["returncode"] == 0, err
    got = json.loads(out)
    assert {k: got[k] for k in MUST_FAIL if got[k] == 0} == {}


def test_read_only_binds_are_idmapped_and_writable_ones_write_as_the_sandbox(uapi, state_daemon, image, tmp_path):
    """Through a read-only bind root inside owns what host root owns; through a writable one it is its own host
    uid (test_rt_binds.py goes after what that means for a setuid file)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "secret").write_text("host root file")
    (ro / "secret").chmod(0o600)
    rw = tmp_path / "rw"
    rw.mkdir(mode=0o777)
    rw.chmod(0o777)
    sid = uapi.create(image, mounts=[{"kind": "bind", "source": str(rw), "target": "/data",
                                       "readonly": False, "size": None},
                                      {"kind": "bind", "source": str(ro), "target": "/ro",
                                       "readonly": True, "size": None}])["id"]
    out, err, res = uapi.sh(sid, "cat /ro/secret; echo; stat -c %u /ro/secret; echo new > /data/new; "
                                 "stat -c %u /data/new; stat -c %u /data; touch /ro/x 2>/dev/null || echo refused")
    assert out == "host root file\n0\n0\n65534\nrefused\n", out + err
    assert not (ro / "x").exists()
    assert (rw / "new").read_text() == "new\n" and (rw / "new").stat().st_uid == _base(uapi, sid)
    assert mounts_under(state_daemon.run_dir) == [], "nothing per sandbox is mounted on the host"


def test_a_file_of_sandbox_root_is_host_root_owned_in_a_snapshot_layer(uapi, state_daemon, image):
    # as a build step runs (apt and dpkg chown): capabilities kept inside its user namespace only
    sid = uapi.create(image, workdir="/", capabilities=["CHOWN", "DAC_OVERRIDE", "FOWNER"])["id"]
    out, err, _ = uapi.sh(sid, "mkdir -p /made && echo hi > /made/f && echo u > /made/u && "
                               "chown 1000:1001 /made/u && rm -rf /home && mkdir /home && echo done")
    assert out == "done\n", err
    base = _base(uapi, sid)
    r = uapi.http.post(f"/v1/sandboxes/{sid}/snapshot", json={})
    assert r.status_code == 201, r.text
    node = r.json()
    fs = state_daemon.state_dir / "layers" / node["layer"] / "fs"
    st = (fs / "made" / "f").stat()
    assert (st.st_uid, st.st_gid) == (0, 0), f"host ids {st.st_uid}:{st.st_gid}, sandbox root was {base}"
    assert (fs / "made").stat().st_uid == 0
    assert ((fs / "made" / "u").stat().st_uid, (fs / "made" / "u").stat().st_gid) == (1000, 1001)
    assert os.getxattr(fs / "home", "user.overlay.opaque") == b"y"
    assert os.getxattr(fs / "home", "trusted.overlay.opaque") == b"y"
    # the next sandbox sees root's file as root's, and the re-made directory empty
    sid2 = uapi.create(node["ref"], workdir="/")["id"]
    out, err, _ = uapi.sh(sid2, "stat -c %u:%g /made/f; cat /made/f; ls -A /home | wc -l")
    assert out == "0:0\nhi\n0\n", err


def test_a_crashed_daemon_frees_its_ranges(tmp_path, image):
    d = Daemon(tmp_path / "run", env={"HUTCH_USERNS": "1"})
    d.start()
    api = Api(d.sock, d.run_dir)
    try:
        sid = api.create(image)["id"]
        base = _base(api, sid)
        assert not _range_free(base)
        d.kill9()
        deadline = time.monotonic() + 2
        while not _range_free(base) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _range_free(base)
    finally:
        api.http.close()
        d.start()   # the next daemon reaps what the crashed one left
        d.stop()
        d.cleanup_cgroups()


def test_opt_out_runs_root_as_host_root_without_capabilities(tmp_path, image):
    d = Daemon(tmp_path / "run", env={"HUTCH_USERNS": "0"})
    d.start()
    api = Api(d.sock, d.run_dir)
    try:
        sid = api.create(image)["id"]
        out, _, _ = api.sh(sid, "cat /proc/self/uid_map; grep CapEff /proc/self/status")
        assert out.split()[:3] == ["0", "0", "4294967295"] and out.split()[-1] == "0000000000000000"
        assert _host_ids(_init_pid(host_state(d, sid)))[0] == {0}   # no host uid 1000 kept: refused instead
        r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["id"], "user": "user"})
        assert r.status_code == 400 and "host's uid 1000" in r.text, r.text
    finally:
        api.close()
        d.stop()
        d.cleanup_cgroups()


NO_USERNS = Path(__file__).with_name("no_userns.py")


def test_a_kernel_that_refuses_user_namespaces_means_the_fallback_with_a_warning(tmp_path, image):
    """As in a chroot, with user.max_user_namespaces=0 or under a container runtime's seccomp profile: the
    daemon starts, says in its log and in `hutch doctor` that it runs without a user namespace and why, and
    its sandboxes run as with HUTCH_USERNS=0. (A seccomp filter on the test daemon alone: no sysctl changes.)"""
    import sys

    from click.testing import CliRunner

    from hutch.cli import cli

    d = Daemon(tmp_path / "run", prefix=(sys.executable, str(NO_USERNS)))
    d.start()
    api = Api(d.sock, d.run_dir)
    try:
        log = d.log.read_text()
        assert "mode: no user namespace (the kernel refused a new user namespace:" in log, log
        assert "Operation not permitted" in log and "Traceback" not in log, log
        doc = api.http.get("/v1/doctor").json()
        assert doc["userns"] is False and "refused a new user namespace" in doc["userns_why_not"], doc
        assert doc["idmap"] is None and doc["cgroup"]["parent"] == d.cgroup_parent
        r = CliRunner().invoke(cli, ["doctor"], env={"HUTCH_SOCKET": str(d.sock), "HUTCH_RUN_DIR": str(d.run_dir),
                                                     "HUTCH_URL": None, "HUTCH_TOKEN": None})
        assert r.exit_code == 0, r.output
        assert "mode:       no user namespace (the kernel refused" in r.output and "userns:     no:" in r.output, r.output
        sid = api.create(image)["id"]
        out, _, _ = api.sh(sid, "id -u; cat /proc/self/uid_map; grep CapEff /proc/self/status")
        assert out.split()[:4] == ["0", "0", "0", "4294967295"] and out.split()[-1] == "0000000000000000", out
        st = host_state(d, sid)
        api.terminate(sid)
        assert leftovers(st) == []
    finally:
        api.close()
        d.stop()
        d.cleanup_cgroups()


def test_the_probe_says_why_and_never_dies_when_unshare_is_refused(tmp_path):
    """The helper child exits at once when unshare fails; the parent used to write to its closed pipe
    (BrokenPipeError at daemon start, about every other time). Many probes under the filter: none raises."""
    import subprocess
    import sys

    code = ("import sys, pathlib; from hutch.sandbox._host.native.idmap import IdMapper\n"
            "for _ in range(100):\n"
            "    m = IdMapper(pathlib.Path(sys.argv[1]))\n"
            "    assert m.start() is False and m.userns_fd == -1\n"
            "print(m.why)\n")
    r = subprocess.run([sys.executable, str(NO_USERNS), sys.executable, "-c", code, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "the kernel refused a new user namespace: [Errno 1] unshare: Operation not permitted"


def test_the_default_mode_is_reported(uapi, state_daemon):
    doc = uapi.http.get("/v1/doctor").json()
    assert doc["userns"] is True and doc["userns_why_not"] is None and doc["idmap"] is True, doc
    assert doc["mode"].startswith("user namespaces") and doc["cgroup"]["version"] in (1, 2)
    assert "hutch daemon: mode: user namespaces" in state_daemon.log.read_text()
