"""Egress gateway benchmarks, side by side with a direct path over the same kind of veth.

    .venv/bin/python bench/egress.py [--quick]

Builds the conformance suite's fake internet (tests/egress/egress_world.py: a
"host" netns running the Gateway, an "internet" netns with DNS and HTTP), plus
one "direct" netns whose veth to the same host is plainly routed (forwarding on
inside the fake host only), and measures (p50 and p99):

  set-up:     new TCP connection + one small HTTP request/response, through the
              proxy vs direct; the difference is what the gateway adds;
  bulk:       one 1 GiB HTTP download through the proxy vs direct (MB/s);
  attach:     Gateway.attach with an allow policy to an existing netns, and detach;
  create:     hutch.Sandbox.create with an allow policy vs with none, through the
              daemon (busybox root), i.e. what a policy adds to sandbox creation;
  scale:      200 attached netns, each holding 2 connections and asking DNS once,
              on one gateway: errors and time;
  dns flood:  one sandbox's lookups (sequential, 2 s each at most) while another floods
              the resolver from two processes as fast as they can send, vs the same
              lookups with no flood (tests/egress/test_dns_limits.py asserts that none of
              them is limited or dropped; the latency is this figure).

Nothing leaves the namespaces it creates; all are removed at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import pct  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "egress"))

from egress_world import GW, World, sh  # noqa: E402

from hutch import Network  # noqa: E402

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

CLIENT = r"""
import json, socket, sys, time
host, addr, n, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
req = ("GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, host)).encode()
def once():
    s = socket.create_connection((addr, 80), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(req)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, body = buf.split(b"\r\n\r\n", 1)
    length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    got = len(body)
    mv = bytearray(1 << 20)
    while got < length:
        k = s.recv_into(mv)
        if not k:
            raise RuntimeError("short body")
        got += k
    s.close()
    return got
if path.startswith("/bytes/"):
    t = time.perf_counter(); got = once(); dt = time.perf_counter() - t
    print(json.dumps({"bytes": got, "seconds": dt}))
else:
    once()   # warm-up (DNS cache, ARP)
    out = []
    for _ in range(n):
        t = time.perf_counter(); once(); out.append((time.perf_counter() - t) * 1e3)
    print(json.dumps(out))
"""


def row(label, xs, peer=None, unit="ms"):
    s = f"{label:<44} p50 {pct(xs, 50):8.3f} {unit}  p99 {pct(xs, 99):8.3f} {unit}"
    if peer:
        s += f"   ratio p50 {pct(xs, 50) / pct(peer, 50):.2f}x"
    print(s, flush=True)


def in_netns(netns, *argv, timeout=120):
    return subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


def direct_netns(world) -> str:
    """A netns routed plainly through the fake host (no gateway): the peer path."""
    name = f"hutch-eg-direct-{world.tag}"
    link = f"hutchd{world.tag}"
    sh("ip", "netns", "add", name)
    sh("ip", "link", "add", link, "netns", world.host, "type", "veth", "peer", "name", "eth0", "netns", name)
    sh("ip", "-n", world.host, "addr", "add", "198.19.0.1/32", "dev", link)
    sh("ip", "-n", world.host, "link", "set", link, "up")
    sh("ip", "-n", world.host, "route", "add", "198.19.0.2/32", "dev", link)
    sh("ip", "-n", name, "addr", "add", "198.19.0.2/32", "dev", "eth0")
    sh("ip", "-n", name, "link", "set", "eth0", "up")
    sh("ip", "-n", name, "link", "set", "lo", "up")
    sh("ip", "-n", name, "route", "add", "198.19.0.1/32", "dev", "eth0")
    sh("ip", "-n", name, "route", "add", "default", "via", "198.19.0.1", "dev", "eth0")
    # forwarding only inside the fake host netns, which routes nowhere but the fake internet
    in_netns(world.host, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    sh("ip", "-n", world.inet, "route", "add", "198.19.0.0/24", "via", "192.0.2.254", "dev", "inet0", "onlink")
    return name


def bench_setup_and_bulk(world, n, bulk_mb):
    sb = world.sandbox(Network.allow(domains=["www.example.test"]))
    direct = direct_netns(world)
    try:
        via = json.loads(in_netns(sb.netns, sys.executable, "-c", CLIENT, "www.example.test", "192.0.2.10", str(n), "/"))
        dir_ = json.loads(in_netns(direct, sys.executable, "-c", CLIENT, "www.example.test", "192.0.2.10", str(n), "/"))
        row("connection + small request, direct", dir_)
        row("connection + small request, via gateway", via, dir_)
        added = pct(via, 50) - pct(dir_, 50)
        print(f"{'  added by the gateway at p50':<44} {added:8.3f} ms   (target <= 1 ms)", flush=True)
        path = f"/bytes/{bulk_mb << 20}"
        res = {}
        for label, ns in (("direct", direct), ("via gateway", sb.netns)):
            rates = []
            for _ in range(3):
                r = json.loads(in_netns(ns, sys.executable, "-c", CLIENT, "www.example.test", "192.0.2.10", "1", path))
                rates.append(r["bytes"] / r["seconds"] / 1e6)
            res[label] = statistics.median(rates)
            print(f"{'bulk ' + str(bulk_mb) + ' MiB download, ' + label:<44} {res[label]:8.0f} MB/s (median of 3)",
                  flush=True)
        print(f"{'  ratio gateway/direct':<44} {res['via gateway'] / res['direct']:8.2f}x  (target >= 300 MB/s)")
    finally:
        world.drop_sandbox(sb)
        sh("ip", "netns", "del", direct, check=False)


def bench_attach(world, n):
    names = []
    att, det = [], []
    gw = world.gw
    try:
        for i in range(n):
            name = f"hutch-eg-att-{world.tag}-{i}"
            sh("ip", "netns", "add", name)
            names.append(name)
        pol = Network.allow(domains=["www.example.test"])
        for i, name in enumerate(names):
            t = time.perf_counter()
            gw.call(gw.gw.attach(f"att{i}", f"/run/netns/{name}", pol))
            att.append((time.perf_counter() - t) * 1e3)
        for i in range(n):
            t = time.perf_counter()
            gw.call(gw.gw.detach(f"att{i}"))
            det.append((time.perf_counter() - t) * 1e3)
        row("Gateway.attach (veth, addresses, both rule sets)", att)
        row("Gateway.detach (link, elements, conntrack)", det)
    finally:
        for i in range(n):
            gw.call(gw.gw.detach(f"att{i}"))
        for name in names:
            sh("ip", "netns", "del", name, check=False)


def _setns(fd):
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def bench_scale(world, count, per):
    """`count` attached netns, each holding `per` connections, one process opening them all via setns."""
    names = []
    gw = world.gw
    pol = Network.allow(domains=["www.example.test"])
    errors = 0
    socks = []
    t0 = time.perf_counter()
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        for i in range(count):
            name = f"hutch-eg-many-{world.tag}-{i}"
            sh("ip", "netns", "add", name)
            names.append(name)
            gw.call(gw.gw.attach(f"many{i}", f"/run/netns/{name}", pol))
        t_attach = time.perf_counter() - t0
        query = (b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03www\x07example\x04test\x00\x00\x01\x00\x01")
        t1 = time.perf_counter()
        for name in names:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                _setns(fd)
                u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                u.settimeout(5)
                for _ in range(per):
                    s = socket.socket()
                    s.settimeout(10)
                    socks.append(s)
            finally:
                _setns(home)
                os.close(fd)
            try:
                u.sendto(query, (GW, 53))
                if not u.recv(512)[6:8] == b"\x00\x01":
                    errors += 1
            except OSError:
                errors += 1
            u.close()
        for s in socks:
            try:
                s.connect(("192.0.2.10", 80))
                s.sendall(b"GET / HTTP/1.1\r\nHost: www.example.test\r\n\r\n")
            except OSError:
                errors += 1
        for s in socks:
            try:
                if b"192.0.2.10" not in s.recv(4096):
                    errors += 1
            except OSError:
                errors += 1
        held = time.perf_counter() - t1
        # all connections still open: one more request on each
        for s in socks:
            try:
                s.sendall(b"GET /again HTTP/1.1\r\nHost: www.example.test\r\n\r\n")
                if b"/again" not in s.recv(4096):
                    errors += 1
            except OSError:
                errors += 1
        print(f"{count} netns attached in {t_attach:.2f} s; {len(socks)} connections + {count} DNS queries "
              f"in {held:.2f} s; errors: {errors}", flush=True)
    finally:
        for s in socks:
            s.close()
        os.close(home)
        t2 = time.perf_counter()
        for i in range(len(names)):
            gw.call(gw.gw.detach(f"many{i}"))
        print(f"{len(names)} detached in {time.perf_counter() - t2:.2f} s", flush=True)
        for name in names:
            sh("ip", "netns", "del", name, check=False)
    return errors


def bench_dns_flood(world, n):
    """The latency of one sandbox's lookups while another floods the shared resolver, vs with no flood."""
    from test_dns_limits import FLOOD, PROBE   # the test's own flood and probe (tests/egress is on sys.path)

    def probe(sb):
        r = sb.run(sys.executable, "-c", PROBE, str(n), GW, "www.example.test,api.example.test", timeout=n * 3 + 60)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        return [t * 1e3 for t, _, _ in got if t is not None], sum(t is None for t, _, _ in got)

    flooder = world.sandbox(Network.allow(domains=["www.example.test"]))
    other = world.sandbox(Network.allow(domains=["www.example.test", "api.example.test"]))
    floods = []
    try:
        probe(other)   # warm: both names in the resolver's cache
        quiet, lost_quiet = probe(other)
        pre = ["ip", "netns", "exec", flooder.netns, "setpriv", "--bounding-set=-all", "--inh-caps=-all",
               "--no-new-privs", "--"]
        floods = [subprocess.Popen([*pre, sys.executable, "-c", FLOOD, str(n * 0.03 + 1), "0", GW],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
        time.sleep(0.5)
        loud, lost_loud = probe(other)
        sent = 0
        for p in floods:   # each ends on its own (its seconds are about the probe's), printing what it sent
            out = p.communicate(timeout=n * 3 + 60)[0]
            sent += json.loads(out.strip().splitlines()[-1])["sent"]
        row("lookups of a sandbox, no flood", quiet)
        row("the same under another's DNS flood", loud, quiet)
        print(f"{'  unanswered (2 s each)':<44} {lost_quiet} quiet, {lost_loud} under a flood of {sent} queries",
              flush=True)
    finally:
        for p in floods:
            if p.poll() is None:
                p.kill()
                p.wait()
        world.drop_sandbox(flooder)
        world.drop_sandbox(other)


def bench_create(world, n):
    """Sandbox.create with an allow policy vs none, through a daemon in the fake host netns."""
    import hutch

    busybox = shutil.which("busybox")
    if not busybox:
        print("create: skipped (busybox-static not installed)")
        return
    root = Path(tempfile.mkdtemp(prefix="hutch-bench-root-"))
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-run-"))
    proc = None
    try:
        (root / "bin").mkdir()
        shutil.copy2(busybox, root / "bin" / "busybox")
        for a in ("sh", "true", "cat", "wget"):
            os.symlink("busybox", root / "bin" / a)
        for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        sock = run_dir / "hutch.sock"
        env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock),
                   HUTCH_EGRESS_RESOLVERS="192.0.2.53", HUTCH_EGRESS_SUBNET="198.18.2.0/24")
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{world.host}", sys.executable, "-m", "hutch", "serve"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock))
        image = hutch.Image.from_directory(root)
        res = {}
        for label, net in (("none", Network.none()), ("allow", Network.allow(domains=["www.example.test"]))):
            xs = []
            for i in range(n + 3):
                t = time.perf_counter()
                sb = hutch.Sandbox.create(image=image, network=net, timeout=60)
                sb.run("true")
                dt = (time.perf_counter() - t) * 1e3
                sb.terminate()
                if i >= 3:
                    xs.append(dt)
            res[label] = xs
        row("Sandbox.create + exec true, Network.none()", res["none"])
        row("Sandbox.create + exec true, Network.allow()", res["allow"], res["none"])
        print(f"{'  added by an allow policy at p50':<44} {pct(res['allow'], 50) - pct(res['none'], 50):8.3f} ms")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(20)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 256 MiB bulk, 50 netns at scale")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/egress.py needs root (it creates network namespaces).")
    n = 100 if a.quick else 500
    world = World(Path(tempfile.mkdtemp(prefix="hutch-bench-egress-")))
    errors = 0
    try:
        world.up()
        print(f"egress gateway benchmark ({os.cpu_count()} CPUs)\n", flush=True)
        # creation first: tearing down many netns keeps the kernel's rtnl lock busy for seconds
        # afterwards, and every veth creation waits for it
        bench_create(world, 20 if a.quick else 50)
        bench_setup_and_bulk(world, n, 256 if a.quick else 1024)
        bench_attach(world, 30 if a.quick else 100)
        bench_dns_flood(world, 60 if a.quick else 300)
        errors = bench_scale(world, 50 if a.quick else 200, 2)
    finally:
        world.down()
        shutil.rmtree(world.tmp, ignore_errors=True)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
