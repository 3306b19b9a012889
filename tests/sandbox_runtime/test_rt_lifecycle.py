"""Every way a sandbox ends leaves no process, namespace, mount or cgroup behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from rt_support import Api, Daemon, host_state, leftovers, uds_client, wait_gone


def test_create_exec_terminate_leaves_nothing(api, daemon, image):
    info = api.create(image)
    assert info["status"] == "running"
    out, err, res = api.sh(info["id"], "echo hello; echo oops >&2; exit 3")
    assert (out, err, res) == ("hello\n", "oops\n", {"returncode": 3, "reason": "exited"})
    state = host_state(daemon, info["id"])
    t0 = time.monotonic()
    done = api.terminate(info["id"])
    took = time.monotonic() - t0
    assert done["status"] == "terminated" and done["ended_at"]
    # terminate answers once everything is gone
    assert leftovers(state) == [], f"left after terminate ({took * 1000:.1f} ms)"
    assert not (daemon.run_dir / "sandboxes" / f"{info['id']}.json").exists()


def test_command_sandbox_lives_as_long_as_its_command(api, daemon, image):
    info = api.create(image, command=["sh", "-c", "sleep 0.3; exit 7"])
    state = host_state(daemon, info["id"])
    r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 10})
    assert r.json()["status"] == "exited" and r.json()["returncode"] == 7
    assert wait_gone(state, 2) == []


def test_a_command_quicker_than_create_still_reports_its_exit(api, image):
    for code in (0, 5):
        info = api.create(image, command=["sh", "-c", f"exit {code}"])
        r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 10}).json()
        assert (r["status"], r["returncode"]) == ("exited", code)


def test_wait_times_out_while_running(api, image):
    info = api.create(image)
    r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 0.2})
    assert r.json()["status"] == "running"


def test_timeout_ends_the_sandbox(api, daemon, image):
    info = api.create(image, timeout=1.0)
    state = host_state(daemon, info["id"])
    r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 10})
    assert r.json()["status"] == "timeout"
    assert r.json()["ended_at"] - r.json()["created_at"] < 3
    assert leftovers(state) == []


def test_idle_timeout_waits_for_running_execs(api, daemon, image):
    info = api.create(image, idle_timeout=0.6)
    sid = info["id"]
    state = host_state(daemon, sid)
    _, _, res = api.sh(sid, "sleep 1.2")  # longer than the idle timeout: a running exec is not idle
    assert res["returncode"] == 0
    assert api.info(sid)["status"] == "running"
    r = api.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": 10})
    assert r.json()["status"] == "idle_timeout"
    assert leftovers(state) == []


def test_exec_timeout_kills_only_that_command(api, image):
    sid = api.create(image)["id"]
    t0 = time.monotonic()
    _, _, res = api.exec(sid, "sh", "-c", "sleep 30 & sleep 30", timeout=0.3)
    assert res["reason"] == "timeout" and res["returncode"] == -9
    assert time.monotonic() - t0 < 25   # a hang guard: well before the command's own end at 30 s
    out, _, res = api.sh(sid, "ps -o pid,args | grep 'sleep 30' | grep -v grep | wc -l")
    assert out.strip() == "0", "the timed-out command's process group must be gone"
    assert res["returncode"] == 0 and api.info(sid)["status"] == "running"


def test_stdin_and_kill(api, image):
    sid = api.create(image)["id"]
    with api.http.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["cat"], "stdin": True}) as r:
        eid = r.headers["X-Hutch-Exec-Id"]
        assert api.http.post(f"/v1/sandboxes/{sid}/exec/{eid}/stdin", content=b"abc\n").status_code == 204
        assert api.http.post(f"/v1/sandboxes/{sid}/exec/{eid}/stdin", params={"eof": 1}, content=b"def").status_code == 204
        data = r.read()
    from rt_support import split_frames

    out, _, res = split_frames(data)
    assert out == b"abc\ndef" and res == {"returncode": 0, "reason": "exited"}
    with api.http.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "30"]}) as r:
        eid = r.headers["X-Hutch-Exec-Id"]
        assert api.http.post(f"/v1/sandboxes/{sid}/exec/{eid}/kill", json={"signal": 15}).status_code == 204
        _, _, res = split_frames(r.read())
    assert res == {"returncode": -15, "reason": "killed"}


def test_output_streams_while_the_command_runs(api, image):
    sid = api.create(image)["id"]
    with api.http.stream("POST", f"/v1/sandboxes/{sid}/exec",
                         json={"argv": ["sh", "-c", "echo first; sleep 60; echo second"]}) as r:
        t0 = time.monotonic()
        first = next(r.iter_raw())
        # the first line came while the command still sleeps (it ends at 60 s; 30 is a margin for load, not a
        # speed target); leaving the stream hangs up, which kills the command
        assert b"first" in first and time.monotonic() - t0 < 30


def test_no_lease_means_terminated_after_the_grace(api, daemon, image):
    info = api.create(image, detach=False)
    state = host_state(daemon, info["id"])
    r = api.http.post(f"/v1/sandboxes/{info['id']}/wait", params={"timeout": 15})
    assert r.json()["status"] == "terminated"
    assert leftovers(state) == []


CLIENT = textwrap.dedent("""
    import socket, sys, httpx
    sock, image, detach = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    c = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://hutch")
    info = c.post("/v1/sandboxes", json={"spec": {"image": image, "timeout": 120, "detach": detach}}).json()
    lease = socket.socket(socket.AF_UNIX)
    lease.connect(sock)
    lease.sendall(f"GET /v1/sandboxes/{info['id']}/lease HTTP/1.1\\r\\nHost: hutch\\r\\n\\r\\n".encode())
    assert lease.recv(12).startswith(b"HTTP/1.1 200")  # the daemon holds the lease now
    print(info["id"], flush=True)
    sys.stdin.read()
