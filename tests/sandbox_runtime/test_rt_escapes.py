"""Escape attempts: real attack code run inside real sandboxes, each asserting that the attack fails.

test_rt_isolation.py holds the basic probe (one call per dangerous syscall); this file goes after
what an agent's code would try next: regaining capabilities in a new user namespace, the init's
descriptors and /proc magic links (through the files API too), host processes, devices, /sys and
/proc/sys, cgroups, setuid files, the host's IPC, abstract sockets and vsock, resource exhaustion,
and processes that try to outlive their sandbox.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from hutch_testing import make_busybox_root
from rt_support import Api, Daemon, host_state, private_state_daemon, wait_gone

PY = "/usr/bin/python3"


def run_py(api, sid: str, code: str, **kw) -> dict:
    """Run `code` with the host's python3 inside the sandbox; it prints one JSON object."""
    out, err, res = api.exec(sid, PY, "-S", "-c", textwrap.dedent(code), **kw)
    assert res == {"returncode": 0, "reason": "exited"}, (res, err.decode()[-2000:])
    return json.loads(out)


@pytest.fixture(scope="module")
def host_root_daemon(tmp_path_factory):
    """A daemon run with HUTCH_USERNS=0: root inside is host root without capabilities."""
    d = Daemon(tmp_path_factory.mktemp("hostroot") / "run", env={"HUTCH_USERNS": "0"})
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()


@pytest.fixture(params=["userns", "host-root"])
def daemon(request, daemon):
    """Each attack runs against both kinds of sandbox: the default (its own user namespace) and the opt-out."""
    return daemon if request.param == "userns" else request.getfixturevalue("host_root_daemon")


#: Attacks on a mechanism of the native runtime that a gVisor sandbox does not have: there the same syscalls
#: reach gVisor's own kernel (the sentry), not the host's (docs/architecture.md, "The gVisor runtime").
NATIVE_ONLY = {
    "test_no_syscall_regains_privileges_or_reaches_the_kernel": "the native seccomp filter's refusals; under "
    "gVisor new user namespaces and the like are the sentry's own",
    "test_no_new_user_namespace_from_the_shell": "gVisor's user namespaces are the sentry's own",
    "test_legacy_abi_syscalls_are_refused": "the native seccomp filter's personality rules; the sentry has its own",
    "test_proc_of_the_init_and_of_host_pids": "the native init's /proc; gVisor's pid 1 is the sandbox's own sleep",
    "test_the_init_ignores_every_signal_from_inside": "gVisor does not shield pid 1 from SIGKILL sent inside: "
    "`kill -9 1` ends a gVisor sandbox (its own root's doing; documented)",
    "test_a_fork_bomb_is_held_by_the_pids_limit": "a gVisor sandbox past its host pids limit ends (documented); "
    "its own `kill -9 -1` ends it too",
    "test_all_sandboxes_together_leave_the_host_process_ids": "as the fork bomb: a gVisor sandbox past its host "
    "pids limit ends",
}


@pytest.fixture(params=["native", "gvisor"])
def runtime(request) -> str:
    """Each attack runs on both runtimes too (the gVisor one: the same spec under runsc)."""
    if request.param == "gvisor":
        if shutil.which("runsc") is None:
            pytest.skip("runsc is not installed (scripts/setup.sh)")
        why = NATIVE_ONLY.get(request.node.originalname)
        if why:
            pytest.skip(f"native only: {why}")
    return request.param


@pytest.fixture
def api(daemon, runtime):
    a = Api(daemon.sock, daemon.run_dir)
    a.runtime = runtime
    try:
        yield a
    finally:
        a.close()


@pytest.fixture
def pysb(api, image, py_mounts) -> str:
    return api.create(image, mounts=py_mounts)["id"]


# --- syscalls: a new user namespace, the mount API, kernel interfaces ---------------------------

