"""A short, real demonstration of both wings of hutch (`scripts/demo` runs it).

The sandbox half starts real sandboxes from the default image (built once,
with progress on stderr, the first time: a few minutes) and shows an egress
policy at work (it fetches one file from deb.debian.org, the only name it
allows); the memory half keeps a store of plain files in a temporary
directory, ingests examples/data/team-chat.json and searches it by meaning.
"""

from __future__ import annotations

import time
from pathlib import Path

import hutch

HERE = Path(__file__).resolve().parent
#: The one name the egress demo allows, and a file it fetches there (plain HTTP: the gateway checks the Host)
ALLOWED, ALLOWED_URL = "deb.debian.org", "http://deb.debian.org/debian/dists/bookworm/Release"
FETCH = ("import sys, urllib.request\n"
         "for url in sys.argv[1:]:\n"
         "    try:\n"
         "        print(url, '->', urllib.request.urlopen(url, timeout=20).status)\n"
         "    except OSError as e:\n"
         "        print(url, '->', type(e).__name__, getattr(e, 'reason', e))\n")


def sandbox_demo() -> None:
    """Run untrusted code in a fresh sandbox: streamed output, files, limits, errors that carry results."""
    print("== sandboxes")
    t0 = time.perf_counter()
    with hutch.Sandbox.create(timeout=120, memory="512M", cpu=1.0, tags={"demo": "1"}) as sb:
        took = time.perf_counter() - t0
        print(f"sandbox {sb.id} ready in " + (f"{took * 1000:.0f} ms" if took < 10 else f"{took:.0f} s") +
              " (no network, default image; the first call also starts the hutch daemon)")

        p = sb.exec("python3", "-c", "import time\nfor i in range(3):\n    print('tick', i, flush=True); time.sleep(0.3)")
        for line in p.stdout:   # lines arrive while the command runs
            print(f"  [{(time.perf_counter() - t0):5.2f}s] {line}", end="")
        print(f"  exit code {p.wait()}")

        sb.files.write("/home/user/hello.txt", b"hi from the host")
        print("  python3 reads the file we wrote:",
              sb.run("python3", "-c", "print(open('/home/user/hello.txt').read())", check=True).stdout.strip())

        r = sb.run("python3", "-c", "import socket; socket.create_connection(('192.0.2.1', 80), timeout=2)")
        print(f"  network is off by default: exit code {r.returncode}, {r.stderr.strip().splitlines()[-1]}")

        try:
            sb.run("sh", "-c", "echo partial; echo 'something broke' >&2; exit 3", check=True)
        except hutch.ExecError as e:
            print(f"  ExecError carries the result: returncode={e.returncode} stdout={e.stdout!r} stderr={e.stderr!r}")

        t1 = time.perf_counter()
        for _ in range(20):
            sb.run("true")
        print(f"  20 execs of `true`: {(time.perf_counter() - t1) / 20 * 1000:.1f} ms each")
    print(f"sandbox {sb.id} is {sb.status}: its processes, mounts and cgroups are gone")
    t1 = time.perf_counter()
    with hutch.Sandbox.create(tags={"demo": "1"}) as sb2:
        sb2.run("true")
    print(f"another sandbox: create, exec `true`, terminate in {(time.perf_counter() - t1) * 1000:.1f} ms")


def egress_demo() -> None:
    """An egress policy: one allowed name, everything else refused at the gateway, every decision logged."""
    print(f"== egress: a sandbox that may reach {ALLOWED} only")
    with hutch.Sandbox.create(network=hutch.Network.allow(domains=[ALLOWED]), tags={"demo": "1"}) as sb:
        r = sb.run("python3", "-c", FETCH, ALLOWED_URL, "http://example.com/", check=True)
        for line in r.stdout.splitlines():
            print("  " + line)
        seen = []   # a name is asked for twice (A and AAAA): one line each decision
        for d in sb.network_log():
            line = f"  gateway: {d['verdict']:<5} {d['protocol']:<4} {d['name']}:{d['port']}  ({d['reason']})"
            if line not in seen:
                seen.append(line)
                print(line)
        sb.set_network(hutch.Network.none())   # replaced while it runs
        r = sb.run("python3", "-c", FETCH, ALLOWED_URL, check=True)
        print("  after set_network(Network.none()): " + r.stdout.strip())


