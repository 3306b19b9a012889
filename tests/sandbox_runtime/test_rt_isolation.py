"""Escape-minded tests: what a process inside a sandbox must not be able to do or see."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from rt_support import host_state, wait_gone

# Runs inside the sandbox (host python3 over a read-only bind of /usr): tries each syscall
# the runtime must refuse and prints {name: errno or 0}.
PROBE = textwrap.dedent("""
    import ctypes, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def sc(nr, *args):
        r = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        return 0 if r >= 0 else ctypes.get_errno()
    out = {}
    out["mount"] = 0 if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0 else ctypes.get_errno()
    out["umount"] = sc(166, b"/proc", 0)
    out["unshare_user"] = sc(272, 0x10000000)
    out["unshare_net"] = sc(272, 0x40000000)
    out["clone_newns"] = sc(56, 0x00020000 | 17, 0, 0, 0, 0)
    out["ptrace_traceme"] = sc(101, 0, 0, 0, 0)
    out["init_module"] = sc(175, b"\\0" * 64, 64, b"")
    out["finit_module"] = sc(313, 0, b"", 0)
    out["delete_module"] = sc(176, b"ext4", 0)
    out["kexec_load"] = sc(246, 0, 0, 0, 0)
    out["bpf"] = sc(321, 0, 0, 0)
    out["perf_event_open"] = sc(298, 0, 0, -1, -1, 0)
    out["keyctl"] = sc(250, 0, 0, 0, 0, 0)
    out["add_key"] = sc(248, b"user", b"x", b"y", 1, -4)
    out["setns"] = sc(308, 0, 0)
    out["pivot_root"] = sc(155, b"/", b"/")
    out["reboot"] = sc(169, 0xfee1dead, 672274793, 0x4321fedc, 0)
    out["swapon"] = sc(167, b"/tmp/x", 0)
    out["userfaultfd"] = sc(323, 0)
    out["io_uring_setup"] = sc(425, 1, 0)
    out["open_by_handle_at"] = sc(304, 3, 0, 0)
    out["chroot"] = sc(161, b"/tmp")
    out["mknod"] = 0 if libc.mknod(b"/tmp/sda", 0o60600, os.makedev(8, 0)) == 0 else ctypes.get_errno()
    out["sethostname"] = 0 if libc.sethostname(b"x", 1) == 0 else ctypes.get_errno()
    pidfd = sc(434, 1, 0)  # pidfd_open(1): allowed; taking the init's socket through it is not
    fd1 = libc.syscall(434, 1, 0)
    out["pidfd_getfd_init"] = sc(438, fd1, 3, 0) if fd1 >= 0 else 0
    out["proc_1_fd"] = 1  # the init's descriptors: neither opened nor even named through /proc
    for n in range(64):
        try:
            os.close(os.open(f"/proc/1/fd/{n}", os.O_RDONLY))
            out["proc_1_fd"] = 0
        except OSError:
            pass
        try:
            os.readlink(f"/proc/1/fd/{n}")
            out["proc_1_fd"] = 0
        except OSError:
            pass
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    out["fork"] = 0
    try:
        open("/proc/sys/kernel/hostname", "w").write("pwned")
        out["proc_sys_write"] = 0
    except OSError as e:
        out["proc_sys_write"] = e.errno
    print(json.dumps(out))
