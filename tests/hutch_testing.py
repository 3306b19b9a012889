"""Test support shared by the suites that run real sandboxes: a tiny busybox root and private daemons.

Importable from every test module because tests/conftest.py puts this directory on sys.path
(pytest's default import mode for a conftest outside a package).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

#: The variables that point the SDK at a daemon; a test that changes them restores them.
SDK_ENV = ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN", "HUTCH_STATE_DIR")


def make_busybox_root(root: Path, busybox: str | None = None) -> Path:
    """Fill `root` with a root filesystem of static busybox and its applets (sh, cat, ls, sleep, wget ...)."""
    busybox = busybox or shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is not installed; run scripts/setup.sh (busybox-static is in scripts/debian-packages.txt).")
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for a in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if a != "busybox":
            os.symlink("busybox", root / "bin" / a)
    for d in ("proc", "dev", "sys", "tmp", "etc", "home/user", "usr", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("sbin", "usr/bin", "usr/sbin"):
        os.symlink("/bin", root / link)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    os.chmod(root / "tmp", 0o1777)
    return root


@contextmanager
def temp_busybox_root(prefix: str, busybox: str | None = None):
    """make_busybox_root in a new temp dir (named `prefix`...), yielded; the dir removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield make_busybox_root(tmp / "root", busybox)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def start_daemon(run_dir: Path, extra_env: dict | None = None, prefix: tuple[str, ...] = (),
                 timeout: float = 120.0, args: tuple[str, ...] = (), sock: Path | None = None,
                 log: Path | None = None, preexec_fn=None, python: str | None = None) -> subprocess.Popen:
    """`python -m hutch serve [args]` on `sock` (default run_dir/hutch.sock; state dir from os.environ),
    ready when this returns (`timeout`: a hang guard; a loaded 2-core machine takes 20 s and more); its output
    goes to `log` (default run_dir/test-daemon.log).

    `prefix` runs it under another command (e.g. nsenter into a test network namespace); `python` is the
    interpreter (default this one; another venv's runs the hutch installed there)."""
    from hutch.sandbox._client import Endpoint, _ping

    sock = sock or run_dir / "hutch.sock"
    log = log or run_dir / "test-daemon.log"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock), **(extra_env or {}))
    env.pop("HUTCH_URL", None)
    with open(log, "ab") as lf:
        proc = subprocess.Popen([*prefix, python or sys.executable, "-m", "hutch", "serve", *args], env=env,
                                stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, start_new_session=True,
                                preexec_fn=preexec_fn)
    ep = Endpoint(socket_path=str(sock))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ping(ep, 1.0):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop_daemon(proc)
    raise RuntimeError(f"the test daemon did not start; its log:\n{log.read_text()[-3000:]}")


