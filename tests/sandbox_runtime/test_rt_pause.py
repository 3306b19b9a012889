"""pause / resume on the native runtime: the cgroup freezer stops every process where it is, memory kept;
an exec or file call resumes it; ending a paused sandbox leaves nothing; on_idle="pause"."""

from __future__ import annotations

import time
from pathlib import Path

from rt_support import host_state, split_frames, uds_client, wait_gone

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.01; done"


def _count(api, sid) -> int:
    r = api.http.get(f"/v1/sandboxes/{sid}/files/read", params={"path": "/tmp/n"})
    assert r.status_code == 200, r.text
    return int(r.content.decode().strip() or 0)


def _freezer_state(daemon, sid) -> str:
    for d in daemon.cgroup_dirs(sid):
        if "freezer" in str(d):
            return (d / "freezer.state").read_text().strip()
    return (daemon.cgroup_dirs(sid)[0] / "cgroup.events").read_text()


def test_pause_stops_a_counter_and_resume_lets_it_carry_on(api, daemon, image):
    sid = api.create(image, command=["sh", "-c", COUNTER])["id"]
    time.sleep(0.3)
    r = api.http.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    assert _freezer_state(daemon, sid) in ("FROZEN", "frozen 1") or "frozen 1" in _freezer_state(daemon, sid)
    assert api.info(sid)["status"] == "paused"
    assert api.http.post(f"/v1/sandboxes/{sid}/pause").json()["status"] == "paused"   # twice: harmless
    # while frozen nothing moves: the host reads the counter's file through the upper layer, not the sandbox
    state = host_state(daemon, sid)
    stats = {pid: Path(f"/proc/{pid}/stat").read_text().split()[2] for pid in state["pids"]}
    assert set(stats.values()) <= {"D", "S", "T", "t"}, stats
    r = api.http.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    before = _count(api, sid)
    time.sleep(0.3)
    assert _count(api, sid) > before, "the counter did not carry on after resume"
    api.terminate(sid)


def test_paused_counter_does_not_count(api, daemon, image):
    sid = api.create(image, command=["sh", "-c", COUNTER])["id"]
    time.sleep(0.2)
    api.http.post(f"/v1/sandboxes/{sid}/pause")
    upper_reads = []
    # read the counter as the host sees it, without a call that would resume the sandbox
    state = host_state(daemon, sid)
    pid = min(state["pids"])
    for _ in range(3):
        upper_reads.append(Path(f"/proc/{pid}/root/tmp/n").read_text())
        time.sleep(0.2)
    assert len(set(upper_reads)) == 1, f"the counter moved while paused: {upper_reads}"
    assert api.info(sid)["status"] == "paused"
    api.http.post(f"/v1/sandboxes/{sid}/resume")
    time.sleep(0.2)
    assert Path(f"/proc/{pid}/root/tmp/n").read_text() != upper_reads[-1]
    api.terminate(sid)


def test_an_exec_resumes_a_paused_sandbox(api, image):
    sid = api.create(image)["id"]
    api.http.post(f"/v1/sandboxes/{sid}/pause")
    out, _, res = api.sh(sid, "echo hi")
    assert (out, res["returncode"]) == ("hi\n", 0)
    assert api.info(sid)["status"] == "running"


def test_terminating_a_paused_sandbox_leaves_nothing(api, daemon, image):
    sid = api.create(image, command=["sh", "-c", COUNTER])["id"]
    state = host_state(daemon, sid)
    api.http.post(f"/v1/sandboxes/{sid}/pause")
    assert api.terminate(sid)["status"] == "terminated"   # a frozen sandbox that hangs this: the call's 60 s timeout
    assert wait_gone(state, 5) == []


def test_a_kill_or_terminate_of_a_paused_sandbox_ends_its_command(api, image):
    """A frozen command takes no signal (SIGKILL included, on cgroup v1) and a frozen gVisor sentry answers no
    runsc call: a kill of a paused sandbox's command resumes the sandbox, as every call acting in it does, and
    the command ends with the signal; a terminate of a paused one ends it and its command."""
    sid = api.create(image)["id"]
    http = uds_client(api.sock, timeout=30)
    try:
        with http.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "60"]}) as r:
            eid = r.headers["X-Hutch-Exec-Id"]
            assert api.http.post(f"/v1/sandboxes/{sid}/pause").json()["status"] == "paused"
            assert api.http.post(f"/v1/sandboxes/{sid}/exec/{eid}/kill", json={"signal": 15}).status_code == 204
            _, _, res = split_frames(r.read())   # the client's timeout (30 s) is the hang guard
        assert res == {"returncode": -15, "reason": "killed"}
        assert api.info(sid)["status"] == "running"
        with http.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["sleep", "60"]}) as r:
            api.http.post(f"/v1/sandboxes/{sid}/pause")
            assert api.terminate(sid)["status"] == "terminated"
            _, _, res = split_frames(r.read())
        assert res["reason"] == "sandbox_ended", res
    finally:
        http.close()


def test_pause_of_an_ended_sandbox_is_a_state_error(api, image):
    sid = api.create(image)["id"]
    api.terminate(sid)
    r = api.http.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 409 and r.json()["error"] == "StateError" and "running" in r.json()["message"]
    r = api.http.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 409 and r.json()["error"] == "StateError"


def test_on_idle_pause_pauses_and_the_next_call_resumes(api, image):
    sid = api.create(image, idle_timeout=0.5, on_idle="pause")["id"]
    deadline = time.monotonic() + 10
    while api.info(sid)["status"] != "paused":
        assert time.monotonic() < deadline, "the idle sandbox was not paused"
        time.sleep(0.1)
    out, _, res = api.sh(sid, "echo back")
    assert out == "back\n"
    assert api.info(sid)["status"] == "running"
    deadline = time.monotonic() + 10
    while api.info(sid)["status"] != "paused":   # idle again: paused again
        assert time.monotonic() < deadline, "the resumed sandbox was not paused again when idle"
        time.sleep(0.1)


def test_on_idle_must_be_known(api, image):
    code, body = api.create_error(image, on_idle="sleep")
    assert code == 400 and body["error"] == "InvalidSpecError" and "on_idle" in body["message"]
