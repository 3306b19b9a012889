"""A few rtnetlink requests, encoded by hand and sent as one batch.

Attaching a sandbox needs about ten link/address/route requests; through a
general netlink library each costs a few hundred microseconds of Python. Here
each batch is one sendmsg and one pass over the acks. The socket belongs to the
network namespace of the thread that opened it.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK = 16, 17
RTM_NEWADDR, RTM_GETADDR = 20, 22
NLM_F_DUMP = 0x300
NLMSG_DONE = 3
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
VETH_INFO_PEER = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_GATEWAY, RTA_OIF = 1, 5, 4
IFF_UP = 0x1
RT_TABLE_MAIN, RTPROT_BOOT, RTN_UNICAST = 254, 3, 1
RT_SCOPE_LINK = 253

_IFINFO = struct.Struct("=BxHiII")     # family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBi")      # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")   # family, dst_len, src_len, tos, table, protocol, scope, type, flags


def _attr(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * ((4 - n % 4) % 4)


def _name(name: str) -> bytes:
    return name.encode() + b"\0"


def _attrs(msg: bytes, p: int) -> dict[int, bytes]:
    """The attributes of one netlink message, from offset `p` (after the family header)."""
    attrs = {}
    while p + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, p)
        if alen < 4:
            break
        attrs[atype] = msg[p + 4:p + alen]
        p += (alen + 3) & ~3
    return attrs


class Rtnl:
    """One NETLINK_ROUTE socket; `batch([...])` sends requests and raises on the first error."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def _msg(self, kind: int, flags: int, body: bytes) -> tuple[int, bytes]:
        self.seq += 1
        return self.seq, struct.pack("=IHHII", 16 + len(body), kind, flags | NLM_F_REQUEST | NLM_F_ACK, self.seq, 0) + body

    def batch(self, requests: list[tuple[int, int, bytes]], ignore: tuple[int, ...] = ()) -> None:
        msgs = [self._msg(*r) for r in requests]
        self.sock.sendall(b"".join(m for _, m in msgs))
        pending = {seq for seq, _ in msgs}
        first_error = None
        while pending:
            data = self.sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, off)
                if kind == NLMSG_ERROR and seq in pending:
                    pending.discard(seq)
                    code = -struct.unpack_from("=i", data, off + 16)[0]
                    if code and code not in ignore and first_error is None:
                        first_error = OSError(code, f"rtnetlink: {os.strerror(code)}")
                off += (length + 3) & ~3
                if length == 0:
                    break
        if first_error is not None:
            raise first_error

    def _dump(self, kind: int, body: bytes):
        """Send a dump request; yield (message type, message) of each answer."""
        self.seq += 1
        self.sock.sendall(struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, self.seq, 0) + body)
        while True:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, mtype, _, seq, _ = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    return
                if seq == self.seq:
                    if mtype == NLMSG_DONE:
                        return
                    if mtype == NLMSG_ERROR:
                        code = -struct.unpack_from("=i", data, off + 16)[0]
                        raise OSError(code, f"rtnetlink: {os.strerror(code)}")
                    yield mtype, data[off:off + length]
                off += (length + 3) & ~3

    def ipv4_addresses(self) -> list[tuple[int, str]]:
        """(ifindex, address) of every IPv4 address in this netns (IFA_LOCAL, else IFA_ADDRESS)."""
        out = []
        for kind, msg in self._dump(RTM_GETADDR, _IFADDR.pack(socket.AF_INET, 0, 0, 0, 0)):
            if kind == RTM_NEWADDR:
                family, _, _, _, index = _IFADDR.unpack_from(msg, 16)
                attrs = _attrs(msg, 16 + _IFADDR.size)
                raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
                if family == socket.AF_INET and raw and len(raw) == 4:
                    out.append((index, socket.inet_ntoa(raw)))
        return out

    def ipv4_routes(self) -> list[tuple[str, int, int]]:
        """(destination, prefix length, ifindex or 0) of every IPv4 route in this netns, of every table."""
        out = []
        for kind, msg in self._dump(RTM_GETROUTE, _RTMSG.pack(socket.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0)):
            if kind == RTM_NEWROUTE:
                family, dst_len = _RTMSG.unpack_from(msg, 16)[:2]
                attrs = _attrs(msg, 16 + _RTMSG.size)
                dst = attrs.get(RTA_DST, b"\0\0\0\0")
                oif = struct.unpack("=i", attrs[RTA_OIF])[0] if len(attrs.get(RTA_OIF, b"")) == 4 else 0
                if family == socket.AF_INET and len(dst) == 4:
                    out.append((socket.inet_ntoa(dst), dst_len, oif))
        return out

    # --- requests ---------------------------------------------------------------

    @staticmethod
    def veth(name: str, peer: str, peer_netns_fd: int, up: bool = True) -> tuple[int, int, bytes]:
        """Create veth `name` here, its peer `peer` in the netns `peer_netns_fd`."""
        peer_info = _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, _name(peer)) + \
            _attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        linkinfo = _attr(IFLA_INFO_KIND, b"veth") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer_info))
        flags = IFF_UP if up else 0
        body = _IFINFO.pack(0, 0, 0, flags, flags) + _attr(IFLA_IFNAME, _name(name)) + _attr(IFLA_LINKINFO, linkinfo)
        return RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body

    @staticmethod
    def link_up(index: int) -> tuple[int, int, bytes]:
        return RTM_NEWLINK, 0, _IFINFO.pack(0, 0, index, IFF_UP, IFF_UP)

    @staticmethod
    def link_del(name: str) -> tuple[int, int, bytes]:
        return RTM_DELLINK, 0, _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, _name(name))

    @staticmethod
    def addr_p2p(index: int, local: str, peer: str) -> tuple[int, int, bytes]:
        """A /32 point-to-point address: the kernel adds the route to `peer` itself."""
        body = _IFADDR.pack(socket.AF_INET, 32, 0, 0, index) + _attr(IFA_LOCAL, socket.inet_aton(local)) + \
            _attr(IFA_ADDRESS, socket.inet_aton(peer))
        return RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body

    @staticmethod
    def addr_plain(index: int, local: str) -> tuple[int, int, bytes]:
        """A plain /32 address (no peer): gVisor's netstack takes it over, which it cannot do with a p2p one."""
        body = _IFADDR.pack(socket.AF_INET, 32, 0, 0, index) + _attr(IFA_LOCAL, socket.inet_aton(local)) + \
            _attr(IFA_ADDRESS, socket.inet_aton(local))
        return RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body

    @staticmethod
    def link_route(dst: str, oif: int) -> tuple[int, int, bytes]:
        """dst/32 on the link `oif` (scope link): how a plain address reaches its gateway."""
        body = _RTMSG.pack(socket.AF_INET, 32, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK, RTN_UNICAST, 0) + \
            _attr(RTA_DST, socket.inet_aton(dst)) + _attr(RTA_OIF, struct.pack("=i", oif))
        return RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body

    @staticmethod
    def default_route(gateway: str, oif: int) -> tuple[int, int, bytes]:
        body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST, 0) + \
            _attr(RTA_GATEWAY, socket.inet_aton(gateway)) + _attr(RTA_OIF, struct.pack("=i", oif))
        return RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body




