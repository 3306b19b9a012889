"""Where hutch keeps its state. The defaults are in the settings table (hutch/_core/settings.py).

Which setting wins: an explicit argument, then the environment variable, then
the default.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hutch._core import settings
from hutch._core.errors import ConfigError

#: Persistent state: images, layers, volumes, snapshots. Env: HUTCH_STATE_DIR.
DEFAULT_STATE_DIR = settings.STATE_DIR.default
#: Runtime state: the daemon's socket, pid file, per-sandbox records. Env: HUTCH_RUN_DIR.
DEFAULT_RUN_DIR = settings.RUN_DIR.default
#: Name prefix of the kernel objects a daemon makes (cgroup parents, nft tables); each carries the daemon's
#: instance id too (hutch/sandbox/_host/instance.py). Veths are `hv<id>...`: IFNAMSIZ leaves no room for more.
KERNEL_NAME_PREFIX = "hutch"
#: The directory holding the hutch package: the zygote and gVisor's keeper (python -I -S) import from here.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def state_dir() -> Path:
    return settings.STATE_DIR.get()


def run_dir() -> Path:
    return settings.RUN_DIR.get()


def daemon_socket() -> Path:
    """The Unix socket the host daemon listens on. Env: HUTCH_SOCKET."""
    return settings.SOCKET.get() or run_dir() / "hutch.sock"


def owned_by_root(path: Path, what: str = "HUTCH_RUN_DIR / HUTCH_SOCKET (the default is /run/hutch)", *,
                  sticky: bool = False) -> None:
    """Refuse `path` unless it (if it exists) and every directory above it are root's and writable by no other
    user; an ancestor may be writable by all if it is sticky (/tmp): nobody else can rename what root made there.
    Both the path as given and the one its symlinks lead to are checked (e.g. /var/run and /run). The root daemon
    (and the SDK's autostart, as root) calls it before it makes or writes anything there. `sticky`: `path` itself
    may be sticky and writable by all too (the directory of a socket elsewhere, /tmp: others make no name of its)."""
    path = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for p in dict.fromkeys([path, *path.parents, real, *real.parents]):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        top = p in (path, real)
        if st.st_uid != 0:
            raise ConfigError(f"{p} belongs to uid {st.st_uid}, not root: whoever owns it could plant links there or "
                              f"swap it while the daemon runs; `chown root {p}` (and `chmod go-w`), or give the daemon "
                              f"a directory of root's own in {what}.")
        if st.st_mode & 0o022 and ((top and not sticky) or not st.st_mode & stat.S_ISVTX):
            raise ConfigError(f"{p} is writable by other users ({stat.S_IMODE(st.st_mode):04o}): they could plant "
                              f"links there or swap what is inside; `chmod go-w {p}`, or give the daemon a directory "
                              f"of root's own in {what}.")


_CODE = ("the root daemon runs the code found there (its interpreter, the Python it imports, the programs on its "
         "PATH): that user would run code as root", "install hutch, its Python and its PATH's programs where only "
         "root can write (`hutch serve` refuses to start until then)")


def _code_refusal(p: str, st: os.stat_result | None, why: str, role: tuple[str, str] = _CODE) -> ConfigError:
    fix = (f"`chown -R root {p}` and `chmod -R go-w {p}`" if st is not None and stat.S_ISDIR(st.st_mode)
           else f"`chown root {p}` and `chmod go-w {p}`")
    return ConfigError(f"{p} {why}, and {role[0]}. {fix}, or {role[1]}.")


class _RootCodeFinder:
    """The first finder on sys.meta_path of the root daemon (guard_imports): each module found after start is
    checked as code_owned_by_root checks code before it runs (ConfigError naming the path and the fix)."""

    def __init__(self) -> None:
        self.seen: set = set()

    def find_spec(self, name, path=None, target=None):
        import sys

        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        # the source, the byte code Python reads or would write beside it, a package's directories
        for p in (spec.origin, spec.cached, *(spec.submodule_search_locations or ())):
            if isinstance(p, str) and os.path.isabs(p):
                _code_path(p, seen=self.seen)
        return spec


def guard_imports() -> None:
    """From now on, check each module this process imports (its file, its byte code file and their directories)
    as code_owned_by_root checks what is imported already: a lazily imported module of a third-party package that
    another user owns or may write, or a __pycache__ they may write, is refused (ConfigError) before it runs.
    Installed by `hutch serve` after code_owned_by_root."""
    import sys

    if not any(isinstance(f, _RootCodeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RootCodeFinder())


def root_only_file(path: str | os.PathLike, trusted_for: str, fix: str) -> None:
    """Refuse (ConfigError) a file the root daemon trusts (`trusted_for`: what another user changing it would
    get) unless it and the directories above it are root's and writable by no other user (a sticky ancestor
    may be); `fix`: the other way out, named in the error."""
    try:
        _code_path(os.fspath(path), role=(trusted_for, fix))
    except OSError as e:
        raise ConfigError(f"{path}: cannot check it ({e.strerror}); {fix}.") from None


def _root_only(p: str, st: os.stat_result, *, sticky_ok: bool = False, role: tuple[str, str] = _CODE) -> None:
    """`p` (stat `st`) is root's and writable by nobody else (its group may write only if it is root's group);
    `sticky_ok`: a sticky directory may be writable by all (/tmp, as a parent: nobody renames root's names)."""
    if st.st_uid != 0:
        raise _code_refusal(p, st, f"belongs to uid {st.st_uid}, not root", role)
    writable = st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != 0)
    if writable and not (sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise _code_refusal(p, st, f"is writable by other users ({stat.S_IMODE(st.st_mode):04o})", role)


def _code_path(path: str, *, children: bool = False, role: tuple[str, str] = _CODE,
               seen: set | None = None) -> None:
    """`path` and every directory above it (as given and as its links resolve) are root's and writable by no
    other user (a sticky ancestor may be: /tmp); with `children`, so is each entry directly in it (a package
    or module a search path holds). A path that does not exist is checked where it would be made: its nearest
    existing directory may not be writable by others at all (sticky or not: they would make it)."""
    path = os.path.abspath(path)
    seen = set() if seen is None else seen   # (path, as a parent?) pairs checked already: same answer again
    for form in dict.fromkeys([path, os.path.realpath(path)]):
        p, first = form, True
        while True:
            try:
                st = os.stat(p)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            if st is not None:
                if (p, first) in seen and not first:
                    break   # it and everything above it passed
                seen.add((p, first))
                _root_only(p, st, sticky_ok=not first, role=role)
                first = False
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
    if children and os.path.isdir(path):
        with os.scandir(path) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):   # where it leads, and the directories above that
                    real = os.path.realpath(e.path)
                    try:
                        _root_only(real, os.stat(real), sticky_ok=True, role=role)
                    except FileNotFoundError:   # dangling: what it names may not be made by another user
                        _code_path(real, role=role, seen=seen)
                        continue
                    p = os.path.dirname(real)
                    while (p, False) not in seen:
                        seen.add((p, False))
                        _root_only(p, os.stat(p), sticky_ok=True, role=role)
                        if os.path.dirname(p) == p:
                            break
                        p = os.path.dirname(p)
                else:   # a sticky directory (/tmp in /, which `python -m` in / searches) renames no name of root's
                    _root_only(e.path, st, sticky_ok=True, role=role)