SYSCALLS = """
import ctypes, errno, json, os, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def raw(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r, (ctypes.get_errno() if r < 0 else 0)
def fork_like(nr, *args):
    # clone/clone3 that succeed return twice: the child leaves at once
    r, e = raw(nr, *args)
    if r == 0:
        os._exit(0)
    if r > 0:
        os.waitpid(r, 0)
    return e
def call(nr, *args):
    r, e = raw(nr, *args)
    if r >= 0 and nr not in (436, 447):
        try:
            os.close(r)
        except OSError:
            pass
    return e
buf = ctypes.create_string_buffer(512)
NEWUSER, NEWNS, NEWPID, NEWNET, NEWCGROUP = 0x10000000, 0x20000, 0x20000000, 0x40000000, 0x02000000
out = {}
# a new user namespace would make this process root with every capability inside it
cargs = struct.pack("11Q", NEWUSER, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
out["clone3_newuser"] = fork_like(435, cargs, len(cargs))
cargs = struct.pack("11Q", 0, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
out["clone3_plain"] = fork_like(435, cargs, len(cargs))
out["clone_newuser"] = fork_like(56, NEWUSER | 17, 0, 0, 0, 0)
out["clone_newpid"] = fork_like(56, NEWPID | 17, 0, 0, 0, 0)
out["clone_newcgroup"] = fork_like(56, NEWCGROUP | 17, 0, 0, 0, 0)
out["unshare_user"] = call(272, NEWUSER)
out["unshare_user_ns"] = call(272, NEWUSER | NEWNS)
out["unshare_cgroup"] = call(272, NEWCGROUP)
ns = os.open("/proc/self/ns/user", os.O_RDONLY)
out["setns_user"] = call(308, ns, 0)
os.close(ns)
out["io_uring_setup"] = call(425, 4, buf)
out["io_uring_enter"] = call(426, 0, 1, 0, 0, 0, 0)
out["io_uring_register"] = call(427, 0, 0, 0, 0)
ctx = ctypes.c_ulong(0)
out["io_setup"] = call(206, 1, ctypes.byref(ctx))   # AIO contexts are counted host-wide (fs.aio-max-nr)
out["userfaultfd"] = call(323, os.O_CLOEXEC)
out["userfaultfd_user_only"] = call(323, os.O_CLOEXEC | 1)
out["keyctl"] = call(250, 0, -3, 1)
out["add_key"] = call(248, b"user", b"hutch", b"x", 1, -2)
out["request_key"] = call(249, b"user", b"hutch", 0, 0)
out["bpf_map_create"] = call(321, 0, buf, 72)
out["bpf_prog_load"] = call(321, 5, buf, 128)
out["perf_event_open"] = call(298, buf, 0, -1, -1, 0)
out["name_to_handle_at"] = call(303, -100, b"/", buf, buf, 0)
out["open_by_handle_at"] = call(304, -100, buf, 0)
out["fsopen"] = call(430, b"tmpfs", 0)
out["fspick"] = call(433, -100, b"/", 0)
out["open_tree_clone"] = call(428, -100, b"/", 1)
out["open_tree_attr_clone"] = call(467, -100, b"/", 1, 0, 0)
out["move_mount"] = call(429, -100, b"/tmp", -100, b"/mnt", 0)
out["mount_setattr"] = call(442, -100, b"/", 0, buf, 32)
out["mount_bind"] = call(165, b"/", b"/tmp", 0, 4096 | 16384, 0)
out["mount_proc"] = call(165, b"proc", b"/tmp", b"proc", 0, 0)
out["remount_proc_sys_rw"] = call(165, 0, b"/proc/sys", 0, 32 | 4096, 0)
out["umount_proc_sys"] = call(166, b"/proc/sys", 2)
out["umount_dev"] = call(166, b"/dev", 2)
out["pivot_root"] = call(155, b"/tmp", b"/tmp")
out["chroot"] = call(161, b"/tmp")
out["init_module"] = call(175, buf, 64, b"")
out["finit_module"] = call(313, 0, b"", 0)
out["delete_module"] = call(176, b"ext4", 0)
out["kexec_file_load"] = call(320, 0, 0, 0, b"", 0)
out["ptrace_attach_init"] = call(101, 16, 1, 0, 0)
iov = struct.pack("QQ", ctypes.addressof(buf), 16)
out["process_vm_readv_init"] = call(310, 1, iov, 1, iov, 1, 0)
out["syslog_read"] = call(103, 3, buf, 512)
out["acct"] = call(163, b"/tmp/acct")
out["iopl"] = call(172, 3)
out["ioperm"] = call(173, 0x80, 1, 1)
out["quotactl"] = call(179, 0x800007, b"/", 0, buf)
out["settimeofday"] = call(164, buf, 0)
out["clock_settime"] = call(227, 0, buf)
out["sethostname"] = call(170, b"pwned", 5)
out["setdomainname"] = call(171, b"pwned", 5)
out["mknod_mem"] = call(133, b"/tmp/mem", 0o20600, os.makedev(1, 1))
out["mknod_block"] = call(133, b"/tmp/vda", 0o60600, os.makedev(254, 0))
out["fanotify_init"] = call(300, 0, 0)
out["lookup_kcmp"] = call(312, 1, os.getpid(), 0, 0, 0)
try:
    # vsock is not network-namespaced: with Network.none() it would still reach the VM's host
    socket.socket(40, socket.SOCK_STREAM).close()
    out["socket_vsock"] = 0
except OSError as e:
    out["socket_vsock"] = e.errno
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    out["socket_packet"] = 0
except OSError as e:
    out["socket_packet"] = e.errno
out["clone3_plain_works"] = out.pop("clone3_plain")
print(json.dumps(out))
"""


def test_no_syscall_regains_privileges_or_reaches_the_kernel(api, pysb):
    got = run_py(api, pysb, SYSCALLS)
    # clone3 is ENOSYS for everyone (libc falls back to clone, whose flags the filter reads)
    assert got.pop("clone3_plain_works") == errno.ENOSYS
    opened = {k: v for k, v in got.items() if v == 0}
    assert opened == {}, f"these succeeded inside the sandbox: {opened}"
    # refused by the filter or for want of a capability, not by an argument check the next kernel may drop
    odd = {k: errno.errorcode.get(v, v) for k, v in got.items()
           if v not in (errno.EPERM, errno.ENOSYS, errno.EACCES, errno.EAFNOSUPPORT)}
    assert odd == {}, f"refused for another reason than policy: {odd}"


LEGACY_ABI = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return ctypes.get_errno() if r < 0 else 0
buf = ctypes.create_string_buffer(16)
out = {}
# 16-bit segments: read and write the LDT
out["modify_ldt_read"] = call(154, 0, buf, 16)
out["modify_ldt_write"] = call(154, 1, buf, 16)
# personalities Docker refuses: every readable mapping executable, no address randomisation, page 0 mapped
for name, persona in (("read_implies_exec", 0x0400000), ("addr_no_randomize", 0x0040000),
                      ("mmap_page_zero", 0x0100000), ("linux_with_high_bits", 0x0400000 | 0x0008)):
    out[name] = call(135, persona)
# and those it allows, each set back to PER_LINUX again
allowed = {}
for persona in (0x0, 0x8, 0x20000, 0x20008):
    allowed[hex(persona)] = call(135, persona)
    call(135, 0)
allowed["query"] = call(135, 0xFFFFFFFF)
print(json.dumps({"refused": out, "allowed": allowed}))
"""


def test_legacy_abi_syscalls_are_refused(api, pysb):
    got = run_py(api, pysb, LEGACY_ABI)
    assert got["refused"] == {k: errno.EPERM for k in got["refused"]}, got
    assert got["allowed"] == {k: 0 for k in got["allowed"]}, got


def test_no_new_user_namespace_from_the_shell(api, image):
    sid = api.create(image)["id"]
    out, err, _ = api.sh(sid, "unshare -U -r id -u 2>&1; unshare -m -r true 2>&1; "
                              "nsenter -t 1 -m true 2>&1; echo end")
    assert out.rstrip().endswith("end") and "\n0\n" not in f"\n{out}", out
    assert out.count("Operation not permitted") + out.count("Permission denied") >= 3, out


# --- descriptors and /proc -----------------------------------------------------------------------

FDS = """
import json, os
fds = {}
for n in os.listdir("/proc/self/fd"):
    try:
        fds[n] = os.readlink(f"/proc/self/fd/{n}")
    except OSError:
        pass  # the directory listing's own fd, closed again by now
