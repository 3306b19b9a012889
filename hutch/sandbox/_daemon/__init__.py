"""The host daemon (`hutch serve`): owns every sandbox on this host and serves docs/api.md.

    serve(socket_path=None, listen=None, token=None)

runs it in the foreground until SIGTERM or SIGINT. On start it reaps whatever
a crashed predecessor left (cgroups, records under run_dir()/sandboxes), then
spawns the zygote (the sandbox start server) and listens on the Unix socket,
and, with `listen="HOST:PORT"`, on TCP where every request needs the bearer
`token`. Only one daemon serves a run directory (a lock file says so).
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import hashlib
import os
import signal
import sys
from pathlib import Path

from hutch._core import paths
from hutch._core.errors import ConfigError, DaemonError

DEFAULT_CGROUP_PARENT = paths.KERNEL_NAME_PREFIX


def cgroup_parent_for(run_dir: Path) -> str:
    """`hutch` for the default run directory, `hutch-<hash>` for another, so daemons never reap each other."""
    if run_dir.resolve() == paths.DEFAULT_RUN_DIR.resolve():
        return DEFAULT_CGROUP_PARENT
    return f"{DEFAULT_CGROUP_PARENT}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:10]}"


def _parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen={listen!r} must be HOST:PORT, like 127.0.0.1:7450.")
    return host.strip("[]") or "0.0.0.0", int(port)


def serve(socket_path: str | os.PathLike | None = None, listen: str | None = None, token: str | None = None) -> None:
    """Run the hutch daemon in the foreground until SIGTERM or SIGINT (see the module docstring)."""
    from hutch.sandbox._native._linux import ARCH_OK

    if os.geteuid() != 0:
        raise DaemonError("the hutch daemon creates namespaces and cgroups, so it must run as root; use sudo.")
    if not ARCH_OK:
        raise DaemonError("the native runtime supports x86_64 only (its seccomp filter is written for it).")
    if listen and not token:
        raise ConfigError("serving on TCP needs a token; pass --token (e.g. `openssl rand -hex 16`).")
    bind = _parse_listen(listen) if listen else None
    asyncio.run(_serve(Path(socket_path) if socket_path else paths.daemon_socket(), bind, token))


async def _serve(sock: Path, bind: tuple[str, int] | None, token: str | None) -> None:
    from hutch.sandbox._daemon._manager import Manager

    run = paths.run_dir()
    run.mkdir(parents=True, exist_ok=True)
    lock = open(run / "daemon.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise DaemonError(f"another hutch daemon already serves {run}; stop it first or set HUTCH_RUN_DIR.") from None
    mgr = Manager(run, cgroup_parent_for(run))
    runner = None
    try:
        # Reap a crashed predecessor's leftovers first, before the heavier imports below.
        mgr.prepare()
        from aiohttp import web

        from hutch.sandbox._daemon._network import load_attacher
        from hutch.sandbox._daemon._server import make_app

        mgr.network = load_attacher()
        await mgr.start()
        runner = web.AppRunner(make_app(mgr, token), handler_cancellation=True, access_log=None)
        await runner.setup()
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        await web.UnixSite(runner, str(sock)).start()
        os.chmod(sock, 0o600)
        if bind:
            await web.TCPSite(runner, bind[0], bind[1]).start()
        (run / "daemon.pid").write_text(str(os.getpid()))
        # What exists now (modules, the app) lives as long as the daemon: the collector need not walk it
        # again, and each request makes many short-lived objects, so young collections may wait longer.
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"hutch daemon {os.getpid()}: serving on unix:{sock}" + (f" and tcp:{bind[0]}:{bind[1]}" if bind else ""),
              file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await mgr.shutdown()
        if runner is not None:
            await runner.cleanup()
        sock.unlink(missing_ok=True)
        (run / "daemon.pid").unlink(missing_ok=True)
        lock.close()


__all__ = ["cgroup_parent_for", "serve"]
