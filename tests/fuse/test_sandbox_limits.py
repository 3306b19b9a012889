"""What a sandbox makes the host do through its memory mount is charged to it (docs/fuse.md, "What the view
costs"): the view server runs in the sandbox's cgroups, indexing a large entity stays within a bounded memory,
and what it writes through the mount counts against its disk limit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import hutch

from sandbox_support import views_settled

MiB = 1 << 20
#: The view's peak (VmHWM) after a sandbox wrote a 16 MiB entity and listed a query: the embedding model's own
#: ~280 MiB, the write buffer and its copies while committing, the index's 1 MiB of units. It was 3 GB.
VIEW_PEAK_MIB = 600


def _view_pid(store) -> int:
    """The view server of `store` (its command line names the store: other tests' views run beside it)."""
    root = str(store.root)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hutch.fuse._mount" in argv and b"--handover" in argv and root.encode() in argv:
            return int(pid)
    raise AssertionError(f"no view server of {root} runs")


def _status(pid: int, key: str) -> int:
    """A figure (kB) of /proc/<pid>/status; 0 once the process is gone (or a zombie, which has no memory)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cgroups(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") or [""]:
                out[c] = path
    return out


def _store_bytes(root) -> int:
    """Disk bytes of the store, its search index left out (a cache, not counted: _quota.py)."""
    out = subprocess.run(["du", "-s", "-B1", "--exclude=.hutch", str(root)], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split()[0])


def test_the_view_runs_in_the_sandbox_cgroups_and_an_oom_stays_there(daemon, image, store):
    with hutch.Sandbox.create(image=image, memory="160M",
                              mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        view = _view_pid(store)
        groups = _cgroups(view)
        v2 = "" in groups and len(groups) == 1
        for controller in ([""] if v2 else ["memory", "pids", "cpu"]):
            assert groups[controller].endswith("/" + sb.id), f"the view's {controller} cgroup is {groups[controller]}"
        # searching loads the embedding model (~280 MiB) into the view: past the sandbox's 160M, the kernel
        # kills the view inside the sandbox's cgroup, not something on the host, and the sandbox lives on
        r = sb.run("sh", "-c", "ls '/memory/search/customer churn/'; echo rc=$?")
        assert "rc=0" not in r.stdout, r.stdout
        assert _status(view, "VmRSS") < 160 * 1024
        assert sb.run("echo", "alive").stdout == "alive\n" and sb.status == "running"
    assert views_settled() == []


def test_a_large_entity_written_in_a_sandbox_costs_the_view_bounded_memory(daemon, image, store):
    with hutch.Sandbox.create(image=image, memory="1G",
                              mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        view = _view_pid(store)
        r = sb.run("sh", "-c", "yes 'the quarterly zebrafish census counts every fin and scale' "
                               f"| head -c {16 * MiB} > /memory/topics/big.md && "
                               "ls '/memory/search/zebrafish census/' && ls '/memory/search/customer churn/' && "
                               "wc -c '/memory/search/zebrafish census/01-topics-big.md'", check=True)
        lines = r.stdout.split()
        assert lines[0] == "01-topics-big.md", r.stdout
        assert "01-orgs-acme.md" in lines, "the search still answers"
        size = os.path.getsize(store.root / "topics" / "big.md")
        assert size > 16 * MiB and str(size) in lines, "the hit reads whole"
        peak = _status(view, "VmHWM") // 1024
        assert peak < VIEW_PEAK_MIB, f"the view peaked at {peak} MiB for a 16 MiB entity"
        assert store.get("topics/big").text.count("zebrafish") > 1000
    assert views_settled() == []


def test_what_a_sandbox_writes_through_its_mount_counts_against_its_disk_limit(daemon, image, store):
    before = _store_bytes(store.root)
    commits = len(store.git.log())
    with hutch.Sandbox.create(image=image, disk="64M",
                              mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        # random bytes: git cannot compress them, each 8 MiB file takes ~16 MiB of the host's disk (the file
        # and git's copy of it); a rewrite keeps the old version in history, so it costs as much again
        r = sb.run("sh", "-c", "i=0; while [ $i -lt 20 ] && dd if=/dev/urandom of=/memory/topics/f$((i % 3)).md "
                               "bs=1M count=8 iflag=fullblock conv=fsync 2>/tmp/err; do i=$((i+1)); done; "
                               "echo written=$i; cat /tmp/err")
        written = int(r.stdout.split("written=")[1].split()[0])
        assert "No space left on device" in r.stdout, r.stdout
        assert 1 <= written < 8, r.stdout
        grown = _store_bytes(store.root) - before
        assert grown <= 64 * MiB + 256 * 1024, f"the store grew by {grown / MiB:.1f} MiB through a 64M sandbox"
        assert grown > 64 * MiB - 2 * 17 * MiB, "the budget is the disk limit, not less"
        assert len(store.git.log()) == commits + written, "a refused write commits nothing"
        status = subprocess.run(["git", "-C", str(store.root), "status", "--porcelain"], capture_output=True,
                                text=True).stdout
        assert status == "", f"a refused write left files behind: {status}"
        # what is left takes small files until it too is spent; the sandbox lives, and reads still work
        r = sb.run("sh", "-c", "i=0; while [ $i -lt 4000 ] && dd if=/dev/urandom of=/memory/topics/s$i.md bs=64K "
                               "count=1 conv=fsync 2>/tmp/err; do i=$((i+1)); done; echo small=$i; cat /tmp/err; "
                               "cat /memory/orgs/acme.md")
        small = int(r.stdout.split("small=")[1].split()[0])
        assert small < 4000 and "No space left on device" in r.stdout and "Acme worries" in r.stdout
        assert not store.exists(f"topics/s{small}")
        grown = _store_bytes(store.root) - before
        assert grown <= 64 * MiB + 256 * 1024, f"the store grew by {grown / MiB:.1f} MiB through a 64M sandbox"
        assert sb.run("echo", "alive").stdout == "alive\n" and sb.status == "running"
    assert views_settled() == []
