"""A memory store on a real 3-node Ray cluster: one writer actor, a bare git remote, a reader per node.

The cluster is this module's own (ray.cluster_utils.Cluster, every node on 127.0.0.2 with fleet_support's
node_args). The pytest process never joins it: the clients are driver processes, as a user's would be, and the
test kills their writer's node with the cluster's own handle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fleet_support import GUARD, hutch_cli, node_args, read_line

from hutch.fleet import init_remote

N = 40          # writes in the stream
KILL_AT = 12    # acknowledged writes before the writer's node is killed
#: how long the stream's handle waits for a write's acknowledgement (its `timeout`; the library's default is
#: 180 s): across the writer's move that is Ray declaring the node dead, starting the writer on another node and
#: its new clone, which took over 180 s on a loaded 2-core machine. A hang guard, not a speed target.
WRITE_WAIT = 3 * GUARD

# A client: starts (or finds) the store, its writer on the worker nodes (they have the resource WRITER), then
# streams puts and prints each acknowledgement as one JSON line, then the store's status.
STREAM = r"""
import json, sys, time
import hutch.fleet as fleet
name, remote, root, n, wait = sys.argv[1:]
mem = fleet.memory(name, remote=remote, root=root, writer_options={"resources": {"WRITER": 0.01}},
                   timeout=float(wait))
print(json.dumps({"writer": mem.status()["node_id"]}), flush=True)
for i in range(int(n)):
    t = time.monotonic()
    e = mem.put("notes", f"note {i}", body=f"payload zq{i}x of the stream", source=f"test:{i}")
    print(json.dumps({"i": i, "id": e.id, "path": str(e.path), "commit": mem.commit,
                      "s": time.monotonic() - t}), flush=True)
print(json.dumps({"status": mem.status()}), flush=True)
"""

# A client that asks every live node's reader (and the handle's own choice) for each note by its token.
SEARCH = r"""
import json, sys
import ray
import hutch.fleet as fleet
from hutch.fleet._memstore import reader_name
name, n, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mem = fleet.memory(name)
out = {"readers": {}, "handle": []}
for node in [x["NodeID"] for x in ray.nodes() if x["Alive"]]:
    r = ray.get_actor(reader_name(name, node), namespace="hutch")
    found = []
    for i in range(n):
        a = ray.get(r.read.remote("search", (f"zq{i}x",), {"k": 3}, commit), timeout=300)
        found.append([a["commit"], [h.entity_id for h in a["result"]]])
    out["readers"][node] = found
hits = mem.search(f"zq{n - 1}x", k=3)
out["handle"] = [h.entity_id for h in hits]
out["text"] = hits[0].text if hits else ""
out["get"] = mem.get(f"notes/note-{n - 1}").body
print(json.dumps(out), flush=True)
"""

DOWN = r"""
import json, sys
import ray
import hutch.fleet as fleet
print(json.dumps(fleet.memory_down(sys.argv[1])), flush=True)
print(json.dumps([a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]), flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="hutch-fleet-mem-"))
    # every agent port chosen (fleet_support.node_args): left to Ray, a loaded host's raylet dies waiting for them
    c = None
    try:
        for attempt in range(3):   # a raylet that does not register in Ray's own 30 s (a loaded machine): again
            try:
                c = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **node_args()})
                workers = [c.add_node(**node_args(), resources={"WRITER": 1}) for _ in range(2)]
                break
            except Exception:
                if c is not None:
                    c.shutdown()
                    c = None
                if attempt == 2:
                    raise
                time.sleep(10)
        env = dict(os.environ, RAY_ADDRESS=c.address)
        env.pop("HUTCH_URL", None)
        yield SimpleNamespace(cluster=c, workers=workers, tmp=tmp, env=env)
    finally:
        if c is not None:
            c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def driver(cluster, script: str, *args: str, timeout: float = 3 * GUARD) -> list[dict]:
    p = subprocess.run([sys.executable, "-c", script, *args], env=cluster.env, capture_output=True, text=True,
                       timeout=timeout, cwd="/")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith(("{", "["))]


def git(remote: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(remote), *args], capture_output=True, text=True,
                          check=True).stdout