""")


def test_client_kill9_ends_its_sandbox(api, daemon, image):
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(daemon.sock), image, "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sid = client.stdout.readline().strip()
        assert sid, "the client did not create a sandbox"
        assert api.info(sid)["status"] == "running"
        state = host_state(daemon, sid)
        client.kill()
        client.wait()
        t0 = time.monotonic()
        assert wait_gone(state, 2.0) == []
        assert api.info(sid)["status"] == "terminated", f"after {time.monotonic() - t0:.2f} s"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        client.stdin.close()
        client.stdout.close()


def test_a_detached_sandbox_outlives_its_client(api, daemon, image):
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(daemon.sock), image, "1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sid = client.stdout.readline().strip()
        api.created.append(sid)  # the fixture terminates it
        client.kill()
        client.wait()
        time.sleep(1.0)
        assert api.info(sid)["status"] == "running"
        assert api.sh(sid, "echo still here")[0] == "still here\n"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        client.stdin.close()
        client.stdout.close()


def test_daemon_kill9_then_restart_reaps_everything(tmp_path, image):
    d = Daemon(tmp_path / "run").start()
    try:
        a = Api(d.sock, d.run_dir)
        sids = [a.create(image)["id"] for _ in range(3)]
        sids.append(a.create(image, command=["sleep", "60"])["id"])
        states = [host_state(d, sid) for sid in sids]
        a.http.close()
        d.kill9()
        # the sandboxes die with the daemon (zygote and inits hold PDEATHSIG)
        deadline = time.monotonic() + 2
        for st in states:
            procs_left = [x for x in wait_gone({**st, "cgroups": []}, max(0.0, deadline - time.monotonic()))]
            assert procs_left == []
        assert any(p.exists() for st in states for p in st["cgroups"]), "the cgroups wait for the next daemon"
        d.start(wait=False)
        # a hang guard, not a speed target (it asserted < 2.0 s and took 2.004 s once under load)
        reaped = wait_gone({**states[0], "cgroups": [p for st in states for p in st["cgroups"]]}, 60)
        assert reaped == [], f"the new daemon did not reap within 60 s: {reaped}"
        d.start()  # wait until it serves
        for st in states:
            assert leftovers(st) == []
        assert not [sid for sid in sids if (d.run_dir / "sandboxes" / f"{sid}.json").exists()]
        a = Api(d.sock, d.run_dir)
        sid = a.create(image)["id"]  # and it works again
        assert a.sh(sid, "echo ok")[0] == "ok\n"
        a.close()
    finally:
        d.stop()
        d.cleanup_cgroups()


def test_tcp_needs_the_token(daemon):
    import ssl

    base = f"https://127.0.0.1:{daemon.port}"
    tls = ssl.create_default_context(cafile=str(daemon.tls[0]))
    r = httpx.get(f"{base}/v1/health", verify=tls)
    assert r.status_code == 401 and r.json()["error"] == "DaemonError"
    r = httpx.get(f"{base}/v1/health", headers={"Authorization": "Bearer wrong"}, verify=tls)
    assert r.status_code == 401
    r = httpx.get(f"{base}/v1/health", headers={"Authorization": f"Bearer {daemon.token}"}, verify=tls)
    assert r.status_code == 200 and r.json()["pid"] == daemon.proc.pid


def test_list_by_tag_and_lookup_by_name(api, image):
    a = api.create(image, tags=[["team", "x"], ["k", "1"]], name="named-one")
    b = api.create(image, tags=[["team", "y"]])
    got = api.http.get("/v1/sandboxes", params=[("tag", "team:x")]).json()["sandboxes"]
    assert [s["id"] for s in got] == [a["id"]]
    assert api.info("named-one")["id"] == a["id"]
    all_ids = {s["id"] for s in api.http.get("/v1/sandboxes").json()["sandboxes"]}
    assert {a["id"], b["id"]} <= all_ids
    api.terminate(a["id"])
    assert a["id"] not in {s["id"] for s in api.http.get("/v1/sandboxes").json()["sandboxes"]}


def test_graceful_stop_ends_every_sandbox(tmp_path, image):
    d = Daemon(tmp_path / "run").start()
    try:
        a = Api(d.sock, d.run_dir)
        states = [host_state(d, a.create(image)["id"]) for _ in range(2)]
        a.http.close()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(10)
        for st in states:
            assert leftovers(st) == []
        assert not d.sock.exists()
        assert not any(p.exists() for p in d.cgroup_dirs("_zygote"))
    finally:
        d.stop()
        d.cleanup_cgroups()
    assert os.path.exists(tmp_path)


def _cgroups_of(d: Daemon) -> list[str]:
    base = Path("/sys/fs/cgroup")
    parents = [base / d.cgroup_parent] + [base / c / d.cgroup_parent for c in ("memory", "pids", "cpu")]
    return sorted(str(c) for p in parents if p.is_dir() for c in p.iterdir() if c.is_dir())


def test_a_stop_while_the_daemon_starts_leaves_nothing(tmp_path):
    """SIGTERM the moment the socket appears (what a test harness does when its fixture fails right after
    start), and a little later, while the warm pool is being filled: a clean exit, no cgroup left."""
    for i, delay in enumerate((0.0, 0.0, 0.003, 0.01, 0.03)):
        d = Daemon(tmp_path / f"run{i}").start(wait=False)
        try:
            deadline = time.monotonic() + 20
            while not d.sock.exists() and d.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(delay)
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(20) == 0, f"the daemon died of the signal (delay {delay}): {d.log.read_text()[-800:]}"
            assert _cgroups_of(d) == [], f"delay {delay}"
        finally:
            d.stop()
            d.cleanup_cgroups()


def test_zygote_death_ends_its_sandboxes_and_a_new_one_takes_over(tmp_path, image):
    d = Daemon(tmp_path / "run").start()
    try:
        a = Api(d.sock, d.run_dir)
        sid = a.create(image)["id"]
        state = host_state(d, sid)
        zygotes = [p for p in (d.cgroup_dirs("_zygote")[0] / "cgroup.procs").read_text().split()
                   if _parent(p) == d.proc.pid]  # not an init just cloned from it
        assert len(zygotes) == 1
        os.kill(int(zygotes[0]), signal.SIGKILL)
        r = a.http.post(f"/v1/sandboxes/{sid}/wait", params={"timeout": 5})
        assert r.json()["status"] == "failed"
        assert wait_gone(state, 2) == []
        deadline = time.monotonic() + 5
        while True:  # the daemon starts a new zygote; creating works again
            r = a.http.post("/v1/sandboxes", json={"spec": {"image": image, "detach": True}})
            if r.status_code == 201 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 201, r.text
        a.created.append(r.json()["id"])
        assert a.sh(r.json()["id"], "echo back")[0] == "back\n"
        a.close()
    finally:
        d.stop()
        d.cleanup_cgroups()


def test_large_output_streams_completely(api, image):
    sid = api.create(image)["id"]
    t0 = time.monotonic()
    out, err, res = api.exec(sid, "sh", "-c", "head -c 20000000 /dev/zero; echo done >&2")
    assert len(out) == 20_000_000 and err == b"done\n" and res["returncode"] == 0
    assert time.monotonic() - t0 < 120   # a hang guard (a stalled stream), not a speed target


def _parent(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0


def test_a_client_that_hangs_up_takes_its_command_along(api, image):
    sid = api.create(image)["id"]
    other = uds_client(api.sock, timeout=10)
    with other.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "37"]}) as r:
        assert r.status_code == 200
        assert api.sh(sid, "ps -o args | grep -c '^sleep 37'")[0].strip() == "1"
    other.close()  # the connection goes; the daemon kills the command's process group
    deadline = time.monotonic() + 3
    while True:
        out, _, _ = api.sh(sid, "ps -o args | grep -c '^sleep 37' || true")
        if out.strip() == "0" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert out.strip() == "0"
