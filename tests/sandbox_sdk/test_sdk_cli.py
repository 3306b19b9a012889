"""`hutch run` and `hutch sandbox ...` as a user runs them: real processes against the test daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import hutch
from sdk_support import RUN_TAG


def hutch_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hutch", *args], capture_output=True, text=True, timeout=60, **kw)


def _running_ids() -> set[str]:
    return {s.id for s in hutch.Sandbox.list() if s.status in ("starting", "running")}


def test_run_exits_with_the_command_code_and_leaves_nothing(daemon, busybox_root):
    before = _running_ids()
    r = hutch_cli("run", "--image", str(busybox_root), "--", "sh", "-c", "echo out; echo err >&2; exit 3",
                  stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert _running_ids() == before


def test_run_streams_output_and_forwards_stdin(daemon, busybox_root):
    p = subprocess.Popen([sys.executable, "-m", "hutch", "run", "--image", str(busybox_root), "--",
                          "sh", "-c", "echo first; read go; echo second $go"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "first\n"
        assert p.poll() is None   # printed before the command ended: it waits for our line
        p.stdin.write("now\n")
        p.stdin.close()
        assert p.stdout.read() == "second now\n" and p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdin.close()
        p.stdout.close()
        p.stdout.close()
    r = hutch_cli("run", "--image", str(busybox_root), "-e", "A=1", "-w", "/tmp", "--",
                  "sh", "-c", 'tr a-z A-Z; echo "$A $PWD"', input="hello\n")
    assert (r.returncode, r.stdout) == (0, "HELLO\n1 /tmp\n")


def test_run_passes_all_output_through_however_much(daemon, busybox_root, tmp_path):
    """`hutch run` writes straight through: no max_output there, and flow control follows our stdout."""
    with open(tmp_path / "out", "wb") as out:
        r = subprocess.run([sys.executable, "-m", "hutch", "run", "--image", str(busybox_root), "--",
                            "sh", "-c", "head -c 30000000 /dev/zero; head -c 7000000 /dev/zero >&2"],
                           stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, timeout=120)
    assert r.returncode == 0 and len(r.stderr) == 7_000_000
    assert (tmp_path / "out").stat().st_size == 30_000_000


def test_run_mount_and_network_options(daemon, busybox_root, tmp_path):
    (tmp_path / "in.txt").write_text("from host\n")
    r = hutch_cli("run", "--image", str(busybox_root), "--mount", f"{tmp_path}:/data", "--",
                  "sh", "-c", "cat /data/in.txt; echo x > /data/new", stdin=subprocess.DEVNULL)
    assert r.stdout == "from host\n" and r.returncode != 0   # read-only unless :rw
    assert not (tmp_path / "new").exists()
    # :rw writes as the sandbox's own unprivileged uid (a world-writable directory takes them) ...
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o1777)
    r = hutch_cli("run", "--image", str(busybox_root), "-v", f"{out}:/out:rw", "--",
                  "sh", "-c", "echo x > /out/new", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and (out / "new").read_text() == "x\n" and (out / "new").stat().st_uid != 0
    # ... and :rw:OWNER as that host user, here root, because the operator says so
    r = hutch_cli("run", "--image", str(busybox_root), "-v", f"{tmp_path}:/data:rw:root", "--",
                  "sh", "-c", "echo x > /data/new", stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and (tmp_path / "new").read_text() == "x\n" and (tmp_path / "new").stat().st_uid == 0
    r = hutch_cli("run", "--image", str(busybox_root), "-v", f"{tmp_path}:/data:ro:root", "--", "true")
    assert r.returncode != 0 and "OWNER" in r.stderr


def test_sandbox_create_exec_ls_kill(daemon, busybox_root):
    tag = f"suite={RUN_TAG['suite']}"
    r = hutch_cli("sandbox", "create", "--detach", "--image", str(busybox_root), "--tag", tag, "--tag", "cli=1")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = hutch_cli("sandbox", "exec", sid, "--", "sh", "-c", "echo hi; exit 2", stdin=subprocess.DEVNULL)
        assert (r.returncode, r.stdout) == (2, "hi\n")
        r = hutch_cli("sandbox", "ls", "--tag", "cli=1", "--tag", tag)
        assert r.returncode == 0 and sid in r.stdout and "running" in r.stdout
        assert hutch_cli("sandbox", "kill", sid).returncode == 0
        r = hutch_cli("sandbox", "exec", sid, "--", "true", stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and r.stderr.startswith("hutch: error:")
    finally:
        try:
            hutch.Sandbox.from_id(sid).terminate()
        except hutch.NotFoundError:
            pass


def test_cli_bad_input_is_one_clear_line(daemon):
    r = hutch_cli("run", "--memory", "lots", "--", "true")
    assert r.returncode == 1 and "memory='lots'" in r.stderr and "Traceback" not in r.stderr
    r = hutch_cli("run", "--image", "no-such-image", "--", "true")
    assert r.returncode == 1 and "no-such-image" in r.stderr and "Traceback" not in r.stderr
    env = dict(os.environ, HUTCH_URL="http://127.0.0.1:9")
    r = hutch_cli("sandbox", "ls", env=env)
    assert r.returncode == 1 and "hutch serve" in r.stderr
