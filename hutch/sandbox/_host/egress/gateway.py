"""The egress gateway: one per host, asyncio, serving every sandbox's DNS and TCP.

    gw = Gateway(upstream_resolvers=["192.0.2.53"])
    await gw.start()
    await gw.attach("sb-1", pid_or_netns_fd, Network.allow(domains=["api.example.com"]))
    await gw.set_policy("sb-1", Network.none())
    gw.log("sb-1")
    await gw.detach("sb-1")
    await gw.stop()

A sandbox whose policy is `none` has no link at all. Any other policy gives it
a veth `hv<hex>` whose host end carries the gateway address and whose
sandbox end (`eth0`) a /32 of the link subnet; that address is how the
resolver and the proxy know which sandbox (and so which policy) asks.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dnslib import QTYPE, RCODE

from hutch._core import settings
from hutch._core.errors import ConfigError, NetworkPolicyError, NotFoundError, SandboxError, StateError
from hutch.sandbox._host.egress import netns as _netns
from hutch.sandbox._host.egress.audit import DecisionLog, LogView
from hutch.sandbox._host.egress.broker import Budget, SandboxCA, Share, upstream_context
from hutch.sandbox._host.egress.dns import ANSWER_TTL, Lane, Resolver, ResolveError, Upstream
from hutch.sandbox._host.egress.policy import (AddressRules, Verdict, chain_allowed, name_allowed, normalize_name,
                                           port_allowed)
from hutch.sandbox._host.egress.proxy import Proxy, delivered_locally
from hutch.sandbox._spec import Network

#: The sandbox link subnet. 198.18.0.0/15 is reserved for benchmarking (RFC 2544): never
#: routed on the internet and unlikely to clash with the host's own networks.
DEFAULT_SUBNET = "198.18.0.0/16"
DEFAULT_PROXY_PORT = 15001
DEFAULT_DNS_PORT = 53
FALLBACK_DNS_PORT = 15053
DEFAULT_TABLE = "hutch_egress"
HOST_ADDRESS_REFRESH = 5.0   # seconds


@dataclass(frozen=True)
class Attachment:
    """What attach() set up: the host link name, the sandbox's address and the gateway's."""

    sandbox_id: str
    link: str | None
    address: str | None
    gateway: str


@dataclass(eq=False)
class _SandboxNet:
    """A sandbox as the gateway knows it: its policy, network namespace, link, connections and logs."""

    id: str
    policy: Network
    netns_fd: int
    index: int | None = None
    link: str | None = None
    address: str | None = None
    conns: set = field(default_factory=set)
    log: DecisionLog = field(default_factory=lambda: DecisionLog(time.monotonic()))
    dns: Lane = field(default_factory=lambda: Lane(time.monotonic()))
    conns_refused: int = 0     # connections reset for going over the proxy's per-sandbox limit
    connects_dropped: int = 0  # SYNs the host dropped over netns.CONNECT_RATE, on links it no longer has
    relayed: int = 0           # bytes the proxy moved for it, both ways (a tenant's egress quota is charged from it)
    held: int = 0              # bytes of its connections the proxy holds while reading them (proxy.HELD_MAX)
    plain: bool = False        # its link takes a plain address (a gVisor sandbox: see netns.Plumber.add)
    # link changes (attach, set_policy, detach) take turns: a detach must not close the netns fd
    # while a link is being built through it (a reused fd number would name another namespace)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    detached: bool = False
    ca: SandboxCA | None = None                       # made when the sandbox first has a credential (broker.py)
    tls: Share = field(default_factory=Share)         # its share of the gateway's TLS work (broker.py)
    budgets: dict = field(default_factory=dict)       # host -> Budget of its credential; ("entry", e) -> policy's

    def entry_budget(self, entry: str) -> Budget | None:
        """The policy's budget of one of its entries (a domain or cidr entry, or "open"), None without one.
        Its counts outlive a policy change (the limits follow the policy in force), so no change resets a minute."""
        rpm, bpm = self.policy.requests_per_minute, self.policy.bytes_per_minute
        b = self.budgets.get(("entry", entry))
        if b is None:
            if rpm is None and bpm is None:
                return None
            b = self.budgets[("entry", entry)] = Budget(rpm, bpm, f"the budget of {entry}")
        else:
            b.requests, b.nbytes = rpm, bpm
        return b if rpm is not None or bpm is not None else None

    def release(self) -> None:
        if self.netns_fd >= 0:
            os.close(self.netns_fd)
            self.netns_fd = -1


def _resolvers_from(value) -> list[tuple[str, int]]:
    if value is None:
        value = _system_resolvers()
    out = []
    for v in value:
        host, port = (v if isinstance(v, tuple) else (str(v), 53))
        if isinstance(v, str) and v.count(":") == 1:
            host, p = v.split(":")
            port = int(p)
        try:
            ipaddress.IPv4Address(host)
        except ValueError as e:
            raise ConfigError(f"upstream resolver {v!r} is not an IPv4 address; give one like '192.0.2.53'.") from e
        out.append((host, int(port)))
    if not out:
        raise ConfigError("the gateway needs at least one upstream resolver; none was given and "
                          "/etc/resolv.conf lists no IPv4 nameserver.")
    return out


def _system_resolvers() -> list[str]:
    if given := settings.EGRESS_RESOLVERS.get():
        return list(given)
    out = []
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        ipaddress.IPv4Address(parts[1])
                        out.append(parts[1])
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


class Gateway:
    """The host's egress gateway. All methods are coroutines except `log` and `attachment`.

    The gateway takes the network namespace of the thread that calls `start()`
    as "the host". Upstream resolvers default to HUTCH_EGRESS_RESOLVERS, then
    /etc/resolv.conf.
    """

    def __init__(self, upstream_resolvers=None, *, subnet: str | None = None, subnets: list[str] | None = None,
                 proxy_port: int = DEFAULT_PROXY_PORT, dns_port: int = DEFAULT_DNS_PORT, table: str = DEFAULT_TABLE,
                 link_prefix: str = "hv", upstream_ca: str | None = None):
        # A subnet given (or HUTCH_EGRESS_SUBNET) is used as it is; else start() takes the first of the
        # candidates `subnets` that nothing on the host uses.
        given = subnet or settings.EGRESS_SUBNET.get() or (None if subnets else DEFAULT_SUBNET)
        self._candidates = [_subnet_of(s) for s in ([given] if given else subnets)]
        self._probe = not given
        if len(link_prefix) + 8 > 15:
            raise ConfigError(f"link_prefix {link_prefix!r} is too long: with 8 hex digits it must fit in 15 "
                              "characters (IFNAMSIZ).")
        self._resolvers = _resolvers_from(upstream_resolvers)
        self.proxy_port = proxy_port
        self.dns_port = dns_port
        self._table = table
        self._prefix = link_prefix
        self._use_subnet(self._candidates[0])
        self._upstream = Upstream(self._resolvers)
        self._resolver = Resolver(self._dns_decide, self._lane_of)
        self._proxy = Proxy(self)
        # how credential hosts are dialed: their certificates verified (HUTCH_EGRESS_UPSTREAM_CA, else the host's)
        self.upstream_tls = upstream_context(upstream_ca)
        self._sandboxes: dict[str, _SandboxNet] = {}
        self._by_addr: dict[str, _SandboxNet] = {}
        self._free_next = 2
        self._used: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None      # attach: creates links and rules
        self._cleanup: ThreadPoolExecutor | None = None   # removal, off the create path
        self._pending: set[asyncio.Future] = set()
        self._refresher: asyncio.Task | None = None
        self._host_fd = -1
        self._started = False

    def _use_subnet(self, net: ipaddress.IPv4Network) -> None:
        self._subnet = net
        self.gateway_address = str(net.network_address + 1)
        self._rules = AddressRules(net)
        self._plumber = _netns.Plumber(table=self._table, gw=self.gateway_address, subnet=str(net),
                                       dns_port=self.dns_port, proxy_port=self.proxy_port, prefix=self._prefix)

    async def _claim_subnet(self) -> socket.socket:
        """Pick the subnet and hold it: the proxy's socket listening on its gateway address, which no other
        gateway of this network namespace can then listen on (a check of addresses alone would race)."""
        loop = asyncio.get_running_loop()
        in_use = []
        if self._probe:
            in_use = await loop.run_in_executor(self._pool, _netns.networks_in_use, self._prefix, self._table)
        refused = []
        for net in self._candidates:
            user = next((who for used, who in in_use if net.overlaps(used)), None)
            if user:
                refused.append(f"{net}: {user}")
                continue
            self._use_subnet(net)
            s = None
            try:
                s = self._listen_socket(socket.SOCK_STREAM, self.gateway_address, self.proxy_port)
                s.listen(4096)
                return s
            except OSError as e:
                if s is not None:
                    s.close()
                if e.errno != errno.EADDRINUSE:
                    raise
                if not self._probe:
                    raise SandboxError(f"the egress subnet {net} is another gateway's on this host "
                                       f"({self.gateway_address}:{self.proxy_port} is taken); give this one "
                                       "another subnet (HUTCH_EGRESS_SUBNET).") from e
                refused.append(f"{net}: {self.gateway_address}:{self.proxy_port} is another gateway's")
        raise SandboxError("no egress subnet is free on this host (" + "; ".join(refused) + "); end a daemon "
                           "that holds one, or give this one a free IPv4 subnet in HUTCH_EGRESS_SUBNET.")

    # --- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Install the host rules and start the resolver and the proxy."""
        if self._started:
            return
        loop = asyncio.get_running_loop()
        _raise_nofile()
        self._host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        host_fd = self._host_fd
        # one thread does all plumbing: setns moves only that thread, and netlink/nft
        # sockets stay bound to the namespace they were opened in
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hutch-egress",
                                        initializer=_netns.setns, initargs=(host_fd,))
        self._cleanup = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hutch-egress-cleanup",
                                           initializer=_netns.setns, initargs=(host_fd,))
        dns_socks, proxy_sock = (), None
        try:
            proxy_sock = await self._claim_subnet()
            # bind first: if the DNS port is taken on this host, fall back to another one,
            # which the host rules then redirect port 53 to
            try:
                dns_socks = self._bind_pair(self.dns_port)
            except OSError:
                if self.dns_port != DEFAULT_DNS_PORT:
                    raise
                self.dns_port = FALLBACK_DNS_PORT
                dns_socks = self._bind_pair(self.dns_port)
            self._plumber.dns_port = self.dns_port
            await loop.run_in_executor(self._pool, self._plumber.setup, host_fd)
            addrs = await loop.run_in_executor(self._pool, self._plumber.host_addresses)
            self._rules.set_host_addresses(addrs)
            await self._resolver.start(dns_socks)
            await self._proxy.start(proxy_sock)
            self._refresher = loop.create_task(self._refresh_host_addresses())
        except BaseException:
            for s in (*dns_socks, proxy_sock):
                if s is not None:
                    s.close()
            await self._teardown()
            raise
        self._started = True

    async def stop(self) -> None:
        """Detach every sandbox, stop serving, remove the host rules."""
        for sid in list(self._sandboxes):
            await self.detach(sid)
        await self._teardown()
        self._started = False

    async def _refresh_host_addresses(self) -> None:
        # the host's addresses may change (DHCP, new bridges); the proxy never dials them
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HOST_ADDRESS_REFRESH)
            try:
                addrs = await loop.run_in_executor(self._pool, self._plumber.host_addresses)
                self._rules.set_host_addresses(addrs)
            except Exception:  # noqa: BLE001 - keep the last known list
                pass

    async def _teardown(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        await self._proxy.stop()
        await self._resolver.stop()
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        if self._pool:
            loop = asyncio.get_running_loop()
            links = [s.link for s in self._sandboxes.values() if s.link]
            await loop.run_in_executor(self._pool, self._plumber.teardown, links)
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._cleanup:
            self._cleanup.shutdown(wait=True)
            self._cleanup = None
        if self._host_fd >= 0:
            os.close(self._host_fd)
            self._host_fd = -1

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    def _bind_pair(self, port: int) -> tuple[socket.socket, socket.socket]:
        u = self._listen_socket(socket.SOCK_DGRAM, self.gateway_address, port)
        try:
            return u, self._listen_socket(socket.SOCK_STREAM, self.gateway_address, port)
        except OSError:
            u.close()
            raise

    def _listen_socket(self, kind: int, host: str, port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, kind)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # the gateway address lives on hv* links, which come and go with sandboxes
            s.setsockopt(socket.SOL_IP, 15, 1)   # IP_FREEBIND
            s.bind((host, port))
            s.setblocking(False)
        except BaseException:   # a port in use (the caller tries the next): not left to the garbage collector
            s.close()
            raise
        return s

    # --- sandboxes ---------------------------------------------------------

    async def attach(self, sandbox_id: str, netns, policy: Network, *, plain: bool = False) -> Attachment:
        """Register a sandbox; unless its policy is `none`, give it a link and rules now.

        `netns`: the sandbox's network namespace as an open fd or a path such as
        /proc/PID/ns/net. Call before the sandbox's command runs.
        """
        self._require_started()
        policy = _check_policy(policy)
        if sandbox_id in self._sandboxes:
            raise StateError(f"sandbox {sandbox_id} is already attached to the gateway; detach it first.")
        fd = _netns.open_netns(netns)
        sb = _SandboxNet(sandbox_id, policy, fd, plain=plain)
        _give_ca(sb, policy)
        sb.dns.note = lambda reason, sb=sb: self._record(sb, None, None, 53, "dns", "deny", reason, metered=False)
        self._sandboxes[sandbox_id] = sb
        try:
            async with sb.lock:
                if policy.mode != "none" and not sb.detached:
                    await self._plumb(sb)
        except BaseException:
            if self._sandboxes.get(sandbox_id) is sb:
                self._sandboxes.pop(sandbox_id)
                sb.release()
            raise
        return self.attachment(sandbox_id)

    def attachment(self, sandbox_id: str) -> Attachment:
        sb = self._get(sandbox_id)
        return Attachment(sb.id, sb.link, sb.address, self.gateway_address)

    def ca_pem(self, sandbox_id: str) -> bytes | None:
        """The PEM certificate of the sandbox's CA, which its trust store must hold (None: no credential)."""
        sb = self._get(sandbox_id)
        return sb.ca.pem if sb.ca is not None else None

    def relayed(self, sandbox_id: str) -> int:
        """Bytes the proxy moved for the sandbox so far, both ways (0 if it is not attached)."""
        sb = self._sandboxes.get(sandbox_id)
        return sb.relayed if sb is not None else 0

    def attached(self, sandbox_id: str) -> bool:
        return sandbox_id in self._sandboxes

    async def set_policy(self, sandbox_id: str, policy: Network, *, keep_link: bool = False) -> None:
        """Replace the sandbox's policy as a whole; connections it forbids are reset now. Network.none() removes
        the link, unless `keep_link` (a gVisor sandbox: its netstack took the link over at start and cannot
        take a new one, so it keeps it, and the rules refuse everything through it)."""
        sb = self._get(sandbox_id)
        policy = _check_policy(policy)
        old = sb.policy
        _give_ca(sb, policy)
        for host in [h for h in sb.budgets if dict(policy.credentials).get(h) != dict(old.credentials).get(h)]:
            del sb.budgets[host]   # a new credential (or none) starts its own minute
        sb.policy = policy
        self._record(sb, None, None, None, "policy", "allow", f"policy replaced: {_describe(old)} -> {_describe(policy)}")
        for conn in list(sb.conns):
            v = self._proxy.recheck(conn, policy)
            if not v:
                self._record(sb, conn.name, conn.address, conn.port, conn.kind, "deny",
                             f"reset by a policy change: {v.reason}")
                conn.close(reset=True)
        async with sb.lock:
            if sb.detached:
                raise NotFoundError(f"sandbox {sandbox_id} was detached from the egress gateway while its "
                                    "policy changed; it has no network.")
            # the latest policy decides: calls queue in order on the lock
            if sb.policy.mode == "none" and sb.link and not keep_link:
                await self._unplumb(sb)
            elif sb.policy.mode != "none" and not sb.link:
                await self._plumb(sb)

    def log(self, sandbox_id: str) -> LogView:
        """The sandbox's decisions kept (oldest first; iterate it like a list), and counts of the rest.

        Refusals and policy changes are kept apart from allowed decisions, every drop is counted, and
        what the resolver's and the proxy's limits held back is in `limits` (see audit.py, docs/egress.md).
        """
        sb = self._get(sandbox_id)
        over_rate = sb.connects_dropped + (self._plumber.connects_dropped(sb.address) if sb.address else 0)
        return sb.log.view({**sb.dns.counters(), "tcp_over_connection_limit": sb.conns_refused,
                            "tcp_over_connect_rate": over_rate, **sb.tls.counters()})

    async def detach(self, sandbox_id: str, *, wait: bool = True) -> None:
        """Remove everything the sandbox had: connections, link, rules, conntrack entries.

        The sandbox is cut off at once. With `wait=False` the kernel objects (a veth
        deletion takes ~20 ms) go in the background; `stop()` waits for them.
        """
        sb = self._sandboxes.pop(sandbox_id, None)
        if sb is None:
            return
        sb.detached = True
        sb.policy = Network.none()    # a link still being built serves nothing
        for conn in list(sb.conns):
            conn.close(reset=True)
        async with sb.lock:           # waits for a link being built, then removes it
            try:
                if sb.link:
                    await self._unplumb(sb, wait=wait)
            finally:
                sb.release()

    # --- internals ---------------------------------------------------------

    @property
    def started(self) -> bool:
        """Between start() and stop()."""
        return self._started

    def _require_started(self):
        if not self._started:
            raise StateError("the egress gateway is not running; call `await gateway.start()` first.")

    def _get(self, sandbox_id: str) -> _SandboxNet:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFoundError(f"sandbox {sandbox_id} is not attached to the egress gateway.")
        return sb

    def _alloc(self) -> int:
        size = self._subnet.num_addresses
        for _ in range(size):
            i = self._free_next
            self._free_next = i + 1 if i + 2 < size else 2
            if i not in self._used:
                self._used.add(i)
                return i
        raise SandboxError(f"the egress subnet {self._subnet} has no free address; give the gateway a larger one.")

    async def _plumb(self, sb: _SandboxNet) -> None:
        i = self._alloc()
        addr = str(self._subnet.network_address + i)
        link = _netns.link_name(self._prefix, addr)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._plumber.add, link, addr, sb.netns_fd, sb.plain)
        except BaseException:
            self._used.discard(i)
            raise
        sb.index, sb.link, sb.address = i, link, addr
        if not sb.detached:
            self._by_addr[addr] = sb
            self._resolver.open_lane(sb.dns, link)

    async def _unplumb(self, sb: _SandboxNet, wait: bool = True) -> None:
        for conn in list(sb.conns):
            conn.close(reset=True)
        self._resolver.close_lane(sb.dns)
        sb.connects_dropped += self._plumber.connects_dropped(sb.address)   # its counter goes with the link
        self._by_addr.pop(sb.address, None)
        index, link, addr = sb.index, sb.link, sb.address
        sb.index = sb.link = sb.address = None
        fut = asyncio.get_running_loop().run_in_executor(self._cleanup, self._plumber.remove, link, addr)
        self._pending.add(fut)

        def done(f):
            self._pending.discard(f)
            self._used.discard(index)   # the address is reused only once its link is gone
            if not f.cancelled():
                f.exception()           # retrieved; a failed removal is retried by the next start's reap

        fut.add_done_callback(done)
        if wait:
            await asyncio.shield(fut)

    def _record(self, sb: _SandboxNet, name, address, port, protocol, verdict, reason, *, metered=True) -> None:
        sb.log.record(time.time(), time.monotonic(), name, address, port, protocol, verdict, reason, metered=metered)

    def _lane_of(self, src: str) -> Lane | None:
        sb = self._by_addr.get(src)
        return sb.dns if sb is not None else None

    def _name_allowed(self, policy: Network, name: str) -> Verdict:
        return name_allowed(policy, name)

    def _port_allowed(self, policy: Network, port: int) -> Verdict:
        return port_allowed(policy, port)

    async def _dns_decide(self, src: str, qname: str, qtype: int):
        sb = self._by_addr.get(src)
        if sb is None:
            return RCODE.REFUSED, (), 0
        policy = sb.policy
        name = normalize_name(qname)
        if name is None:
            self._record(sb, qname[:255], None, 53, "dns", "deny", "not a valid DNS name")
            return RCODE.NXDOMAIN, (), 0
        v = name_allowed(policy, name)
        if not v:
            # never forwarded: a query for a name the policy does not allow goes nowhere
            self._record(sb, name, None, 53, "dns", "deny", v.reason)
            return RCODE.NXDOMAIN, (), 0
        if qtype != QTYPE.A:
            return RCODE.NOERROR, (), 0
        try:
            answer = await self._upstream.resolve(name)
        except ResolveError as e:
            self._record(sb, name, None, 53, "dns", "deny", str(e))
            return RCODE.NXDOMAIN, (), 0
        if sb.policy is not policy:
            # the policy changed during the lookup: the answer follows the one in force now
            v = name_allowed(sb.policy, name)
            if not v:
                self._record(sb, name, None, 53, "dns", "deny", f"{v.reason} (the policy changed during the lookup)")
                return RCODE.NXDOMAIN, (), 0
        # a CNAME chain hands out its last name's addresses as this name's: each name on it must pass too
        cv = chain_allowed(sb.policy, answer.names)
        if not cv:
            self._record(sb, name, None, 53, "dns", "deny", cv.reason)
            return RCODE.NXDOMAIN, (), 0
        addrs, ttl = answer.addrs, answer.ttl
        ok, why = [], []
        for a in addrs:
            av = self._rules.address_allowed(sb.policy, a)
            if av and delivered_locally(a):
                av = Verdict(False, f"{a} is delivered to the host itself (a local address or route)")
            (ok if av else why).append(a if av else av.reason)
        if not ok:
            self._record(sb, name, addrs[0], 53, "dns", "deny", f"only refused addresses: {'; '.join(why)}")
            return RCODE.NOERROR, (), 0
        via = f" (through CNAMEs: {' -> '.join(answer.names[1:])})" if len(answer.names) > 1 else ""
        self._record(sb, name, ",".join(ok), 53, "dns", "allow", v.reason + via)
        return RCODE.NOERROR, ok, min(ttl, ANSWER_TTL)


