"""pip_install through the egress gateway to a fake package index: the step reaches the index's
name and nothing else. Everything runs among network namespaces this module creates (the fake
internet of tests/egress on 192.0.2.0/24); no packet reaches a real address.

The base image is a tiny root with the host's Python and pip (hard links where /tmp is on /usr's
filesystem, copies where it is not, e.g. a tmpfs).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "egress"))
import egress_world  # noqa: E402  (skips this module without root, iproute2 or libnftables)
from hutch_testing import restore_env  # noqa: E402
from img_support import host_root, stop_daemon  # noqa: E402

import hutch  # noqa: E402

INDEX_ADDR = "192.0.2.80"
INDEX_NAME = "pypi.example.test"
OTHER_NAME = "files.example.test"    # in the fake zone too, but no step here is allowed to reach it
DEB_NAME = "deb.example.test"        # the fake Debian archive (same server, under /debian)
_ENV = ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_STATE_DIR", "HUTCH_URL", "HUTCH_TOKEN")

_SERVER = r"""
import http.server, json, sys, time
root, addr, log = sys.argv[1], sys.argv[2], sys.argv[3]
class H(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **k): super().__init__(*a, directory=root, **k)
    def log_message(self, fmt, *args):
        with open(log, "a") as f: f.write(json.dumps({"path": self.path, "host": self.headers.get("Host")}) + "\n")
