"""The SDK against a real daemon and real sandboxes (busybox root unless a test needs python3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hutch
from sdk_support import RUN_TAG

ENDED = {"exited", "terminated", "timeout", "idle_timeout", "oom", "failed"}


def _gone_or_ended(sandbox_id: str) -> bool:
    try:
        return hutch.Sandbox.from_id(sandbox_id).status in ENDED
    except hutch.NotFoundError:
        return True


def test_issue_example_with_the_default_image(daemon, capsys):
    """The example of the issue, verbatim but for the tag that lets the suite clean up."""
    with hutch.Sandbox.create(timeout=300, memory="512M", cpu=1.0, tags=RUN_TAG) as sb:
        p = sb.exec("python3", "-c", "print(sum(range(10)))")
        for line in p.stdout:
            print(line, end="")
        assert p.wait() == 0
        sb.files.write("/home/user/hello.txt", b"hi")
        print(sb.files.read("/home/user/hello.txt"))
        assert sb.run("python3", "-c", "import sys; print(sys.version_info[0])", check=True).stdout == "3\n"
        sid = sb.id
    assert capsys.readouterr().out == "45\nb'hi'\n"
    assert sb.status in ENDED
    assert _gone_or_ended(sid)


def test_the_default_image_has_a_real_python(daemon):
    """The whole standard library, pip and venv (python3-minimal had neither json nor asyncio)."""
    with hutch.Sandbox.create(timeout=300, tags=RUN_TAG) as sb:
        sb.run("python3", "-c", "import json, asyncio, urllib.request, multiprocessing, dataclasses, shutil, "
                                "sqlite3, ctypes, venv, ensurepip", check=True)
        assert sb.run("python3", "-m", "pip", "--version", check=True).stdout.startswith("pip ")
        sb.run("python3", "-m", "venv", "/tmp/v", check=True)
        r = sb.run("/tmp/v/bin/python", "-c", "import sys; print(sys.prefix)", check=True)
        assert r.stdout == "/tmp/v\n"
        assert sb.run("/tmp/v/bin/python", "-m", "pip", "--version", check=True).stdout.startswith("pip ")


def test_output_streams_while_the_command_runs(sb):
    p = sb.exec("sh", "-c", "echo first; read go; echo second")
    assert p.stdout.readline() == "first\n"
    assert p.poll() is None   # the first line came before the command ended: it waits for our line
    p.stdin.write("go\n")
    p.stdin.close()
    assert list(p.stdout) == ["second\n"]
    assert p.wait() == 0 and p.reason == "exited"


def test_stdin_round_trip(sb):
    p = sb.exec("cat")
    p.stdin.write("hello\n")
    assert p.stdout.readline() == "hello\n"     # answered while stdin is still open
    p.stdin.write(b"\x00bytes\n")
    p.stdin.close()
    assert p.stdout.read() == "\x00bytes\n"
    assert p.wait() == 0
    assert sb.run("cat", stdin="fed\n").stdout == "fed\n"
    assert sb.run("cat").stdout == ""           # run() gives no input by default: cat sees end-of-file


def test_stderr_bytes_and_exit_codes(sb):
    r = sb.run("sh", "-c", "printf 'o\\377'; echo e >&2; exit 3", text=False)
    assert (r.stdout, r.stderr, r.returncode) == (b"o\xff", b"e\n", 3)
    with pytest.raises(hutch.ExecError) as ei:
        sb.run("sh", "-c", "echo out; echo boom >&2; exit 4", check=True)
    assert (ei.value.returncode, ei.value.stdout, ei.value.stderr) == (4, "out\n", "boom\n")
    assert sb.run("sh", "-c", 'echo "$A $PWD"', env={"A": "x"}, workdir="/tmp").stdout == "x /tmp\n"


def test_exec_timeout_ends_the_process_not_the_sandbox(sb):
    t0 = time.monotonic()
    p = sb.exec("sleep", "30", timeout=0.5)
    assert p.wait() != 0
    assert p.reason == "timeout" and time.monotonic() - t0 < 25   # a hang guard: before the sleep's own end
    assert sb.run("echo", "alive", check=True).stdout == "alive\n"
    assert sb.poll() is None


def test_kill_ends_the_command(sb):
    p = sb.exec("sleep", "30")
    time.sleep(0.2)
    p.kill()
    assert p.wait() != 0 and p.reason in ("killed", "signaled")
    assert sb.run("true").returncode == 0


def test_exec_as_the_sandboxs_unprivileged_user(sb):
    from hutch.sandbox._host.native.init import USER_ID
    from hutch.sandbox._spec import SANDBOX_USER_ID

    assert USER_ID == SANDBOX_USER_ID == 1000
    assert sb.run("id", "-u").stdout == "0\n"
    r = sb.run("sh", "-c", "id -u; id -g; echo x > /tmp/mine; echo y > /etc/not-mine", user="user")
    assert r.stdout == "1000\n1000\n" and "Permission denied" in r.stderr, r
    assert sb.files.stat("/tmp/mine").uid == 1000 and sb.files.stat("/etc").uid == 0
    # its commands cannot get root back, nor does root's exec inherit the user (execve resets the saved ids)
    r = sb.run("sh", "-c", "cat /proc/self/status | grep -E '^(Uid|Gid|CapEff|CapPrm)'", user="user")
    assert "Uid:\t1000\t1000\t1000\t1000" in r.stdout and "CapEff:\t0000000000000000" in r.stdout, r.stdout
    r = sb.run("sh", "-c", "grep -E '^Uid' /proc/self/status")
    assert "Uid:\t0\t0\t0\t0" in r.stdout, r.stdout
    # the init still ends the user's commands: timeouts and kills
    t = time.monotonic()
    r = sb.run("sleep", "30", user="user", timeout=1)
    assert r.reason == "timeout" and r.returncode == -9 and time.monotonic() - t < 25   # hang guard, as above
    p = sb.exec("sleep", "30", user="user")
    time.sleep(0.3)
    p.kill()
    assert p.wait() == -9
    with pytest.raises(hutch.InvalidSpecError, match="'root'"):
        sb.run("id", user="nobody")


def test_odd_names_in_paths_and_tags_survive_the_query(make_sandbox):
    odd = "a b+c é%20&x=1"
    sb = make_sandbox(tags={"odd": odd})
    path = f"/home/user/{odd}.txt"
    sb.files.write(path, b"x y")
    assert sb.files.read(path) == b"x y" and sb.files.stat(path).name == f"{odd}.txt"
    assert sb.run("cat", path).stdout == "x y"
    assert [s.id for s in hutch.Sandbox.list(tags={"odd": odd})] == [sb.id]


def test_files_api_and_confinement(sb, tmp_path):
    f = sb.files
    f.mkdir("/home/user/d/e", parents=True)
    f.write("/home/user/d/e/a.txt", "héllo")
    f.write("/home/user/d/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert f.read("/home/user/d/e/a.txt") == "héllo".encode()
    names = {e.name: e for e in f.list("/home/user/d")}
    assert set(names) == {"e", "run.sh"} and names["e"].type == "dir"
    st = f.stat("/home/user/d/run.sh")
    assert st.type == "file" and st.size == 19 and st.mode & 0o777 == 0o755
    assert sb.run("/home/user/d/run.sh").stdout == "ran\n"
    f.remove("/home/user/d/run.sh")
    with pytest.raises(hutch.NotFoundError):
        f.stat("/home/user/d/run.sh")
    f.remove("/home/user/d", recursive=True)
    assert [e.name for e in f.list("/home/user")] == []
    # neither '..' nor a symlink reaches the host
    host = tmp_path / "host-only"
    host.mkdir()
    sb.run("ln", "-s", str(host), "/home/user/esc", check=True)
    try:
        f.write("/home/user/esc/x", b"1")
    except hutch.Error:
        pass
    assert not (host / "x").exists()
    try:
        f.write("/../../../" + str(host).lstrip("/") + "/y", b"1")
    except hutch.Error:
        pass
    assert not (host / "y").exists()
    with pytest.raises(hutch.InvalidSpecError):
        f.read("relative/path")


def test_from_id_and_list_by_tags(make_sandbox):
    a = make_sandbox(tags={"role": "a"}, name=f"sdk-{os.getpid()}-a")
    b = make_sandbox(tags={"role": "b"})
    assert [s.id for s in hutch.Sandbox.list(tags={**RUN_TAG, "role": "a"})] == [a.id]
    assert {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)} >= {a.id, b.id}
    again = hutch.Sandbox.from_id(a.id)
    assert again.tags["role"] == "a" and again.run("echo", "hi").stdout == "hi\n"
    assert hutch.Sandbox.from_id(a.name).id == a.id
    with pytest.raises(hutch.NotFoundError):
        hutch.Sandbox.from_id("no-such-sandbox")


def test_sandbox_with_a_command_lives_as_long_as_it(make_sandbox):
    sb = make_sandbox("sh", "-c", "sleep 0.3; exit 7")
    assert sb.wait(timeout=10) == 7
    assert sb.status == "exited"


def test_exec_on_a_terminated_sandbox_names_the_fix(make_sandbox):
    sb = make_sandbox()
    sb.terminate()
    sb.terminate()   # harmless twice
    with pytest.raises(hutch.StateError, match="Sandbox.create"):
        sb.exec("true")
    try:
        other = hutch.Sandbox.from_id(sb.id)   # a second handle learns the state from the daemon
    except hutch.NotFoundError:
        return
    with pytest.raises(hutch.StateError):
        other.run("true")


def test_bad_input_gets_a_clear_error(daemon, busybox_root, tmp_path):
    before = {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)}
    with pytest.raises(hutch.InvalidSpecError, match="memory='lots'"):
        hutch.Sandbox.create(memory="lots", tags=RUN_TAG)
    with pytest.raises(hutch.InvalidSpecError, match="does not exist"):
        hutch.Sandbox.create(mounts=[hutch.Mount.bind(tmp_path / "missing", "/data")], tags=RUN_TAG)
    with pytest.raises(hutch.NotFoundError, match="Image"):
        hutch.Sandbox.create(image="no-such-image", tags=RUN_TAG)
    with pytest.raises(hutch.NotFoundError):
        hutch.Sandbox.create(image=f"dir:{tmp_path}/missing-root", tags=RUN_TAG)
    assert {s.id for s in hutch.Sandbox.list(tags=RUN_TAG)} == before   # nothing was half-made


_CHILD = """
import sys, hutch
sb = hutch.Sandbox.create(image=hutch.Image.from_directory(sys.argv[1]), tags={"suite": sys.argv[2]},
                          detach=sys.argv[3] == "1", timeout=120)
