"""What a brokered (credential) connection costs the egress gateway's CPU, which is the daemon's, not the sandbox's.

The gateway terminates the sandbox's TLS and opens its own to the real server (broker.py): per connection two
handshakes (one as the server, with the sandbox's per-sandbox CA leaf; one as the client, verifying the real
server), and per byte a decryption, the redaction scan and an encryption. This measures the gateway's share
only, in process (memory BIOs: no network, no kernel): the CPU time (thread_time) of the gateway's calls, with
the sandbox's and the server's side of each connection running beside it but not counted. The peer is the
sandbox's own side of the same work (what the sandbox's cgroup is charged for its TLS).

    .venv/bin/python bench/broker.py [--rounds 200] [--mib 64] [--write]
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hutch.sandbox._host.egress.broker import Redactor, SandboxCA  # noqa: E402

HOST = "api.example.test"
SECRET = b"sk-live-7c1f0e5a9b2d4c3e8f60a1b2c3d4e5f6"


def _pump(a_out: ssl.MemoryBIO, b_in: ssl.MemoryBIO) -> None:
    data = a_out.read()
    if data:
        b_in.write(data)


class Pair:
    """Two SSLObjects joined by memory BIOs; `gw` is the gateway's end, whose calls are timed."""

    def __init__(self, gw_ctx, other_ctx, gw_server: bool, hostname=None):
        self.g_in, self.g_out, self.o_in, self.o_out = (ssl.MemoryBIO() for _ in range(4))
        self.gw = gw_ctx.wrap_bio(self.g_in, self.g_out, server_side=gw_server,
                                  server_hostname=None if gw_server else hostname)
        self.other = other_ctx.wrap_bio(self.o_in, self.o_out, server_side=not gw_server,
                                        server_hostname=hostname if gw_server else None)
        self.gw_cpu = 0.0

    def _gw(self, fn, *a):
        t = time.thread_time()
        try:
            return fn(*a)
        finally:
            self.gw_cpu += time.thread_time() - t

    def handshake(self) -> None:
        done_g = done_o = False
        while not (done_g and done_o):
            if not done_o:
                try:
                    self.other.do_handshake()
                    done_o = True
                except ssl.SSLWantReadError:
                    pass
            _pump(self.o_out, self.g_in)
            if not done_g:
                try:
                    self._gw(self.gw.do_handshake)
                    done_g = True
                except ssl.SSLWantReadError:
                    pass
            _pump(self.g_out, self.o_in)

    def gw_reads(self, data: bytes) -> bytes:
        """The other end sends `data`; the gateway decrypts it."""
        self.other.write(data)
        _pump(self.o_out, self.g_in)
        out = bytearray()
        while len(out) < len(data):
            out += self._gw(self.gw.read, 1 << 20)
        return bytes(out)

    def gw_writes(self, data: bytes) -> None:
        """The gateway encrypts `data`; the other end reads it."""
        self._gw(self.gw.write, data)
        _pump(self.g_out, self.o_in)
        got = 0
        while got < len(data):
            got += len(self.other.read(1 << 20))


def contexts():
    ca = SandboxCA("bench", [HOST])
    down_server = ca.context_for(HOST)                      # the gateway as the server, to the sandbox
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as f:
        f.write(ca.pem)
    sandbox_client = ssl.create_default_context(cafile=f.name)   # the sandbox trusts its CA
    sandbox_client.set_alpn_protocols(["http/1.1"])
    # the real server: a leaf of a CA of its own, which the gateway's upstream context trusts
    server_ca = SandboxCA("upstream", [HOST])
    real_server = server_ca.context_for(HOST)
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as g:
        g.write(server_ca.pem)
    up_client = ssl.create_default_context(cafile=g.name)   # the gateway verifies the server, as broker does
    up_client.minimum_version = ssl.TLSVersion.TLSv1_2
    up_client.set_alpn_protocols(["http/1.1"])
    os.unlink(f.name)
    os.unlink(g.name)
    return down_server, sandbox_client, up_client, real_server


def measure(rounds: int, mib: int) -> dict:
    down_server, sandbox_client, up_client, real_server = contexts()
    hs_gw, hs_sandbox = [], []
    for _ in range(rounds):
        down = Pair(down_server, sandbox_client, gw_server=True, hostname=HOST)
        t = time.thread_time()
        down.handshake()
        total = time.thread_time() - t
        up = Pair(up_client, real_server, gw_server=False, hostname=HOST)
        up.handshake()
        hs_gw.append(down.gw_cpu + up.gw_cpu)
        hs_sandbox.append(total - down.gw_cpu)
    # a download of `mib` MiB through one brokered connection: upstream -> gateway (decrypt, redact) -> sandbox
    down = Pair(down_server, sandbox_client, gw_server=True, hostname=HOST)
    down.handshake()
    up = Pair(up_client, real_server, gw_server=False, hostname=HOST)
    up.handshake()
    red = Redactor([SECRET, b"Bearer " + SECRET])
    chunk = os.urandom(1 << 16)
    down.gw_cpu = up.gw_cpu = 0.0
    red_cpu = 0.0
    for _ in range(mib * 16):
        data = up.gw_reads(chunk)
        t = time.thread_time()
        data = red.feed(data)
        red_cpu += time.thread_time() - t
        down.gw_writes(data)
    per_mib_gw = (down.gw_cpu + up.gw_cpu + red_cpu) / mib
    return {"hs_gw_ms": statistics.median(hs_gw) * 1e3, "hs_gw_p99_ms": sorted(hs_gw)[int(len(hs_gw) * 0.99) - 1] * 1e3,
            "hs_sandbox_ms": statistics.median(hs_sandbox) * 1e3, "mib_gw_ms": per_mib_gw * 1e3,
            "mib_redact_ms": red_cpu / mib * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md")
    a = ap.parse_args()
    load = os.getloadavg()[0]
    r = measure(a.rounds, a.mib)
    text = (f"The gateway's CPU per brokered connection and per MiB (in process, memory BIOs; {a.rounds} "
            f"connections, a {a.mib} MiB download; load average {load:.1f} on 2 cores):\n\n"
            "| what | gateway (daemon) | peer: the sandbox's own side |\n|---|---|---|\n"
            f"| two handshakes (as the server with the sandbox's CA leaf, as the client verifying the real server) "
            f"| {r['hs_gw_ms']:.2f} ms p50, {r['hs_gw_p99_ms']:.2f} ms p99 | {r['hs_sandbox_ms']:.2f} ms (one handshake) |\n"
            f"| 1 MiB downloaded (decrypt, redact, encrypt) | {r['mib_gw_ms']:.2f} ms (redaction "
            f"{r['mib_redact_ms']:.2f} ms) | |\n")
    print(text)
    if a.write:
        from bench._report import write_section

        write_section(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md", "broker.py",
                      "Brokered credentials: the gateway's CPU", text)


if __name__ == "__main__":
    main()
