"""Helpers of the image suite (a unique module name: the tests/ tree has several conftests)."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path

from hutch_testing import make_busybox_root, start_daemon, stop_daemon

#: Every sandbox the suite makes carries this tag; the session ends by terminating whatever has it.
RUN_TAG = {"suite": f"img-{uuid.uuid4().hex[:8]}"}

# Loaded with dlopen(), so ldd does not name it: glibc needs it to cancel or end a thread.
_DLOPENED = ("/usr/lib/x86_64-linux-gnu/libgcc_s.so.1",)
_LOADER = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"


def _usr(path: str) -> str:
    """Debian 12 has a merged /usr: /lib/x is /usr/lib/x, and a root made here keeps only the /usr copy."""
    return "/usr" + path if path.startswith(("/lib/", "/lib64/", "/bin/", "/sbin/")) else path


def _place(src: str, dst: Path) -> None:
    """dst as a hard link to src, or a copy where they are on different filesystems (a tmpfs /tmp)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM):
            raise
        shutil.copy2(src, dst)


def graft(root: Path, *host_paths: str, skip: tuple[str, ...] = ()) -> None:
    """Put host files and trees into `root` at the same path (symlinks as symlinks, never written in place:
    a lower dir is never written). Directories named in `skip` are left out."""
    for hp in host_paths:
        dest = root / _usr(hp).lstrip("/")
        # the busybox root's usr/bin is a symlink to /bin: a path through it would write the host's
        if not os.path.realpath(dest.parent).startswith(os.path.realpath(root) + "/"):
            raise ValueError(f"{hp} would land outside {root}")
        if not os.path.isdir(hp):
            _place(os.path.realpath(hp), dest)
            continue
        for top, dirs, files in os.walk(hp):
            dirs[:] = [d for d in dirs if d not in skip]
            rel = os.path.relpath(top, hp)
            (dest / rel).mkdir(parents=True, exist_ok=True)
            for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
                src, out = os.path.join(top, name), dest / rel / name
                if os.path.islink(src):
                    os.symlink(os.readlink(src), out)
                else:
                    _place(src, out)


def shared_libs(*elfs: str) -> list[str]:
    """The shared libraries the ELF files `elfs` load (ldd), with the loader and what glibc dlopen()s."""
    libs = {_LOADER, *_DLOPENED}
    for elf in elfs:
        out = subprocess.run(["ldd", elf], capture_output=True, text=True).stdout
        libs.update(_usr(line.split("=>")[1].split()[0]) for line in out.splitlines()
                    if "=>" in line and "/" in line.split("=>")[1])
    return sorted(libs)


def host_root(root: Path, programs: tuple[str, ...], trees: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> Path:
    """A busybox root plus host `programs` (into /bin, over busybox's applets), host `trees`, and the
    shared libraries all of them load. Hard-linked where `root` is on /usr's filesystem, copied elsewhere."""
    make_busybox_root(root, shutil.which("busybox"))
    elfs = list(programs)
    for t in trees:
        for top, _dirs, files in os.walk(t):
            elfs += [os.path.join(top, f) for f in files if _is_elf(os.path.join(top, f))]
    for path in (*trees, *shared_libs(*elfs)):
        graft(root, path, skip=skip)
    for prog in programs:
        (root / "bin" / os.path.basename(prog)).unlink(missing_ok=True)
        _place(os.path.realpath(prog), root / "bin" / os.path.basename(prog))
    (root / "usr/lib64").mkdir(exist_ok=True)
    os.symlink("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", root / "usr/lib64/ld-linux-x86-64.so.2")
    os.symlink("usr/lib", root / "lib")
    os.symlink("usr/lib64", root / "lib64")
    return root


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return not os.path.islink(path) and f.read(4) == b"\x7fELF"
    except OSError:
        return False


__all__ = ["RUN_TAG", "graft", "host_root", "make_busybox_root", "shared_libs", "start_daemon", "stop_daemon"]


def one_layer_archive(path: Path, tree: Path, base: str, node_id: str, kind: str) -> Path:
    """An image archive at `path` of one node `node_id` (of `kind`) over `base`, whose layer is `tree`."""
    from hutch.sandbox._host import archive, layers

    meta = layers.measure_tree(tree)
    manifest = {"format": 1, "top": node_id, "base": base, "layers": {meta["digest"]: meta},
                "nodes": [{"id": node_id, "parent": base, "layer": meta["digest"], "kind": kind}]}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(archive.MANIFEST)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
        t.add(tree, arcname=f"layers/{meta['digest']}")
    return path
