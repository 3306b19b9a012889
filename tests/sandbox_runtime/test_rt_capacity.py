"""`hutch serve --max-sandboxes N`: the daemon itself holds the cap, for creates at once too (a fleet node's
cap, docs/fleet.md): over it a create gets a retryable 429 QuotaExceededError and nothing is made."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
from rt_support import Api, Daemon

CAP = 4


def test_a_daemon_at_its_cap_refuses_creates_at_once_and_takes_them_again_later(tmp_path, busybox_root):
    d = Daemon(tmp_path / "run", serve_kw={"max_sandboxes": CAP})
    api = None
    try:
        d.start()
        api = Api(d.sock, d.run_dir)

        def one(_):
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.sock)), base_url="http://hutch",
                              timeout=120) as h:
                r = h.post("/v1/sandboxes", json={"spec": {"image": f"dir:{busybox_root}", "detach": True,
                                                           "timeout": 120}})
                return r.status_code, r.json()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(16)))
        made = [b["id"] for s, b in answers if s == 201]
        api.created += made
        refused = [b for s, b in answers if s != 201]
        assert len(made) == CAP, answers
        assert len(refused) == 16 - CAP and all(b["error"] == "QuotaExceededError" and b["quota"] == "host_sandboxes"
                                                and b["limit"] == CAP and "--max-sandboxes" in b["message"]
                                                for b in refused), refused
        health = api.http.get("/v1/health").json()
        assert health["sandboxes"] == CAP and health["max_sandboxes"] == CAP
        assert len(api.http.get("/v1/sandboxes").json()["sandboxes"]) == CAP   # nothing half-made
        api.terminate(made[0])
        assert api.create(f"dir:{busybox_root}")["status"] == "running"   # retryable: room again, taken again
        status, body = api.create_error(f"dir:{busybox_root}")
        assert status == 429 and body["quota"] == "host_sandboxes"
    finally:
        if api is not None:
            api.close()
        d.stop()
        d.cleanup_cgroups()


def test_a_bad_cap_is_refused_before_anything_starts():
    r = subprocess.run([sys.executable, "-m", "hutch", "serve", "--max-sandboxes", "-1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--max-sandboxes" in r.stderr
