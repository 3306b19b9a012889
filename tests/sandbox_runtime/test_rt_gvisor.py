"""runtime="gvisor": the same API on runsc (exec, streams, files, limits, endings), and nothing left after."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from rt_support import split_frames

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")


def gv(api, image, **spec):
    return api.create(image, runtime="gvisor", **spec)


def _leftovers(daemon, sid) -> list[str]:
    left = [f"cgroup {d}" for d in daemon.cgroup_dirs(sid) if d.exists()]
    left += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/{daemon.cgroup_parent}/{sid}")]
    left += [f"mount {ln.split()[4]}" for ln in Path("/proc/self/mountinfo").read_text().splitlines()
             if f"/{sid}/" in ln.split()[4] + "/"]
    gvdir = daemon.run_dir / "gvisor"
    left += [f"file {p}" for p in gvdir.rglob(f"*{sid}*")] if gvdir.exists() else []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if f"/{daemon.cgroup_parent}/{sid}" in Path(f"/proc/{pid}/cgroup").read_text():
                    left.append(f"process {pid}")
            except OSError:
                pass
    return left


def test_exec_streams_exit_codes_and_files(api, daemon, image):
    sid = gv(api, image)["id"]
    out, err, res = api.sh(sid, "echo out; echo err >&2; exit 7")
    assert (out, err, res["returncode"], res["reason"]) == ("out\n", "err\n", 7, "exited")
    out, _, _ = api.sh(sid, "cat /proc/version")
    assert "gVisor" in out or "4.4.0" in out, out   # gVisor's own kernel, not the host's
    base = f"/v1/sandboxes/{sid}/files"
    data = bytes(range(256)) * 1024
    assert api.http.put(f"{base}/write", params={"path": "/home/user/f.bin"}, content=data).status_code == 204
    assert api.http.get(f"{base}/read", params={"path": "/home/user/f.bin"}).content == data
    out, _, _ = api.sh(sid, "wc -c < /home/user/f.bin; ls -ln /home/user/f.bin")
    assert out.split()[0] == str(len(data)) and " 0 " in out   # owned by root inside
    api.sh(sid, "echo inside > /home/user/g")
    assert api.http.get(f"{base}/read", params={"path": "/home/user/g"}).content == b"inside\n"
    r = api.http.get(f"{base}/read", params={"path": "/../../../etc/shadow"})
    assert r.status_code == 200 and b"sandbox-shadow" in r.content   # the sandbox's /etc/shadow, not the host's
    api.terminate(sid)
    assert _leftovers(daemon, sid) == []


def test_tmp_is_the_roots_so_the_files_api_and_disk_see_it(api, image):
    """runsc mounts a tmpfs of its own at /tmp unless told otherwise: what landed there was invisible to the
    files API, the disk= limit and filesystem snapshots."""
    sid = gv(api, image, limits={"disk": 8 * 1024**2})["id"]
    out, err, _ = api.sh(sid, "echo hi > /tmp/f && stat -c %a /tmp && echo ok")
    assert out == "1777\nok\n", err
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/tmp/f"})
    assert r.status_code == 200 and r.content == b"hi\n", r.text
    out, err, _ = api.sh(sid, "dd if=/dev/zero of=/tmp/big bs=1M count=16 2>&1; echo rc=$?")
    assert "No space left" in out and "rc=1" in out, out


def test_an_exec_timeout_kills_the_command_inside(api, image):
    sid = gv(api, image)["id"]
    t0 = time.monotonic()
    out, _, res = api.exec(sid, "sh", "-c", "echo started; sleep 30", timeout=1)
    # the time: a hang guard, well before the sleep's own end at 30 s
    assert res["reason"] == "timeout" and out == b"started\n" and time.monotonic() - t0 < 25, res
    out, _, _ = api.sh(sid, "ps -o comm | grep -c sleep || true")
    assert out.strip() == "0", "the timed-out command still runs inside"


def test_pid_1_reaps_the_orphans_commands_leave(api, image):
    """An exec's background process outlives its shell and is reparented to pid 1, which must wait for it (a
    bare `sleep` as pid 1 left every such orphan a zombie for the sandbox's life)."""
    sid = gv(api, image)["id"]
    for _ in range(3):
        out, err, res = api.sh(sid, "sleep 0.3 </dev/null >/dev/null 2>&1 & echo $!")
        assert res["returncode"] == 0, err
    orphan = out.strip()
    out, _, _ = api.sh(sid, f"cat /proc/{orphan}/stat 2>/dev/null | cut -d' ' -f4")
    assert out.strip() in ("1", ""), out   # reparented to pid 1 (or already gone)
    deadline = time.monotonic() + 20   # a hang guard: each orphan ends after 0.3 s
    while True:
        out, _, _ = api.sh(sid, "ps -o stat,pid,args | grep -v grep | grep -c '^Z' || true")
        if out.strip() == "0":
            break
        assert time.monotonic() < deadline, api.sh(sid, "ps -o stat,pid,ppid,args")[0]
        time.sleep(0.2)


