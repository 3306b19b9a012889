"""What a sandbox makes the host do through its memory mount is charged to it (docs/fuse.md, "What the view
costs"): the view server runs in the sandbox's cgroups, and indexing a large entity stays within a bounded
memory."""

from __future__ import annotations

import os

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
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
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