print(json.dumps(fds))
"""


def test_a_command_holds_only_its_three_streams(api, pysb, image, py_mounts):
    for stdin in (False, True):
        fds = run_py(api, pysb, FDS, stdin=stdin)
        assert sorted(fds) == ["0", "1", "2"], f"descriptors leaked into the command: {fds}"
    # the main command of a sandbox too
    info = api.create(image, mounts=py_mounts,
                      command=[PY, "-S", "-c", FDS.replace("print(json.dumps(fds))",
                                                           "open('/tmp/fds', 'w').write(json.dumps(fds))")
                               + "\nimport time; time.sleep(30)"])
    deadline = time.monotonic() + 10
    while True:
        r = api.http.get(f"/v1/sandboxes/{info['id']}/files/read", params={"path": "/tmp/fds"})
        if r.status_code == 200 and r.content:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    fds = json.loads(r.content)
    # (under gVisor the /dev/null runsc was given shows as the sentry's "host:[n]" descriptors)
    null = {"/dev/null"} if api.runtime != "gvisor" else {v for v in fds.values() if v.startswith("host:[")}
    assert sorted(fds) == ["0", "1", "2"] and set(fds.values()) == null, fds


PROC = """
import json, os
me = os.getpid()
out = {"init": {}, "others": []}
for what in ("root", "cwd", "exe", "fd/0", "fd/1", "fd/2", "fd/3", "fd/4", "fd/5", "fd/6"):
    try:
        out["init"][what] = os.readlink(f"/proc/1/{what}")
    except OSError as e:
        out["init"][what] = -e.errno
for what in ("environ", "mem", "maps", "auxv", "syscall", "stack", "map_files"):
    try:
        p = f"/proc/1/{what}"
        out["init"][what] = len(os.listdir(p)) if what == "map_files" else len(open(p, "rb").read(4096))
    except OSError as e:
        out["init"][what] = -e.errno
try:
    out["init"]["root_list"] = os.listdir("/proc/1/root/")
except OSError as e:
    out["init"]["root_list"] = -e.errno
for n in os.listdir("/proc"):
    if n.isdigit() and int(n) not in (1, me):
        try:
            out["others"].append([int(n), open(f"/proc/{n}/cmdline", "rb").read().decode(errors="replace")])
        except OSError:
            pass
out["pids"] = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
print(json.dumps(out))
"""


def test_proc_of_the_init_and_of_host_pids(api, daemon, pysb):
    got = run_py(api, pysb, PROC)
    init = got["init"]
    # pid 1 (the init) is not dumpable: no link, no memory, no environment (the daemon's) through /proc
    leaked = {k: v for k, v in init.items() if isinstance(v, str) or (isinstance(v, int) and v > 0)
              or isinstance(v, list)}
    assert leaked == {}, f"the init's /proc entries are readable from inside: {leaked}"
    # host pids mean nothing inside: neither the daemon nor this test is there under its number
    assert daemon.proc.pid not in got["pids"] or daemon.proc.pid < 10
    assert all("hutch" not in cmd and "pytest" not in cmd for _, cmd in got["others"]), got["others"]
    assert max(got["pids"]) < 100, got["pids"]


def test_the_init_holds_none_of_the_daemons_environment(daemon, image, api):
    """Defence in depth: were the init's memory ever read, it holds no token or credential of the daemon's."""
    sid = api.create(image)["id"]
    for pid in host_state(daemon, sid)["pids"]:
        env = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"HUTCH_RUN_DIR" not in env and b"PATH=" not in env, (pid, env[:200])


def test_files_api_does_not_follow_proc_magic_links(api, daemon, pysb):
    """Symlinks the sandbox plants for the host to read or write through: /proc/self and /proc/1 are the
    init serving the call, whose descriptors reach the daemon's log and its scratch mount."""
    links = {"log1": "/proc/self/fd/1", "log2": "/proc/1/fd/2", "exe": "/proc/self/exe",
             "root": "/proc/1/root/etc/marker", "stderr": "/dev/stderr", "task": "/proc/thread-self/fd/2"}
    for n in range(3, 12):
        links[f"up{n}"] = f"/proc/self/fd/{n}/.."
    script = "; ".join(f"ln -s {t} /home/user/{name}" for name, t in links.items())
    assert api.sh(pysb, script)[2]["returncode"] == 0
    log = (daemon.log.read_bytes() or b"")[:64]
    for name in links:
        for direct in (f"/home/user/{name}", links[name]):
            r = api.http.get(f"/v1/sandboxes/{pysb}/files/read", params={"path": direct})
            assert r.status_code >= 400 or (log and log not in r.content and not r.content.startswith(b"\x7fELF")), \
                (direct, r.status_code, r.content[:80])
            r = api.http.get(f"/v1/sandboxes/{pysb}/files/list", params={"path": direct})
            names = {e["name"] for e in r.json().get("entries", [])} if r.status_code == 200 else set()
            assert not ({"upper", "work"} & names), (direct, names)
    for path in ("/proc/self/environ", "/proc/1/environ", "/proc/self/cmdline"):   # the daemon's environment
        r = api.http.get(f"/v1/sandboxes/{pysb}/files/read", params={"path": path})
        assert b"HUTCH_RUN_DIR" not in r.content and b"zygote" not in r.content, (path, r.content[:80])
    for n in range(3, 12):   # a write through the init's descriptors lands nowhere outside the root
        r = api.http.put(f"/v1/sandboxes/{pysb}/files/write", params={"path": f"/home/user/up{n}/x/hutch-pwned"},
                         content=b"x")
        r2 = api.http.post(f"/v1/sandboxes/{pysb}/files/mkdir", params={"path": f"/home/user/up{n}/hutch-dir"})
        assert r.status_code >= 400 and r2.status_code >= 400, (n, r.text, r2.text)
    # a workdir through them would start a command outside its root
    api.sh(pysb, "ln -s /proc/self/fd/5/.. /home/user/wd5; ln -s /proc/self/fd/4/.. /home/user/wd4")
    for wd in ("/home/user/wd4", "/home/user/wd5"):
        r = api.http.post(f"/v1/sandboxes/{pysb}/exec", json={"argv": ["sh", "-c", "ls -a"], "workdir": wd})
        assert r.status_code >= 400 or b"upper" not in r.content, r.content