def stop_daemon(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (the daemon tears every sandbox down), SIGKILL only if it does not end in time (a SIGKILL
    leaves its sandboxes' mounts and cgroups: the timeout is a generous hang guard)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def sdk_pointed_at(run_dir: Path, **extra: str):
    """Point this process's SDK at the daemon of `run_dir` (and `extra` variables); restore on exit."""
    saved = {k: os.environ.get(k) for k in (*SDK_ENV, *extra)}
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"), **extra)
    os.environ.pop("HUTCH_URL", None)
    os.environ.pop("HUTCH_TOKEN", None)
    try:
        yield
    finally:
        restore_env(saved)


@contextmanager
def session_daemon(prefix: str, tags: dict | None):
    """A private daemon (its run dir a new temp dir named `prefix`...), the SDK pointed at it (sdk_pointed_at);
    yields the run dir. At the end every sandbox whose tags include `tags` (None: every sandbox) is terminated
    while the daemon runs, then the daemon stops and its run dir is removed, also when a test failed."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    proc = None
    try:
        with sdk_pointed_at(run_dir):
            proc = start_daemon(run_dir)
            try:
                yield run_dir
            finally:
                if proc.poll() is None:
                    import hutch

                    for sb in hutch.Sandbox.list(tags=tags):
                        sb.terminate()
    finally:
        if proc is not None:
            stop_daemon(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


def restore_env(saved: dict) -> None:
    """Put back environment variables saved as {name: value or None (was unset)}."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextmanager
def sandbox_maker(image, tags: dict, timeout: float = 120):
    """Yield make(*command, **create_kwargs) -> a Sandbox from `image` (a hutch.Image, or a root directory such
    as the busybox one), carrying `tags`, by default living `timeout` seconds; every sandbox it made is
    terminated on exit, also when the test failed."""
    import hutch

    made = []

    def make(*command, **kw):
        kw.setdefault("image", image if isinstance(image, hutch.Image) else hutch.Image.from_directory(image))
        kw.setdefault("timeout", timeout)
        kw["tags"] = {**tags, **(kw.get("tags") or {})}
        sb = hutch.Sandbox.create(*command, **kw)
        made.append(sb)
        return sb

    try:
        yield make
    finally:
        for sb in made:
            sb.terminate()



class LoopbackHTTP:
    """An HTTP server on 127.0.0.1 (a free port) serving `handler` (a BaseHTTPRequestHandler class) in a thread
    while its `with` block runs: the base of the fakes at a true external boundary (a model API)."""

    def __init__(self, handler):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


# --- other host accounts: the attacker's side of the access tests --------------------------------------

#: The host's own python (stdlib only), which another account can run (the venv's lives under /root).
HOST_PYTHON = next((p for p in ("/usr/bin/python3.11", "/usr/bin/python3") if os.access(p, os.X_OK)), None)


@contextmanager
def host_group():
    """A new host group hutch-tg-<random>; removed at exit, also when the test failed. Yields its grp entry."""
    name = f"hutch-tg-{secrets.token_hex(4)}"
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        yield grp.getgrnam(name)
    finally:
        subprocess.run(["groupdel", name], capture_output=True)
        assert not _exists(grp.getgrnam, name), f"group {name} is still there"


@contextmanager
def host_user(groups: tuple[str, ...] = ()):
    """A new unprivileged host account hutch-test-<random> (its own primary group, members of `groups`);
    removed at exit with userdel -r, also when the test failed. Yields its pwd entry."""
    name = f"hutch-test-{secrets.token_hex(4)}"
    cmd = ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin"]
    if groups:
        cmd += ["--groups", ",".join(groups)]
    subprocess.run([*cmd, name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)   # no home to remove: its complaint is fine
        assert not _exists(pwd.getpwnam, name), f"user {name} is still there"


def _exists(lookup, name) -> bool:
    try:
        lookup(name)
        return True
    except KeyError:
        return False


def run_as(user: pwd.struct_passwd, script: str, *args: str, timeout: float = 60.0,
           primary_gid: int | None = None) -> subprocess.CompletedProcess:
    """Run a stdlib-only Python `script` as `user` with exactly the groups the group database gives it
    (never root's supplementary groups), in a directory it may enter; stdout/stderr as text."""
    assert HOST_PYTHON, "no host python3.11 for the other account (python3.11 is in scripts/debian-packages.txt)"
    gid = user.pw_gid if primary_gid is None else primary_gid
    return subprocess.run([HOST_PYTHON, "-I", "-S", "-c", script, *args], user=user.pw_uid, group=gid,
                          extra_groups=os.getgrouplist(user.pw_name, user.pw_gid), cwd="/",
                          env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                          capture_output=True, text=True, timeout=timeout)


#: As another user: connect to the Unix socket argv[1], GET /v1/health, print {"connect": errno name or "ok",
#: "status": HTTP status or None, "body": answer body}.
UNIX_GET = r"""
import errno, json, socket, sys
out = {"connect": "ok", "status": None, "body": ""}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as e:
    out["connect"] = errno.errorcode.get(e.errno, str(e.errno))
else:
    try:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: hutch\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        out["status"] = int(head.split()[1]) if head.startswith(b"HTTP/") else None
        out["body"] = body.decode(errors="replace")
    except OSError as e:
        out["error"] = str(e)
print(json.dumps(out))
"""


def unix_get_as(user: pwd.struct_passwd, sock: Path, **kw) -> dict:
    """UNIX_GET run as `user` against `sock`."""
    r = run_as(user, UNIX_GET, str(sock), **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
