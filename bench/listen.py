"""The Unix socket's clients while a TCP flood holds the daemon's descriptors (the figure
tests/sandbox_sdk/test_sdk_listen.py prints but does not assert).

    .venv/bin/python bench/listen.py [--pings 200] [--flood 1500]

A private daemon (`hutch serve --listen` on loopback, its own run and state directories) limited to 512
descriptors (soft and hard: `prlimit --nofile=512:512`), as the test's: health pings over its Unix socket,
one after another, with no flood (the peer, in the same run) and then while `--flood` TCP connections from
127.0.0.2... are held open. Prints p50 / p99 of each and their ratio, the pings not answered within 5 s, and
the daemon's descriptors under the flood. The daemon is stopped (SIGTERM) and its directories removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from _report import pct  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "sandbox_sdk"))

from sdk_support import start_remote, stop_remote  # noqa: E402


def row(label, xs, peer=None):
    s = f"{label:<48} p50 {pct(xs, 50):8.2f} ms  p99 {pct(xs, 99):8.2f} ms"
    if peer:
        s += f"   ratio p50 {pct(xs, 50) / pct(peer, 50):.2f}x  p99 {pct(xs, 99) / pct(peer, 99):.2f}x"
    print(s, flush=True)


def pings(sock: Path, n: int) -> tuple[list[float], int]:
    from hutch.sandbox._client import Endpoint, _ping

    ep = Endpoint(socket_path=str(sock))
    out, lost = [], 0
    for _ in range(n):
        t0 = time.monotonic()
        if _ping(ep, 5.0):
            out.append((time.monotonic() - t0) * 1e3)
        else:
            lost += 1
    return out, lost


def flood(port: int, count: int, addresses: int = 40) -> list[socket.socket]:
    out = []
    for i in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.bind((f"127.0.0.{2 + i % addresses}", 0))
        s.connect_ex(("127.0.0.1", port))   # not waited for: beyond the listen queue the SYNs just wait
        out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pings", type=int, default=200)
    ap.add_argument("--flood", type=int, default=1500)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/listen.py needs root (the daemon it starts is root's).")
    os.environ.pop("HUTCH_URL", None)
    d = Path(tempfile.mkdtemp(prefix="hutch-bench-listen-"))
    r = start_remote(d, "--header-timeout", "5", prefix=("prlimit", "--nofile=512:512"))
    try:
        sock = r.run_dir / "run" / "hutch.sock"
        print(f"Unix-socket health pings, daemon limited to 512 descriptors ({os.cpu_count()} CPUs, load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        quiet, lost_q = pings(sock, a.pings)
        conns = flood(r.port, a.flood)
        try:
            time.sleep(1.0)   # the daemon accepts what its caps allow
            loud, lost_l = pings(sock, a.pings)
            fds = len(os.listdir(f"/proc/{r.proc.pid}/fd"))
        finally:
            for s in conns:
                s.close()
        row("no flood", quiet)
        row(f"under a flood of {len(conns)} TCP connections", loud, quiet)
        print(f"{'  not answered within 5 s':<48} {lost_q} quiet, {lost_l} under the flood; daemon descriptors "
              f"under the flood {fds}/512 (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        stop_remote(r)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