def test_an_image_cannot_plant_its_workdir_in_the_inits_descriptors(api, busybox_root, tmp_path):
    """A snapshot of a hostile sandbox is an image: its workdir's parent may be a symlink to
    /proc/self/fd/<n>, which the init (making the workdir) would resolve to one of its own descriptors,
    an image layer's tree among them (the host's directory, owned by root inside)."""
    img = tmp_path / "img"
    shutil.copytree(busybox_root, img, symlinks=True)
    src = tmp_path / "ro"
    src.mkdir()
    for k in range(3, 12):
        os.symlink(f"/proc/self/fd/{k}", img / f"w{k}")
        r = api.http.post("/v1/sandboxes", json={"spec": {
            "image": f"dir:{img}", "detach": True, "timeout": 30, "workdir": f"/w{k}/made-by-sandbox",
            "mounts": [{"kind": "bind", "source": str(src), "target": "/ro", "readonly": True, "size": None}]}})
        if r.status_code == 201:
            api.created.append(r.json()["id"])
    assert list(img.rglob("made-by-sandbox")) == [] and list(src.iterdir()) == []
    assert list(busybox_root.rglob("made-by-sandbox")) == []


def test_mount_targets_never_follow_an_images_symlinks(api, busybox_root, tmp_path):
    """Mount points are made before pivot_root, while an absolute symlink still resolves on the host."""
    img = tmp_path / "img"
    shutil.copytree(busybox_root, img, symlinks=True)
    host = tmp_path / "host"
    host.mkdir()
    (img / "mnt").symlink_to(host)
    (img / "rel").symlink_to("../../../../../../../.." + str(host))
    src = tmp_path / "src"
    src.mkdir()
    for target in ("/mnt/x", "/rel/x", "/mnt", "/rel"):
        for m in ({"kind": "tmpfs", "target": target, "size": 1 << 20, "readonly": False, "source": None},
                  {"kind": "bind", "source": str(src), "target": target, "readonly": True, "size": None}):
            r = api.http.post("/v1/sandboxes", json={"spec": {"image": f"dir:{img}", "detach": True,
                                                              "timeout": 30, "mounts": [m]}})
            if r.status_code == 201:
                api.created.append(r.json()["id"])
            assert r.status_code >= 400 and "symlink" in r.text, (m, r.text)
    assert list(host.iterdir()) == [] and list(src.iterdir()) == []
    assert not any(str(host) in line for line in Path("/proc/self/mountinfo").read_text().splitlines())


# --- host processes ---------------------------------------------------------------------------------

KILL_ALL = """
import json, os, signal, ctypes
libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
hit = []
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for pid in [int(a) for a in os.environ["HOST_PIDS"].split()] + list(range(2, 4096)):
    if pid == me:
        continue
    for sig in (signal.SIGKILL,):
        try:
            os.kill(pid, sig)
            hit.append(pid)
        except OSError:
            pass
ptrace = [libc.ptrace(16, int(p), 0, 0) for p in os.environ["HOST_PIDS"].split()]
try:
    os.kill(-1, signal.SIGTERM)
    minus_one = 0
except OSError as e:
    minus_one = e.errno
print(json.dumps({"hit": hit, "ptrace": ptrace, "me": me}))
"""


def test_signals_and_ptrace_reach_no_host_process(api, daemon, pysb):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        host_pids = [victim.pid, daemon.proc.pid, os.getpid(), 1]
        if api.runtime == "gvisor":   # kill(-1) there reaches the attacker and pid 1 too: the sandbox ends
            api.exec(pysb, PY, "-S", "-c", textwrap.dedent(KILL_ALL), env={"HOST_PIDS": " ".join(map(str, host_pids))})
            assert victim.poll() is None and daemon.proc.poll() is None, "a host process died of a signal inside"
            return
        got = run_py(api, pysb, KILL_ALL, env={"HOST_PIDS": " ".join(map(str, host_pids))})
        assert all(p == -1 for p in got["ptrace"]), got
        assert victim.poll() is None, "a host process died of a signal sent inside a sandbox"
        assert daemon.proc.poll() is None
        assert set(got["hit"]) <= set(range(1, 100)), got["hit"]   # only pids of its own namespace
        assert api.sh(pysb, "echo alive")[0] == "alive\n"
    finally:
        victim.kill()
        victim.wait()


def test_the_init_ignores_every_signal_from_inside(api, image):
    sid = api.create(image)["id"]
    for sig in ("INT", "TERM", "HUP", "QUIT", "USR1", "USR2", "PIPE", "ALRM", "CHLD", "STOP", "KILL"):
        api.sh(sid, f"kill -{sig} 1")
    out, _, _ = api.sh(sid, "sleep 0.1; echo alive; sh -c 'kill -INT $$; echo not-reached'; echo $?")
    assert out == "alive\n130\n", out   # and a command still dies of SIGINT (its default again)
    assert api.info(sid)["status"] == "running"


def test_a_malformed_command_gets_an_error_not_the_end_of_the_sandbox(api, image):
    """An agent's tool call passes argv, env and workdir through: C strings cannot hold what it may send."""
    sid = api.create(image)["id"]
    for body in ({"argv": ["echo", "a\0b"]}, {"argv": ["echo\0", "x"]}, {"argv": ["echo"], "env": {"A=B": "1"}},
                 {"argv": ["echo"], "env": {"A": "1\0"}}, {"argv": ["echo"], "env": {"": "1"}},
                 {"argv": ["echo"], "workdir": "/tmp\0/x"}):
        r = api.http.post(f"/v1/sandboxes/{sid}/exec", json=body)
        assert r.status_code == 400 and r.json()["error"] == "ConfigError", (body, r.text)
    assert api.sh(sid, "echo alive")[0] == "alive\n"


# --- devices, /sys, /proc/sys, kernel modules ----------------------------------------------------

