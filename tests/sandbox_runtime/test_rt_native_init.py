"""The C init (native/initd.c) against the Python one (native/init.py's Init): the same calls get the same answers.

The session's daemon runs sandboxes on the C init (the default once scripts/setup.sh built it); a second daemon
here runs them with HUTCH_NATIVE_INIT=0, the Python fallback. One scenario (commands, exit codes and signals,
stdin, the sandbox's user, timeouts and kills, a terminal, the files API with awkward names, and every kind of
error) runs in a sandbox of each, and what each observed must be equal, error texts included.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import hutch
from hutch.sandbox._host.native import runtime as native_runtime
from hutch_testing import sdk_pointed_at
from rt_support import Daemon

pytestmark = pytest.mark.skipif(not native_runtime.native_init(),
                                reason="the C init is not built (scripts/setup.sh builds it)")


@pytest.fixture(scope="module")
def python_daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("rt-pyinit") / "run", env={"HUTCH_NATIVE_INIT": "0"})
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()


def _init_pid(run_dir: Path, sid: str) -> int:
    """The host pid of the sandbox's init: the one process of its pids cgroup whose parent is outside it."""
    from hutch.sandbox._host.daemon import cgroup_parent_for

    procs = Path(f"/sys/fs/cgroup/pids/{cgroup_parent_for(run_dir)}/{sid}/cgroup.procs").read_text().split()
    for pid in procs:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        if ppid not in procs:
            return int(pid)
    raise AssertionError(f"no init among {procs}")


