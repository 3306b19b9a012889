"""Helpers of the runtime tests: a raw API client, a daemon subprocess, host-side views of a sandbox."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from hutch.sandbox._host.daemon import cgroup_parent_for

REPO = Path(__file__).resolve().parents[2]
# hang guards, not speed targets: on a loaded 2-core machine a daemon takes 20 s and more to start, and a
# stop tears every sandbox down first (speed is bench/'s, side by side with a peer)
START_WITHIN = 120
STOP_WITHIN = 60
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")   # what a daemon joins on cgroup v1 (freezer: when mounted)


def accepts(sock: Path) -> bool:
    """Whether something accepts connections on the Unix socket `sock`, asked with a plain socket: httpcore (1.0.9)
    leaks its socket (ResourceWarning) when a Unix connect fails, so ask before an httpx call that may meet none."""
    try:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(5)
            probe.connect(str(sock))
            return True
    except OSError:
        return False


class Api:
    """The daemon's raw HTTP API (docs/api.md), blocking, for tests."""

    def __init__(self, sock: Path, run_dir: Path):
        self.sock = sock
        self.run_dir = run_dir
        self.http = uds_client(sock)
        self.created: list[str] = []
        self.runtime: str | None = None   # the runtime create() asks for unless a test names one

    def close(self):
        if self.created and accepts(self.sock):   # (a test may have killed the daemon)
            for sid in self.created:
                try:
                    self.http.post(f"/v1/sandboxes/{sid}/terminate")
                except httpx.HTTPError:
                    pass
        self.http.close()

    def create(self, image: str, **spec) -> dict:
        if self.runtime:
            spec.setdefault("runtime", self.runtime)
        spec.setdefault("detach", True)
        spec.setdefault("timeout", 120)
        r = self.http.post("/v1/sandboxes", json={"spec": {"image": image, **spec}})
        assert r.status_code == 201, r.text
        info = r.json()
        self.created.append(info["id"])
        return info

    def create_error(self, image: str, **spec) -> tuple[int, dict]:
        if self.runtime:
            spec.setdefault("runtime", self.runtime)
        spec.setdefault("detach", True)
        r = self.http.post("/v1/sandboxes", json={"spec": {"image": image, **spec}})
        assert r.status_code >= 400, r.text
        return r.status_code, r.json()

    def exec(self, sid: str, *argv: str, **kw) -> tuple[bytes, bytes, dict]:
        r = self.http.post(f"/v1/sandboxes/{sid}/exec", json={"argv": list(argv), **kw})
        assert r.status_code == 200, r.text
        return split_frames(r.content)

    def sh(self, sid: str, script: str, **kw) -> tuple[str, str, dict]:
        out, err, res = self.exec(sid, "sh", "-c", script, **kw)
        return out.decode(), err.decode(), res

    def terminate(self, sid: str) -> dict:
        r = self.http.post(f"/v1/sandboxes/{sid}/terminate")
        assert r.status_code == 200, r.text
        return r.json()

    def info(self, sid: str) -> dict:
        return self.http.get(f"/v1/sandboxes/{sid}").json()


def split_frames(data: bytes) -> tuple[bytes, bytes, dict]:
    out, err, exit_ = bytearray(), bytearray(), None
    i = 0
    while i < len(data):
        kind, n = struct.unpack(">BI", data[i:i + 5])
        payload = data[i + 5:i + 5 + n]
        i += 5 + n
        if kind == 1:
            out += payload
        elif kind == 2:
            err += payload
        elif kind == 3:
            exit_ = json.loads(payload)
    assert exit_ is not None, "the exec stream ended without an exit frame"
    return bytes(out), bytes(err), exit_


