"""The host daemon (`hutch serve`): owns every sandbox on this host and serves docs/api.md.

    serve(socket_path=None, listen=None, token=None, *, token_file=None, group=None, tls_cert=None, tls_key=None,
          limits=None)

runs it in the foreground until SIGTERM or SIGINT. On start it reaps whatever
a crashed predecessor left (cgroups, records under run_dir()/sandboxes), then
spawns the zygote (the sandbox start server) and listens on the Unix socket
(for root, and members of `group`: access.py), and, with `listen="HOST:PORT"`,
on TCP with TLS (`tls_cert`/`tls_key`, or a certificate made on first start:
tls.py) where every request needs the bearer `token`. The listeners' timeouts
and caps are `limits` (listen.py). Only one daemon serves a run directory (a
lock file says so).
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import re
import signal
import socket
import sys
from pathlib import Path

from hutch._core import paths, settings
from hutch._core.errors import ConfigError, DaemonError
from hutch._core.tokens import check_token, read_token_file
from hutch.sandbox._host.daemon.access import PeerCheck, PeerPolicy, bind_unix, private_dir
from hutch.sandbox._host.daemon.listen import ListenLimits
from hutch.sandbox._host.daemon.ratelog import INTERVAL, RateLog, install
from hutch.sandbox._host.daemon.tls import fingerprint, server_certificate, server_context

#: The daemon's TCP token, when no token file is given (the SDK reads the same name).
ENV_TOKEN = settings.TOKEN.name



def cgroup_parent_for(run_dir: Path) -> str:
    """`hutch-<instance id>`: the run directory's daemon instance's own (see hutch/sandbox/_host/instance.py)."""
    from hutch.sandbox._host.instance import names_for

    return names_for(run_dir).cgroup_parent


_ID_PREFIX = re.compile(r"[a-z0-9]{1,12}\Z")


def _parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen={listen!r} must be HOST:PORT, like 127.0.0.1:7450.")
    return host.strip("[]") or "0.0.0.0", int(port)


def serve(socket_path: str | os.PathLike | None = None, listen: str | None = None, token: str | None = None, *,
          token_file: str | os.PathLike | None = None, group: str | int | None = None,
          tls_cert: str | os.PathLike | None = None, tls_key: str | os.PathLike | None = None,
          limits: ListenLimits | None = None, tenants: str | os.PathLike | None = None,
          audit_log: str | os.PathLike | None = None, audit_max_bytes: int = 16 << 20, audit_keep: int = 5,
          id_prefix: str = "", max_sandboxes: int = 0) -> None:
    """Run the hutch daemon in the foreground until SIGTERM or SIGINT (see the module docstring).

    The TCP token: `token`, else the file `token_file`, else $HUTCH_TOKEN (taken out of the
    environment either way, so nothing the daemon starts inherits it). `tenants`: a tenants file
    (daemon/tenants.py, docs/tenants.md): each tenant's token drives only its own sandboxes, within its
    quotas; the operator's token (optional then) and the Unix socket's peers see everything.
    `audit_log`: JSON lines of every call that changes something, rotated at `audit_max_bytes`.
    `max_sandboxes`: sandboxes it runs at once at most (0: no cap; a fleet node's cap, docs/fleet.md)."""
    from hutch.sandbox._host.native.linux import ARCH_OK

    env_token = settings.TOKEN.pop()
    if token is None and token_file:
        token = read_token_file(token_file)
    elif token is None and env_token:
        token = check_token(env_token.strip(), f"${ENV_TOKEN}")

    if id_prefix and not _ID_PREFIX.fullmatch(id_prefix):
        raise ConfigError(f"id_prefix={id_prefix!r} must be 1 to 12 lowercase letters and digits (a fleet node's "
                          "key: the ids of this daemon's sandboxes start with it and a dash).")
    if type(max_sandboxes) is not int or max_sandboxes < 0:
        raise ConfigError(f"max_sandboxes={max_sandboxes!r} must be a number of sandboxes (0: no cap).")
    if os.geteuid() != 0:
        raise DaemonError("the hutch daemon creates namespaces and cgroups, so it must run as root; use sudo.")
    if not ARCH_OK:
        raise DaemonError("the native runtime supports x86_64 only (its seccomp filter is written for it).")
    settings.check("daemon")   # a bad value stops the start here, before anything is made
    paths.code_owned_by_root()   # nobody but root may change the code this root process runs
    paths.guard_imports()        # nor what it imports later
    from hutch.sandbox._host.native.idmap import check_host_accounts
    check_host_accounts()   # no other account may be a sandbox's host ids
    policy = PeerPolicy.for_group(group)
    bind = _parse_listen(listen) if listen else None
    registry = audit = None
    if tenants is not None:
        from hutch.sandbox._host.daemon.tenants import Registry
        registry = Registry(tenants)   # a bad file is refused now, with what to fix
    if bind and not token and registry is None:
        raise ConfigError("serving on TCP needs a token: put one in a file (`openssl rand -hex 32 > /etc/hutch/token; "
                          "chmod 600 /etc/hutch/token`) and pass --token-file, or set HUTCH_TOKEN.")
    if token is not None:
        check_token(token, "token=")
    tls = server_certificate(tls_cert, tls_key) if bind else None
    limits = (limits or ListenLimits()).fitted()
    # Nothing this root daemon creates is writable by others, whatever umask it was started with.
    os.umask(0o022)
    if audit_log is not None:
        from hutch.sandbox._host.daemon.tenants import AuditLog
        audit = AuditLog(audit_log, audit_max_bytes, audit_keep)
    try:
        asyncio.run(_serve(Path(socket_path) if socket_path else paths.daemon_socket(), bind, token, policy, tls,
                           limits, registry, audit, id_prefix, max_sandboxes))
    finally:
        if audit is not None:
            audit.close()


async def _serve(sock: Path, bind: tuple[str, int] | None, token: str | None, policy: PeerPolicy,
                 tls: tuple[Path, Path] | None, limits: ListenLimits, registry=None, audit=None,
                 id_prefix: str = "", max_sandboxes: int = 0) -> None:
    from hutch.sandbox._host.daemon.manager import Manager

    run = paths.run_dir()
    private_dir(run, policy, close=False)
    paths.owned_by_root(paths.state_dir(), "HUTCH_STATE_DIR (the default is /var/lib/hutch)")
    lock = open(run / "daemon.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise DaemonError(f"another hutch daemon already serves {run}; stop it first or set HUTCH_RUN_DIR.") from None
    private_dir(run, policy)   # ours now: nobody else may reach its lock, records, log or (by default) socket
    log = RateLog()
    install(log)
    mgr = Manager(run, cgroup_parent_for(run))
    mgr.audit = audit
    mgr.id_prefix = f"{id_prefix}-" if id_prefix else ""
    mgr.max_sandboxes = max_sandboxes
    if registry is not None:
        from hutch.sandbox._host.daemon.scope import Tenancy
        registry.log = log
        mgr.tenancy = Tenancy(registry)
    runner = gate = egress_task = disk_task = None
    listeners: list[socket.socket] = []
    # First of all: a SIGTERM while it starts (the socket exists before it serves) must still end in the
    # teardown below, not in the default action, which would leave the cgroups and inits made so far.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # Reap a crashed predecessor's leftovers first, before the heavier imports below.
        mgr.prepare()
        from aiohttp import web

        from hutch.sandbox._host.daemon.listen import Gate
        from hutch.sandbox._host.daemon.network import load_attacher
        from hutch.sandbox._host.daemon.server import make_app

        mgr.network = load_attacher()
        await mgr.start()
        if mgr.tenancy is not None:
            egress_task = loop.create_task(mgr.tenancy.egress_loop(mgr))
            disk_task = loop.create_task(mgr.tenancy.disk_loop())
        ssl_ctx = server_context(*tls) if tls else None
        gate = Gate(limits, log, PeerCheck(policy), token, ssl_ctx, registry)
        runner = web.AppRunner(make_app(mgr, gate), handler_cancellation=True, access_log=None)
        await runner.setup()
        gate.server = runner.server
        listeners.append(bind_unix(sock, policy, own_dir=sock.parent.resolve() == run.resolve()))
        gate.start_unix(listeners[-1])
        where = f"unix:{sock} (for {policy.describe()})"
        if bind:
            listeners.append(_tcp_socket(*bind))
            gate.start_tcp(listeners[-1])
            where += (f" and tls:{bind[0]}:{bind[1]} (certificate {tls[0]}, SHA-256 fingerprint {fingerprint(tls[0])}: "
                      "clients pin it with HUTCH_FINGERPRINT)")
        (run / "daemon.pid").write_text(str(os.getpid()))
        # What exists now (modules, the app) lives as long as the daemon: the collector need not walk it
        # again, and each request makes many short-lived objects, so young collections may wait longer.
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)
        print(f"hutch daemon {os.getpid()}: serving on {where}", file=sys.stderr, flush=True)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), INTERVAL)
            except asyncio.TimeoutError:
                log.flush()
    finally:
        for task in (egress_task, disk_task):
            if task is not None:
                task.cancel()
        if gate is not None:
            await gate.close()
        for s in listeners:
            s.close()
        await mgr.shutdown()
        if mgr.tenancy is not None:
            mgr.tenancy.close()
        if runner is not None:
            await runner.cleanup()
        if listeners:
            sock.unlink(missing_ok=True)
        (run / "daemon.pid").unlink(missing_ok=True)
        log.flush()
        lock.close()


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.create_server((host, port), family=family, backlog=1024,
                                 dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
    except OSError as e:
        raise DaemonError(f"cannot listen on {host}:{port} ({e.strerror}); pick a free port and an address of this "
                          "host for --listen.") from e
    s.setblocking(False)
    return s


__all__ = ["ListenLimits", "cgroup_parent_for", "serve"]
