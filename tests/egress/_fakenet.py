"""A small fake internet, run inside the test's own "internet" network namespace.

    python _fakenet.py CONFIG.json

Serves, on documentation-range addresses only (plus honeypot addresses that
exist only inside the test namespaces): an authoritative DNS server for the
test zone, HTTP and HTTPS on every web address, TCP echo servers, UDP sinks,
and a forward proxy that would relay CONNECT. Every query, connection and
datagram is appended to the events file as a JSON line, so tests can prove
what did *not* arrive. Prints "ready" when listening; exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import sys
import time

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, A, DNSHeader, DNSRecord


class Events:
    def __init__(self, path):
        self.f = open(path, "a", buffering=1)

    def add(self, kind, **kw):
        kw.update(kind=kind, t=time.time())
        self.f.write(json.dumps(kw) + "\n")


async def main(cfg):
    ev = Events(cfg["events"])
    zone = {k.lower(): v for k, v in cfg["zone"].items()}
    zone6 = {k.lower(): v for k, v in cfg.get("zone6", {}).items()}
    rebind = {k.lower(): v for k, v in cfg.get("rebind", {}).items()}
    cname = {k.lower(): v.lower() for k, v in cfg.get("cname", {}).items()}
    slow = [b"".join(bytes([len(p)]) + p.encode() for p in n.split(".")).decode("latin-1")
            for n in cfg.get("slow_dns", [])]
    asked = {}
    loop = asyncio.get_running_loop()

    def dns_answer(data):
        q = DNSRecord.parse(data)
        name = str(q.q.qname).lower().rstrip(".")
        ev.add("dns", name=name, qtype=QTYPE.get(q.q.qtype))
        r = DNSRecord(DNSHeader(id=q.header.id, qr=1, aa=1, rd=q.header.rd, ra=0), q=q.q)
        if name in cname:
            # like an authoritative server for every zone here: the chain, then the last name's A records
            hop = name
            while hop in cname and len(r.rr) < 8:
                r.add_answer(RR(hop, QTYPE.CNAME, ttl=cfg.get("ttl", 60), rdata=CNAME(cname[hop])))
                hop = cname[hop]
            if q.q.qtype == QTYPE.A:
                for a in zone.get(hop, ()):
                    r.add_answer(RR(hop, QTYPE.A, ttl=cfg.get("ttl", 60), rdata=A(a)))
        elif name in rebind and q.q.qtype == QTYPE.A:
            # each A query gets the next answer in turn, with TTL 0
            n = asked[name] = asked.get(name, -1) + 1
            answers = rebind[name][n % len(rebind[name])]
            ev.add("rebind", name=name, answer=answers)
            for a in answers:
                r.add_answer(RR(q.q.qname, QTYPE.A, ttl=0, rdata=A(a)))
        elif name not in zone and name not in zone6:
            r.header.rcode = RCODE.NXDOMAIN
        elif q.q.qtype == QTYPE.A:
            for a in zone.get(name, ()):
                r.add_answer(RR(q.q.qname, QTYPE.A, ttl=cfg.get("ttl", 60), rdata=A(a)))
        elif q.q.qtype == QTYPE.AAAA:
            for a in zone6.get(name, ()):
                r.add_answer(RR(q.q.qname, QTYPE.AAAA, ttl=60, rdata=AAAA(a)))
        return r.pack()

    class DnsUdp(asyncio.DatagramProtocol):
        def connection_made(self, t):
            self.t = t

        def datagram_received(self, data, addr):
            try:
                if any(n.encode() in data.lower() for n in slow):
                    loop.call_later(1.0, self.t.sendto, dns_answer(data), addr)
                    return
                self.t.sendto(dns_answer(data), addr)
            except Exception as e:  # noqa: BLE001
                ev.add("dns-error", error=str(e))

    await loop.create_datagram_endpoint(DnsUdp, local_addr=(cfg["dns"], 53))

    async def dns_tcp(reader, writer):
        try:
            while True:
                n = struct.unpack("!H", await reader.readexactly(2))[0]
                out = dns_answer(await reader.readexactly(n))
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    await asyncio.start_server(dns_tcp, cfg["dns"], 53)

    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cfg["cert"], cfg["key"])

    def http_handler(local, port, is_tls):
        async def handle(reader, writer):
            ev.add("tcp", local=local, port=port, tls=is_tls)
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    method, path, _ = lines[0].split(" ", 2)
                    hdrs = {}
                    for ln in lines[1:]:
                        if ":" in ln:
                            k, v = ln.split(":", 1)
                            hdrs[k.strip().lower()] = v.strip()
                    if "content-length" in hdrs:
                        await reader.readexactly(int(hdrs["content-length"]))
                    ev.add("http", local=local, port=port, tls=is_tls, method=method, path=path,
                           host=hdrs.get("host"), headers=hdrs)
                    if path.startswith("/echo-headers"):   # a fake API that echoes what it got (credentials)
                        body = json.dumps({"server": local, "headers": hdrs}).encode()
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                        await writer.drain()
                        continue
                    if path.startswith("/bytes/"):
                        n = int(path.split("/")[2])
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                        chunk = b"x" * (1 << 20)
                        while n > 0:
                            writer.write(chunk[:min(n, len(chunk))])
                            n -= len(chunk)
                            await writer.drain()
                        continue
                    if path.startswith("/reset"):   # the server resets the connection
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    if path.startswith("/slow"):
                        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                        for _ in range(600):
                            writer.write(b"2\r\n.\n\r\n")
                            await writer.drain()
                            await asyncio.sleep(0.1)
                        writer.write(b"0\r\n\r\n")
                        continue
                    body = json.dumps({"server": local, "port": port, "host": hdrs.get("host"),
                                       "path": path, "tls": is_tls}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, ValueError, ssl.SSLError, asyncio.LimitOverrunError):
                pass
            writer.close()
        return handle

    for addr in cfg["web"]:
        await asyncio.start_server(http_handler(addr, 80, False), addr, 80)
        await asyncio.start_server(http_handler(addr, 443, True), addr, 443, ssl=tls)
    for addr, port in cfg.get("https_extra", ()):
        await asyncio.start_server(http_handler(addr, port, True), addr, port, ssl=tls)

    def echo_handler(local, port):
        async def handle(reader, writer):
            ev.add("tcp", local=local, port=port, tls=False)
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            writer.close()
        return handle

    for addr, port in cfg["echo"]:
        await asyncio.start_server(echo_handler(addr, port), addr, port)

    class Sink(asyncio.DatagramProtocol):
        def __init__(self, local, port):
            self.local, self.port = local, port

        def datagram_received(self, data, addr):
            ev.add("udp", local=self.local, port=self.port, src=addr[0], size=len(data))

    for addr, port in cfg["udp"]:
        await loop.create_datagram_endpoint(lambda a=addr, p=port: Sink(a, p), local_addr=(addr, port))

    # a forward proxy on an allowed name: it would relay CONNECT and absolute-form requests
    async def fwd(reader, writer):
        ev.add("tcp", local=cfg["proxy"], port=80, tls=False)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].decode()
            method, target, _ = line.split(" ", 2)
            ev.add("proxy-request", method=method, target=target)
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                ev.add("connect-relay", target=target)
                await reader.read(65536)
            else:
                body = json.dumps({"server": cfg["proxy"], "proxied": target}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        writer.close()

    await asyncio.start_server(fwd, cfg["proxy"], 80)

    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        asyncio.run(main(json.load(f)))
