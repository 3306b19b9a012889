"""Commands on a terminal in a sandbox (exec(..., pty=True), `hutch run -it`, `hutch sandbox exec -it`), used as a
person would: keys typed into a real terminal (tmux on our side, a pty made inside the sandbox on the other).

Each runs on both runtimes (`runtime` parametrizes `sb`): natively the pty is the sandbox's own devpts'; on
gVisor it is a pty of the sandbox's devpts instance on the host, which gVisor gives the command as its terminal."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import hutch
from sdk_support import RUN_TAG

PROMPT = b"# "   # busybox ash's prompt as root: "/home/user # "
LEFT = b"\x1b[D"
GVISOR = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")
RUNTIMES = ["native", pytest.param("gvisor", marks=GVISOR)]


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    return request.param


@pytest.fixture
def sb(make_sandbox, runtime):
    """One idle busybox sandbox on `runtime`."""
    return make_sandbox(runtime=runtime)


def _shell(sb, **kw):
    p = sb.exec("sh", pty=kw.pop("pty", (30, 100)), **kw)
    p.read_until(PROMPT)
    return p


def _cmd(p, line: str, timeout: float = 10.0) -> str:
    """Type `line` and Enter; what the shell printed before its next prompt (the echoed line excluded)."""
    p.write(line + "\r")
    p.read_until(line + "\r\n", timeout)   # its echo: a prompt redrawn before it (a resize does) is passed
    return p.read_until(PROMPT, timeout).decode().rsplit("\r\n", 1)[0]


def _eventually(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (v := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return v


def _daemon_pid(daemon) -> int:
    return int(next(p for p in Path("/proc").iterdir() if p.name.isdigit() and _serves(p, daemon)).name)


def _serves(proc: Path, run_dir) -> bool:
    try:
        env = (proc / "environ").read_bytes().split(b"\0")
        cmd = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in cmd and f"HUTCH_RUN_DIR={run_dir}".encode() in env


def _ptys_held(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).endswith("ptmx"):
                n += 1
        except OSError:
            pass
    return n


def _running(sb, name: str) -> list[str]:
    ps = sb.run("ps", "-o", "pid,args").stdout.splitlines()[1:]
    return [line for line in ps if name in line and "ps -o" not in line]


def test_a_shell_on_a_terminal_edits_lines_resizes_and_survives_ctrl_c(sb, runtime):
    with _shell(sb) as p:
        if runtime == "native":
            assert _cmd(p, "tty") == "/dev/pts/0"   # a pty of the sandbox's own devpts
            assert _cmd(p, "echo $(ls /dev/pts)") == "0 ptmx"
        else:   # gVisor names a terminal of the host host:[N], so ttyname() fails (google/gvisor#13535)
            assert _cmd(p, "tty") == "not a tty"
            assert _cmd(p, "echo $(ls /dev/pts)") == "ptmx"   # nothing of the host's shows inside
        assert _cmd(p, "test -t 0 && test -t 1 && test -t 2 && echo on-a-terminal") == "on-a-terminal"
        assert _cmd(p, "stty size") == "30 100"
        # line editing by the shell on its terminal: a left arrow, an insert, a backspace
        p.write(b"echo ac" + LEFT + b"b" + b"\x1b[C" + b"x\x7fd\r")
        assert p.read_until(PROMPT).split(b"\r\n")[-2] == b"abcd"
        p.resize(40, 120)
        # ash redraws its line on the SIGWINCH (on gVisor runsc forwards it, a little later): typing before
        # that would interleave the redraw with the echo
        p.read_until(b"# \x1b[J")
        assert _cmd(p, "stty size") == "40 120"
        # Ctrl-C ends the foreground program, not the shell
        p.write("sleep 100\r")
        assert _eventually(lambda: _running(sb, "sleep 100"))
        p.write(b"\x03")
        p.read_until(PROMPT)
        assert _cmd(p, "echo $?") == "130"
        assert not _running(sb, "sleep 100")
        p.write("exit 7\r")
        assert p.wait(10) == 7 and (p.returncode, p.reason) == (7, "exited")
        rest = b""
        while chunk := p.read(timeout=10):   # what is left of the output, then its end
            rest += chunk
        assert rest.endswith(b"exit 7\r\n")
    assert p.read() == b""


def test_a_terminal_is_its_users_and_in_the_sandbox_only(sb, daemon, runtime):
    host_ptys = set(os.listdir("/dev/pts"))
    # (on gVisor the terminal has no name inside to stat: it is the host's pty, root's, 0600)
    owner = "stat -c '%u %g %a' $(tty); " if runtime == "native" else ""
    p = sb.exec("sh", "-c", f"id -u; {owner}echo $TERM; stty size", pty=True, user="user")
    assert p.wait(10) == 0
    out = b""
    while chunk := p.read(timeout=10):
        out += chunk
    want = ["1000", *(["1000 1000 620"] if runtime == "native" else []), "xterm-256color", "24 80"]
    assert out.decode().split("\r\n")[:len(want)] == want
    assert set(os.listdir("/dev/pts")) == host_ptys   # nothing was made in the host's devpts
    p.close()


def test_the_exit_code_and_signals_come_through(sb):
    p = sb.exec("sh", "-c", "exit 3", pty=True)
    assert p.wait(10) == 3 and p.reason == "exited"
    p.close()
    p = sb.exec("sleep", "100", pty=True)
    p.send_signal(15)
    assert p.wait(10) == -15 and p.reason == "killed"
    p.close()
    p = sb.exec("sleep", "100", pty=True, timeout=0.5)
    assert p.wait(10) == -9 and p.reason == "timeout"
    p.close()


def test_hanging_up_ends_the_command_and_leaves_nothing(sb, daemon):
    pid = _daemon_pid(daemon)
    before = _ptys_held(pid)
    p = _shell(sb)
    p.write("sleep 200 & sleep 100\r")
    assert _eventually(lambda: _running(sb, "sleep 100") and _running(sb, "sleep 200"))
    assert _ptys_held(pid) == before + 1
    p.close()   # the client goes away mid-command
    # the shell is killed; its jobs lose their terminal (SIGHUP)
    assert _eventually(lambda: not _running(sb, "sleep 100") and not _running(sb, "sleep 200")), \
        sb.run("ps", "-o", "pid,ppid,pgid,sid,stat,args").stdout
    assert _ptys_held(pid) == before


def test_a_dropped_handle_hangs_up(sb):
    import gc

    p = sb.exec("sleep", "100", pty=True)
    assert _eventually(lambda: _running(sb, "sleep 100"))
    del p
    gc.collect()
    assert _eventually(lambda: not _running(sb, "sleep 100"))


def test_a_dropped_async_handle_hangs_up_and_says_so(sb):
    import gc
    import warnings

    async def main():
        asb = await hutch.AsyncSandbox.from_id(sb.id)
        p = await asb.exec("sleep", "100", pty=True)
        assert await asyncio.to_thread(_eventually, lambda: _running(sb, "sleep 100"))
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            del p
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) and "AsyncPtyProcess" in str(w.message) for w in got), \
            [str(w.message) for w in got]
        # the loop runs the hang-up: the daemon ends the command
        assert await asyncio.to_thread(_eventually, lambda: not _running(sb, "sleep 100"))
        q = await asb.exec("sh", "-c", "exit 0", pty=True)   # one closed is no warning
        await q.wait(10)
        await q.close()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            del q
            gc.collect()
        assert not [w for w in got if issubclass(w.category, ResourceWarning)], [str(w.message) for w in got]

    asyncio.run(main())


def test_the_sandbox_ending_under_a_terminal_ends_its_session(make_sandbox, runtime):
    sb = make_sandbox(runtime=runtime)
    p = _shell(sb)
    p.write("sleep 100\r")
    assert _eventually(lambda: _running(sb, "sleep 100"))
    sb.terminate()
    assert p.wait(10) == -9 and p.reason == "sandbox_ended"
    while p.read(timeout=10):
        pass
    p.close()


def test_output_nobody_reads_blocks_the_command_not_the_daemon(sb, daemon):
    pid = _daemon_pid(daemon)
    rss = lambda: int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:")))
    total = 40 << 20
    p = sb.exec("dd", "if=/dev/zero", f"bs={1 << 20}", f"count={total >> 20}", "status=none", pty=True)
    before = rss()
    time.sleep(2)
    assert _running(sb, "dd if")                    # blocked in write(), not done (busybox rewrites its argv)
    assert rss() - before < 16 << 10                # KiB: the daemon did not take the output in
    got = 0
    while chunk := p.read(timeout=30):
        got += len(chunk)
    assert got == total and p.wait(10) == 0
    p.close()


def test_a_slow_reader_gets_all_the_command_wrote_before_it_ended(sb):
    """The daemon is still sending when the command exits (this reader takes 64 KiB at a time): what the
    terminal still held then is sent all the same, not cut after the short drain for background children
    (it was: the last ~69 KB of 5 MB lost 1 run in 2 at load 30-250)."""
    with sb.exec("sh", "-c", "head -c 5000000 /dev/zero | tr '\\0' x; echo END", pty=(24, 80)) as p:
        got = bytearray()
        while not got.endswith(b"END\r\n"):
            chunk = p.read(65536, timeout=60)
            if not chunk:
                break
            got += chunk
            time.sleep(0.05)
        assert got.endswith(b"END\r\n") and len(got) == 5_000_000 + 5, (len(got), bytes(got[-20:]))
        assert p.wait(60) == 0


def test_input_the_command_does_not_read_blocks_the_writer_not_the_daemon(sb, daemon):
    import threading

    pid = _daemon_pid(daemon)
    rss = lambda: int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("VmRSS:")))
    # raw mode: in canonical mode the line discipline itself drops what does not fit in a line (4 KiB)
    p = sb.exec("sh", "-c", "stty raw -echo; exec sleep 100", pty=True)
    assert _eventually(lambda: _running(sb, "sleep 100"))
    before, sent = rss(), [0]

    def flood():
        try:
            for _ in range(400):   # 25 MiB in 64 KiB messages
                p.write(b"x" * 65536)
                sent[0] += 65536
        except hutch.StateError:
            pass   # hung up below

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    time.sleep(2)
    assert t.is_alive() and sent[0] < 12 << 20   # the writer waits for the command
    assert rss() - before < 16 << 10             # KiB: the daemon did not take the input in
    p.close()   # the daemon, not reading (the command does not), still sees the hang-up
    assert _eventually(lambda: not _running(sb, "sleep 100"), 5)
    t.join(20)
    assert not t.is_alive()


def test_a_sandbox_holds_at_most_64_terminals_and_says_so(sb, runtime):
    held = [sb.exec("sleep", "100", pty=True) for _ in range(64)]
    try:
        with pytest.raises(hutch.SandboxError, match="64 terminals"):
            sb.exec("sleep", "100", pty=True)
    finally:
        for p in held:
            p.close()
    # (a hang guard: on gVisor each hang-up's kill is a helper runsc exec, 64 of them on a loaded machine)
    assert _eventually(lambda: not _running(sb, "sleep 100"), 10 if runtime == "native" else 120)
    with sb.exec("sh", "-c", "exit 0", pty=True) as p:   # freed
        assert p.wait(10) == 0


def test_bad_terminal_arguments_get_clear_errors(sb):
    for bad in ((0, 80), (24, 70000), "big", (24,), (24.5, 80)):
        with pytest.raises(hutch.InvalidSpecError, match="pty|rows|cols|terminal"):
            sb.exec("sh", pty=bad)
    with pytest.raises(hutch.NotFoundError, match="not found"):
        sb.exec("no-such-program", pty=True)
    with _shell(sb) as p:
        with pytest.raises(hutch.InvalidSpecError, match="rows"):
            p.resize(0, 80)
        with pytest.raises(TypeError):
            p.write(12)
        assert _cmd(p, "echo still") == "still"


def test_the_daemon_refuses_a_terminal_exec_over_the_plain_route_and_bad_first_messages(sb):
    from websockets.sync.client import unix_connect

    from hutch.sandbox._client import default_client

    with pytest.raises(hutch.ConfigError, match="WebSocket"):
        default_client().request("POST", f"/v1/sandboxes/{sb.id}/exec", json={"argv": ["sh"], "pty": {}})
    sock = os.environ["HUTCH_SOCKET"]
    for first, match in ((b"\x01", "first message"), ("not json", "not JSON"), ('{"argv": []}', "argv"),
                         ('{"argv": ["sh"], "pty": {"rows": 0}}', "rows")):
        with unix_connect(sock, f"ws://hutch/v1/sandboxes/{sb.id}/exec/pty") as ws:
            ws.send(first)
            d = json.loads(ws.recv(timeout=10))
            assert issubclass(getattr(hutch, d["error"]), hutch.ConfigError) and match in d["message"], d


def test_tiocsti_cannot_push_input_even_into_its_own_terminal(daemon, runtime):
    """The seccomp filter refuses TIOCSTI (and TIOCLINUX): a sandbox's program cannot type into a terminal
    (gVisor's kernel does not take it for the host's terminal it gave the command: ENOTTY)."""
    with hutch.Sandbox.create(timeout=120, tags=RUN_TAG, runtime=runtime) as sb:
        code = ("import fcntl, termios, errno\n"
                "try:\n fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('PUSHED')\n"
                "except OSError as e:\n print('refused', errno.errorcode[e.errno])\n")
        p = sb.exec("python3", "-c", code, pty=True)
        assert p.wait(30) == 0
        out = b""
        while chunk := p.read(timeout=10):
            out += chunk
        assert out.strip() == (b"refused EPERM" if runtime == "native" else b"refused ENOTTY")
        p.close()


@GVISOR
def test_a_gvisor_terminal_across_pause_and_a_refused_snapshot(make_sandbox, daemon):
    """Paused, a terminal's command is stopped and what is typed waits in the terminal; resumed, it goes on. A
    memory snapshot or fork refuses while a terminal is open (its pty is the host's: gVisor cannot checkpoint
    it), naming the fix, and works once the session has ended; nothing of the terminal is left then."""
    sb = make_sandbox(runtime="gvisor")
    p = _shell(sb)
    assert _cmd(p, "echo before") == "before"
    try:   # what follows its prompt (ash asks where the cursor is: ESC [6n)
        while p.read(timeout=0.5):
            pass
    except hutch.SandboxTimeout:
        pass
    sb.pause()
    p.write("echo typed-while-paused\r")
    with pytest.raises(hutch.SandboxTimeout):   # stopped: not even its echo (ash echoes itself)
        p.read(timeout=1)
    sb.resume()
    assert b"typed-while-paused\r\n" in p.read_until(PROMPT)
    for call in (sb.snapshot_memory, lambda: sb.fork(1)):
        with pytest.raises(hutch.StateError, match="terminal open.*end that session first"):
            call()
    assert _cmd(p, "echo still-here") == "still-here"   # the refusal left the session as it was
    p.write("exit 0\r")
    assert p.wait(10) == 0
    p.close()
    snap = sb.snapshot_memory()
    try:
        copy = hutch.Sandbox.restore(snap)
        try:
            with copy.exec("sh", "-c", "stty size", pty=(12, 34)) as q:   # a terminal in the restored copy
                assert q.wait(30) == 0 and q.read_until(b"\r\n", 10) == b"12 34\r\n"
        finally:
            copy.terminate()
    finally:
        snap.delete()
    run_tty = daemon / "gvisor-tty"
    assert oct(os.stat(run_tty).st_mode & 0o777) == "0o700" and os.stat(run_tty).st_uid == 0
    assert [d.name for d in run_tty.iterdir()] == [sb.id]   # the copy's is gone with it
    assert os.stat(run_tty / sb.id / "ptmx").st_mode & 0o777 == 0o600   # its devpts, root's only
    sb.terminate()
    assert list(run_tty.iterdir()) == []
    assert str(run_tty) not in Path("/proc/self/mountinfo").read_text()


def test_async_sandbox_terminal(sb):
    async def main():
        asb = await hutch.AsyncSandbox.from_id(sb.id)
        p = await asb.exec("sh", pty=(20, 60))
        async with p:
            await p.read_until(PROMPT)
            await p.write("stty size\r")
            assert b"20 60" in await p.read_until(PROMPT)
            await p.resize(33, 99)
            await p.write("stty size; exit 4\r")
            assert b"33 99" in await p.read_until(b"33 99")
            assert await p.wait(10) == 4

    asyncio.run(main())


# --- the CLI through a real terminal: tmux ----------------------------------------------------------------

class Tmux:
    """A private tmux server (its own socket) running one command in a window of a known size."""

    def __init__(self, tmp: Path, command: str, size=(100, 30)):
        self.sock = str(tmp / f"tmux-{uuid.uuid4().hex[:8]}")
        self.rc = tmp / "rc"
        env = {k: os.environ[k] for k in ("HUTCH_SOCKET", "HUTCH_RUN_DIR", "PATH") if k in os.environ}
        line = (f"env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} TERM=xterm-256color "
                f"{command}; echo $? > {self.rc}; sleep 60")
        self.tmux("new-session", "-d", "-s", "t", "-x", str(size[0]), "-y", str(size[1]), line)

    def tmux(self, *args) -> str:
        return subprocess.run(["tmux", "-S", self.sock, *args], check=True, capture_output=True, text=True,
                              timeout=20).stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def wait_for(self, text: str, timeout: float = 30.0, count: int = 1) -> str:
        deadline = time.monotonic() + timeout
        while True:
            s = self.screen()
            if s.count(text) >= count:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on the screen in {timeout} s:\n{s}")
            time.sleep(0.05)

    def exit_code(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while not (self.rc.exists() and self.rc.read_text().strip()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the command did not end:\n{self.screen()}")
            time.sleep(0.05)
        return int(self.rc.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=20)


@pytest.fixture
def tmux_run(tmp_path):
    made = []

    def start(command: str, size=(100, 30)) -> Tmux:
        t = Tmux(tmp_path, command, size)
        made.append(t)
        return t

    yield start
    for t in made:
        t.close()


def _ids() -> set[str]:
    return {s.id for s in hutch.Sandbox.list() if s.status in ("starting", "running")}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hutch_run_it_bash_as_a_person_uses_it(daemon, tmux_run, runtime):
    before = _ids()
    t = tmux_run(f"{sys.executable} -m hutch run -it --runtime {runtime} --timeout 120 -- bash --norc", size=(100, 30))
    t.wait_for("bash-")   # its prompt as root
    t.keys("stty size; echo $TERM", "Enter")
    t.wait_for("30 100")
    t.wait_for("xterm-256color")
    # colours: the sandbox's escape sequences reach our terminal as they are (tmux draws them)
    t.keys("printf '\\033[31mRED\\033[0m%s\\n' done", "Enter")
    t.wait_for("REDdone")
    assert "\x1b[31mRED" in t.tmux("capture-pane", "-p", "-e", "-t", "t")
    # line editing: readline's Ctrl-A and history (Up)
    t.keys("cho edited", "C-a", "e", "Enter")
    t.wait_for("edited", count=2)
    t.keys("Up", "Enter")
    t.wait_for("edited", count=4)
    # Ctrl-C interrupts the foreground program, not the shell
    t.keys("sleep 100", "Enter")
    time.sleep(0.5)
    t.keys("C-c")
    t.keys("echo rc=$?", "Enter")
    t.wait_for("rc=130")
    # a resize of our terminal is seen in the sandbox
    t.tmux("resize-window", "-t", "t", "-x", "120", "-y", "40")
    time.sleep(0.3)
    t.keys("stty size", "Enter")
    t.wait_for("40 120")
    t.keys("exit 5", "Enter")
    assert t.exit_code() == 5
    deadline = time.monotonic() + 10
    while _ids() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _ids() - before   # the sandbox is gone


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hutch_sandbox_exec_it_python_in_a_running_sandbox(daemon, tmux_run, runtime):
    sb = hutch.Sandbox.create(timeout=120, tags=RUN_TAG, runtime=runtime)
    try:
        t = tmux_run(f"{sys.executable} -m hutch sandbox exec -it {sb.id} -- python3 -q")
        t.wait_for(">>>")
        t.keys("import os, signal; print(os.get_terminal_size())", "Enter")
        t.wait_for("columns=100, lines=30")
        t.keys("while True: pass", "Enter")
        t.keys("Enter")
        time.sleep(0.5)
        t.keys("C-c")
        t.wait_for("KeyboardInterrupt")
        t.keys("raise SystemExit(9)", "Enter")
        assert t.exit_code() == 9
        assert sb.status == "running"   # the sandbox outlives the exec
    finally:
        sb.terminate()