def test_no_device_node_kernel_log_or_module_is_reachable(api, image):
    sid = api.create(image)["id"]
    script = ("for d in /dev/mem /dev/kmem /dev/port /dev/kmsg /dev/vda /dev/sda /dev/nvme0n1 /dev/loop0 "
              "/dev/vsock /dev/fuse /dev/net/tun /dev/console /dev/tty0; do test -e $d && echo exists $d; done; "
              "mknod /tmp/mem c 1 1 2>/dev/null && echo made-mem; mknod /tmp/vda b 254 0 2>/dev/null && echo made-vda; "
              "mknod /dev/shm/mem c 1 1 2>/dev/null && echo made-shm-mem; "
              "head -c 1 /proc/kmsg 2>/dev/null && echo read-kmsg; dmesg 2>/dev/null | head -c 1 | grep -q . && echo dmesg; "
              "insmod /lib/modules/x.ko 2>/dev/null && echo insmod; rmmod ext4 2>/dev/null && echo rmmod; "
              "modprobe dummy 2>/dev/null && echo modprobe; "
              "cat /proc/kcore /proc/kpageflags /proc/kpagecount /proc/kpagecgroup /proc/slabinfo "
              "/proc/vmallocinfo /proc/pagetypeinfo 2>/dev/null | head -c 16 | wc -c; "
              "grep -v '^0000000000000000 ' /proc/kallsyms 2>/dev/null | head -c 1 | wc -c; "
              "echo end")
    if api.runtime == "gvisor":   # the sentry's own FUSE device: a mount of it would be the sentry's too
        script = script.replace("/dev/fuse ", "").replace("/dev/net/tun ", "")   # and its netstack's tun
        # its tmpfs takes a node (nodev is not shown nor needed): the sentry has no /dev/mem to open behind it
        script = script.replace("mknod /dev/shm/mem c 1 1 2>/dev/null && echo made-shm-mem",
                                "mknod /dev/shm/mem c 1 1 2>/dev/null; head -c 1 /dev/shm/mem >/dev/null 2>&1 "
                                "&& echo read-shm-mem")
        # and its kernel log is the sentry's few lines of its own start, none of the host's
        script = script.replace("dmesg 2>/dev/null | head -c 1 | grep -q . && echo dmesg",
                                "dmesg 2>/dev/null | grep -q 'Linux version' && echo dmesg")
    out, err, _ = api.sh(sid, script)
    assert out.split() == ["0", "0", "end"], out


def _host_block_dirs() -> list[str]:
    """Where sysfs keeps the host's disks (their I/O counters), as the host sees it."""
    out = set()
    for name in os.listdir("/sys/class/block"):
        path = os.path.realpath(f"/sys/class/block/{name}")
        while os.path.basename(path) != "block":
            path = os.path.dirname(path)
        out.add(path)
    return sorted(out)


def test_host_wide_information_is_masked(api, image):
    """The kernel's command line and config, the host's disks, interrupts and pressure: empty inside."""
    sid = api.create(image)["id"]
    files = [p for p in ("/proc/cmdline", "/proc/config.gz", "/proc/diskstats", "/proc/partitions",
                         "/proc/interrupts", "/proc/softirqs", "/proc/swaps", "/proc/mdstat",
                         "/proc/pressure/cpu", "/proc/pressure/io", "/proc/pressure/memory")
             if os.path.exists(p)]
    assert "/proc/cmdline" in files and "/proc/diskstats" in files and Path("/proc/cmdline").read_text()
    if api.runtime == "gvisor":   # its /proc and /sys are the sentry's: nothing of the host's kernel or disks
        out, _, _ = api.sh(sid, "cat /proc/cmdline /proc/diskstats /proc/partitions /proc/interrupts 2>/dev/null; "
                                "ls /sys/block /sys/class/block 2>/dev/null")
        assert Path("/proc/cmdline").read_text().strip() not in out, out
        disks = [n for n in os.listdir("/sys/class/block")]
        assert not [d for d in disks if d in out.split()], out
        return
    dirs = [p for p in ["/proc/pressure", "/sys/fs", "/sys/devices/virtual/block"] + _host_block_dirs()
            if os.path.isdir(p)]
    script = "; ".join([f"cat {f} 2>/dev/null | wc -c" for f in files]
                       + [f"ls -A {d} 2>/dev/null | wc -l" for d in dirs])
    out, err, _ = api.sh(sid, script)
    got = dict(zip(files + dirs, out.split()))
    assert got == {p: "0" for p in files + dirs}, got
    # nowhere else in /sys either: no block device's counters (/sys/block and co. only link into the masked
    # directories), no filesystem's statistics
    out, _, _ = api.sh(sid, "find /sys -name stat -path '*block*' 2>/dev/null | head -3; "
                            "cat /sys/block/*/stat /sys/class/block/*/stat /sys/dev/block/*/stat 2>/dev/null | head -3; "
                            "cat /sys/block/*/size 2>/dev/null | head -3; "
                            "find /sys -path '*/fs/*' -name lifetime_write_kbytes 2>/dev/null | head -3; echo end")
    assert out == "end\n", out
    # a pressure trigger (host-wide, a kernel resource per fd) cannot be armed
    out, _, _ = api.sh(sid, "(printf 'some 150000 1000000' > /proc/pressure/memory) 2>/dev/null && echo armed; "
                            "echo end")
    assert out == "end\n", out
    # what programs need stays: their own status, CPU counts and times, the CPUs that are online
    out, err, _ = api.sh(sid, "grep -c ^Pid: /proc/self/status; grep -c ^cpu /proc/stat | grep -qv ^0 && echo stat; "
                              "cat /sys/devices/system/cpu/online | grep -q . && echo online")
    assert out.split() == ["1", "stat", "online"], out + err


def test_sys_and_proc_sys_refuse_writes(api, image):
    sid = api.create(image)["id"]
    host = {p: Path(p).read_text() for p in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe",
                                             "/proc/sys/kernel/hostname", "/proc/sys/vm/overcommit_memory")
            if os.path.exists(p)}
    targets = ["/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/kernel/hostname",
               "/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/ns_last_pid", "/proc/sys/net/ipv4/ip_forward",
               "/sys/kernel/uevent_helper", "/sys/kernel/mm/transparent_hugepage/enabled",
               "/sys/module/printk/parameters/time", "/sys/fs/cgroup/release_agent", "/sys/power/state",
               "/proc/self/attr/current"]
    script = "; ".join(f"(echo 1 > {t}) 2>/dev/null && echo wrote {t}" for t in targets)
    out, _, _ = api.sh(sid, script + "; sysctl -w kernel.hostname=pwned 2>/dev/null; "
                                     "mount -o remount,rw /proc/sys 2>/dev/null && echo remounted; "
                                     "mount -o remount,rw /sys 2>/dev/null && echo remounted; echo end")
    assert out.split()[-1] == "end" and "wrote" not in out and "remounted" not in out, out
    assert {p: Path(p).read_text() for p in host} == host