""")

MUST_FAIL = ["mount", "umount", "unshare_user", "unshare_net", "clone_newns", "ptrace_traceme", "init_module",
             "finit_module", "delete_module", "kexec_load", "bpf", "perf_event_open", "keyctl", "add_key", "setns",
             "pivot_root", "reboot", "swapon", "userfaultfd", "io_uring_setup", "open_by_handle_at", "chroot",
             "mknod", "sethostname", "proc_sys_write", "pidfd_getfd_init", "proc_1_fd"]


@pytest.fixture
def pysb(api, image, py_mounts):
    return api.create(image, mounts=py_mounts)["id"]


def test_dangerous_syscalls_are_refused(api, pysb):
    out, err, res = api.exec(pysb, "/usr/bin/python3", "-S", "-c", PROBE)
    assert res == {"returncode": 0, "reason": "exited"}, err
    got = json.loads(out)
    assert got["fork"] == 0
    allowed = {k: got[k] for k in MUST_FAIL if got[k] == 0}
    assert allowed == {}, f"these succeeded inside the sandbox: {allowed}"


def test_no_capabilities_no_new_privs_seccomp(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "grep -E '^(CapEff|CapPrm|CapBnd|CapInh|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status")
    fields = dict(line.split(":\t") for line in out.strip().splitlines())
    assert {fields[k] for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")} == {"0000000000000000"}
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"


def test_host_processes_are_invisible(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '")
    pids = [int(p) for p in out.split()]
    assert pids[0] == 1 and len(pids) <= 8 and max(pids) < 50, pids  # init and this pipeline only
    assert str(os.getpid()) not in out.split() or os.getpid() < 10
    out, _, _ = api.sh(sid, "cat /proc/1/cmdline | tr '\\0' ' '")
    assert "pytest" not in out and "systemd" not in out


def test_proc_is_masked_and_sys_is_read_only(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "cat /proc/kcore 2>/dev/null | wc -c; cat /proc/keys | wc -c; "
                            "cat /proc/timer_list | wc -c; ls /proc/acpi 2>/dev/null | wc -l")
    assert out.split() == ["0", "0", "0", "0"]
    out, err, res = api.sh(sid, "echo 1 > /proc/sys/vm/drop_caches")
    assert res["returncode"] != 0 and "Read-only" in err
    out, err, res = api.sh(sid, "echo x > /proc/sysrq-trigger")
    assert res["returncode"] != 0
    out, err, res = api.sh(sid, "touch /sys/x")
    assert res["returncode"] != 0 and "Read-only" in err


def test_dev_is_minimal(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "ls /dev | tr '\\n' ' '")
    assert set(out.split()) == {"fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
                                "tty", "urandom", "zero"}
    out, _, res = api.sh(sid, "head -c 4 /dev/urandom | wc -c; echo x > /dev/null && echo ok")
    assert out.split() == ["4", "ok"]


def test_only_loopback_with_network_none(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "ls /sys/class/net | tr '\\n' ' '; echo; ip -o addr | awk '{print $2, $4}'")
    lines = out.strip().splitlines()
    assert lines[0].split() == ["lo"]
    assert "lo 127.0.0.1/8" in out
    _, err, res = api.sh(sid, "wget -T 1 -q -O- http://192.0.2.1/ 2>&1 || echo failed")
    assert "failed" in _ or res["returncode"] != 0


def test_root_is_the_image_not_the_host(api, image):
    sid = api.create(image)["id"]
    out, _, _ = api.sh(sid, "cat /etc/marker; ls / | tr '\\n' ' '; cat /proc/self/mountinfo | wc -l")
    assert out.startswith("sandbox image\n")
    assert "work" not in out.split() and "farm" not in out.split()
    out, _, _ = api.sh(sid, "ls /tmp/.. /../../.. | sort -u | tr '\\n' ' '")
    assert "marker" not in out and "work" not in out.split()


def test_files_api_cannot_escape_through_symlinks_or_dotdot(api, image):
    sid = api.create(image)["id"]
    api.sh(sid, "ln -s / /tmp/rootlink; ln -s /etc/shadow /tmp/shadowlink; ln -s ../../../../etc /tmp/up")
    host_entries = set(os.listdir("/"))
    r = api.http.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/tmp/rootlink/"})
    names = {e["name"] for e in r.json()["entries"]}
    assert "bin" in names and not ({"work", "farm", "boot"} & names) and names != host_entries
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/tmp/shadowlink"})
    assert r.content == b"root:sandbox-shadow:0:0:99999:7:::\n"  # the image's, never the host's
    if os.path.exists("/etc/shadow"):
        assert r.content != Path("/etc/shadow").read_bytes()
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/../../../etc/marker"})
    assert r.content == b"sandbox image\n"
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/tmp/up/marker"})
    assert r.content == b"sandbox image\n"
    # writes through a symlink stay inside too
    api.sh(sid, "ln -s /etc /tmp/etclink")
    r = api.http.put(f"/v1/sandboxes/{sid}/files/write", params={"path": "/tmp/etclink/hutch-written"}, content=b"x")
    assert r.status_code == 204
    assert not os.path.exists("/etc/hutch-written")
    assert api.sh(sid, "cat /etc/hutch-written")[0] == "x"


def test_memory_limit_oom_is_reported(api, image, py_mounts):
    sid = api.create(image, mounts=py_mounts, limits={"memory": 48 * 1024**2, "cpu": 1.0, "pids": 64,
                                                      "disk": 64 * 1024**2})["id"]
    _, _, res = api.exec(sid, "/usr/bin/python3", "-S", "-c", "b = bytearray(200 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])")
    assert res["reason"] == "oom", res
    assert api.info(sid)["status"] == "running"  # the sandbox survives its command's OOM


def test_oom_of_the_main_command_is_the_sandbox_status(api, daemon, image, py_mounts):
    info = api.create(image, mounts=py_mounts, command=["/usr/bin/python3", "-S", "-c", "b = b'x' * (300 * 1024 * 1024)"],
                      limits={"memory": 48 * 1024**2, "cpu": 1.0, "pids": 64, "disk": 64 * 1024**2})
    r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 20})
    assert r.json()["status"] == "oom", r.json()


def test_pids_limit_stops_a_fork_bomb(api, daemon, image):
    sid = api.create(image, limits={"memory": 256 * 1024**2, "cpu": 1.0, "pids": 24, "disk": 64 * 1024**2})["id"]
    pids_dir = next(d for d in daemon.cgroup_dirs(sid) if (d / "pids.max").exists())
    _, _, res = api.sh(sid, "for i in $(seq 100); do sleep 1 & done 2>/dev/null; wait", timeout=20)
    assert int((pids_dir / "pids.peak").read_text()) <= 24 if (pids_dir / "pids.peak").exists() else True
    events = (pids_dir / "pids.events").read_text()
    assert int(events.split()[-1]) > 0, f"no fork was refused: {events}"
    out, _, res = api.sh(sid, "echo alive")  # the sandbox recovers once the sleeps end
    assert out == "alive\n"


def test_disk_limit_holds_and_harms_no_other_sandbox(api, image):
    small = api.create(image, limits={"memory": 256 * 1024**2, "cpu": 1.0, "pids": 64, "disk": 16 * 1024**2})["id"]
    other = api.create(image)["id"]
    out, err, res = api.sh(small, "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; ls -l /tmp/fill")
    # EDQUOT on the disk store (its quota), ENOSPC on a tmpfs layer (HUTCH_LAYERS=tmpfs)
    assert res["returncode"] == 0 and ("Disk quota exceeded" in out or "No space left" in out), out
    size = int(out.strip().splitlines()[-1].split()[4])
    assert size <= 16 * 1024**2
    r = api.http.put(f"/v1/sandboxes/{small}/files/write", params={"path": "/tmp/more"}, content=b"y" * (4 * 1024**2))
    assert r.status_code == 409 and r.json()["error"] == "StateError" and "disk" in r.json()["message"], r.text
    assert api.sh(small, "ls /tmp/ | grep -c hutch-write || true")[0].strip() == "0"  # nothing half-written
    out, _, res = api.sh(other, "dd if=/dev/zero of=/tmp/ok bs=1M count=8 2>/dev/null && echo fine")
    assert out.strip() == "fine"


def test_writable_layer_is_discarded(api, daemon, image, busybox_root):
    sid = api.create(image)["id"]
    api.sh(sid, "echo changed > /etc/marker; rm /bin/ls; touch /new-file")
    state = host_state(daemon, sid)
    api.terminate(sid)
    assert wait_gone(state, 1) == []
    assert (busybox_root / "etc" / "marker").read_text() == "sandbox image\n"
    assert (busybox_root / "bin" / "ls").is_symlink() and not (busybox_root / "new-file").exists()
    sid2 = api.create(image)["id"]
    assert api.sh(sid2, "cat /etc/marker; ls /new-file 2>&1 | grep -c 'No such'")[0] == "sandbox image\n1\n"


def test_readonly_bind_mount(api, image, tmp_path):
    (tmp_path / "data.txt").write_text("host data")
    sid = api.create(image, mounts=[{"kind": "bind", "source": str(tmp_path), "target": "/data", "readonly": True,
                                     "size": None},
                                    {"kind": "tmpfs", "target": "/scratch", "size": 1024**2, "readonly": False,
                                     "source": None}])["id"]
    out, err, res = api.sh(sid, "cat /data/data.txt; echo x > /data/new 2>&1 || echo refused; "
                                "echo y > /scratch/f && cat /scratch/f")
    assert out == "host data" + "refused\n" + "y\n" or out.startswith("host data"), out
    assert "refused" in out and not (tmp_path / "new").exists()