def test_the_files_api_refuses_what_the_sentry_serves(api, image):
    """/dev, /proc, /sys and a tmpfs mount of a gVisor sandbox are its kernel's, not in its root on the host:
    a file call there is a ConfigError (400) as a native sandbox's on a device or /proc file, directly or
    through a link, and never reads or writes the directory hidden below (a command sees what it wrote)."""
    sid = gv(api, image, mounts=[{"kind": "tmpfs", "target": "/scratch", "size": 4 * 1024**2}])["id"]
    out, err, res = api.sh(sid, "echo mine > /scratch/f && echo shm > /dev/shm/f && ln -s /dev/zero /home/user/z "
                                "&& ln -s ../../scratch /home/user/s")
    assert res["returncode"] == 0, err
    base = f"/v1/sandboxes/{sid}/files"
    for path in ("/dev/zero", "/dev/shm/f", "/proc/1/status", "/sys/kernel", "/scratch/f", "/home/user/z",
                 "/home/user/s/f", "/dev"):
        for method, op in (("get", "read"), ("get", "list"), ("put", "write"), ("post", "mkdir")):
            if path == "/home/user/z" and op in ("write", "mkdir"):
                continue   # a write replaces the link itself (natively too), a mkdir finds it there
            r = getattr(api.http, method)(f"{base}/{op}", params={"path": path}, **({"content": b"x"} if
                                                                                     method == "put" else {}))
            assert r.status_code == 400 and r.json()["error"] == "ConfigError", (path, op, r.text)
    r = api.http.get(f"{base}/stat", params={"path": "/home/user/z"})   # the link itself is the root's
    assert r.status_code == 200 and r.json()["type"] == "symlink", r.text
    out, _, _ = api.sh(sid, "cat /scratch/f /dev/shm/f; ls /scratch")
    assert out == "mine\nshm\nf\n", out


def test_an_exec_program_is_looked_up_inside_the_root(api, image):
    """Before runsc exec starts it, an exec's program and workdir are looked up in the sandbox's root (the
    native 404 naming what is missing); a link resolves inside the root, never to the host's file of that path
    (the host has /usr/bin/python3, the image does not); what is under a sentry's directory is runsc's to find."""
    assert os.path.exists("/usr/bin/python3")
    sid = gv(api, image)["id"]
    out, err, res = api.sh(sid, "ln -s /usr/bin/python3 /home/user/py && ln -s ../../../../../../usr/bin/python3 /home/user/e"
                                " && printf '#!/bin/sh\\necho linked\\n' > /home/user/hi.sh && chmod +x /home/user/hi.sh"
                                " && ln -s /home/user/hi.sh /home/user/hi && printf '#!/bin/sh\\necho shm-ran\\n' > /dev/shm/x "
                                "&& chmod +x /dev/shm/x")
    assert res["returncode"] == 0, err
    for argv, env in ((["/home/user/py", "-c", "1"], {}), (["/home/user/e"], {}), (["py"], {"PATH": "/home/user"}),
                      (["no-such-program"], {})):
        r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": argv, "env": env})
        assert r.status_code == 404 and r.json()["error"] == "NotFoundError", (argv, r.text)
        assert repr(argv[0]) in r.json()["message"] and "not found" in r.json()["message"], r.text
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"], "workdir": "/home/user/py"})
    assert r.status_code == 404 and "working directory" in r.json()["message"], r.text
    assert api.exec(sid, "/home/user/hi")[0] == b"linked\n"
    assert api.exec(sid, "hi", env={"PATH": "/nowhere:/home/user"})[0] == b"linked\n"
    assert api.exec(sid, "/dev/shm/x")[0] == b"shm-ran\n"