print(sb.id, flush=True)
sys.stdin.read()   # wait to be killed
"""


def _child_creates(busybox_root, detach: bool) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(busybox_root), RUN_TAG["suite"], "1" if detach else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def _kill9(child: subprocess.Popen) -> None:
    """kill -9 of the client process (if it still runs), and close our ends of its pipes."""
    if child.poll() is None:
        child.kill()
        child.wait()
    child.stdin.close()
    child.stdout.close()


def test_client_crash_ends_its_sandbox(daemon, busybox_root):
    child, sid = _child_creates(busybox_root, detach=False)
    try:
        assert hutch.Sandbox.from_id(sid).status == "running"
        _kill9(child)
        deadline = time.monotonic() + 2.0
        while not _gone_or_ended(sid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone_or_ended(sid), "the sandbox outlived its client by more than 2 s"
    finally:
        _kill9(child)


def test_detached_sandbox_outlives_its_client(daemon, busybox_root):
    child, sid = _child_creates(busybox_root, detach=True)
    _kill9(child)
    time.sleep(0.5)
    sb = hutch.Sandbox.from_id(sid)
    try:
        assert sb.status == "running" and sb.info["detach"] is True
        assert sb.run("echo", "still here").stdout == "still here\n"
    finally:
        sb.terminate()
    assert _gone_or_ended(sid)


def test_async_sandbox(daemon, busybox_root):
    import asyncio

    async def main():
        sb = await hutch.AsyncSandbox.create(image=hutch.Image.from_directory(busybox_root), tags=RUN_TAG)
        async with sb:
            p = await sb.exec("sh", "-c", "echo a; sleep 1; echo b; echo e >&2")
            first = await p.stdout.readline()
            assert p.poll() is None and first == "a\n"
            rest = [line async for line in p.stdout]
            assert rest == ["b\n"] and await p.stderr.read() == "e\n" and await p.wait() == 0
            q = await sb.exec("cat")
            await q.stdin.write("x")
            await q.stdin.close()
            assert await q.stdout.read() == "x"
            await sb.files.write("/tmp/f", b"z")
            assert await sb.files.read("/tmp/f") == b"z"
            assert (await sb.run("sh", "-c", "exit 5")).returncode == 5
            assert [s.id for s in await hutch.AsyncSandbox.list(tags=RUN_TAG)].count(sb.id) == 1
            assert await sb.poll() is None
        assert sb.status in ENDED
        with pytest.raises(hutch.StateError):
            await sb.exec("true")

    asyncio.run(main())


def test_an_event_loops_client_is_closed_with_the_loop(sb):
    """AsyncSandbox's client belongs to its event loop; asyncio.run ending closes it (no unclosed connection,
    no ResourceWarning), and the next loop gets a client of its own."""
    import asyncio
    import gc
    import warnings

    async def main():
        asb = await hutch.AsyncSandbox.from_id(sb.id)
        assert (await asb.run("echo", "hi")).stdout == "hi\n"

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(3):
            asyncio.run(main())
        gc.collect()
    assert not [w for w in got if issubclass(w.category, ResourceWarning)], [str(w.message) for w in got]


def test_daemon_autostart_is_race_safe(busybox_root, tmp_path):
    """With no daemon on the socket, clients start one; two at once start exactly one."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"))
    env.pop("HUTCH_URL", None)
    code = "import hutch, json; print(json.dumps([s.id for s in hutch.Sandbox.list()]))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    pid = None
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [json.loads(o) for o in outs] == [[], []]
        from hutch.sandbox._client import Client, Endpoint

        c = Client(Endpoint(socket_path=str(run_dir / "hutch.sock")))
        pid = c.json("GET", "/v1/health")["pid"]
        c.http.close()
        daemons = [p for p in os.listdir("/proc") if p.isdigit() and _is_serve_for(int(p), run_dir)]
        assert daemons == [str(pid)], daemons
        # detached: another session than ours, and not a child of the client that started it
        assert os.getsid(pid) != os.getsid(0)
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid not in (os.getpid(), *(p.pid for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if pid is not None:
            os.kill(pid, 15)
            for _ in range(150):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.1)


def _is_serve_for(pid: int, run_dir) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and b"hutch" in cmd and f"HUTCH_SOCKET={run_dir}/hutch.sock".encode() in env


def test_autostart_failure_says_why(daemon, tmp_path, monkeypatch):
    """A spawned daemon that exits at once (here: the run directory is already served) is reported with its reason."""
    monkeypatch.setenv("HUTCH_SOCKET", str(tmp_path / "other.sock"))
    t0 = time.monotonic()
    with pytest.raises(hutch.DaemonError, match="exited saying: .*another hutch daemon"):
        hutch.Sandbox.list()
    assert time.monotonic() - t0 < 60   # a hang guard (a daemon start under load takes 20 s and more)


def test_a_call_about_a_sandbox_whose_daemon_stopped_starts_no_daemon(busybox_root, tmp_path):
    """The daemon stopped (its sandboxes with it): terminate() is harmless, exec says the sandbox is gone, and
    neither starts a new daemon (one that would not know the sandbox and would outlive the caller's cleanup)."""
    import signal as _signal

    from hutch_testing import sdk_pointed_at, start_daemon, stop_daemon

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    proc = start_daemon(run_dir)
    stopped = False
    try:
        with sdk_pointed_at(run_dir):
            sb = hutch.Sandbox.create("sleep", "600", image=f"dir:{busybox_root}")
            proc.send_signal(_signal.SIGTERM)
            proc.wait(20)
            stopped = True
            sb.terminate()
            with pytest.raises(hutch.NotFoundError, match=f"sandbox {sb.id} is gone: no hutch daemon answers"):
                sb.exec("true")
            assert not (run_dir / "hutch.sock").exists() or not _is_live_socket(run_dir / "hutch.sock")
            assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_serve_for(int(p), run_dir)]
            assert hutch.Sandbox.list() == []   # a call about no one sandbox still starts the daemon it needs
    finally:
        for p in os.listdir("/proc"):
            if p.isdigit() and int(p) != proc.pid and _is_serve_for(int(p), run_dir):
                os.kill(int(p), _signal.SIGTERM)
        if not stopped:
            stop_daemon(proc)


def _is_live_socket(path) -> bool:
    import socket as _socket

    s = _socket.socket(_socket.AF_UNIX)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