def _subnet_of(subnet: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise ConfigError(f"subnet {subnet!r} is not an IPv4 network; give one like '198.18.0.0/20'.") from e
    if net.num_addresses < 4:
        raise ConfigError(f"subnet {subnet!r} is too small; give a /30 or larger.")
    return net


def _raise_nofile() -> None:
    """Every proxied connection holds two descriptors: lift the soft limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def _check_policy(policy) -> Network:
    if isinstance(policy, dict):
        policy = Network.from_dict(policy)
    if not isinstance(policy, Network):
        raise ConfigError(f"policy={policy!r} is not a Network; use hutch.Network.none(), .allow(...) or .open().")
    for host, secret in policy.credentials:
        # only the value the caller sent: a name alone must never make the daemon read its own environment
        if secret.value is None:
            raise NetworkPolicyError(f"the credential for {host} came without its value; send the policy as "
                                     "Network.to_dict(reveal=True) (the SDK does).")
    return policy


def _give_ca(sb: "_SandboxNet", policy: Network) -> None:
    """A CA for the sandbox once it has credentials; a new one when a host beyond its name constraints joins
    (the daemon installs each in the sandbox's trust store; the older one keeps serving its hosts)."""
    hosts = {h for h, _ in policy.credentials}
    if hosts and (sb.ca is None or not hosts <= sb.ca.hosts):
        sb.ca = SandboxCA(sb.id, hosts | (sb.ca.hosts if sb.ca else set()))


def _describe(p: Network) -> str:
    budget = "".join(f", {k}={getattr(p, k)}" for k in ("requests_per_minute", "bytes_per_minute")
                     if getattr(p, k) is not None)
    if p.mode != "allow":
        return f"{p.mode}({budget[2:]})" if budget else p.mode
    creds = f", credentials for {[h for h, _ in p.credentials]}" if p.credentials else ""
    return f"allow(domains={list(p.domains)}, cidrs={list(p.cidrs)}, ports={list(p.ports)}{creds}{budget})"
