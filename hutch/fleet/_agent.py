"""A fleet node's agent: a Ray actor pinned to its node that runs and watches that node's hutch daemon.

The agent claims a slot on its host (a lock file, `slot-N.lock` under the fleet's run root, held for its life:
several Ray nodes on one host each get their own, and a node that comes back after a crash gets the slot the
dead one held, so its daemon finds that run directory and reaps what the old one left). The slot names the
node's key (its sandboxes' ids start with it), its run directory and its socket. The daemon is `python -m
hutch serve --id-prefix KEY --listen IP:PORT --token-file ...`, started with PDEATHSIG on the agent's thread
that supervises it: it lives as long as its agent, and the agent as long as its Ray node. A daemon that
dies is started again (its sandboxes are lost, and say so). Every REPORT seconds the agent sends the
controller the node's row: where its daemon is, whether it answers, how many sandboxes it runs, the host's
CPU, load and memory.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hutch.sandbox._fleet import CONTROLLER, NAMESPACE, local_boot_id

REPORT = 0.5          # seconds between the agent's reports to the controller
START_TIMEOUT = 60.0  # seconds a daemon may take to answer its first health check
SLOTS = 64            # fleet nodes one host can hold
_PR_SET_PDEATHSIG = 1
#: what the daemon must not inherit from the Ray worker's environment
_STRIP = ("HUTCH_URL", "HUTCH_TOKEN", "HUTCH_TOKEN_FILE", "HUTCH_SOCKET", "HUTCH_RUN_DIR", "HUTCH_FINGERPRINT",
          "HUTCH_CA")


def _pdeathsig() -> None:   # in the daemon's child, before exec: end with the agent's supervising thread
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def machine_id() -> str:
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            v = Path(p).read_text().strip()
        except OSError:
            continue
        if v:
            return v
    return socket.gethostname()


def node_key(run_root: Path, slot: int) -> str:
    """The node's key: stable for this host, fleet root and slot (a node that comes back keeps it), unique in
    the fleet."""
    return hashlib.sha256(f"{machine_id()}:{run_root}:{slot}".encode()).hexdigest()[:8]


def meminfo() -> tuple[int, int]:
    total = avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k == "MemTotal":
                total = int(v.split()[0]) * 1024
            elif k == "MemAvailable":
                avail = int(v.split()[0]) * 1024
    except OSError:
        pass
    return total, avail


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NodeAgent:
    """The Ray actor (hutch/fleet/_ops.py starts one per node, NodeAffinitySchedulingStrategy, num_cpus=0)."""

    def __init__(self, token: str, options: dict):
        import ray

        self.options = options
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = options.get("listen_host") or ray.util.get_node_ip_address()
        run_root = Path(options["run_root"])
        run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.slot, self._slot_lock = self._claim(run_root)
        self.key = node_key(run_root, self.slot)
        self.name = f"{socket.gethostname()}/{self.slot}"
        self.run_dir = run_root / self.key
        self.run_dir.mkdir(exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        state = Path(options["state_dir"]) if options.get("state_dir") else None
        self.state_dir = state / self.key if state and options.get("state_per_node") else state
        self.socket = self.run_dir / "hutch.sock"
        self.log = self.run_dir / "daemon.log"
        self.token = token
        self.token_file = self.run_dir / "fleet-token"
        self.cordon_file = self.run_dir / "cordoned"   # there while the node is cordoned (`hutch fleet cordon`)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(self.token_file, 0o600)
        self.port = 0
        self.fingerprint = ""
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.problem = "starting"
        self.live = 0
        self.healthy = False
        self.stopping = False
        self._ready = threading.Event()
        self._start_error = ""
        self._controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        threading.Thread(target=self._supervise, name="hutch-fleet-daemon", daemon=True).start()
        threading.Thread(target=self._report_loop, name="hutch-fleet-report", daemon=True).start()
        self._ready.wait(START_TIMEOUT)

    # --- the slot -------------------------------------------------------------------------

    @staticmethod
    def _claim(run_root: Path):
        for i in range(SLOTS):
            f = open(run_root / f"slot-{i}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            return i, f
        raise RuntimeError(f"all {SLOTS} fleet slots of this host are held ({run_root}/slot-*.lock)")

    # --- the daemon -----------------------------------------------------------------------

    def _env(self) -> dict:
        env = dict(os.environ)   # the Ray worker's, passed on whole but for what names another daemon
        for k in _STRIP:
            env.pop(k, None)
        env.update(HUTCH_RUN_DIR=str(self.run_dir), HUTCH_SOCKET=str(self.socket))
        if self.state_dir:
            env["HUTCH_STATE_DIR"] = str(self.state_dir)
        return env

    def _start(self) -> subprocess.Popen:
        env = self._env()
        if not self.fingerprint:
            out = subprocess.run([sys.executable, "-m", "hutch", "tls-fingerprint"], env=env, capture_output=True,
                                 text=True, timeout=60, cwd="/")
            if out.returncode != 0:
                raise RuntimeError(f"`hutch tls-fingerprint` failed: {out.stderr.strip()}")
            self.fingerprint = out.stdout.strip()
        self.port = self.port or _free_port(self.ip)
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        argv = [sys.executable, "-m", "hutch", "serve", "--socket", str(self.socket), "--id-prefix", self.key,
                "--listen", f"{host}:{self.port}", "--token-file", str(self.token_file),
                "--max-tcp-per-peer", str(self.options.get("max_tcp_per_peer", 256)),
                "--max-sandboxes", str(int(self.options.get("max_per_node", 1000)))]   # the daemon holds the cap
        if self.options.get("tenants"):
            argv += ["--tenants", str(self.options["tenants"])]
        with open(self.log, "ab") as lf:
            return subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=lf, stderr=lf,
                                    start_new_session=True, preexec_fn=_pdeathsig)

    def _health(self) -> dict | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(str(self.socket))
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: hutch\r\nConnection: close\r\n\r\n")
            data = b""
            while len(data) < 1 << 16 and (chunk := s.recv(4096)):
                data += chunk
        except OSError:
            return None
        finally:
            s.close()
        head, _, body = data.partition(b"\r\n\r\n")
        try:
            d = json.loads(body)
        except ValueError:
            return None
        d["ok"] = head[9:12] == b"200"
        return d

    def _supervise(self) -> None:
        """Start the daemon, wait for it, start it again when it dies (with a backoff), until stop()."""
        backoff = 0.2
        while not self.stopping:
            try:
                self.proc = self._start()
            except Exception as e:
                self.problem = f"the daemon could not be started: {e}"
                self._start_error = self.problem
                self._ready.set()
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            deadline = time.monotonic() + START_TIMEOUT
            while not self.stopping and self.proc.poll() is None and time.monotonic() < deadline:
                h = self._health()
                if h is not None and h["ok"]:
                    self.started, self.healthy, self.problem = time.time(), True, ""
                    backoff = 0.2
                    break
                time.sleep(0.05)
            self._ready.set()
            self.proc.wait()
            self.healthy = False
            if not self.stopping:
                self.problem = f"its daemon exited with {self.proc.returncode}; restarting it (log: {self.log})"
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _poll(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.healthy = False
            return
        h = self._health()
        if h is None:
            self.healthy, self.problem = False, "its daemon does not answer on its socket"
        elif not h["ok"]:
            self.healthy, self.problem = False, str(h.get("message") or "its daemon reports itself unhealthy")
        else:
            self.healthy, self.problem, self.live = True, "", int(h.get("sandboxes") or 0)

    def row(self) -> dict:
        total, avail = meminfo()
        return {"key": self.key, "name": self.name, "node_id": self.node_id, "boot_id": local_boot_id(),
                "socket": str(self.socket), "url": f"https://{self.ip}:{self.port}" if ":" not in self.ip
                else f"https://[{self.ip}]:{self.port}", "fingerprint": self.fingerprint, "started": self.started,
                "live": self.live, "max_sandboxes": int(self.options.get("max_per_node", 1000)),
                "cpus": float(os.cpu_count() or 1), "load": os.getloadavg()[0], "mem_total": total,
                "mem_available": avail, "healthy": self.healthy, "problem": self.problem,
                "cordoned": self.cordon_file.exists(),
                "pid": self.proc.pid if self.proc else 0, "agent_pid": os.getpid(), "run_dir": str(self.run_dir),
                "state_dir": str(self.state_dir or "")}

    def _report_loop(self) -> None:
        self._ready.wait(START_TIMEOUT)
        while not self.stopping:
            self._poll()
            try:
                self._controller.report.remote(self.row())
            except Exception:   # the controller restarts: the next report reaches the new one
                pass
            time.sleep(REPORT)

    # --- remote calls -------------------------------------------------------------------------

    def describe(self) -> dict:
        self._poll()
        return self.row()

    def cordon(self, on: bool) -> bool:
        """Record (on) or drop (off) the node's cordon in its run directory, where the slot's next agent finds it:
        a cordon outlives the controller, this agent, the node's daemon and `hutch fleet down`/`up`."""
        if on:
            fd = os.open(self.cordon_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{time.time()}\n")
        else:
            self.cordon_file.unlink(missing_ok=True)
        return on

    def stop(self, timeout: float = 30.0) -> dict:
        """End the daemon (SIGTERM: it ends every sandbox it runs and removes what they had)."""
        self.stopping = True
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.healthy = False
        return {"key": self.key, "returncode": p.returncode if p else None}


def new_token() -> str:
    return secrets.token_hex(32)


__all__ = ["NodeAgent", "machine_id", "meminfo", "new_token", "node_key"]