class Daemon:
    """A hutch daemon subprocess with a private run directory."""

    def __init__(self, run_dir: Path, listen: str | None = None, token: str | None = None, env: dict | None = None,
                 tls: tuple[Path, Path] | None = None, prefix: tuple[str, ...] = (), serve_kw: dict | None = None):
        self.extra_env = env or {}
        self.serve_kw = serve_kw or {}   # more keyword arguments of serve() (tenants=...)
        self.tls = tls
        self.prefix = prefix   # a command that execs the daemon (e.g. unshare -m: a mount namespace of its own)
        self.run_dir = run_dir
        self.sock = run_dir / "hutch.sock"
        self.cgroup_parent = cgroup_parent_for(run_dir)
        self.listen, self.token = listen, token
        self.proc: subprocess.Popen | None = None
        self.log = run_dir.parent / f"{run_dir.name}-daemon.log"

    @property
    def env(self) -> dict:
        return dict(os.environ, HUTCH_RUN_DIR=str(self.run_dir), HUTCH_SOCKET=str(self.sock), **self.extra_env)

    def start(self, wait: bool = True) -> "Daemon":
        """Start the daemon (unless it runs already) and, with `wait`, wait until it answers."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            args = f"socket_path=None, listen={self.listen!r}, token={self.token!r}"
            if self.tls:
                args += f", tls_cert={str(self.tls[0])!r}, tls_key={str(self.tls[1])!r}"
            args += "".join(f", {k}={v!r}" for k, v in self.serve_kw.items())
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [*self.prefix, sys.executable, "-c", f"from hutch.sandbox._host.daemon import serve; serve({args})"],
                    env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=str(REPO))
        if not wait:
            return self
        deadline = time.monotonic() + START_WITHIN
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-3000:]}")
            if self._answers_health():
                return self
            time.sleep(0.02)
        raise RuntimeError(f"daemon did not answer within {START_WITHIN} s: {self.log.read_text()[-3000:]}")

    def _answers_health(self) -> bool:
        """Whether this daemon (our pid, not a predecessor's) answers /v1/health (`accepts` first: here most
        connects fail)."""
        if not accepts(self.sock):
            return False
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock))) as c:
                r = c.get("http://h/v1/health", timeout=5)
            return r.status_code == 200 and r.json()["pid"] == self.proc.pid
        except (httpx.HTTPError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_WITHIN)   # a SIGKILL leaves its sandboxes' mounts and cgroups behind
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def cgroup_dirs(self, sid: str) -> list[Path]:
        base = Path("/sys/fs/cgroup")
        if (base / "cgroup.controllers").exists():
            return [base / self.cgroup_parent / sid]
        return [base / c / self.cgroup_parent / sid for c in V1_CONTROLLERS if (base / c / "cgroup.procs").exists()]

    def cleanup_cgroups(self) -> None:
        """Last resort after a failed test: kill what our cgroups hold and remove them."""
        base = Path("/sys/fs/cgroup")
        for parent in [base / self.cgroup_parent] + [c / self.cgroup_parent for c in base.iterdir()]:  # runsc: all
            if not parent.is_dir():
                continue
            for child in [p for p in parent.iterdir() if p.is_dir()] + [parent]:
                for _ in range(200):
                    try:
                        child.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        for pid in (child / "cgroup.procs").read_text().split():
                            try:
                                os.kill(int(pid), signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        time.sleep(0.01)


# --- host-side views of a sandbox ---------------------------------------------------------

@contextmanager
def private_state_daemon(base: Path):
    """A started daemon with a private state dir under `base` (snapshots land there); stopped and its
    cgroups removed at the end."""
    d = Daemon(base / "run", env={"HUTCH_STATE_DIR": str(base / "state")})
    d.state_dir = base / "state"
    try:
        yield d.start()
    finally:
        d.stop()
        d.cleanup_cgroups()


def uds_client(sock: Path, timeout: float = 60, token: str | None = None) -> httpx.Client:
    """A raw HTTP client of the daemon on the Unix socket `sock`: the operator's, or with `token` a tenant's."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://hutch", timeout=timeout,
                        headers={"Authorization": f"Bearer {token}"} if token else None)


