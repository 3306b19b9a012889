"""Host and sandbox network plumbing: veths over netlink, rules as nftables transactions.

Everything here is blocking and runs on the gateway's worker threads. To work
inside a sandbox's network namespace a thread enters it with setns(2)
(which moves only the calling thread) and always returns to the host's.

Host side (table `inet <table>`, rules bound to this gateway's links through
the sets `links` and `members`): packets from a sandbox link must be IPv4
with the source address that link was given (anti-spoofing), TCP not
addressed to the host or the link subnet is redirected to the proxy, and the
only local ports they may reach are the resolver's and the proxy's. Nothing
from or to a sandbox link is forwarded, whatever ip_forward says.

Sandbox side (table `inet hutch` in its netns): IPv6 off, and out of the
netns only DNS to the gateway and TCP through eth0 (which the host redirects).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import ipaddress
import os
import re
import socket
import threading
from contextlib import contextmanager

from hutch._core.errors import SandboxError
from hutch.sandbox._host.egress.nft import Nft
from hutch.sandbox._host.egress.rtnl import Conntrack, Rtnl

CLONE_NEWNET = 0x40000000
#: New TCP connections (SYNs) a second that one sandbox may open, in bursts of CONNECT_BURST; the host drops the
#: rest before conntrack or the proxy see them, and counts them per sandbox (set `syn_over`)
CONNECT_RATE = 200
CONNECT_BURST = 400
NS_GET_NSTYPE = 0xB703
SANDBOX_IF = "eth0"
SANDBOX_TABLE = "hutch"

_libc = ctypes.CDLL(None, use_errno=True)


def setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns into a network namespace failed: {os.strerror(e)}")


def _is_netns(fd: int) -> bool:
    try:
        return fcntl.ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNET
    except OSError:
        return False


def open_netns(target) -> int:
    """A new fd for a network namespace given as an open netns fd (int) or a path (/proc/PID/ns/net).

    An int is only ever an fd, never a pid: a pid number that happened to equal an open
    descriptor would otherwise name the wrong namespace.
    """
    if isinstance(target, int) and not isinstance(target, bool):
        if not _is_netns(target):
            raise SandboxError(f"fd {target} is not a network namespace; pass an open netns fd or '/proc/PID/ns/net'.")
        return os.dup(target)
    path = os.fspath(target)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SandboxError(f"cannot open the network namespace {path}: {e.strerror}; is the sandbox running?") from e
    if not _is_netns(fd):
        os.close(fd)
        raise SandboxError(f"{path} is not a network namespace; pass '/proc/PID/ns/net' or a netns fd.")
    return fd


def sandbox_ruleset(gw: str) -> str:
    return f"""
table inet {SANDBOX_TABLE}
delete table inet {SANDBOX_TABLE}
table inet {SANDBOX_TABLE} {{
  chain output {{
    type filter hook output priority filter; policy drop;
    oif "lo" accept
    meta nfproto != ipv4 drop
    ip daddr {gw} udp dport 53 accept
    ip daddr {gw} tcp dport 53 accept
    oifname "{SANDBOX_IF}" meta l4proto tcp accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    meta nfproto != ipv4 drop
    iifname "{SANDBOX_IF}" ct state established accept
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
  }}
}}
"""


def host_ruleset(table: str, gw: str, subnet: str, dns_port: int, proxy_port: int) -> str:
    # Rules match this gateway's own links (set `links`), so two gateways in one netns keep apart.
    # Nothing but its links (and the host itself) may send from or to the link subnet: another
    # machine routing to the gateway address through this host must not reach the resolver or proxy.
    # TCP to the host's own addresses and to other sandboxes is never redirected: it falls
    # to the input/forward chains below and is dropped before any socket sees it.
    dns_redirect = ""
    if dns_port != 53:
        dns_redirect = (f'    iifname @links ip daddr {gw} udp dport 53 redirect to :{dns_port}\n'
                        f'    iifname @links ip daddr {gw} tcp dport 53 redirect to :{dns_port}\n')
    return f"""