def ours(root: Path) -> list[str]:
    """Processes whose command line names the clones' root (git cat-file, fetch, ...)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if str(root).encode() in (p / "cmdline").read_bytes():
                    out.append(f"{p.name}: {(p / 'cmdline').read_bytes()[:200]!r}")
            except OSError:
                pass
    return out


def test_killing_the_writers_node_mid_stream_loses_no_acknowledged_write(cluster):
    remote = Path(init_remote(cluster.tmp / "notes.git"))
    root = cluster.tmp / "clones"
    with open(cluster.tmp / "stream.err", "w") as stream_err:   # the child has its own copy of the fd
        p = subprocess.Popen([sys.executable, "-c", STREAM, "notes", str(remote), str(root), str(N), str(WRITE_WAIT)],
                             env=cluster.env, stdout=subprocess.PIPE, stderr=stream_err, text=True, cwd="/")
    err = lambda: (cluster.tmp / "stream.err").read_text()[-4000:]  # noqa: E731
    acks, status, killed_at = [], None, None
    try:
        first = json.loads(read_line(p.stdout, "{") or "{}")
        if "writer" not in first:
            p.wait(timeout=60)
            raise AssertionError(f"the client did not start: {err()}")
        victim = next(w for w in cluster.workers if w.node_id == first["writer"])
        for line in p.stdout:
            if not line.startswith("{"):
                continue   # Ray's own word to its drivers that a node died ("(raylet) Raylet is terminated ...")
            msg = json.loads(line)
            if "status" in msg:
                status = msg["status"]
                break
            acks.append(msg)
            if len(acks) == KILL_AT:   # the stream goes on: the next write is in flight as the node dies
                killed_at = time.monotonic()
                cluster.cluster.remove_node(victim, allow_graceful=False)
                cluster.workers.remove(victim)
        assert p.wait(timeout=WRITE_WAIT + GUARD) == 0, err()   # a hang guard: the handle gives up first
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    assert killed_at is not None and status is not None, (acks[-3:], err())
    # every write of the stream was acknowledged, in order, each on a commit of its own ...
    assert [a["i"] for a in acks] == list(range(N))
    assert len({a["commit"] for a in acks}) == N
    assert all(a["path"] == f"notes/note-{a['i']}.md" for a in acks)
    # ... and every acknowledged one is on the remote, once: the writer's death lost none, a retry doubled none
    head = git(remote, "rev-parse", "main").strip()
    assert head == acks[-1]["commit"] == status["commit"]
    for a in acks:
        assert git(remote, "merge-base", "--is-ancestor", a["commit"], "main") == ""   # (raises if not)
        assert f"zq{a['i']}x" in git(remote, "show", f"main:{a['id']}.md")
    subjects = git(remote, "log", "--format=%s", "main").splitlines()
    assert sorted(s for s in subjects if s.startswith("put ")) == sorted(f"put notes/note-{i}" for i in range(N))
    requests = [r for r in git(remote, "log", "--format=%(trailers:key=Hutch-Request,valueonly)", "main").split()]
    assert len(requests) == len(set(requests)) == N
    # the writer runs again, on another node; the write in flight waited for it (and was acknowledged: above).
    # How long that took is a figure, not an assertion (docs/fleet.md quotes it with the load)
    assert status["node_id"] != victim.node_id
    slowest = max(a["s"] for a in acks[KILL_AT:])
    print(f"the longest write across the writer's move took {slowest:.1f} s at load {os.getloadavg()[0]:.1f}")
    # readers on the other nodes find every write by search, at the remote's commit
    live = {n.node_id for n in [cluster.cluster.head_node, *cluster.workers]}
    out = driver(cluster, SEARCH, "notes", str(N), head)[-1]
    assert set(out["readers"]) == live
    for node, found in out["readers"].items():
        for i, (commit, ids) in enumerate(found):
            assert commit == head, (node, i, commit)
            assert ids[:1] == [f"notes/note-{i}"], (node, i, ids)
    assert out["handle"][:1] == [f"notes/note-{N - 1}"] and f"zq{N - 1}x" in out["text"]
    assert f"zq{N - 1}x" in out["get"]
    # the store ends with nothing left: no actor, no clone, no process of it
    down, names = driver(cluster, DOWN, "notes")
    assert not [n for n in names if n.startswith("hutch-mem:")], names
    assert {d["node_id"] for d in down if "removed" in d} == live, down
    assert not root.joinpath("notes").exists(), sorted(str(x) for x in root.rglob("*"))[:20]
    deadline = time.monotonic() + 60
    while ours(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours(root) == []
    assert git(remote, "rev-parse", "main").strip() == head   # the remote is the store: kept


ERRORS = r"""
import json, sys
import hutch, hutch.fleet as fleet
remote, other, root = sys.argv[1:]
out = {}
def err(f):
    try:
        f()
    except hutch.Error as e:
        return [type(e).__name__, str(e)]
    return None