def _err(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except hutch.Error as e:
        return (type(e).__name__, str(e))
    return ("no error",)


#: Files of /proc and /sys, which the files API refuses to read on both inits (test_no_file_of_proc_or_sys_...).
PSEUDO_FILES = ("/proc/self/mem", "/proc/1/mem", "/proc/self/environ", "/proc/self/status", "/proc/cpuinfo",
                "/sys/devices/system/cpu/online")


def _entry(f) -> tuple:
    return (f.name, f.path, f.type, f.size if f.type != "dir" else "-", f.mode, f.uid, f.gid, type(f.mtime).__name__)


def scenario(sb) -> list:
    seen = []
    r = sb.run("sh", "-c", "echo out; echo err >&2; exit 7")
    seen.append(("exit", r.returncode, r.stdout, r.stderr, r.reason))
    r = sb.run("sh", "-c", "kill -TERM $$")
    seen.append(("signal", r.returncode, r.reason))
    r = sb.run("cat", stdin="fed through stdin\n")
    seen.append(("stdin", r.stdout))
    r = sb.run("sh", "-c", "id; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status", user="user")
    seen.append(("user", r.stdout))
    r = sb.run("sh", "-c", "id; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; ls /proc/self/fd/")
    seen.append(("root", r.stdout))
    r = sb.run("sh", "-c", "pwd; echo \"$A\"; env | grep -v ^HOSTNAME= | sort", workdir="/tmp", env={"A": "b c", "Z": "é"})
    seen.append(("env", r.stdout))
    r = sb.run("sh", "-c", "trap '' INT; kill -INT 1; kill -TERM 1; kill -CHLD 1; echo alive")
    seen.append(("pid 1 ignores the sandbox", r.stdout, r.returncode))
    r = sb.run("sleep", "30", timeout=0.5)
    seen.append(("timeout", r.returncode, r.reason))
    p = sb.exec("sleep", "30", stdin=False)
    p.kill()
    seen.append(("kill", p.wait(), p.reason))
    p = sb.exec("sh", "-c", "sleep 30 & sleep 30 & wait", stdin=False)
    time.sleep(0.2)
    p.kill()
    p.wait()
    r = sb.run("sh", "-c", "ps -o comm= | grep -c sleep || true")
    seen.append(("group killed", r.stdout))
    for argv, kw in ((("nosuch",), {}), (("ls",), {"workdir": "/nope"}), (("/etc/marker",), {}),
                     (("ls",), {"workdir": "/etc/marker"}), (("/tmp",), {})):
        seen.append(("exec error", argv, kw, _err(sb.run, *argv, **kw)))
    # the files API
    f = sb.files
    f.write("/tmp/d/a.txt", b"hello\n", mode=0o640)
    seen.append(("read", f.read("/tmp/d/a.txt")))
    seen.append(("stat", _entry(f.stat("/tmp/d/a.txt")), _entry(f.stat("/tmp/d/"))))
    sb.run("sh", "-c", "cd /tmp/d && touch é \"$(printf 'b\\377')\" 'q\"uote' \"$(printf 'ctl\\tx')\" 😀 Z a "
                       "&& ln -s /etc/marker link && mkfifo fifo && mkdir -p sub/deeper && touch sub/deeper/x", check=True)
    seen.append(("list", [_entry(e) for e in f.list("/tmp/d")]))
    seen.append(("list /", [e.name for e in f.list("/")]))
    f.mkdir("/tmp/m/n/o", parents=True)
    f.mkdir("/tmp/m/p")
    seen.append(("mkdir", [e.name for e in f.list("/tmp/m")]))
    for call, args, kw in (
            (f.read, ("/nope",), {}), (f.read, ("/tmp",), {}), (f.read, ("/dev/null",), {}),
            (f.read, ("/proc/self/fd/2",), {}), (f.read, ("/tmp/d/a.txt/x",), {}),
            (f.list, ("/tmp/d/a.txt",), {}), (f.list, ("/nope",), {}), (f.stat, ("/nope/x",), {}),
            (f.mkdir, ("/tmp/m",), {}), (f.mkdir, ("/nope/x",), {}), (f.mkdir, ("/proc/x",), {}),
            (f.remove, ("/",), {}), (f.remove, ("/tmp/d",), {}), (f.remove, ("/nope",), {}),
            (f.write, ("/tmp/d", b"x"), {}), (f.write, ("/proc/x/y", b"x"), {}), (f.write, ("/sys/x", b"x"), {}),
            *((f.read, (p,), {}) for p in PSEUDO_FILES),
            (f.remove, ("/tmp/d",), {"recursive": True}), (f.list, ("/tmp/d",), {})):
        seen.append(("files", call.__name__, args, kw, _err(call, *args, **kw)))
    f.write("/tmp/big.txt", b"x" * 300_000)
    seen.append(("big", len(f.read("/tmp/big.txt"))))
    sb.run("sh", "-c", "mkdir /tmp/many && cd /tmp/many && i=0; while [ $i -lt 1500 ]; do touch f-$i-$i-$i-$i; "
                       "i=$((i+1)); done", check=True)   # a listing over one packet: the reply rides in a memfd
    seen.append(("many", len(f.list("/tmp/many"))))
    f.write("/tmp/u.txt", b"by user")
    seen.append(("user file", sb.run("cat", "/tmp/u.txt", user="user").stdout))
    # a terminal: the controlling one, resized, its session ended with it
    t = sb.exec("sh", pty=(30, 100))
    t.write("tty; stty size; echo $((6*7))\n")
    out = t.read_until(b"42\r\n")
    t.resize(40, 120)
    t.write("stty size; sleep 60 & echo started\n")
    out += t.read_until(b"started\r\n")
    t.kill()
    t.wait()
    seen.append(("pty", b"/dev/pts/0" in out, b"30 100" in out, b"40 120" in out, t.reason))
    r = sb.run("sh", "-c", "ps -o comm= | grep -c sleep || true")
    seen.append(("pty session ended", r.stdout))
    t = sb.exec("id", pty=True, user="user")
    seen.append(("pty user", t.read_until(b"gid=1000").count(b"uid=1000"), t.wait()))
    return seen


def _run_in(run_dir: Path, image) -> tuple[list, str, int]:
    with sdk_pointed_at(run_dir):
        sb = hutch.Sandbox.create(image=image, timeout=300)
        try:
            comm = sb.run("cat", "/proc/1/comm").stdout.strip()
            return scenario(sb), comm, _init_pid(run_dir, sb.id)
        finally:
            sb.terminate()


def test_the_c_init_answers_as_the_python_init_does(daemon, python_daemon, busybox_root):
    image = hutch.Image.from_directory(str(busybox_root))
    native, native_comm, _ = _run_in(daemon.run_dir, image)
    python, python_comm, _ = _run_in(python_daemon.run_dir, image)
    assert native_comm == "hutch-init" and python_comm.startswith("python"), (native_comm, python_comm)
    for a, b in zip(native, python):
        assert a == b, f"C init: {a}\nPython init: {b}"
    assert len(native) == len(python)


def test_the_c_init_is_locked_down_and_small(daemon, busybox_root):
    """Not dumpable (no process of the sandbox reaches its memory or its socket to the daemon), no capabilities,
    seccomp on, and well under 256 KiB of memory of its own (the Python init: about 2.3 MiB)."""
    with sdk_pointed_at(daemon.run_dir):
        with hutch.Sandbox.create(image=hutch.Image.from_directory(str(busybox_root)), timeout=120) as sb:
            for user in ("root", "user"):
                for argv in (("readlink", "/proc/1/fd/0"), ("cat", "/proc/1/environ"), ("cat", "/proc/1/maps"),
                             ("cat", "/proc/1/mem")):
                    r = sb.run(*argv, user=user)
                    assert r.returncode != 0 and not r.stdout, (user, r)
            pid = _init_pid(daemon.run_dir, sb.id)
            status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
            assert status["CapEff"].strip() == "0" * 16 and status["CapBnd"].strip() == "0" * 16, status
            assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
            assert os.readlink(f"/proc/{pid}/exe").endswith("hutch-init"), os.readlink(f"/proc/{pid}/exe")
            # its own memory: anonymous pages (the binary's are the page cache's, shared by every C init)
            anon = int(next(ln.split()[1] for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                            if ln.startswith("Pss_Anon:")))
            assert anon < 256, f"the C init holds {anon} KiB of anonymous memory"
            # its saved ids are the sandbox's user (what lets it run commands as that user), the others root's
            uids = status["Uid"].split()
            assert uids[0] == uids[1] == uids[3] != uids[2], uids


def test_no_file_of_proc_or_sys_is_read_through_the_files_api_on_either_init(daemon, python_daemon, busybox_root):
    """/proc/self in a files call is the init's own: with the C init its /proc/self/mem opened and read as an empty
    file, with the Python init it was EACCES (its /proc files are host root's). A file of /proc or /sys has no
    content until it is read (size 0, or a page), so both inits refuse them alike, checked on an O_PATH fd before
    the file's own permissions count: a ConfigError naming run('cat', path), which still reads them."""
    image = hutch.Image.from_directory(str(busybox_root))
    seen = []
    for d in (daemon, python_daemon):
        with sdk_pointed_at(d.run_dir):
            with hutch.Sandbox.create(image=image, timeout=120) as sb:
                got = [_err(sb.files.read, p) for p in PSEUDO_FILES]
                sb.files.write("/tmp/plain", b"regular\n")
                assert sb.files.read("/tmp/plain") == b"regular\n"
                assert sb.run("cat", "/sys/devices/system/cpu/online").stdout.strip()
                assert "Pid:" in sb.run("cat", "/proc/self/status").stdout
        for p, (kind, message) in zip(PSEUDO_FILES, got):
            assert kind == "ConfigError" and message.startswith(f"{p}: Invalid argument; only regular files") \
                and "run('cat', path)" in message, (d.run_dir, p, kind, message)
        seen.append(got)
    assert seen[0] == seen[1]