def code_owned_by_root(extra: tuple[str, ...] = ()) -> None:
    """Refuse (ConfigError naming the path and the chown/chmod that fixes it) unless everything the root daemon
    runs is root's and writable by no other user: the interpreter, each directory on sys.path and what it holds
    directly (the current directory too, which `python -m` and `-c` search first), every file of the hutch
    package, every module imported so far, and each directory on PATH and the programs in it (the daemon runs
    ip, nft, git, runsc by name). Called by `hutch serve` before it makes anything. Not walked here: the deeper
    files of third-party packages not yet imported; guard_imports() checks each of those when it is imported."""
    import sys

    seen: set[str] = set()
    parents: set = set()

    def check(p: str, **kw) -> None:
        if p not in seen:
            seen.add(p)
            _code_path(p, seen=parents, **kw)

    check(sys.executable)
    check(os.path.realpath(sys.executable))
    for entry in sys.path:
        check(entry or os.getcwd(), children=True)
    check(str(PACKAGE_PARENT), children=True)   # the zygote's and the keeper's sys.path[0]
    pkg = str(Path(__file__).resolve().parents[1])
    check(pkg)
    for dirpath, dirnames, filenames in os.walk(pkg):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                check(p)
            else:
                _root_only(p, st)
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and os.path.isabs(f):
            check(f)
    search = settings.PATH.get()
    scanned = set()
    for d in (os.defpath if search is None else search).split(os.pathsep):
        d = d or os.getcwd()
        real = os.path.realpath(d)   # /bin and /usr/bin: one directory, its programs looked at once
        check(d, children=real not in scanned)   # the programs in it too (runsc, nft, ip)
        scanned.add(real)
    for p in extra:
        check(p)