mem = fleet.memory("errs", remote=remote, root=root, readers=False)
a = mem.put("notes", "once", body="one")
out["again"] = err(lambda: mem.put("notes", "once"))
out["other_remote"] = err(lambda: fleet.memory("errs", remote=other))
out["no_store"] = err(lambda: fleet.memory("nosuch"))
out["bad_name"] = err(lambda: fleet.memory("Bad Name", remote=remote))
out["ext"] = err(lambda: fleet.memory("x", remote="ext::sh -c id"))
out["relative"] = err(lambda: fleet.memory("x", remote="notes.git"))
out["fixed"] = err(lambda: fleet.memory("y", remote=remote, writer_options={"max_restarts": 0}))
out["no_reader"] = err(lambda: mem.search("one"))
out["updated"] = mem.update(a, add_facts=["two"]).facts
fleet.memory_down("errs")
print(json.dumps(out), flush=True)
"""


def test_a_writes_error_comes_back_as_it_is_and_bad_input_is_refused(cluster):
    remote = init_remote(cluster.tmp / "errs.git")
    out = driver(cluster, ERRORS, remote, str(cluster.tmp / "other.git"), str(cluster.tmp / "clones"))[-1]
    assert out["again"][0] == "EntityExistsError"               # the writer's error, not Ray's wrapping of it
    assert out["other_remote"][0] == "ConfigError" and remote in out["other_remote"][1]
    assert out["no_store"][0] == "ConfigError" and "hutch.fleet.memory('nosuch', remote=" in out["no_store"][1]
    assert out["bad_name"][0] == "ConfigError"
    assert out["ext"][0] == "ConfigError" and "runs a program" in out["ext"][1]
    assert out["relative"][0] == "ConfigError" and "absolute path" in out["relative"][1]
    assert out["fixed"][0] == "ConfigError" and "max_restarts" in out["fixed"][1]
    assert out["no_reader"][0] == "MemoryStoreError" and "no reader answered" in out["no_reader"][1]
    assert out["updated"] == ["two"]
    assert "two" in git(Path(remote), "show", "main:notes/once.md")


# A store whose remote moves on under its writer (another writer's push landing late, as one still running on a
# node Ray gave up on would), then a writer restart over a clone with git's lock files left in it (a git process
# killed with its node leaves them): the writes go on, none is done twice.
STALE = r"""
import json, os, subprocess, sys
import ray
import hutch.fleet as fleet
from hutch.fleet._memstore import writer_name
remote, root, other = sys.argv[1:]
def git(*a, cwd=other):
    return subprocess.run(["git", "-C", cwd, *a], capture_output=True, text=True, check=True).stdout.strip()
def foreign(name, rid):
    git("pull", "-q", "origin", "main")
    open(os.path.join(other, name), "w").write("not from the writer\n")
    git("add", name)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"foreign {name}\n\nHutch-Request: {rid}")
    git("push", "-q", "origin", "HEAD:main")
    return git("rev-parse", "HEAD")
mem = fleet.memory("stale", remote=remote, root=root, readers=False)
mem.put("notes", "first", body="one")
subprocess.run(["git", "clone", "-q", remote, other], check=True, capture_output=True)
out = {"foreign": foreign("late.txt", "ab" * 16)}
e = mem.put("notes", "second", body="two")          # its first push is refused: the remote moved on
out["second"] = mem.commit
w = ray.get_actor(writer_name("stale"), namespace="hutch")
out["again"] = ray.get(w.write.remote("ab" * 16, "put", ("notes", "doubled"), {}))["again"]
clone = mem.status()["clone"]
out["foreign2"] = foreign("later.txt", "cd" * 16)
for lock in ("index.lock", "refs/remotes/origin/main.lock", "refs/heads/main.lock"):
    open(os.path.join(clone, ".git", lock), "w").close()