def test_cgroups_cannot_be_left_or_reconfigured(api, daemon, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "cat /proc/self/cgroup | cut -d: -f3 | sort -u | tr '\\n' ' '; echo; "
                            "ls -A /sys/fs/cgroup | wc -l; "
                            "mkdir -p /tmp/cg; mount -t cgroup -o memory none /tmp/cg 2>/dev/null && echo mounted; "
                            "mount -t cgroup2 none /tmp/cg 2>/dev/null && echo mounted2; "
                            "for f in /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/memory/cgroup.procs "
                            "/sys/fs/cgroup/unified/cgroup.procs /sys/fs/cgroup/memory/release_agent; do "
                            "(echo $$ > $f) 2>/dev/null && echo wrote $f; done; "
                            "sleep 30 > /dev/null 2>&1 & echo started")
    lines = out.split("\n")
    assert lines[0].split() == ["/"], out   # its own cgroup namespace: the host's tree is not named
    assert lines[1] == "0" and "mounted" not in out and "wrote" not in out, out
    marker = f"/{daemon.cgroup_parent}/{sid}"
    for pid in host_state(daemon, sid)["pids"]:   # every process (the background sleep too) stays in it
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        for ctrl in ("memory", "pids"):
            assert any(ctrl in ln.split(":")[1].split(",") and ln.endswith(marker) for ln in lines), (pid, lines)


# --- setuid files, hostname, IPC, sockets -------------------------------------------------------------

@pytest.fixture(scope="module")
def suid_root(tmp_path_factory, busybox_root) -> Path:
    """An image holding a setuid-1234 and a setuid-root copy of the host's python3."""
    root = make_busybox_root(tmp_path_factory.mktemp("suid") / "root", shutil.which("busybox"))
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").symlink_to("usr/lib64")
    for name, uid in (("suid1234", 1234), ("suid0", 0)):
        p = root / name
        shutil.copy(os.path.realpath(PY), p)
        os.chown(p, uid, uid)
        os.chmod(p, 0o6755)
    return root


def test_setuid_files_give_no_other_id_or_capability(api, suid_root, py_mounts):
    probe = "import os; print(os.getresuid(), os.getresgid(), [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])"
    # the check can fail: outside, the bit works (exec'd through a descriptor: the pytest dirs are 0700)
    fd = os.open(suid_root / "suid1234", os.O_RDONLY)
    try:
        child = subprocess.run([f"/proc/self/fd/{fd}", "-S", "-c", probe], capture_output=True, text=True,
                               user=4321, group=4321, pass_fds=[fd])
    finally:
        os.close(fd)
    assert child.stdout.startswith("(4321, 1234, 1234)"), child.stdout + child.stderr
    sid = api.create(f"dir:{suid_root}", mounts=py_mounts)["id"]
    for name in ("suid1234", "suid0"):
        out, err, res = api.exec(sid, f"/{name}", "-S", "-c", probe)
        assert out.decode().split("\n")[0] == "(0, 0, 0) (0, 0, 0) 0000000000000000", (name, out, err)
    # su/passwd of a bound /usr stay unprivileged too (nosuid; gVisor shows none and honours no setuid bit)
    if api.runtime != "gvisor":
        out, _, _ = api.sh(sid, "grep /usr /proc/self/mountinfo | grep -c nosuid")
        assert out.strip() != "0"


def test_hostname_is_the_sandboxs_own(api, image):
    before = os.uname().nodename
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "hostname; hostname pwned 2>/dev/null && echo changed; "
                            "echo pwned > /proc/sys/kernel/hostname 2>/dev/null && echo changed; hostname")
    assert out.split() == [f"hutch-{sid}", f"hutch-{sid}"], out
    assert os.uname().nodename == before


IPC = """
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
key = int(os.environ["SHM_KEY"])
out = {"shmget": libc.shmget(key, 0, 0), "msgget": libc.msgget(key, 0), "semget": libc.semget(key, 0, 0),
       "sysvipc": [open(f"/proc/sysvipc/{k}").read().count(str(key)) if os.path.exists("/proc/sysvipc") else 0
                   for k in ("shm", "msg", "sem")]}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("\\0" + os.environ["ABSTRACT"])
    out["abstract"] = 0
except OSError as e:
    out["abstract"] = e.errno
s2 = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    s2.sendto(b"x", "\\0" + os.environ["ABSTRACT"] + "-dgram")
    out["abstract_dgram"] = 0
except OSError as e:
    out["abstract_dgram"] = e.errno
print(json.dumps(out))
"""


def test_host_ipc_and_abstract_sockets_are_out_of_reach(api, pysb):
    libc = ctypes.CDLL(None, use_errno=True)
    key = int.from_bytes(os.urandom(3), "big") | 0x68000000
    name = f"hutch-escape-{os.urandom(4).hex()}"
    shm = libc.shmget(key, 4096, 0o1666)
    msq = libc.msgget(key, 0o1666)
    sem = libc.semget(key, 1, 0o1666)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert min(shm, msq, sem) >= 0, ctypes.get_errno()
        listener.bind("\0" + name)
        listener.listen(1)
        dgram.bind("\0" + name + "-dgram")
        got = run_py(api, pysb, IPC, env={"SHM_KEY": str(key), "ABSTRACT": name})
        assert got["shmget"] == got["msgget"] == got["semget"] == -1, got
        assert got["sysvipc"] == [0, 0, 0], got
        assert got["abstract"] == errno.ECONNREFUSED and got["abstract_dgram"] == errno.ECONNREFUSED, got
    finally:
        listener.close()
        dgram.close()
        libc.shmctl(shm, 0, None) if shm >= 0 else None   # IPC_RMID
        libc.msgctl(msq, 0, None) if msq >= 0 else None
        libc.semctl(sem, 0, 0) if sem >= 0 else None


# --- resources ----------------------------------------------------------------------------------------