# --- conntrack ------------------------------------------------------------------

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_DELETE = 1, 2
NLA_F_NESTED = 0x8000
CTA_TUPLE_ORIG, CTA_TUPLE_IP, CTA_IP_V4_SRC, CTA_FILTER = 1, 1, 1, 25
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
CTA_FILTER_F_CTA_IP_SRC = 1 << 0


class Conntrack:
    """Deletes conntrack entries by original source address in one kernel-filtered request."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def flush_source(self, addr: str) -> None:
        """Delete every IPv4 entry whose original source is `addr` (a no-op when there is none)."""
        tup = _attr(CTA_TUPLE_IP | NLA_F_NESTED, _attr(CTA_IP_V4_SRC, socket.inet_aton(addr)))
        filt = _attr(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", CTA_FILTER_F_CTA_IP_SRC)) + \
            _attr(CTA_FILTER_REPLY_FLAGS, struct.pack("=I", 0))
        # version 1: the flush is limited to this family (and so may filter on an IPv4 tuple)
        body = struct.pack("=BBH", socket.AF_INET, 1, 0) + _attr(CTA_TUPLE_ORIG | NLA_F_NESTED, tup) + \
            _attr(CTA_FILTER | NLA_F_NESTED, filt)
        self.seq += 1
        kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
        self.sock.sendall(struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, self.seq, 0) + body)
        while True:
            data = self.sock.recv(65536)
            length, mtype, _, seq, _ = struct.unpack_from("=IHHII", data, 0)
            if mtype == NLMSG_ERROR and seq == self.seq:
                code = -struct.unpack_from("=i", data, 16)[0]
                if code and code != errno.ENOENT:
                    raise OSError(code, f"conntrack flush: {os.strerror(code)}")
                return
