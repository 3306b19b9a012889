"""Building a `hutch.Image`: step keys, cache checks, each step in a real sandbox, progress.

A step's key is sha256(parent key, step kind, step definition, copied files' contents);
the base's key is its image id (the default image) or its path and a fingerprint of its
tree (a prepared directory). A step whose key the daemon's store holds is not run again.
Otherwise it runs in a sandbox made from its parent (a run, apt or pip step: commands;
a copy step: files written through the files API), and the sandbox's writable layer is
frozen into the store under that key (POST .../snapshot with "key"). env and workdir
steps record a node without a layer. A failing step raises ImageError and leaves nothing:
the layer exists only once snapshotted, and the snapshot renames a complete copy into place.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import threading
import time
from pathlib import Path

from hutch._core import settings
from hutch._core.errors import ImageError, InvalidSpecError, NotFoundError
from hutch.sandbox import _client, _ensure
from hutch.sandbox._spec import BUILD_CAPABILITIES, DEFAULT_IMAGE, Network, SandboxSpec

#: Names an apt step may reach. Env: HUTCH_APT_HOSTS (comma-separated).
APT_HOSTS = settings.APT_HOSTS.default
#: Names a pip step may reach. Env: HUTCH_PIP_HOSTS (comma-separated).
PIP_HOSTS = settings.PIP_HOSTS.default
#: Where a pip step finds the CA bundle the host's pip trusts (see _pip_ca); removed before the layer is frozen.
PIP_CA_PATH = "/tmp/.hutch-pip-ca.pem"
STEP_TIMEOUT = 3600.0     # seconds one step may run
STEP_MEMORY = "4G"        # a build sandbox's memory (its written files count: the writable layer is tmpfs)
STEP_DISK = "8G"
PREFIX = "image:"


def _pip_ca() -> bytes | None:
    """The CA bundle the host's pip is told to trust (HUTCH_PIP_CERT, else PIP_CERT, else `cert` in
    /etc/pip.conf), or None. Where a TLS-inspecting proxy stands between the host and PyPI, the image's own
    CA store does not know its certificate; the bundle only carries trust, so it is not part of the step's key."""
    path = settings.PIP_CERT.get() or settings.PIP_CERT_PIP.get()
    if not path:
        import configparser

        cfg = configparser.ConfigParser()
        try:
            cfg.read("/etc/pip.conf")
            path = cfg.get("global", "cert", fallback=None)
        except configparser.Error:
            path = None
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(16 << 20)
    except OSError:
        return None


def _hosts(setting: settings.Setting[tuple[str, ...]]) -> list[str]:
    return list(setting.get())


class Progress:
    """Build progress on stderr: one line per step (cached, or built with bytes and time), and the
    output of running steps, indented."""

    def __init__(self, total: int, quiet: bool = False, stream=None):
        self.total, self.quiet = total, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"hutch: {text}", file=self.stream, flush=True)

    def output(self, line: str) -> None:
        if not self.quiet:
            print(f"    {line.rstrip()}", file=self.stream, flush=True)


# --- keys ---------------------------------------------------------------------------------------

def _dir_fingerprint(root: str) -> str:
    """Path, types, sizes, modes and mtimes of a prepared root: a changed tree is a new base."""
    h = hashlib.sha256(root.encode())
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files) + dirs:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            h.update(f"{os.path.relpath(p, root)}\0{st.st_mode:o}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(
                "utf-8", "surrogateescape"))
    return h.hexdigest()


def _copy_entries(step) -> list[tuple[str, str, int]]:
    """(local file, remote path, mode) of a copy step, sorted; directories as (None, path, mode)."""
    a = step.args
    if not a["dir"]:
        return [(step.local, a["remote"], os.stat(step.local).st_mode)]
    out = []
    for dirpath, dirs, files in os.walk(step.local, followlinks=True):
        dirs.sort()
        rel = os.path.relpath(dirpath, step.local)
        remote = a["remote"] if rel == "." else f"{a['remote'].rstrip('/')}/{rel}"
        out.append(("", remote, os.stat(dirpath).st_mode))
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            if os.path.isfile(p):   # symlinks to files are followed; dangling ones and sockets skipped
                out.append((p, f"{remote.rstrip('/')}/{f}", os.stat(p).st_mode))
    return out