@contextmanager
def shared_snapshot_daemon(base: Path, busybox_root: Path, tenant: str, quotas, shared: str):
    """A started daemon (state under `base`) serving one tenant `tenant` with `quotas` (tenants.Quotas), who may use
    `shared`: the operator's memory snapshot of a busybox sandbox (gVisor; a tenant may not use a host directory).
    Yields (daemon, operator client, tenant client); at the end every sandbox is terminated and the daemon
    stopped, its cgroups removed, also when a test failed."""
    from hutch.sandbox._host.daemon import tenants

    tf = base / "etc" / "tenants.json"
    token = tenants.add(tf, tenant, quotas, images=[shared])
    d = Daemon(base / "run", env={"HUTCH_STATE_DIR": str(base / "state"), "HUTCH_WARM_POOL": "0"},
               serve_kw={"tenants": str(tf)})
    d.state_dir, d.tenants_file = base / "state", tf
    op = ten = None
    try:
        d.start()
        op = uds_client(d.sock, timeout=120)
        ten = uds_client(d.sock, timeout=120, token=token)
        r = op.post("/v1/sandboxes", json={"spec": {"image": f"dir:{busybox_root}", "detach": True, "timeout": 120}})
        assert r.status_code == 201, r.text
        src = r.json()["id"]
        r = op.post(f"/v1/sandboxes/{src}/snapshot", json={"name": shared})
        assert r.status_code == 201, r.text
        op.post(f"/v1/sandboxes/{src}/terminate")
        yield d, op, ten
    finally:
        try:
            if op is not None:
                for s in op.get("/v1/sandboxes").json()["sandboxes"]:
                    op.post(f"/v1/sandboxes/{s['id']}/terminate")
        finally:
            for c in (op, ten):
                if c is not None:
                    c.close()
            d.stop()
            d.cleanup_cgroups()


def host_state(daemon: Daemon, sid: str) -> dict:
    """Pids, namespaces and cgroups of a running sandbox, as the host sees them."""
    pids = set()
    for d in daemon.cgroup_dirs(sid):
        pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
    ns = set()
    for pid in pids:
        for kind in ("net", "mnt", "pid_for_children", "ipc", "uts"):
            try:
                ns.add((kind, os.stat(f"/proc/{pid}/ns/{kind}").st_ino))
            except FileNotFoundError:
                pass
    assert pids, f"sandbox {sid} has no processes in its cgroups"
    return {"pids": pids, "ns": ns, "cgroups": daemon.cgroup_dirs(sid), "scratch": daemon.run_dir / "mnt",
            "sid": sid, "parent": daemon.cgroup_parent}


def _in_sandbox_cgroup(pid: str, marker: str) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def leftovers(state: dict) -> list[str]:
    """What of a sandbox still exists: processes, namespaces held by any host process, cgroups.

    Namespace inode numbers are reused once freed, so a process counts only if it also sits in
    this sandbox's cgroup (nothing inside can leave it: cgroupfs is not mounted there).
    """
    left = [f"cgroup {d}" for d in state["cgroups"] if d.exists()]
    marker = f"/{state['parent']}/{state['sid']}"
    wanted = {ino for kind, ino in state["ns"] if kind in ("net", "mnt", "ipc", "uts")}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        for kind in ("net", "mnt", "ipc", "uts"):
            try:
                if os.stat(f"/proc/{entry.name}/ns/{kind}").st_ino in wanted and _in_sandbox_cgroup(entry.name, marker):
                    left.append(f"process {entry.name} in the sandbox's {kind} namespace")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    for pid in state["pids"]:
        if _in_sandbox_cgroup(str(pid), marker):
            left.append(f"process {pid} of the sandbox")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(state.get("scratch", "/nonexistent-scratch")) in line:
            left.append(f"mount {line.split()[4]}")
    return left


def wait_gone(state: dict, within: float) -> list[str]:
    deadline = time.monotonic() + within
    while True:
        left = leftovers(state)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
