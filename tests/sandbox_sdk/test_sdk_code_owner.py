"""The root daemon refuses to run code another local user could change: a hutch package, a directory on its
Python path or on its PATH that a second account owns or may write would let that account run code as root
(edit a module the daemon imports later, plant a module or a program found before the real one).

The second account is a real host account, made and removed here. Each refused start names the path and the
chown/chmod that fixes it, and makes nothing (no run directory).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hutch_testing import HOST_PYTHON, host_user, run_as

import hutch

pytestmark = pytest.mark.skipif(HOST_PYTHON is None, reason="needs the host's python3.11 for the second account")

PACKAGE = Path(hutch.__file__).resolve().parent


def _copy(into: Path) -> Path:
    """A copy of the hutch package in `into` (root's, 0755 directories, 0644 files, as a clone's)."""
    into.mkdir(mode=0o755, exist_ok=True)
    shutil.copytree(PACKAGE, into / "hutch", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def _serve(cwd: Path, run: Path, **env) -> subprocess.CompletedProcess:
    """`python -m hutch serve` in `cwd` (so the hutch it runs is cwd's, as `python -m` searches it first)."""
    e = dict(os.environ, HUTCH_RUN_DIR=str(run), HUTCH_SOCKET=str(run / "hutch.sock"), **env)
    e.pop("HUTCH_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "hutch", "serve"], cwd=cwd, env=e, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)   # a hang guard: a refused start ends in about a second
    except subprocess.TimeoutExpired:
        proc.terminate()   # started: the old code served; the test fails below
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _refused(got: subprocess.CompletedProcess, path: Path, run: Path, why: str) -> None:
    assert got.returncode != 0, got.stderr
    assert f"{path} {why}" in got.stderr, got.stderr
    assert "chmod" in got.stderr and "chown" in got.stderr, got.stderr
    assert not run.exists()   # refused before anything was made


def test_a_hutch_package_another_user_owns_is_refused(public):
    with host_user() as other:
        src = _copy(public / "src")
        # Theirs: they could edit any module the daemon imports after it started (an import route's archive.py).
        subprocess.run(["chown", "-R", f"{other.pw_uid}:{other.pw_gid}", str(src / "hutch")], check=True)
        r = run_as(other, "import sys; open(sys.argv[1], 'a').close(); print('writable')",
                   str(src / "hutch" / "sandbox" / "_host" / "archive.py"))
        assert r.returncode == 0 and "writable" in r.stdout, r.stderr
        run = public / "run"
        _refused(_serve(src, run), src / "hutch", run, f"belongs to uid {other.pw_uid}, not root")


def test_one_module_others_may_write_is_refused(public):
    with host_user() as other:
        src = _copy(public / "src")
        victim = src / "hutch" / "sandbox" / "_host" / "archive.py"
        os.chmod(victim, 0o666)
        r = run_as(other, "import sys; open(sys.argv[1], 'a').close(); print('writable')", str(victim))
        assert r.returncode == 0 and "writable" in r.stdout, r.stderr
        run = public / "run"
        _refused(_serve(src, run), victim, run, "is writable by other users (0666)")


def test_a_python_path_directory_another_user_owns_is_refused(public):
    # PYTHONPATH (or the directory `python -m` is started in) searched before site-packages: a module planted
    # there (aiohttp.py) is imported by the root daemon instead of the real one.
    with host_user() as other:
        theirs = public / "theirs"
        r = run_as(other, "import os, sys; os.mkdir(sys.argv[1], 0o755); print('made')", str(theirs))
        assert r.returncode == 0, r.stderr
        src = _copy(public / "src")
        run = public / "run"
        _refused(_serve(src, run, PYTHONPATH=str(theirs)), theirs, run, f"belongs to uid {other.pw_uid}")
        _refused(_serve(theirs, run), theirs, run, f"belongs to uid {other.pw_uid}")   # python -m in their dir


def test_a_path_directory_others_may_write_is_refused(public):
    # The daemon runs ip, nft, git, runsc by name: a program planted in a PATH directory others may write (or
    # in one not made yet, in a directory every user may write) runs as root.
    src = _copy(public / "src")
    shared = public / "bin"
    shared.mkdir()
    os.chmod(shared, 0o777)
    run = public / "run"
    _refused(_serve(src, run, PATH=f"{shared}:{os.environ['PATH']}"), shared, run, "is writable by other users")
    _refused(_serve(src, run, PATH=f"{public / 'later'}:{os.environ['PATH']}"), public, run,
             "is writable by other users")
    # a root directory holding a program another user owns (they replace it at will)
    tools = public / "tools"
    tools.mkdir(mode=0o755)
    nft = tools / "nft"
    nft.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(nft, 0o755)
    with host_user() as other:
        os.chown(nft, other.pw_uid, other.pw_gid)
        _refused(_serve(src, run, PATH=f"{tools}:{os.environ['PATH']}"), nft, run,
                 f"belongs to uid {other.pw_uid}, not root")
        # and one reached through a link, in a directory of theirs
        os.chown(nft, 0, 0)
        theirs = public / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, other.pw_uid, other.pw_gid)
        shutil.move(str(nft), theirs / "nft")
        nft.symlink_to(theirs / "nft")
        _refused(_serve(src, run, PATH=f"{tools}:{os.environ['PATH']}"), theirs, run,
                 f"belongs to uid {other.pw_uid}, not root")


def test_a_copy_of_roots_in_a_sticky_directory_passes(public):
    # Root's own clone under /tmp (a sticky directory every user may write) is fine: nobody else can rename or
    # change what root made there. The check itself, in the copy, passes; a directory of the other user's
    # between them does not.
    src = _copy(public / "src")
    check = [sys.executable, "-c", "from hutch._core import paths; paths.code_owned_by_root(); print('ok')"]
    got = subprocess.run(check, cwd=src, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout == "ok\n", got.stderr
    # started in / (the SDK's autostart and a fleet node do): / holds /tmp, sticky and root's, which is fine
    got = subprocess.run([sys.executable, *check[1:]], cwd="/", capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout == "ok\n", got.stderr
    with host_user() as other:
        mid = public / "mid"
        mid.mkdir()
        os.chown(mid, other.pw_uid, other.pw_gid)
        inner = _copy(mid / "src")
        got = subprocess.run(check, cwd=inner, capture_output=True, text=True, timeout=60)
        assert got.returncode != 0 and f"{mid} belongs to uid {other.pw_uid}" in got.stderr, got.stderr


_GUARDED = """
import sys
from hutch._core import paths
from hutch._core.errors import ConfigError
paths.code_owned_by_root()   # passes: the package directories are root's; what is deeper is not walked
paths.guard_imports()        # as `hutch serve` does next
import lib.fine              # root's, and its __pycache__ too
try:
    import {name}
except ConfigError as e:
    print("refused:", e)
else:
    print("imported")
"""


def test_a_module_imported_after_start_is_checked_too(public, tmp_path):
    # code_owned_by_root looks at each sys.path directory and what it holds directly, not at the deeper files of
    # packages nobody imported yet: a module that the root daemon imports lazily (a route's first call) from a
    # package another user owns a file in, or whose byte code they may plant, is refused when it is imported,
    # before any of it runs.
    site = public / "site"
    site.mkdir(mode=0o755)
    os.chmod(site, 0o755)
    marker = tmp_path / "ran"
    for pkg, names in (("lib", ("__init__", "fine", "theirs")), ("cached", ("__init__", "mod"))):
        (site / pkg).mkdir(mode=0o755)
        (site / pkg / "__pycache__").mkdir(mode=0o755)
        for name in names:
            (site / pkg / f"{name}.py").write_text(f"open({f'{marker}-{pkg}.{name}'!r}, 'w').close()\n")
    env = dict(os.environ, PYTHONPATH=str(site))

    def guarded(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _GUARDED.format(name=name)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    with host_user() as other:
        os.chown(site / "lib" / "theirs.py", other.pw_uid, other.pw_gid)
        got = guarded("lib.theirs")
        assert got.returncode == 0, got.stderr
        assert f"refused: {site / 'lib' / 'theirs.py'} belongs to uid {other.pw_uid}, not root" in got.stdout, \
            got.stdout
        assert "chown" in got.stdout and not Path(f"{marker}-lib.theirs").exists()
        assert Path(f"{marker}-lib.fine").exists()   # a root-owned module still imports
    # root's modules, but a __pycache__ any user may write: they plant the byte code Python runs instead
    pycache = site / "cached" / "__pycache__"
    os.chmod(pycache, 0o777)
    got = guarded("cached.mod")
    assert got.returncode == 0, got.stderr
    assert f"refused: {pycache} is writable by other users (0777)" in got.stdout, got.stdout
    assert not Path(f"{marker}-cached.__init__").exists() and not Path(f"{marker}-cached.mod").exists()
    # once only root may write there, the same import runs
    os.chmod(pycache, 0o755)
    got = guarded("cached.mod")
    assert "imported" in got.stdout and Path(f"{marker}-cached.mod").exists(), got.stdout + got.stderr