def test_memory_and_shm_exhaustion_stay_inside(api, daemon, image, py_mounts):
    shm = api.create(image, limits={"memory": 256 * 1024**2, "cpu": 1.0, "pids": 64, "disk": 16 * 1024**2})["id"]
    out, err, res = api.sh(shm, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=128 2>/dev/null; "
                                "ls -l /dev/shm/fill | awk '{print $5}'", timeout=30)
    assert int(out.split()[-1]) <= 64 * 1024**2, out   # /dev/shm: at most 64 MiB
    tmpfs = api.create(image, mounts=[{"kind": "tmpfs", "target": "/scratch", "size": 4 * 1024**2,
                                       "readonly": False, "source": None}])["id"]
    out, _, _ = api.sh(tmpfs, "dd if=/dev/zero of=/scratch/fill bs=1M count=32 2>/dev/null; "
                              "ls -l /scratch/fill | awk '{print $5}'")
    assert int(out) <= 4 * 1024**2, out
    hog = api.create(image, mounts=py_mounts, limits={"memory": 48 * 1024**2, "cpu": 1.0, "pids": 64,
                                                      "disk": 16 * 1024**2})["id"]
    _, _, res = api.exec(hog, PY, "-S", "-c", "b = [bytearray(1 << 20) for _ in range(400)]", timeout=30)
    if api.runtime == "gvisor":   # the host's OOM killer takes the sentry: the whole sandbox ends (documented)
        assert res["reason"] == "sandbox_ended" and api.info(hog)["status"] in ("oom", "exited", "failed"), res
        assert api.sh(shm, "echo ok")[0] == "ok\n"
    else:
        assert res["reason"] == "oom", res
        assert api.sh(shm, "echo ok")[0] == "ok\n" and api.sh(hog, "echo ok")[0] == "ok\n"
    assert daemon.proc.poll() is None


PTYS = """
import os, sys, time
fds = []
try:
    while len(fds) < 4000:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError:
    pass
print(len(fds), flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_one_sandbox_cannot_take_every_pty(api, pysb, image, py_mounts):
    """kernel.pty.max is shared by every devpts instance: each sandbox gets a share, not all of them."""
    other = api.create(image, mounts=py_mounts)["id"]
    code = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (5000, 5000))\n" + textwrap.dedent(PTYS)
    with api.http.stream("POST", f"/v1/sandboxes/{pysb}/exec", json={"argv": [PY, "-S", "-c", code, "20"]}) as held:
        buf = b""   # the hog prints how many it holds (one stdout frame), then keeps them
        for chunk in held.iter_bytes():
            buf += chunk
            if len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                break
        # gVisor's ptys are the sentry's (no host devpts, so no share of kernel.pty.max to take)
        most = 4000 if api.runtime == "gvisor" else 256
        assert buf[0] == 1 and 0 < int(buf[5:5 + int.from_bytes(buf[1:5], "big")]) <= most, buf
        out, err, _ = api.exec(other, PY, "-S", "-c", code, "0")
        assert int(out) >= 8, err   # the other sandbox still gets its own
        api.http.post(f"/v1/sandboxes/{pysb}/exec/{held.headers['X-Hutch-Exec-Id']}/kill", json={"signal": 9})


INOTIFY = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while n < 1000 and libc.inotify_init1(0) >= 0:
    n += 1
print(n, flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_per_user_kernel_counts_are_the_sandboxs_own(api, daemon, pysb):
    """The kernel charges a user namespace's per-user counts to its owner as well: a sandbox holding every
    inotify instance it may have must leave host root's (128 for all of root's daemons) alone."""
    if "0" in (daemon.extra_env.get("HUTCH_USERNS"), os.environ.get("HUTCH_USERNS")):
        pytest.skip("without a user namespace root inside is host root: these are root's counts (documented)")
    libc = ctypes.CDLL(None, use_errno=True)
    with api.http.stream("POST", f"/v1/sandboxes/{pysb}/exec", json={"argv": [PY, "-S", "-c", INOTIFY, "20"]}) as held:
        buf = b""
        for chunk in held.iter_bytes():
            buf += chunk
            if len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                break
        assert int(buf[5:5 + int.from_bytes(buf[1:5], "big")]) > 8, buf   # the sandbox got its own
        fds = [libc.inotify_init1(os.O_CLOEXEC) for _ in range(4)]
        try:
            assert min(fds) >= 0, f"host root got no inotify instance: {os.strerror(ctypes.get_errno())}"
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        api.http.post(f"/v1/sandboxes/{pysb}/exec/{held.headers['X-Hutch-Exec-Id']}/kill", json={"signal": 9})


def _recovers(api, sid, within: float = 10.0) -> bool:
    """Whether the sandbox runs a command again within `within` seconds (after its processes were held)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["echo", "alive"]})
        if r.status_code == 200 and b"alive" in r.content:
            return True
        time.sleep(0.1)
    return False


def test_a_fork_bomb_is_held_by_the_pids_limit(api, daemon, image):
    sid = api.create(image, limits={"memory": 128 * 1024**2, "cpu": 1.0, "pids": 32, "disk": 16 * 1024**2})["id"]
    pids_dir = next(d for d in daemon.cgroup_dirs(sid) if (d / "pids.max").exists())
    # a real bomb: every process forks two more, for a second
    api.sh(sid, "bomb() { bomb & bomb & wait; }; (bomb) 2>/dev/null & sleep 1; kill -9 -1 2>/dev/null; true",
           timeout=20)
    assert int((pids_dir / "pids.current").read_text()) <= 32
    assert int((pids_dir / "pids.events").read_text().split()[-1]) > 0
    assert _recovers(api, sid), "the sandbox did not recover from its fork bomb"


