"""Pure egress decisions: which names, addresses and ports a policy lets through.

No I/O here. The resolver and the proxy ask these functions, so both always
agree on what a policy allows.

Address classes:

- NEVER: unspecified, loopback, multicast, broadcast, reserved (240/4), the
  gateway's own link subnet and the host's own addresses. No policy reaches them.
- SPECIAL: private (10/8, 172.16/12, 192.168/16), CGNAT (100.64/10),
  link-local and cloud metadata (169.254/16), IETF protocol assignments
  (192.0.0/24), benchmarking (198.18/15), 6to4 relay (192.88.99/24). Reached
  only when a CIDR rule of the policy lies wholly inside that block and covers
  the address: `cidrs=["10.1.0.0/16"]` opens 10.1.x.y, `cidrs=["0.0.0.0/0"]`
  opens no SPECIAL address.
- Everything else is public. The documentation ranges (192.0.2/24,
  198.51.100/24, 203.0.113/24) count as public: they never occur on the real
  internet, and the conformance suite builds its fake internet on them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable

from hutch.sandbox._spec import Network, matching_domain

IPv4 = ipaddress.IPv4Address
Net4 = ipaddress.IPv4Network

NEVER = tuple(Net4(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
))
SPECIAL = tuple(Net4(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
    "192.0.0.0/24", "198.18.0.0/15", "192.88.99.0/24",
))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: allowed or not, and why (a short sentence for the log)."""

    allowed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.allowed


ALLOW = Verdict(True, "allowed")


def normalize_name(name: str) -> str | None:
    """Lower-case, strip one trailing dot; None when it is not a plausible DNS name."""
    if not isinstance(name, str):
        return None
    n = name.strip().lower()
    if n.endswith("."):
        n = n[:-1]
    if not n or len(n) > 253:
        return None
    for label in n.split("."):
        if not label or len(label) > 63 or not all(c.isalnum() and c.isascii() or c in "-_" for c in label):
            return None
    if is_address(n):
        return None
    return n


def is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def name_allowed(policy: Network, name: str) -> Verdict:
    """Does the policy let this (normalized) name through?"""
    if policy.mode == "none":
        return Verdict(False, "the policy is none: no network")
    if policy.mode == "open":
        return ALLOW
    d = matching_domain(policy.domains, name)
    if d is not None:
        return Verdict(True, f"matches {d}")
    return Verdict(False, f"{name} is not in the allowed domains")


def chain_allowed(policy: Network, names) -> Verdict:
    """An answer reached through CNAMEs: every name on the chain must be allowed by itself.

    Otherwise an allowed name could lend its standing to any other: a CNAME to a name in a zone
    the policy never named (an internal one, one of an attacker's) would get its addresses
    handed out, and dialed, as the allowed name's.
    """
    names = tuple(names)
    for target in names[1:]:
        n = normalize_name(target)
        if n is None:
            return Verdict(False, f"{names[0]} is a CNAME for {target!r}, which is not a valid DNS name")
        if not name_allowed(policy, n):
            return Verdict(False, f"{names[0]} is a CNAME for {n}, which is not in the allowed domains "
                                  f"(allow {n} too, if it should be reached)")
    return ALLOW


#: The protocol a well-known port carries, when the proxy must read the name from the connection.
#: A TLS connection is relayed unread after its ClientHello, so TLS to a port whose servers speak
#: plain HTTP would carry requests whose Host no one checks; on port 80 a ClientHello is refused.
#: Plain HTTP is read request by request wherever it goes, but on 443 nothing legitimate sends it.
#: On every other port either is accepted, and a TLS connection is relayed only once the server
#: has answered the ClientHello with TLS (see _proxy).
PORT_PROTOCOLS = {80: "http", 443: "tls"}


def protocol_allowed(port: int, protocol: str) -> Verdict:
    """May a connection to `port` that names its server through `protocol` (tls | http) go on?"""
    want = PORT_PROTOCOLS.get(port)
    if want is None or want == protocol:
        return ALLOW
    if protocol == "tls":
        return Verdict(False, f"a TLS ClientHello on port {port}, where servers speak plain HTTP: it would be "
                              "relayed without its requests being read")
    return Verdict(False, f"plain HTTP on port {port}, which carries TLS")


def port_allowed(policy: Network, port: int) -> Verdict:
    if policy.mode == "none":
        return Verdict(False, "the policy is none: no network")
    if policy.mode == "open" or not policy.ports or port in policy.ports:
        return ALLOW
    return Verdict(False, f"port {port} is not in the allowed ports {list(policy.ports)}")


class AddressRules:
    """Address checks that also know the host: its own addresses and the gateway's link subnet."""

    def __init__(self, link_subnet: Net4, host_addresses: Iterable[str] = ()):
        self.link_subnet = link_subnet
        self.host_addresses: frozenset[IPv4] = frozenset()
        self.set_host_addresses(host_addresses)

    def set_host_addresses(self, addrs: Iterable[str]) -> None:
        out = set()
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                continue
            if ip.version == 4:
                out.add(ip)
        self.host_addresses = frozenset(out)

    def never(self, ip: IPv4) -> str | None:
        """Why no policy may reach this address, or None."""
        if ip in self.link_subnet:
            return f"{ip} is a sandbox link address of the gateway"
        if ip in self.host_addresses:
            return f"{ip} is an address of the host"
        for n in NEVER:
            if ip in n:
                return f"{ip} is in the never-reachable range {n}"
        return None

    def address_allowed(self, policy: Network, addr: str, *, by_cidr_only: bool = False) -> Verdict:
        """May the proxy dial this address under the policy?

        by_cidr_only: the connection carries no allowed name, so in `allow` mode
        only a CIDR rule can admit the address.
        """
        if policy.mode == "none":
            return Verdict(False, "the policy is none: no network")
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            return Verdict(False, f"{addr!r} is not an address")
        if ip.version != 4:
            return Verdict(False, f"{ip} is IPv6; sandboxes have no IPv6")
        why = self.never(ip)
        if why:
            return Verdict(False, why)
        special = next((n for n in SPECIAL if ip in n), None)
        cidrs = [Net4(c) for c in policy.cidrs] if policy.mode == "allow" else []
        covering = [c for c in cidrs if ip in c]
        if special is not None:
            named = [c for c in covering if c.subnet_of(special)]
            if named:
                return Verdict(True, f"{ip} is in the allowed cidr {named[0]}")
            return Verdict(False, f"{ip} is a private/link-local/metadata address ({special}) no cidr rule names")
        if policy.mode == "open":
            return Verdict(True, f"{ip} is public")
        if covering:
            return Verdict(True, f"{ip} is in the allowed cidr {covering[0]}")
        if by_cidr_only:
            return Verdict(False, f"{ip} is in no allowed cidr")
        return Verdict(True, f"{ip} is public")