table inet {table}
delete table inet {table}
table inet {table} {{
  set links {{ type ifname; }}
  set members {{ type ifname . ipv4_addr; }}
  set syn_rate {{ type ipv4_addr; size 65535; flags dynamic; timeout 10s; }}
  set syn_over {{ type ipv4_addr; size 65535; flags dynamic; counter; }}
  chain pre_raw {{
    type filter hook prerouting priority raw; policy accept;
    iifname @links meta nfproto != ipv4 drop
    iifname @links iifname . ip saddr != @members drop
    iifname @links tcp flags & (fin|syn|rst|ack) == syn add @syn_rate {{ ip saddr limit rate over {CONNECT_RATE}/second burst {CONNECT_BURST} packets }} update @syn_over {{ ip saddr }} drop
    iifname != "lo" iifname != @links ip saddr {subnet} drop
    iifname != "lo" iifname != @links ip daddr {subnet} drop
  }}
  chain pre_nat {{
    type nat hook prerouting priority dstnat; policy accept;
{dns_redirect}    iifname @links ip daddr != {subnet} fib daddr type != local meta l4proto tcp redirect to :{proxy_port}
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname @links jump from_sandbox
  }}
  chain from_sandbox {{
    ip daddr {gw} udp dport {dns_port} accept
    ip daddr {gw} tcp dport {{ {dns_port}, {proxy_port} }} accept
    drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname @links drop
    oifname @links drop
  }}
  chain output {{
    type filter hook output priority filter - 10; policy accept;
    oifname @links ip saddr != {gw} drop
    oifname @links meta l4proto != tcp meta l4proto != udp drop
  }}
}}
"""


def _write_sysctl(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        pass   # IPv6 compiled out: nothing to disable


class Plumber:
    """Owns the host-side table and creates/removes sandbox links.

    Safe from several threads, each of which must sit in the host netns: every thread
    gets its own netlink sockets (they stay bound to the netns they were opened in).
    """

    def __init__(self, *, table: str, gw: str, subnet: str, dns_port: int, proxy_port: int, prefix: str = "hv"):
        self.table = table
        self.subnet = subnet
        self.gw = gw
        self.dns_port = dns_port
        self.proxy_port = proxy_port
        self.prefix = prefix
        self.host_fd = -1
        self._local = threading.local()
        self._all: list = []
        self._all_lock = threading.Lock()
        # a sandbox's nft context stays open while it is attached: closing one that has
        # loaded rules costs ~10 ms (kernel side), so it is paid at removal, off the create path
        self._sandbox_nft: dict[str, Nft] = {}
        self._installed = False

    @property
    def rtnl(self) -> Rtnl:
        r = getattr(self._local, "rtnl", None)
        if r is None:
            r = self._local.rtnl = Rtnl()
            with self._all_lock:
                self._all.append(r)
        return r

    @property
    def nft(self) -> Nft:
        n = getattr(self._local, "nft", None)
        if n is None:
            n = self._local.nft = Nft()
            with self._all_lock:
                self._all.append(n)
        return n

    def setup(self, host_fd: int) -> list[str]:
        """Install the host table, reaping links a crashed predecessor left. Returns reaped names."""
        self.host_fd = host_fd
        setns(host_fd)
        reaped = self.reap()
        self.nft.run(host_ruleset(self.table, self.gw, self.subnet, self.dns_port, self.proxy_port))
        self._installed = True
        return reaped

    def reap(self) -> list[str]:
        """Delete links of ours (name prefix and our gateway address) that a crashed gateway left."""
        out = []
        for index, address in self.rtnl.ipv4_addresses():
            if address != self.gw:
                continue
            try:
                name = socket.if_indextoname(index)
            except OSError:
                continue
            if name.startswith(self.prefix):
                self._del_link(name)
                out.append(name)
        return out

    def teardown(self, names: list[str]) -> None:
        """Delete the given links and the host table; close every socket."""
        for n in names:
            self._del_link(n)
        if self._installed:
            # only a table this gateway installed: a gateway that failed to start must not
            # delete the rules of another one that runs
            try:
                self.nft.run(f"table inet {self.table}\ndelete table inet {self.table}\n")
            except SandboxError:
                pass
            self._installed = False
        for n in list(self._sandbox_nft.values()):
            n.close()
        self._sandbox_nft.clear()
        with self._all_lock:
            for obj in self._all:
                obj.close()
            self._all.clear()

    def host_addresses(self) -> list[str]:
        return sorted({a for _, a in self.rtnl.ipv4_addresses()})

    @contextmanager
    def _in_netns(self, fd: int):
        setns(fd)
        try:
            yield
        finally:
            setns(self.host_fd)

    def add(self, name: str, addr: str, netns_fd: int, plain: bool = False) -> None:
        """Create veth `name` (host) <-> eth0 (sandbox), addresses, routes, and both rule sets. `plain`: the
        sandbox end gets a plain /32 and a link route to the gateway, not a point-to-point address (gVisor's
        netstack moves the address off the interface into itself, which a p2p one refuses)."""
        rt = self.rtnl
        # the host rules cover the link before it exists: no window in which it is unfiltered
        self.nft.run(f'add element inet {self.table} links {{ "{name}" }}\n'
                     f'add element inet {self.table} members {{ "{name}" . {addr} }}\n')
        try:
            # IPv6 off in the sandbox before its end of the veth exists, so it never gets an address
            with self._in_netns(netns_fd):
                _write_sysctl("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1")
                _write_sysctl("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1")
            rt.batch([Rtnl.veth(name, SANDBOX_IF, netns_fd, up=False)])
            _write_sysctl(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6", "1")
            idx = socket.if_nametoindex(name)
            # a point-to-point address: the kernel adds the route to the peer itself
            rt.batch([Rtnl.addr_p2p(idx, self.gw, addr), Rtnl.link_up(idx)])
            with self._in_netns(netns_fd):
                # rules first: the link comes up in the sandbox only once they hold
                n = Nft()
                self._sandbox_nft[name] = n
                n.run(sandbox_ruleset(self.gw))
                e = socket.if_nametoindex(SANDBOX_IF)    # asks the netns this thread is in
                inner = Rtnl()
                try:   # lo is ifindex 1 in every network namespace
                    own = [Rtnl.addr_plain(e, addr), Rtnl.link_up(e), Rtnl.link_route(self.gw, e)] if plain else \
                        [Rtnl.addr_p2p(e, addr, self.gw), Rtnl.link_up(e)]
                    inner.batch(own + [Rtnl.link_up(1), Rtnl.default_route(self.gw, e)])
                finally:
                    inner.close()
        except Exception as e:
            self.remove(name, addr)
            if isinstance(e, SandboxError):
                raise
            raise SandboxError(f"setting up the sandbox network ({name}, {addr}) failed: {e}") from e

    def remove(self, name: str, addr: str) -> None:
        """Remove the veth (its sandbox end goes with it), then the host's elements for it, then conntrack.

        In that order: while the link exists its elements must too, or its packets would
        meet no host rule at all.
        """
        self._del_link(name)
        self._del_elements(name, addr)
        n = self._sandbox_nft.pop(name, None)
        if n is not None:
            n.close()
        self.flush_conntrack(addr)

    def connects_dropped(self, addr: str) -> int:
        """New TCP connections from `addr` that the host dropped for going over CONNECT_RATE."""
        try:
            out = self.nft.run(f"list set inet {self.table} syn_over\n")
        except SandboxError:
            return 0
        m = re.search(rf"(?<![\d.]){re.escape(addr)} counter packets (\d+)", out)
        return int(m.group(1)) if m else 0

    def _del_elements(self, name: str, addr: str) -> None:
        for cmd in (f'delete element inet {self.table} members {{ "{name}" . {addr} }}',
                    f'delete element inet {self.table} links {{ "{name}" }}',
                    f'delete element inet {self.table} syn_over {{ {addr} }}',
                    f'delete element inet {self.table} syn_rate {{ {addr} }}'):
            try:
                self.nft.run(cmd + "\n")
            except SandboxError:
                pass

    def _del_link(self, name: str) -> None:
        # gone already when the sandbox's netns was destroyed first: the kernel takes both ends
        self.rtnl.batch([Rtnl.link_del(name)], ignore=(errno.ENODEV, errno.ENOENT))

    def flush_conntrack(self, addr: str) -> None:
        """Delete the host's conntrack entries whose original source is `addr` (best effort)."""
        ct = getattr(self._local, "ct", None)
        try:
            if ct is None:
                ct = self._local.ct = Conntrack()
                with self._all_lock:
                    self._all.append(ct)
            ct.flush_source(addr)
        except OSError:
            pass   # no conntrack netlink, or an old kernel: the entries time out by themselves


