"""The daemon's side of the gateway: the NetworkAttacher that hutch.sandbox._host.daemon.network loads.

The daemon calls `attach` for every sandbox (after its namespaces exist,
before its command runs), `update` for `PUT /v1/sandboxes/{id}/network`,
`log` for the decision log and `detach` when the sandbox has ended. A sandbox
whose policy is `none` is only registered, so a later `update` can give it a
network; it gets a veth only while its policy is not `none`.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os

from hutch._core import paths
from hutch._core.errors import NetworkPolicyError
from hutch.sandbox._host.egress.gateway import Gateway
from hutch.sandbox._host.instance import names_for
from hutch.sandbox._spec import Network

_libc = ctypes.CDLL(None, use_errno=True)


def _root_of(pid: int, kind: str) -> int:
    """The host id that is id 0 inside the sandbox's user namespace (0 when it has none)."""
    try:
        with open(f"/proc/{pid}/{kind}_map") as f:
            for line in f:
                inside, outside, _ = (int(x) for x in line.split())
                if inside == 0:
                    return outside
    except (OSError, ValueError):
        pass
    return 0


def write_resolv_conf(pid: int, nameserver: str) -> bool:
    """Point the sandbox's /etc/resolv.conf at the gateway. False when its root does not allow it.

    Opened relative to /proc/PID/root without following symlinks, so a hostile image
    (say /etc/resolv.conf -> /etc/shadow) cannot make the host write its own files. In a
    sandbox with a user namespace the file is made as the host id of its root (setfsuid,
    which moves only this thread), as its idmapped root requires.
    """
    uid, gid = _root_of(pid, "uid"), _root_of(pid, "gid")
    old_uid = old_gid = None
    if uid or gid:
        old_gid = _libc.setfsgid(gid)
        old_uid = _libc.setfsuid(uid)
    try:
        return _write_resolv_conf(pid, nameserver)
    finally:
        if old_uid is not None:
            _libc.setfsuid(old_uid)
            _libc.setfsgid(old_gid)


def _write_resolv_conf(pid: int, nameserver: str) -> bool:
    try:
        etc = os.open(f"/proc/{pid}/root/etc", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            os.unlink("resolv.conf", dir_fd=etc)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            return False
        fd = os.open("resolv.conf", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=etc)
        try:
            os.write(fd, f"nameserver {nameserver}\noptions attempts:2 timeout:2\n".encode())
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP, errno.EEXIST,
                       errno.EOVERFLOW):
            return False
        raise
    finally:
        os.close(etc)


class DaemonAttacher:
    """Runs one Gateway for the daemon; starts it on first use unless `start()` was awaited."""

    def __init__(self, **gateway_kw):
        self.gateway = Gateway(**gateway_kw)
        self._pids: dict[str, int] = {}
        self._cas: dict[str, set] = {}
        self._start_lock: asyncio.Lock | None = None

    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self.gateway.started:
                await self.gateway.start()

    async def stop(self) -> None:
        if self.gateway.started:
            await self.gateway.stop()

    async def attach(self, sandbox_id: str, init_pid: int, network, *, plain: bool = False) -> None:
        await self.start()
        policy = Network.from_dict(network) if isinstance(network, dict) else network
        await self.gateway.attach(sandbox_id, f"/proc/{init_pid}/ns/net", policy, plain=plain)
        self._pids[sandbox_id] = init_pid
        if policy.mode != "none":
            write_resolv_conf(init_pid, self.gateway.gateway_address)

    async def update(self, sandbox_id: str, network, *, keep_link: bool = False) -> None:
        policy = Network.from_dict(network) if isinstance(network, dict) else network
        if not self.gateway.attached(sandbox_id):
            raise NetworkPolicyError(f"sandbox {sandbox_id} is not on the egress gateway (it may have ended); "
                                     "its network cannot change.")
        await self.gateway.set_policy(sandbox_id, policy, keep_link=keep_link)
        pid = self._pids.get(sandbox_id)
        if policy.mode != "none" and pid:
            write_resolv_conf(pid, self.gateway.gateway_address)

    async def detach(self, sandbox_id: str) -> None:
        self._pids.pop(sandbox_id, None)
        self._cas.pop(sandbox_id, None)
        if self.gateway.started:
            await self.gateway.detach(sandbox_id, wait=False)   # kernel cleanup in the background

    def pending_ca(self, sandbox_id: str) -> bytes | None:
        """The sandbox's egress CA certificate if the gateway made one it was not given yet (then once)."""
        if not self.gateway.attached(sandbox_id):
            return None
        pem = self.gateway.ca_pem(sandbox_id)
        given = self._cas.setdefault(sandbox_id, set())
        if pem is None or pem in given:
            return None
        given.add(pem)
        return pem

    def relayed(self, sandbox_id: str) -> int:
        """Bytes the gateway's proxy moved for the sandbox so far, both ways (0 once it is detached)."""
        return self.gateway.relayed(sandbox_id)

    def log(self, sandbox_id: str) -> dict:
        if not self.gateway.attached(sandbox_id):
            return {"decisions": []}
        return self.gateway.log(sandbox_id).to_dict()


def daemon_attacher() -> DaemonAttacher:
    """The attacher the hutch daemon loads (see hutch.sandbox._host.daemon.network).

    Its table, link prefix and subnet come from the daemon's instance id (hutch/sandbox/_host/instance.py):
    the first /20 of 198.18.0.0/15, in the instance's own order, that nothing on the host uses, so
    several daemons on one host (in other mount namespaces or with other run dirs) each keep their own.
    HUTCH_EGRESS_SUBNET gives the subnet instead, HUTCH_EGRESS_RESOLVERS the upstream resolvers.
    """
    return DaemonAttacher(**gateway_settings(paths.run_dir()))


def gateway_settings(run_dir) -> dict:
    names = names_for(run_dir)
    return {"table": names.nft_table, "link_prefix": names.link_prefix, "subnets": names.egress_subnets()}