def step_key(parent_key: str, step) -> str:
    h = hashlib.sha256(f"{parent_key}\0{step.kind}\0{step.spec}\0".encode())
    if step.kind == "copy":
        for local, remote, mode in _copy_entries(step):
            h.update(f"{remote}\0{stat.S_IMODE(mode):o}\0".encode())
            if local:
                with open(local, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _base_key(client, ref: str, progress: Progress) -> str:
    if ref.startswith(PREFIX):
        return ref
    if ref.startswith("dir:"):
        return f"{ref}\0{_dir_fingerprint(ref[4:])}" if os.path.isdir(ref[4:]) else ref
    return f"{ref}\0{_ensure.ensure_image(client, ref, remember=False)['id']}"   # the base as it is now


# --- building -----------------------------------------------------------------------------------

def _exists(client, key: str) -> bool:
    """Is step `key` built here? Only a node a build recorded counts: an imported one (kind "import") carries
    whatever its archive held under that id, so the step is built again (and replaces it)."""
    try:
        return client.json("GET", f"/v1/images/{key}").get("kind") == "step"
    except NotFoundError:
        return False


def build(image, *, name: str | None = None, quiet: bool = False, say_cached: bool = True):
    """Build what is not cached of `image`; `say_cached=False` says nothing when every step is (Sandbox.create)."""
    from hutch.sandbox.image import Image

    if name is not None and (name == DEFAULT_IMAGE or name.startswith(("dir:", PREFIX))):
        raise InvalidSpecError(f"{name!r} cannot name a built image: it is a base image's reference; pick another name.")
    client = _client.default_client()
    progress = Progress(len(image.steps), quiet)
    if not image.steps:
        if name:
            raise ImageError("only an image with steps (or a snapshot) can be named; add a step, or use it as it is.")
        return image
    base = image.ref
    if not base.startswith((PREFIX, "dir:")) and base != DEFAULT_IMAGE:
        base = client.json("GET", f"/v1/images/{base}")["ref"]   # a built image's name: the image it names now
    parent_key = _base_key(client, base, progress)
    keys = []
    for step in image.steps:
        parent_key = step_key(parent_key, step)
        keys.append(parent_key)
    have = len(keys)
    while have > 0 and not _exists(client, keys[have - 1]):   # the deepest step already stored
        have -= 1
    n = len(keys)
    if have == n and not say_cached:
        quiet = progress.quiet = True
    for i, step in enumerate(image.steps):
        desc = step.describe()
        if i < have:
            if i == n - 1 or not quiet:
                progress.say(f"image step {i + 1}/{n} {_short(desc)}: cached")
            continue
        parent = base if i == 0 else PREFIX + keys[i - 1]
        t = time.monotonic()
        progress.say(f"image step {i + 1}/{n} {_short(desc)}: building")
        node = _run_step(client, step, parent, keys[i], desc, progress, f"{i + 1}/{n}")
        progress.say(f"image step {i + 1}/{n} {_short(desc)}: built, {(node.get('size') or 0) / 1e6:.1f} MB "
                     f"in {time.monotonic() - t:.1f} s")
    if name:
        client.json("POST", "/v1/images/nodes", json={"id": keys[-1], "parent": base if n == 1 else
                                                      PREFIX + keys[-2], "name": name, "pinned": True})
    if have < n:
        progress.say(f"image {keys[-1][:12]} ready ({n - have} of {n} steps built, "
                     f"{time.monotonic() - progress.t0:.1f} s)")
    return Image(PREFIX + keys[-1])


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _run_step(client, step, parent: str, key: str, desc: str, progress: Progress, where: str) -> dict:
    a = step.args
    if step.kind in ("env", "workdir"):
        body = {"id": key, "parent": parent, "description": desc,
                "env": a.get("env") or {}, "workdir": a.get("workdir")}
        if step.kind == "workdir":   # made now, so that every sandbox of the image finds it
            return _in_sandbox(client, step, parent, key, desc, progress, where,
                               [["mkdir", "-p", a["workdir"]]], Network.none(), body)
        return client.json("POST", "/v1/images/nodes", json=body)
    if step.kind == "run":
        argvs = [["sh", "-c", c] if isinstance(c, str) else c for c in a["commands"]]
        net = Network.from_dict(a["network"]) if a.get("network") else Network.none()
        return _in_sandbox(client, step, parent, key, desc, progress, where, argvs, net)
    if step.kind == "apt":
        argvs = [["apt-get", "update"],
                 ["apt-get", "install", "-y", "--no-install-recommends", *a["packages"]],
                 ["apt-get", "clean"],
                 ["sh", "-c", "rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin"]]   # not needed to run
        net = Network.allow(domains=_hosts(settings.APT_HOSTS), ports=[80, 443])
        return _in_sandbox(client, step, parent, key, desc, progress, where, argvs, net,
                           env={"DEBIAN_FRONTEND": "noninteractive"})
    if step.kind == "pip":
        hosts = _hosts(settings.PIP_HOSTS)
        argv = ["python3", "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check"]
        ports = {80, 443}
        if a.get("index_url"):
            from urllib.parse import urlsplit

            u = urlsplit(a["index_url"])
            hosts.append(u.hostname)
            ports.add(u.port or (443 if u.scheme == "https" else 80))
            argv += ["--index-url", a["index_url"]]
            if u.scheme == "http":   # the user named a plain-HTTP index: pip would ignore it otherwise
                argv += ["--trusted-host", u.hostname]
        net = Network.allow(domains=hosts, ports=sorted(ports))
        env = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore"}
        ca = _pip_ca()
        if ca is not None:
            env["PIP_CERT"] = PIP_CA_PATH
        return _in_sandbox(client, step, parent, key, desc, progress, where, [argv + a["packages"]], net,
                           env=env, scratch={PIP_CA_PATH: ca} if ca is not None else None)
    if step.kind == "copy":
        return _in_sandbox(client, step, parent, key, desc, progress, where, [], Network.none())
    raise ImageError(f"unknown image step kind {step.kind!r}.")


def _in_sandbox(client, step, parent, key, desc, progress, where, argvs, network, node=None, env=None,
                scratch=None) -> dict:
    from hutch.sandbox.sandbox import Sandbox

    # The build capabilities (chown, setuid ...: apt, dpkg and useradd need them) are not on
    # Sandbox.create: only build steps get them, so the spec is posted here.
    spec = SandboxSpec.build((), image=parent, network=network, timeout=STEP_TIMEOUT, memory=STEP_MEMORY,
                             disk=STEP_DISK, cpu=float(os.cpu_count() or 1), tags={"hutch-build": key[:12]},
                             capabilities=BUILD_CAPABILITIES)
    sb = Sandbox(client, client.json("POST", "/v1/sandboxes", json={"spec": spec.to_dict()}))
    try:
        _client.hold_lease(client.ep, sb.id)
        for path, data in (scratch or {}).items():   # files the commands need but the layer must not keep
            sb.files.write(path, data)
        if step.kind == "copy":
            for local, remote, mode in _copy_entries(step):
                if local:
                    with open(local, "rb") as f:
                        sb.files.write(remote, f.read(), mode=stat.S_IMODE(mode))
                else:
                    sb.files.mkdir(remote, parents=True)
        step_out: list[str] = []   # every command's output: an earlier warning often explains the failure
        for argv in argvs:
            p = sb.exec(*argv, env=env, stdin=False)
            out, errs = [], []
            # stderr read meanwhile: unread output blocks the command (flow control), so reading one
            # stream after the other would hang a step that writes much to stderr
            reader = threading.Thread(target=lambda: errs.append(p.stderr.read()), daemon=True)
            reader.start()
            for line in p.stdout:
                out.append(line)
                progress.output(line)
            reader.join()
            err = errs[0] if errs else ""
            for line in err.splitlines():
                progress.output(line)
            rc = p.wait()
            step_out += out + [err]
            if rc != 0:
                text = "".join(out) + err
                tail = text.strip()[-800:]
                hint = (" The image has no pip: add .apt_install('python3-pip') before pip_install."
                        if "No module named pip" in text else "")
                raise ImageError(
                    f"image step {where} ({desc}) failed: {argv} exited with code {rc}. Its output ends with:\n"
                    f"{tail}\nFix the step and build again; the steps before it stay cached.{hint}",
                    step=desc, output="".join(step_out), returncode=rc)
        for path in scratch or {}:
            sb.files.remove(path)
        body = dict(node or {"description": desc})
        body["key"] = key
        body.pop("id", None)
        body.pop("parent", None)
        return client.json("POST", f"/v1/sandboxes/{sb.id}/snapshot", json=body)
    finally:
        sb.terminate()


# --- export / import ----------------------------------------------------------------------------

def export_image(image, path) -> None:
    from hutch.sandbox.image import Image

    client = _client.default_client()
    if not image.ref.startswith((PREFIX, "dir:")) and image.ref != DEFAULT_IMAGE:
        image = Image(client.json("GET", f"/v1/images/{image.ref}")["ref"])   # a built image's name
    if not image.ref.startswith(PREFIX):
        raise ImageError(f"image {image.ref!r} is a base image; only built images and snapshots can be exported.")
    client.download(f"/v1/images/{image.ref[len(PREFIX):]}/export", path)


def import_image(path, base: str | None = None, replace: bool = False):
    from hutch.sandbox.image import Image

    src = Path(path)
    if not src.is_file():
        raise NotFoundError(f"{src} is not a file; give the path of an archive made by Image.export().")
    with open(src, "rb") as f:
        d = _client.default_client().json("POST", "/v1/images/import", content=f,
                                          params={**({"base": base} if base is not None else {}),
                                                  **({"replace": "1"} if replace else {})} or None)
    return Image(d["ref"])


__all__ = ["APT_HOSTS", "PIP_HOSTS", "build", "export_image", "import_image", "step_key"]