ray.kill(w, no_restart=False)                          # Ray starts it again, over that clone
mem.put("notes", "third", body="three")
out["third"] = mem.commit
out["status"] = mem.status()
fleet.memory_down("stale")
print(json.dumps(out), flush=True)
"""


def test_a_writer_goes_on_when_the_remote_moved_under_it_and_over_a_dead_writers_locks(cluster):
    remote = Path(init_remote(cluster.tmp / "stale.git"))
    root = cluster.tmp / "stale-clones"
    out = driver(cluster, STALE, str(remote), str(root), str(cluster.tmp / "stale-other"))[-1]
    log = git(remote, "log", "--format=%H %s", "main").splitlines()
    subjects = [line.split(" ", 1)[1] for line in log]
    # every write once, on top of the foreign commits; the request the foreign commit carried was not done again
    assert [s for s in subjects if s.startswith(("put ", "foreign"))][::-1] == [
        "put notes/first", "foreign late.txt", "put notes/second", "foreign later.txt", "put notes/third"], subjects
    assert out["again"] is True
    assert git(remote, "merge-base", "--is-ancestor", out["foreign"], out["second"]) == ""
    assert git(remote, "rev-parse", "main").strip() == out["third"] == out["status"]["commit"]
    assert not root.joinpath("stale").exists(), sorted(str(x) for x in root.rglob("*"))[:20]


# One entity rewritten on every commit (body zqvK) while another thread searches a reader for random K: each
# answer names the commit it was read at, which the test holds against the remote's file at that commit.
FLIP = r"""
import json, random, sys, threading, time
import ray
import hutch.fleet as fleet
from hutch.fleet._memstore import reader_name
remote, root, m = sys.argv[1], sys.argv[2], int(sys.argv[3])
mem = fleet.memory("flip", remote=remote, root=root)
e = mem.put("notes", "counter", body="zqv0")
here = ray.get_runtime_context().get_node_id()
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
node = next((n for n in nodes if n != here), here)
while True:
    try:
        r = ray.get_actor(reader_name("flip", node), namespace="hutch"); break
    except ValueError:
        import time; time.sleep(0.2)
done, top, answers, errors = threading.Event(), [0], [], []
def search():
    while not done.is_set():
        k = random.randint(max(0, top[0] - 2), top[0])
        try:
            a = ray.get(r.read.remote("search", (f"zqv{k}",), {"k": 3}, None), timeout=120)
        except Exception as ex:   # a reader between commits answers StateError: not a wrong answer
            errors.append(type(ex).__name__)
            continue
        answers.append([a["commit"], k, any("bm25" in h.channels for h in a["result"])])
t = threading.Thread(target=search)
t.start()
for k in range(1, m + 1):
    mem.update(e, body=f"zqv{k}")
    top[0] = k
    time.sleep(0.3)   # readers fetch every 0.5 s: on an idle machine 25 updates take under one fetch otherwise
done.set()
t.join()
fleet.memory_down("flip")
print(json.dumps({"answers": answers, "errors": errors, "node": node}), flush=True)
"""


def test_a_reader_answers_from_one_commit_never_a_stale_or_half_updated_view(cluster):
    remote = Path(init_remote(cluster.tmp / "flip.git"))
    out = driver(cluster, FLIP, str(remote), str(cluster.tmp / "clones"), "25")[-1]
    answers = out["answers"]
    commits = {c for c, _, _ in answers}
    assert len(answers) >= 20 and len(commits) >= 3, (len(answers), len(commits), out["errors"][:5])
    for commit, k, found in answers:
        body = git(remote, "show", f"{commit}:notes/counter.md")
        assert found == (f"zqv{k}\n" in body or body.endswith(f"zqv{k}")), (commit, k, found, body[-40:])
    assert any(found for _, _, found in answers) and not all(found for _, _, found in answers)


def test_the_cli_starts_shows_and_ends_a_store(cluster):
    remote, root = cluster.tmp / "cli.git", cluster.tmp / "cli-clones"
    ray = ["--ray", cluster.cluster.address]
    r = hutch_cli("fleet", "memory", "clinotes", *ray, "--remote", str(remote), "--init-remote", "--root", str(root),
                  "--json", env=cluster.env)
    assert r.returncode == 0, r.stderr[-3000:]
    st = json.loads(r.stdout)
    assert st["remote"] == str(remote) and st["commit"] == git(remote, "rev-parse", "main").strip()
    r = hutch_cli("fleet", "memory", "clinotes", *ray, env=cluster.env)
    assert r.returncode == 0 and f"commit {st['commit'][:12]}" in r.stdout, r.stdout + r.stderr[-2000:]
    r = hutch_cli("fleet", "memory", "clinotes", *ray, "--remote", "ext::sh -c id", env=cluster.env)
    assert r.returncode != 0 and "runs a program" in r.stderr
    r = hutch_cli("fleet", "memory", "clinotes", *ray, "--down", env=cluster.env)
    assert r.returncode == 0 and "clinotes: down" in r.stdout, r.stderr[-2000:]
    assert not (root / "clinotes").exists()
    r = hutch_cli("fleet", "memory", "clinotes", *ray, env=cluster.env)
    assert r.returncode != 0 and "no memory store 'clinotes'" in r.stderr