def memory_demo() -> None:
    """Memory as plain files: entities, symlinked relations, git history, time travel, a check, an ingest."""
    import os
    import shutil
    import subprocess
    import tempfile

    print("== memory (SMF)")
    root = Path(tempfile.mkdtemp(prefix="hutch-demo-mem-"))
    try:
        mem = hutch.Memory(root / "agent-memory")   # creates the directory and its git repository
        alice = mem.put("actors", "Alice Chen", body="Head of data at Acme.",
                        facts=["prefers weekly reports"], source="chat:2026-11-02#14")
        mem.link(alice, "works_at", mem.put("orgs", "Acme"))
        print("  links of actors/alice-chen:", dict(mem.get("actors/alice-chen").links))
        print("  neighbors of orgs/acme:", [(n.relation, n.direction, n.id) for n in mem.neighbors("orgs/acme")])
        mem.supersede("actors/alice-chen", facts=["prefers daily reports"], valid_from="2026-11-20",
                      source="chat:2026-11-20#3", reason="she asked for daily reports")
        print("  now:", mem.get("actors/alice-chen").facts,
              "| as of 2026-11-01:", mem.as_of("2026-11-01").get("actors/alice-chen").facts)
        for v in mem.history("actors/alice-chen"):
            print(f"  history: {v.op:<9} valid {v.valid_from} .. {v.valid_to}  source={v.source}")
        link_dir = mem.root / "actors" / "alice-chen.links" / "works_at"
        print("  on disk:", " ".join(f"{n} -> {os.readlink(link_dir / n)}" for n in os.listdir(link_dir)))
        conv = HERE / "data" / "team-chat.json"   # a short chat in LoCoMo's form: two sessions, two speakers
        t0 = time.perf_counter()
        r = mem.ingest_conversation(conv)
        print(f"  ingested {conv.name}: {r.count} entities, {r.links} links, one commit, "
              f"{(time.perf_counter() - t0) * 1000:.0f} ms")
        print("  turn D1:7 is addressable:", mem.get("interactions/team-chat-session-1").section("D1:7")[:60], "...")
        t0 = time.perf_counter()
        rep = mem.reindex()   # optional: the first search would build the index itself
        print(f"  index built from the files in {time.perf_counter() - t0:.1f} s: {rep.units} turns and notes, "
              f"{rep.vectors} vectors of {rep.model} (a cache under .hutch/, ignored by git)")
        q = "Which hobbies help Priya relax?"   # no turn says "hobby" or "relax": lexical + semantic + graph, fused
        t0 = time.perf_counter()
        hits = mem.search(q, k=1, classes=["interactions"])
        print(f"  search {q!r} in {(time.perf_counter() - t0) * 1000:.0f} ms, the best hit:")
        for h in hits:
            print(f"    {h.entity.id}#{h.anchor}  score={h.score:.2f}  channels={sorted(h.channels)}  {h.text[:60]!r}")
        report = mem.check()
        print(f"  check: {report.entities} entities, {report.links} links, {len(report.errors)} errors")
        log = subprocess.run(["git", "-C", str(mem.root), "log", "--oneline"], capture_output=True, text=True).stdout
        print("  git log:", " | ".join(log.splitlines()[:4]), "...")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def memory_in_sandbox_demo() -> None:
    """Both wings together: a sandbox lists a query directory of a store and writes a note to it."""
    import shutil
    import tempfile
    from pathlib import Path

    print("== memory inside a sandbox (the FUSE view, docs/fuse.md)")
    root = Path(tempfile.mkdtemp(prefix="hutch-demo-mnt-"))
    try:
        mem = hutch.Memory(root / "agent-memory")
        mem.put("orgs", "Acme", body="Acme worries about customer churn: clients cancel after onboarding.")
        mem.put("topics", "Churn", body="Why customers leave.\n")
        with hutch.Sandbox.create(mounts=[hutch.MemoryMount(mem, "/memory", writable=True)], tags={"demo": "1"}) as sb:
            r = sb.run("sh", "-c", "ls '/memory/search/customer churn/' && "
                                   "echo '- onboarding is the main cause' >> /memory/topics/churn.md", check=True)
            print("  in the sandbox, ls '/memory/search/customer churn/':", r.stdout.split())
            v = mem.history("topics/churn")[0]
            last = mem.get("topics/churn").body.strip().splitlines()[-1]
            print(f"  on the host, topics/churn: {v.op} committed by {v.source}, ending {last!r}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    sandbox_demo()
    egress_demo()
    memory_demo()
    memory_in_sandbox_demo()


if __name__ == "__main__":
    main()
