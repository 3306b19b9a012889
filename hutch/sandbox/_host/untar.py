"""Reading an image archive as hostile input (for archive.import_): bounded, and never through a link.

Each layer is extracted into a fresh temp directory of its own under the layer store (mode 0700,
inside the 0700 store): every member is created relative to directory descriptors, each component
of its name opened `O_NOFOLLOW | O_DIRECTORY` and the last one made with mkdirat / openat(O_CREAT |
O_EXCL | O_NOFOLLOW) / symlinkat / mknodat / linkat, none of which follows a symlink or reuses what
exists. So no member is ever written through or onto a link, a name seen twice is refused (EEXIST),
and a member's parent must be a directory member seen before it. Ownership and modes are applied to
the descriptor of what was just made (fchown, then fchmod: chown clears setuid bits).

What a layer may hold is what the store itself writes (layers._Walker): directories, regular files,
symlinks (their targets are only ever resolved inside a sandbox), overlay whiteouts (char 0/0), and
owners in a sandbox's own id range 0..65535 (snapshots shift ids back into it). Hard links only to a
regular file made earlier in the same layer. Anything else (devices, FIFOs, sparse files, GNU or pax, pax global
headers, unknown types, absolute names, `.` or `..`, a name outside `layers/<digest>/` of a layer
the manifest lists) is refused. Setuid/setgid bits are kept (the digest covers modes, and an image
needs its /usr/bin/su): nothing in a layer is reachable from the host (0700 root directories), and it
is only ever an overlay lower dir mounted nosuid under no_new_privs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hutch._core import settings
from hutch._core.errors import ImageError, InvalidArchiveError
from hutch.sandbox._host.layers import OPAQUE_XATTRS, TMP_PREFIX

MANIFEST = "hutch-image.json"
#: Members of one archive (every layer's entries, the manifest included). Env: HUTCH_IMPORT_MAX_ENTRIES.
MAX_ENTRIES = settings.IMPORT_MAX_ENTRIES.default
#: Bytes of one archive, so of all its content too. Env: HUTCH_IMPORT_MAX_BYTES.
MAX_BYTES = settings.IMPORT_MAX_BYTES.default
MAX_MANIFEST = 8 << 20     # bytes of hutch-image.json
MAX_HEADER = 64 << 10      # one pax extended header or GNU long name (tarfile reads it whole into memory)
NAME_MAX = 255             # bytes of one name component
PATH_MAX = 4096            # bytes of a member's name or a symlink's target
ID_SPAN = 65536            # a layer's owners are a sandbox's own ids, 0..65535
_MTIME_MAX = 1 << 40
_CHUNK = 1 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FIX = "nothing was imported; import only archives made by `hutch image export`, from a source you trust."


@dataclass(frozen=True)
class ImportLimits:
    """What one import may cost; the environment of the daemon overrides the defaults above."""

    entries: int = MAX_ENTRIES
    bytes: int = MAX_BYTES

    @classmethod
    def from_env(cls) -> "ImportLimits":
        return cls(entries=settings.IMPORT_MAX_ENTRIES.get(), bytes=settings.IMPORT_MAX_BYTES.get())


def refuse(name: str, why: str) -> InvalidArchiveError:
    return InvalidArchiveError(f"the image archive is refused: {name!r} {why}; {_FIX}")


class Counted:
    """An archive's bytes, refused past `limit` (also bounds the content of every layer together). `kind` names the
    archive in errors: "image" (`hutch image export`) or "snapshot" (`hutch snapshot export`)."""

    def __init__(self, fileobj, limit: int, kind: str = "image"):
        self.f, self.limit, self.seen, self.kind = fileobj, limit, 0, kind

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.seen += len(data)
        if self.seen > self.limit:
            raise InvalidArchiveError(f"the {self.kind} archive is larger than {self.limit} bytes (HUTCH_IMPORT_MAX_BYTES "
                                      "of the daemon); raise that limit if the archive is yours, else " + fix(self.kind))
        return data


def fix(kind: str) -> str:
    return f"nothing was imported; import only archives made by `hutch {kind} export`, from a source you trust."


def header_type(refuse_as: Callable[[str, str], InvalidArchiveError], command: str) -> type[tarfile.TarInfo]:
    """A TarInfo that bounds what tarfile reads whole: a pax header or GNU long name is read into memory whatever
    size it declares, and pax global headers apply to every later member; _proc_member is its documented hook."""

    class Header(tarfile.TarInfo):
        def _proc_member(self, tar):
            if self.type in (tarfile.GNUTYPE_SPARSE, tarfile.XGLTYPE):
                raise refuse_as(self.name, f"is a sparse file or a pax global header, which `{command}` never writes")
            if self.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                             tarfile.GNUTYPE_LONGLINK) and self.size > MAX_HEADER:
                raise refuse_as(self.name, f"has a {self.size}-byte extended header (at most {MAX_HEADER})")
            member = super()._proc_member(tar)
            if member.sparse is not None:   # pax GNU.sparse.* records on a regular file: its size is only claimed
                raise refuse_as(member.name, f"is a sparse file (pax GNU.sparse records of {member.size} bytes), "
                                f"which `{command}` never writes")
            return member

    return Header


def strict_json(data: bytes, name: str, refuse_as: Callable[[str, str], InvalidArchiveError]):
    """A manifest's JSON, a key named twice refused (json.loads would keep the last one silently)."""
    def pairs(items):
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise refuse_as(name, "names a key twice")
        return dict(items)

    try:
        return json.loads(data, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as e:
        raise refuse_as(name, f"is not valid JSON ({str(e)[:100]})") from None


_Header = header_type(refuse, "hutch image export")


def components(name: str, what: str) -> tuple[str, ...]:
    """The components of a relative archive name, each checked; refused if absolute, empty, `.` or `..`."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise refuse(what, "has an empty name or one with a NUL byte")
    if len(os.fsencode(name)) > PATH_MAX:
        raise refuse(what[:200], f"has a name longer than {PATH_MAX} bytes")
    if name.startswith("/"):
        raise refuse(what, "has an absolute name")
    parts = tuple(name.split("/"))
    for p in parts:
        if p in ("", ".", ".."):
            raise refuse(what, "has an empty, '.' or '..' component")
        if len(os.fsencode(p)) > NAME_MAX:
            raise refuse(what[:200], f"has a name component longer than {NAME_MAX} bytes")
    return parts


class LayerTree:
    """One layer being extracted into `dir/fs`, a fresh private temp dir under the store."""

    def __init__(self, store: Path, digest: str, files: int, size: int):
        self.digest, self.max_files, self.max_size = digest, files, size
        self.dir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=store))   # 0700
        self.fs = self.dir / "fs"
        self.root: int | None = None
        self.entries = self.bytes = 0
        self._dirs: list[tuple[tuple[str, ...], int, int, int, int]] = []
        self._cached: tuple[tuple[str, ...], int] | None = None

    # --- resolving a directory made earlier, never through a link ---

    def _walk(self, parts: tuple[str, ...], name: str) -> int:
        """A new fd of the directory `parts` (relative to the layer root), every component O_NOFOLLOW."""
        fd = os.dup(self.root)
        try:
            for p in parts:
                try:
                    nfd = os.open(p, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    raise refuse(name, f"comes before its directory {'/'.join(parts)!r} (or that is missing)") from None
                except OSError:   # ELOOP: a symlink; ENOTDIR: a file
                    raise refuse(name, "has a path through a symlink or a non-directory") from None
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _parent(self, parts: tuple[str, ...], name: str) -> int:
        if self._cached is not None and self._cached[0] == parts:
            return self._cached[1]
        fd = self._walk(parts, name)
        if self._cached is not None:
            os.close(self._cached[1])
        self._cached = (parts, fd)
        return fd

    # --- members ---

    def add(self, m: tarfile.TarInfo, parts: tuple[str, ...], tar: tarfile.TarFile) -> None:
        name = m.name
        self.entries += 1
        if self.entries > self.max_files:
            raise refuse(name, f"is one more entry of layer {self.digest[:12]} than its manifest declares")
        if not (0 <= m.uid < ID_SPAN and 0 <= m.gid < ID_SPAN):
            raise refuse(name, f"has owner {m.uid}:{m.gid}, outside a sandbox's own ids 0..{ID_SPAN - 1}")
        if not 0 <= m.mtime < _MTIME_MAX:   # a pax mtime is any float: inf or 1e300 would fail utime()
            raise refuse(name, f"has a modification time {m.mtime!r} out of range")
        mode = m.mode & 0o7777
        if not parts:   # the layer's root directory, always its first entry
            if not m.isdir() or self.root is not None:
                raise refuse(name, "is not the layer's one root directory")
            os.mkdir(self.fs, 0o700)
            self.root = os.open(self.fs, _DIR)
            self._dirs.append(((), mode, m.uid, m.gid, int(m.mtime)))
            return
        if self.root is None:
            raise refuse(name, "comes before its layer's root directory")
        pfd = self._parent(parts[:-1], name)
        leaf = parts[-1]
        try:
            if m.isdir():
                os.mkdir(leaf, 0o700, dir_fd=pfd)   # its owner and mode once its children are in (finish)
                self._dirs.append((parts, mode, m.uid, m.gid, int(m.mtime)))
            elif m.isreg():
                self._file(pfd, leaf, m, tar, mode)
            elif m.issym():
                target = m.linkname
                if not target or "\0" in target or len(os.fsencode(target)) >= PATH_MAX:
                    raise refuse(name, "is a symlink with an empty or overlong target")
                os.symlink(target, leaf, dir_fd=pfd)
                os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
                os.utime(leaf, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
            elif m.islnk():
                self._hardlink(pfd, leaf, m)
            elif m.ischr() and m.devmajor == 0 and m.devminor == 0:   # an overlay whiteout
                os.mknod(leaf, stat.S_IFCHR | 0o600, 0, dir_fd=pfd)
                os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
                os.chmod(leaf, mode, dir_fd=pfd)   # just made by mknodat: not a symlink
            else:
                raise refuse(name, "is a device, FIFO or unknown member type (layers hold only directories, "
                             "files, symlinks, hard links and overlay whiteouts)")
        except FileExistsError:
            raise refuse(name, "appears twice in the archive") from None

    def _file(self, pfd: int, leaf: str, m: tarfile.TarInfo, tar: tarfile.TarFile, mode: int) -> None:
        self.bytes += m.size
        if self.bytes > self.max_size:
            raise refuse(m.name, f"makes layer {self.digest[:12]} larger than its manifest declares")
        fd = os.open(leaf, _NEW_FILE, 0o600, dir_fd=pfd)
        try:
            src = tar.extractfile(m)
            while data := src.read(_CHUNK):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            os.fchown(fd, m.uid, m.gid)
            os.fchmod(fd, mode)
            os.utime(fd, (m.mtime, m.mtime))
        finally:
            os.close(fd)

    def _hardlink(self, pfd: int, leaf: str, m: tarfile.TarInfo) -> None:
        lparts = components(m.linkname, m.name)
        if len(lparts) < 3 or lparts[:2] != ("layers", self.digest):
            raise refuse(m.name, "is a hard link to a name outside its own layer")
        sfd = self._walk(lparts[2:-1], m.name)
        try:
            try:
                st = os.stat(lparts[-1], dir_fd=sfd, follow_symlinks=False)
            except FileNotFoundError:
                raise refuse(m.name, "is a hard link to a file not earlier in its layer") from None
            if not stat.S_ISREG(st.st_mode):
                raise refuse(m.name, "is a hard link to something other than a regular file")
            os.link(lparts[-1], leaf, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(sfd)

    def finish(self, opaque) -> None:
        """Directories' owners, modes and times (deepest first, now that their children are in); opaque flags."""
        if self.root is None:
            raise refuse(f"layers/{self.digest}", "is a layer the manifest lists but the archive does not hold")
        for parts, mode, uid, gid, mtime in reversed(self._dirs):
            fd = self._walk(parts, f"layers/{self.digest}/{'/'.join(parts)}")
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
        for rel in opaque:   # tar does not carry the xattrs; both, see layers._Walker.walk_dir
            what = f"opaque directory {rel!r} of layer {self.digest[:12]}"
            if not isinstance(rel, str) or not rel.startswith("/"):
                raise refuse(MANIFEST, f"names an {what} that is not an absolute path in the layer")
            fd = self._walk(components(rel[1:], what) if rel != "/" else (), what)
            try:
                for x in OPAQUE_XATTRS:
                    os.setxattr(fd, x, b"y")
            finally:
                os.close(fd)
        self.close()

    def close(self) -> None:
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None
        if self.root is not None:
            os.close(self.root)
            self.root = None

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def read_archive(fileobj, store: Path, limits: ImportLimits,
                 check_manifest: Callable[[object], dict]) -> tuple[dict, dict[str, LayerTree]]:
    """Extract every layer of the archive into its own temp dir under `store`; (manifest, trees).

    The manifest must be the first member; `check_manifest` validates it (and its declared sizes,
    which bound each layer) before any layer is read. On any refusal every temp dir is removed."""
    trees: dict[str, LayerTree] = {}
    try:
        try:
            with tarfile.open(fileobj=Counted(fileobj, limits.bytes), mode="r|", tarinfo=_Header,
                              bufsize=_CHUNK) as tar:
                m = tar.next()
                if m is None or m.name != MANIFEST or not m.isreg():
                    raise refuse(m.name if m is not None else "(empty)", f"is the first member, not {MANIFEST}")
                if m.size > MAX_MANIFEST:
                    raise refuse(MANIFEST, f"is {m.size} bytes (at most {MAX_MANIFEST})")
                manifest = check_manifest(strict_json(tar.extractfile(m).read(), MANIFEST, refuse))
                layers = manifest["layers"]
                count = 1
                while (m := tar.next()) is not None:
                    tar.members.clear()   # stream mode keeps every header it read: memory would grow with the count
                    count += 1
                    if count > limits.entries:
                        raise InvalidArchiveError(f"the image archive holds more than {limits.entries} entries "
                                         "(HUTCH_IMPORT_MAX_ENTRIES of the daemon); " + _FIX)
                    parts = components(m.name, m.name)
                    if len(parts) < 2 or parts[0] != "layers" or parts[1] not in layers:
                        raise refuse(m.name, "is outside layers/<digest>/ of the layers its manifest lists")
                    tree = trees.get(parts[1])
                    if tree is None:
                        meta = layers[parts[1]]
                        tree = trees[parts[1]] = LayerTree(store, parts[1], meta["files"], meta["size"])
                    try:
                        tree.add(m, parts[2:], tar)
                    except OSError as e:   # ENOSPC, EMLINK ...: the host's limits, named
                        raise ImageError(f"the image archive's entry {m.name!r} could not be extracted "
                                         f"({e.strerror}); nothing was imported.") from e
        except (tarfile.TarError, EOFError, UnicodeError) as e:
            raise InvalidArchiveError(f"the image archive is not readable ({e}); give a file made by "
                             "`hutch image export`.") from e
        for digest, meta in layers.items():
            if digest not in trees:
                raise refuse(f"layers/{digest}", "is a layer the manifest lists but the archive does not hold")
            trees[digest].finish(meta["opaque"])
        return manifest, trees
    except BaseException:
        for t in trees.values():
            t.discard()
        raise


__all__ = ["ID_SPAN", "MANIFEST", "MAX_BYTES", "MAX_ENTRIES", "MAX_MANIFEST", "ImportLimits", "LayerTree",
           "components", "read_archive", "refuse"]