def test_command_exit_ends_the_sandbox_with_its_code(api, daemon, image):
    sid = gv(api, image, command=["sh", "-c", "exit 3"])["id"]
    info = api.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": 20}).json()   # answers once it is gone
    assert (info["status"], info["returncode"]) == ("exited", 3), info
    assert _leftovers(daemon, sid) == []


def test_a_program_the_image_lacks_is_the_callers_error_and_leaves_nothing(api, daemon, image):
    """runsc refuses to start a program it cannot find: a 400 ConfigError naming the fix (the fuzzer met a 500
    with command [""]), and the sandbox it began is gone."""
    before = {p.name for p in (daemon.run_dir / "gvisor").iterdir()} if (daemon.run_dir / "gvisor").exists() else set()
    for command in (["no-such-program"], [""]):
        code, body = api.create_error(image, runtime="gvisor", command=command, timeout=60)
        assert (code, body["error"]) == (400, "ConfigError"), body
        assert "is not in its image" in body["message"], body
    listed = api.http.get("/v1/sandboxes").json()
    assert not [s for s in listed.get("sandboxes", listed) if isinstance(s, dict) and s.get("status") == "running"
                and s.get("spec", {}).get("command") in (["no-such-program"], [""])]
    after = {p.name for p in (daemon.run_dir / "gvisor").iterdir()} if (daemon.run_dir / "gvisor").exists() else set()
    assert after <= before, sorted(after - before)


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids |= {int(k) for k in (task / "children").read_text().split()}
        except OSError:
            pass
    return kids