s = http.server.ThreadingHTTPServer((addr, 80), H)
print("ready", flush=True)
s.serve_forever()
"""


def _wheel(dest: Path) -> str:
    name = "hutchdemo-1.0-py3-none-any.whl"
    files = {"hutchdemo.py": b"VALUE = 42\n",
             "hutchdemo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: hutchdemo\nVersion: 1.0\n",
             "hutchdemo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: hutch-test\nRoot-Is-Purelib: true\n"
                                              b"Tag: py3-none-any\n"}
    record = ""
    for n, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{n},sha256={digest},{len(data)}\n"
    record += "hutchdemo-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr("hutchdemo-1.0.dist-info/RECORD", record)
    (dest / name).write_bytes(buf.getvalue())
    return name


def _index(root: Path) -> None:
    (root / "packages").mkdir(parents=True)
    whl = _wheel(root / "packages")
    sha = hashlib.sha256((root / "packages" / whl).read_bytes()).hexdigest()
    for pkg, host in (("hutchdemo", INDEX_NAME), ("elsewhere", OTHER_NAME)):
        d = root / "simple" / pkg
        d.mkdir(parents=True)
        target = whl if pkg == "hutchdemo" else whl.replace("hutchdemo", "elsewhere")
        if pkg == "elsewhere":
            shutil.copy(root / "packages" / whl, root / "packages" / target)
        d.joinpath("index.html").write_text(
            f'<html><body><a href="http://{host}/packages/{target}#sha256={sha}">{target}</a></body></html>')


def _python_root(root: Path) -> Path:
    """busybox + the host's python3.11 and pip (hard links where the filesystem allows; the lower dir is never
    written)."""
    host_root(root, ("/usr/bin/python3.11",), ("/usr/lib/python3.11", "/usr/lib/python3/dist-packages/pip"),
              skip=("config-3.11-x86_64-linux-gnu",))
    os.symlink("python3.11", root / "bin" / "python3")
    return root


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """The fake internet plus an index on pypi.example.test, a daemon in its host netns, a python root."""
    if shutil.which("busybox") is None or not os.path.exists("/usr/bin/python3.11") or \
            not os.path.isdir("/usr/lib/python3/dist-packages/pip"):
        pytest.skip("needs busybox-static and Debian's python3.11 with python3-pip")
    tmp = tmp_path_factory.mktemp("registry")
    egress_world.ZONE.update({INDEX_NAME: [INDEX_ADDR], OTHER_NAME: [INDEX_ADDR], DEB_NAME: [INDEX_ADDR]})
    world = egress_world.World(tmp)
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-img-reg-run-"))
    state = Path(tempfile.mkdtemp(prefix="hutch-img-reg-state-"))
    saved = {k: os.environ.get(k) for k in _ENV}
    proc = None
    try:
        world.up()
        egress_world.sh("ip", "-n", world.inet, "addr", "add", f"{INDEX_ADDR}/32", "dev", "inet0")
        _index(tmp / "index")
        hits = tmp / "index-hits.jsonl"
        hits.touch()
        world.spawn(world.inet, sys.executable, "-c", _SERVER, str(tmp / "index"), INDEX_ADDR, str(hits))
        sock = run_dir / "hutch.sock"
        env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock), HUTCH_STATE_DIR=str(state),
                   HUTCH_EGRESS_RESOLVERS=egress_world.DNS_ADDR)
        # nsenter, not `ip netns exec`: the latter remounts /sys and would hide the cgroup controllers
        with open(run_dir / "daemon.log", "ab") as log:   # the daemon writes to its own copy of the fd
            proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{world.host}", sys.executable, "-m", "hutch",
                                     "serve"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
        deadline = time.monotonic() + 30
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not sock.exists():
            pytest.fail(f"the daemon did not start: {(run_dir / 'daemon.log').read_text()[-2000:]}")
        os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(sock), HUTCH_STATE_DIR=str(state))
        os.environ.pop("HUTCH_URL", None)
        os.environ.pop("HUTCH_TOKEN", None)
        root = _python_root(tmp / "pyroot")
        yield {"base": hutch.Image.from_directory(root), "hits": hits, "world": world, "index_root": tmp / "index"}
    finally:
        try:
            if proc is not None:
                stop_daemon(proc)
        finally:
            restore_env(saved)
            for name in (INDEX_NAME, OTHER_NAME, DEB_NAME):
                egress_world.ZONE.pop(name, None)
            world.down()
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)


def _hits(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_pip_install_from_a_fake_index_reaches_only_the_index(registry):
    base, hits = registry["base"], registry["hits"]
    image = base.pip_install("hutchdemo==1.0", index_url=f"http://{INDEX_NAME}/simple")
    built = image.build(quiet=True)
    assert any(h["path"].startswith("/packages/hutchdemo") for h in _hits(hits))
    sb = hutch.Sandbox.create(image=built, timeout=60)
    try:
        r = sb.run("python3", "-c", "import hutchdemo; print(hutchdemo.VALUE)", check=True)
        assert r.stdout == "42\n"
        # the sandbox made from the image has no network at all
        r = sb.run("python3", "-c", f"import socket; socket.create_connection(('{INDEX_ADDR}', 80), 2)")
        assert r.returncode != 0
    finally:
        sb.terminate()
    # cached: the index is not asked again
    n = len(_hits(hits))
    assert image.build(quiet=True).ref == built.ref and len(_hits(hits)) == n


def test_a_pip_step_cannot_reach_a_name_it_was_not_given(registry):
    base, hits = registry["base"], registry["hits"]
    n = len(_hits(hits))
    # the index page points at files.example.test: in DNS, but not a name this step may reach
    with pytest.raises(hutch.ImageError) as ei:
        base.pip_install("elsewhere", index_url=f"http://{INDEX_NAME}/simple").build(quiet=True)
    assert "elsewhere" in ei.value.output
    got = _hits(hits)[n:]
    assert [h["path"] for h in got] == ["/simple/elsewhere/"]   # the index page, never the wheel
    # a run step has no network: the index is unreachable, by name and by address
    with pytest.raises(hutch.ImageError) as ei:
        base.run_commands(f"wget -q -T 2 -O- http://{INDEX_NAME}/simple/ || wget -q -T 2 -O- http://{INDEX_ADDR}/ "
                          "|| (echo unreachable; exit 9)").build(quiet=True)
    assert "unreachable" in ei.value.output and len(_hits(hits)) == n + 1


def _apt_root(root: Path) -> Path:
    """busybox + the host's apt and dpkg (hard links where the filesystem allows), an empty dpkg database,
    sources on the fake archive."""
    progs = [f"/usr/bin/{p}" for p in ("apt-get", "apt-config", "dpkg", "dpkg-deb", "dpkg-query", "dpkg-split",
                                       "dpkg-trigger", "tar")]
    progs += [f"/sbin/{p}" for p in ("ldconfig", "ldconfig.real", "start-stop-daemon") if os.path.exists(f"/sbin/{p}")]
    host_root(root, tuple(progs), ("/usr/lib/apt", "/usr/share/dpkg"))
    for d in ("etc/apt/apt.conf.d", "etc/apt/sources.list.d", "etc/apt/preferences.d", "etc/dpkg/dpkg.cfg.d",
              "var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/dpkg/triggers", "var/cache/apt/archives/partial",
              "var/lib/apt/lists/partial", "var/log/apt"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        (root / f).touch()
    (root / "var/lib/dpkg/arch").write_text("amd64\n")
    (root / "etc/apt/sources.list").write_text(f"deb [trusted=yes] http://{DEB_NAME}/debian ./\n")
    with open(root / "etc/passwd", "a") as f:
        f.write("_apt:x:42:65534::/nonexistent:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return root


def _archive(root: Path) -> None:
    """A flat Debian archive: one package, its Packages and an unsigned Release (sources say trusted=yes)."""
    pkg = root / "build" / "hutch-hello"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/share/hutch-hello").mkdir(parents=True)
    (pkg / "usr/share/hutch-hello/hello.txt").write_text("hello from a fake archive\n")
    (pkg / "DEBIAN/control").write_text("Package: hutch-hello\nVersion: 1.0\nArchitecture: all\n"
                                        "Maintainer: hutch tests <tests@example.test>\nDescription: a test package\n")
    out = root / "debian"
    out.mkdir(parents=True)
    deb = out / "hutch-hello_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(pkg), str(deb)], check=True,
                   capture_output=True)
    data = deb.read_bytes()
    packages = ("Package: hutch-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: hutch tests <tests@example.test>\n"
                f"Filename: ./{deb.name}\nSize: {len(data)}\nSHA256: {hashlib.sha256(data).hexdigest()}\n"
                "Description: a test package\n\n")
    (out / "Packages").write_text(packages)
    date = time.strftime("%a, %d %b %Y %H:%M:%S UTC", time.gmtime(time.time() - 3600))
    (out / "Release").write_text(f"Origin: hutch-test\nLabel: hutch-test\nSuite: stable\nCodename: hutch\nDate: {date}\n"
                                 f"Architectures: all amd64\nSHA256:\n {hashlib.sha256(packages.encode()).hexdigest()} "
                                 f"{len(packages)} Packages\n")
    shutil.rmtree(root / "build")


def test_apt_install_from_a_fake_archive_reaches_only_the_archive(registry, tmp_path, monkeypatch):
    hits = registry["hits"]
    _archive(registry["index_root"])
    monkeypatch.setenv("HUTCH_APT_HOSTS", DEB_NAME)
    base = hutch.Image.from_directory(_apt_root(tmp_path / "aptroot"))
    n = len(_hits(hits))
    built = base.apt_install("hutch-hello").build(quiet=True)
    paths = [h["path"] for h in _hits(hits)[n:]]
    assert "/debian/./hutch-hello_1.0_all.deb" in paths and all(h["host"] == DEB_NAME for h in _hits(hits)[n:])
    sb = hutch.Sandbox.create(image=built, timeout=60)
    try:
        r = sb.run("sh", "-c", "cat /usr/share/hutch-hello/hello.txt; dpkg-query -W hutch-hello; "
                               "ls /var/lib/apt/lists | grep -c example || true", check=True)
        assert r.stdout.split("\n")[:3] == ["hello from a fake archive", "hutch-hello\t1.0", "0"]
    finally:
        sb.terminate()
    # with the default names (the real Debian archive's), an apt step may not reach the fake archive's name
    monkeypatch.delenv("HUTCH_APT_HOSTS")
    n = len(_hits(hits))
    with pytest.raises(hutch.ImageError) as ei:
        base.apt_install("hutch-hello=1.0").build(quiet=True)
    assert "Unable to locate package" in ei.value.output and DEB_NAME in ei.value.output
    assert len(_hits(hits)) == n


def test_the_python_root_builds_on_a_tmpfs(tmp_path):
    """Where /tmp is a tmpfs (Debian 13 and many hosts), hard links to /usr cannot be made: the root is
    copied instead, and its python and pip run."""
    if shutil.which("busybox") is None or not os.path.isdir("/usr/lib/python3/dist-packages/pip"):
        pytest.skip("needs busybox-static and Debian's python3.11 with python3-pip")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "hutch-test-tmpfs", str(mnt)], check=True)
    try:
        root = _python_root(mnt / "pyroot")
        assert os.stat(root / "bin/python3.11").st_dev != os.stat("/usr/bin/python3.11").st_dev
        r = subprocess.run(["chroot", str(root), "/bin/python3", "-c", "import json, pip; print(pip.__name__)"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "pip\n", r.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