def test_all_sandboxes_together_leave_the_host_process_ids(api, daemon, image):
    """kernel.pid_max is one pool for the host: the daemon's sandboxes share at most half of it, whatever each
    sandbox's own pids limit says."""
    from hutch.sandbox._host.native.cgroups import host_pids_share

    sid = api.create(image, limits={"memory": 128 * 1024**2, "cpu": 1.0, "pids": 4096, "disk": 16 * 1024**2})["id"]
    sb_pids = next(d for d in daemon.cgroup_dirs(sid) if (d / "pids.max").exists())
    parent = sb_pids.parent
    assert int((parent / "pids.max").read_text()) == host_pids_share() <= int(Path("/proc/sys/kernel/pid_max").read_text()) // 2
    # the cap binds below a sandbox's own limit: lower it for a moment to what is running now plus 24
    saved = (parent / "pids.max").read_text().strip()
    cap = int((parent / "pids.current").read_text()) + 24
    try:
        (parent / "pids.max").write_text(str(cap))
        api.sh(sid, "bomb() { bomb & bomb & wait; }; (bomb) 2>/dev/null & sleep 1; kill -9 -1 2>/dev/null; true",
               timeout=20)
        refused = lambda d: int((d / "pids.events").read_text().split()[-1])  # noqa: E731
        # forks were refused (v1 counts it where the fork failed, v2 where the limit is) ...
        assert refused(sb_pids) + refused(parent) > 0
        # ... at the daemon's cap, long before the sandbox's own 4096
        assert int((sb_pids / "pids.peak").read_text()) <= cap < 4096
    finally:
        (parent / "pids.max").write_text(saved)
    assert _recovers(api, sid), "the sandbox did not recover once the cap was back"


# --- nothing outlives its sandbox ---------------------------------------------------------------------

SURVIVORS = ("trap '' TERM HUP INT; "
             "setsid sh -c 'trap \"\" TERM HUP INT; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 & "
             "(sh -c 'trap \"\" TERM HUP; sleep 300' </dev/null >/dev/null 2>&1 &) ; "
             "setsid sh -c '(trap \"\" TERM HUP; exec sleep 301) &' </dev/null >/dev/null 2>&1; "
             "echo started")


def _host_pids_with_start(pids) -> set[tuple[int, str]]:
    """(pid, start time) of the live processes among `pids` (a zombie is dead, only not yet reaped)."""
    out = set()
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            out.add((pid, fields[19]))
    return out


def _still_running(procs: set[tuple[int, str]], within: float = 2.0) -> set[int]:
    deadline = time.monotonic() + within
    while True:
        left = {pid for pid, _ in procs & _host_pids_with_start(pid for pid, _ in procs)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["terminate", "timeout"])
def test_no_process_survives_the_end_of_its_sandbox(api, daemon, image, how):
    sid = api.create(image, timeout=2.5 if how == "timeout" else 120)["id"]
    out, _, _ = api.sh(sid, SURVIVORS)
    assert out == "started\n"
    time.sleep(0.2)
    state = host_state(daemon, sid)
    procs = _host_pids_with_start(state["pids"])
    assert len(procs) >= 5, procs   # init + the four that try to stay
    if how == "terminate":
        api.terminate(sid)
    else:
        r = api.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": 10})
        assert r.json()["status"] == "timeout"
    assert wait_gone(state, 2) == []
    assert _still_running(procs) == set()


def test_an_exec_timeout_leaves_nothing_once_the_sandbox_ends(api, daemon, image):
    sid = api.create(image)["id"]
    r = api.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", SURVIVORS + "; sleep 100"],
                                                        "timeout": 0.5})
    assert r.status_code == 200
    procs = _host_pids_with_start(host_state(daemon, sid)["pids"])
    state = host_state(daemon, sid)
    api.terminate(sid)
    assert wait_gone(state, 2) == [] and _still_running(procs) == set()


# --- snapshots of what a sandbox planted ---------------------------------------------------------------

@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory):
    """A daemon with a private state dir: snapshots land there."""
    with private_state_daemon(tmp_path_factory.mktemp("esc")) as d:
        yield d


def test_a_snapshot_copies_links_not_what_they_point_at(store_daemon, image):
    sapi = Api(store_daemon.sock, store_daemon.run_dir)
    try:
        sid = sapi.create(image, workdir="/")["id"]
        out, err, _ = sapi.sh(sid, "ln -s /etc/shadow /shadow; ln -s /proc/self/fd/2 /log; "
                                   "ln -s /proc/1/root /hostroot; mkfifo /fifo; echo data > /f; ln /f /hard; "
                                   "echo ok")
        assert out == "ok\n", err
        r = sapi.http.post(f"/v1/sandboxes/{sid}/snapshot", json={})
        assert r.status_code == 201, r.text
        fs = store_daemon.state_dir / "layers" / r.json()["layer"] / "fs"
        assert os.readlink(fs / "shadow") == "/etc/shadow" and os.readlink(fs / "log") == "/proc/self/fd/2"
        assert os.readlink(fs / "hostroot") == "/proc/1/root"
        assert not (fs / "fifo").exists() and (fs / "hard").read_text() == "data\n"
        assert stat.S_IMODE(fs.parent.parent.stat().st_mode) == 0o700   # no host user reaches a layer
    finally:
        sapi.close()


def test_volume_calls_stay_in_the_volume_whatever_a_sandbox_planted(store_daemon, image, tmp_path):
    """The daemon does a volume's file calls on the host: links a sandbox left there resolve in the volume."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_text("host secret\n")
    sapi = Api(store_daemon.sock, store_daemon.run_dir)
    try:
        name = f"esc-{os.urandom(3).hex()}"
        assert sapi.http.post("/v1/volumes", json={"name": name, "create": True}).status_code == 200
        sid = sapi.create(image, mounts=[{"kind": "volume", "source": name, "target": "/vol", "readonly": False,
                                          "size": None}])["id"]
        out, err, _ = sapi.sh(sid, f"ln -s {host}/secret /vol/abs; ln -s ../../../../../../../..{host} /vol/up; "
                                   f"ln -s {host} /vol/dir; ln -s /proc/self/fd/2 /vol/log; echo ok")
        assert out == "ok\n", err
        base = f"/v1/volumes/{name}/files"
        for p in ("/abs", "/up/secret", "/dir/secret", "/log"):
            r = sapi.http.get(f"{base}/read", params={"path": p})
            assert r.status_code >= 400 and b"host secret" not in r.content, (p, r.text)
        for p in ("/dir/new", "/up/new"):
            sapi.http.put(f"{base}/write", params={"path": p}, content=b"x")
        sapi.http.post(f"{base}/remove", params={"path": "/dir/secret"})
        sapi.http.post(f"{base}/remove", params={"path": "/up/secret"})
        assert sorted(os.listdir(host)) == ["secret"] and (host / "secret").read_text() == "host secret\n"
        sapi.terminate(sid)
        sapi.http.delete(f"/v1/volumes/{name}")
    finally:
        sapi.close()