def test_a_command_whose_sentry_dies_ends_with_the_sandbox(api, daemon, image):
    """The host's OOM killer may take a sandbox's sentry (here: SIGKILL, as it sends): the command running
    in it ends with the sandbox (sandbox_ended, the sandbox no longer running), not with runsc exec's own error
    (exit 128 or 255) as if the command had exited. The keeper, which reaps the sentry and tells the daemon,
    is held stopped until runsc exec has exited: the order in which the exhaustion test failed under load."""
    sid = gv(api, image)["id"]
    sentry = int((Path("/run/hutch-gvisor") / daemon.cgroup_parent / sid / "pid").read_text())
    keeper = int(Path(f"/proc/{sentry}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])   # its reaper
    assert keeper not in (1, daemon.proc.pid), keeper
    with api.http.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", "echo up; sleep 60"]}) as r:
        buf, chunks = b"", r.iter_bytes()
        while len(buf) < 5 or len(buf) < 5 + int.from_bytes(buf[1:5], "big"):   # "up": the command runs
            buf += next(chunks)
        execs = [p for p in _children(daemon.proc.pid)
                 if b"--internal-pid-file" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(execs) == 1, execs   # its runsc exec
        os.kill(keeper, signal.SIGSTOP)
        try:
            os.kill(sentry, signal.SIGKILL)
            deadline = time.monotonic() + 60   # a hang guard
            while Path(f"/proc/{execs[0]}").exists() and time.monotonic() < deadline:   # until the daemon reaped it
                time.sleep(0.02)
            time.sleep(0.5)   # and acted on it (the command's end was reported here, as an exit of 128)
        finally:
            os.kill(keeper, signal.SIGCONT)
        buf += b"".join(chunks)
    out, _, res = split_frames(buf)
    assert out == b"up\n" and (res["returncode"], res["reason"]) == (-9, "sandbox_ended"), (out, res)
    assert api.info(sid)["status"] in ("failed", "oom"), api.info(sid)


def test_sentry_ending_tells_a_live_sentry_from_an_ended_one():
    """What the exec's end asks (runtime.sentry_ending), on a real process standing in for a sentry."""
    from hutch.sandbox._host.gvisor.runtime import GvSandbox, sentry_ending

    proc = subprocess.Popen(["sleep", "60"])
    fd = os.pidfd_open(proc.pid)
    try:
        stand_in = GvSandbox("x", Path("/nonexistent"), False, sentry_pid=proc.pid, sentry_fd=fd)
        assert not sentry_ending(stand_in)
        assert not sentry_ending(GvSandbox("y", Path("/nonexistent"), False))   # not started yet
        proc.kill()
        assert select.select([fd], [], [], 30)[0]
        assert sentry_ending(stand_in)   # exited, not reaped yet
        proc.wait()
        assert sentry_ending(stand_in)   # reaped: its pid may be another's by now
        stand_in.sentry_fd = -1
        assert sentry_ending(stand_in)   # torn down
    finally:
        proc.kill()
        proc.wait()
        os.close(fd)


def test_memory_limit_is_gvisors_total_memory(api, image):
    sid = gv(api, image, limits={"memory": 128 * 1024**2})["id"]
    out, _, _ = api.sh(sid, "head -1 /proc/meminfo")
    assert int(out.split()[1]) <= 128 * 1024, out


def test_pause_resume_and_terminate_leave_nothing(api, daemon, image):
    sid = gv(api, image, command=["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /n; sleep 0.01; done"])["id"]
    time.sleep(0.5)
    assert api.http.post(f"/v1/sandboxes/{sid}/pause").json()["status"] == "paused"
    upper = Path("/run/hutch-gvisor") / daemon.cgroup_parent / sid / "disk" / "upper" / "n"
    a = upper.read_text()
    time.sleep(0.3)
    assert upper.read_text() == a, "the counter moved while paused"
    assert api.http.post(f"/v1/sandboxes/{sid}/resume").json()["status"] == "running"
    time.sleep(0.3)
    assert upper.read_text() != a
    api.http.post(f"/v1/sandboxes/{sid}/pause")
    api.terminate(sid)
    assert _leftovers(daemon, sid) == []


def test_a_bind_target_through_a_symlink_of_the_image_is_refused(api, daemon, tmp_path):
    """The daemon makes a bind's mount point inside the sandbox's root on the host: a symlink of the image on
    the way would resolve on the host (here: make /etc/hutch-evil-<n>), so it is refused, and nothing is left."""
    root = tmp_path / "root"
    root.mkdir()
    name = f"hutch-evil-{os.getpid()}"
    (root / "evil").symlink_to("/etc")
    (root / "afile").write_text("x")
    src = tmp_path / "src"
    src.mkdir()
    for target in (f"/evil/{name}", f"/afile/{name}"):
        code, body = api.create_error(f"dir:{root}", runtime="gvisor",
                                      mounts=[{"kind": "bind", "source": str(src), "target": target, "readonly": True}])
        assert code == 400 and body["error"] == "InvalidSpecError" and "symlink" in body["message"], body
    assert not os.path.exists(f"/etc/{name}")
    dirs = Path("/run/hutch-gvisor") / daemon.cgroup_parent   # each gVisor sandbox's directory (runtime.Runsc)
    left = [p.name for p in dirs.iterdir()] if dirs.exists() else []
    assert not [sid for sid in left if sid not in {s["id"] for s in api.http.get("/v1/sandboxes").json()["sandboxes"]}]


def test_doctor_reports_the_gvisor_runtime(api, daemon):
    from click.testing import CliRunner

    from hutch.cli import cli

    doc = api.http.get("/v1/doctor").json()
    assert doc["gvisor"]["available"] is True and "20240729" in doc["gvisor"]["version"], doc["gvisor"]
    assert doc["freezer"] is True
    r = CliRunner().invoke(cli, ["doctor"], env={"HUTCH_SOCKET": str(daemon.sock), "HUTCH_RUN_DIR": str(daemon.run_dir),
                                                 "HUTCH_URL": None, "HUTCH_TOKEN": None})
    assert r.exit_code == 0 and "gvisor:     available (runsc version 0.0~20240729" in r.output, r.output


def test_an_old_or_missing_runsc_is_named_with_the_fix(monkeypatch, tmp_path):
    from hutch.sandbox._host.gvisor import runsc

    fake = tmp_path / "runsc"
    fake.write_text("#!/bin/sh\necho 'runsc version 0.0~20221219.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    runsc.probe.cache_clear()
    try:
        p = runsc.probe()
        assert not p.ok and "too old" in p.why and "scripts/setup.sh" in p.why, p
        monkeypatch.setenv("PATH", str(tmp_path / "none"))
        runsc.probe.cache_clear()
        p = runsc.probe()
        assert not p.ok and "not installed" in p.why and "scripts/setup.sh" in p.why
    finally:
        runsc.probe.cache_clear()


def _keepers_of(pid: int) -> list[int]:
    """The gVisor keepers (spare or a sandbox's) the daemon `pid` started."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                st = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                if int(st[1]) == pid and b"gvisor.keeper" in Path(f"/proc/{p}/cmdline").read_bytes():
                    out.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("ending", ["stop", "kill"])
def test_spare_keepers_end_with_the_daemon(tmp_path, image, ending):
    """Keepers are started ahead (a create or restore takes a ready one): at most 2 spares beside the
    sandboxes' own, and none outlive the daemon, stopped or killed."""
    from rt_support import Api, Daemon

    d = Daemon(tmp_path / "run").start()
    api = Api(d.sock, d.run_dir)
    try:
        sid = gv(api, image)["id"]
        assert api.sh(sid, "echo hi")[0] == "hi\n"
        keepers = _keepers_of(d.proc.pid)
        assert 2 <= len(keepers) <= 3, keepers   # the sandbox's and the spares
        api.terminate(sid)
        pid = d.proc.pid
        d.stop() if ending == "stop" else d.kill9()
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in keepers):
            assert time.monotonic() < deadline, f"keepers of daemon {pid} outlived it: {_keepers_of(pid)}"
            time.sleep(0.05)
    finally:
        api.close()
        d.stop()
        d.cleanup_cgroups()


def _tty_mounts(run_dir: Path) -> list[str]:
    at = str(run_dir / "gvisor-tty") + "/"
    return [t for t in (ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines())
            if t.startswith(at)]


@pytest.mark.parametrize("ending", ["terminate", "daemon killed"])
def test_a_terminals_devpts_goes_with_its_sandbox_and_after_a_killed_daemon(tmp_path, image, ending):
    """A terminal exec mounts the sandbox's devpts instance (root's, 0700 parent, ptmx 0600) on the host; it is
    unmounted and removed when the sandbox ends, and by the next daemon when the last one was killed outright."""
    import json

    from websockets.sync.client import unix_connect

    from rt_support import Api, Daemon

    d = Daemon(tmp_path / "run").start()
    api = Api(d.sock, d.run_dir)
    ws = None
    try:
        sid = gv(api, image)["id"]
        ws = unix_connect(str(d.sock), f"ws://hutch/v1/sandboxes/{sid}/exec/pty")
        ws.send(json.dumps({"argv": ["sh", "-c", "stty size; exec sleep 100"], "pty": {"rows": 9, "cols": 33}}))
        assert "eid" in json.loads(ws.recv(timeout=60))
        out = b""
        while b"9 33\r\n" not in out:
            out += ws.recv(timeout=30)
        tty = d.run_dir / "gvisor-tty"
        assert _tty_mounts(d.run_dir) == [str(tty / sid)]
        st = os.stat(tty)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
        assert os.stat(tty / sid / "ptmx").st_mode & 0o777 == 0o600
        if ending == "terminate":
            api.terminate(sid)
        else:
            ws.close()
            ws = None
            d.kill9()
            d.start()   # the next daemon clears what the killed one left
        assert _tty_mounts(d.run_dir) == [] and list(tty.iterdir()) == []
    finally:
        if ws is not None:
            ws.close()
        api.close()
        d.stop()
        d.cleanup_cgroups()
        for left in _tty_mounts(d.run_dir):   # only after a failure above
            subprocess.run(["umount", "-l", left], capture_output=True, timeout=30)