def networks_in_use(own_prefix: str, own_table: str) -> list[tuple[ipaddress.IPv4Network, str]]:
    """What in this netns (the host's: run on a plumbing thread) uses which IPv4 networks, and who.

    Addresses and routes (but those on links named with our own prefix: what a crashed predecessor of
    ours left, reaped by setup), and the networks other egress gateways' tables name (a gateway without
    sandboxes has neither addresses nor routes). A gateway then holds the subnet it picks by listening
    on its address.
    """
    out = []

    def foreign(index: int) -> str | None:
        try:
            name = socket.if_indextoname(index)
        except OSError:
            return "?"
        return None if name.startswith(own_prefix) else name

    rt = Rtnl()
    try:
        for index, addr in rt.ipv4_addresses():
            if dev := foreign(index):
                out.append((ipaddress.IPv4Network(addr), f"address {addr} on {dev}"))
        for dst, plen, oif in rt.ipv4_routes():
            if plen and (dev := foreign(oif) if oif else "-"):
                out.append((ipaddress.IPv4Network(f"{dst}/{plen}", strict=False), f"a route to {dst}/{plen} via {dev}"))
    finally:
        rt.close()
    nft = Nft()
    try:
        for table in re.findall(r"table inet (hutch_egress\S*)", nft.run("list tables inet")):
            if table != own_table:
                rules = nft.run(f"list table inet {table}")
                for cidr in set(re.findall(r"ip [sd]addr (?:!= )?(\d+\.\d+\.\d+\.\d+/\d+)", rules)):
                    out.append((ipaddress.IPv4Network(cidr, strict=False), f"the egress gateway of table inet {table}"))
    finally:
        nft.close()
    return out


def link_name(prefix: str, addr: str) -> str:
    """The gateway's prefix (`hv`, the daemon's `hv<instance id[:5]>`) + the sandbox address in hex: unique per
    netns even with several gateways (their subnets differ)."""
    return prefix + socket.inet_aton(addr).hex()

