"""Terminal benchmarks: keystroke echo round trip on a terminal in a sandbox, beside a pty on the host.

    .venv/bin/python bench/terminal.py [--quick] [--write docs/benchmarks.md]

A keystroke is one byte written, its echo the same byte read back; p50 and p99 in ms:
  the line discipline's echo (`cat` in canonical mode: the kernel echoes, no program runs);
  bash's line editor (readline echoes it from user space);
each through the SDK (PtyProcess.write / read) and through the CLI as a person uses it
(`hutch sandbox exec -it ID -- ...` running on a pty of this host, the bytes written to that pty's master).
Peer, in the same run: the same program on a pty of this host (os.openpty), bytes written to its master.
The sandbox (the default image) runs on a private daemon started (and stopped) by this script.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import start_daemon, stop_daemon, summary, write_section  # bench/ is the script's directory

ROOT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT_DIR))

import hutch  # noqa: E402

TAG = {"bench": f"terminal-{os.getpid()}"}
KEYS_PER_LINE = 40   # then Enter, so that a line never wraps


class HostPty:
    """A program on a pty of this host; write() / read_until() on its master, as PtyProcess has them."""

    def __init__(self, argv, env=None):
        self.master, slave = os.openpty()
        os.set_blocking(self.master, True)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     env=env, preexec_fn=lambda: __import__("fcntl").ioctl(0, __import__("termios").TIOCSCTTY, 0))
        os.close(slave)
        self.buf = b""

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def read_until(self, pat: bytes, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while (i := self.buf.find(pat)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.master], [], [], left)[0]:
                raise TimeoutError(f"{pat!r} did not come; got {self.buf[-200:]!r}")
            self.buf += os.read(self.master, 65536)
        out, self.buf = self.buf[: i + len(pat)], self.buf[i + len(pat):]
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def echo_times(t, n: int, prompt: bytes | None) -> list[float]:
    """Type n keys into `t`, timing each one's echo; with a `prompt` (a shell), Enter and the next prompt every
    KEYS_PER_LINE keys (`cat` gets one long line: a canonical line holds 4095 bytes)."""
    out = []
    for i in range(n):
        key = b"abcdefghijklmnopqrstuvwxyz"[i % 26:i % 26 + 1]
        t0 = time.perf_counter()
        t.write(key)
        t.read_until(key)
        out.append((time.perf_counter() - t0) * 1000)
        if prompt and (i + 1) % KEYS_PER_LINE == 0:
            t.write(b"\r")
            t.read_until(prompt)
    return out


BASH = ["bash", "--norc", "--noprofile"]
PROMPT = b"$ "


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer keystrokes")
    ap.add_argument("--write", metavar="MD", help="also write the results as Markdown to this file")
    a = ap.parse_args()
    n = 200 if a.quick else 1000   # cat's line: n + the warm-up's 20 keys, under 4095
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-bench-terminal-"))
    daemon = start_daemon(run_dir)
    env = {"PATH": "/usr/bin:/bin", "TERM": "xterm", "PS1": "$ ", "HOME": "/tmp", "INPUTRC": "/dev/null"}
    res = {}
    try:
        with hutch.Sandbox.create(timeout=600, tags=TAG) as sb:
            for name, argv, prompt in (("cat", ["cat"], None), ("bash", BASH, PROMPT)):
                # the SDK
                p = sb.exec(*argv, pty=(24, 200), env=env)
                if prompt:
                    p.read_until(prompt)
                echo_times(p, 20, prompt)   # warm-up
                res[("sdk", name)] = echo_times(p, n, prompt)
                p.close()
                # the CLI, on a pty of ours
                cli = HostPty([sys.executable, "-m", "hutch", "sandbox", "exec", "-it", sb.id, "--", "env",
                               *[f"{k}={v}" for k, v in env.items()], *argv], env=dict(os.environ, TERM="xterm"))
                if prompt:
                    cli.read_until(prompt, 30)
                else:
                    time.sleep(1.0)   # nothing to wait for: give the session time to start
                echo_times(cli, 20, prompt)
                res[("cli", name)] = echo_times(cli, n, prompt)
                cli.close()
                # the host
                h = HostPty(argv, env=env)
                if prompt:
                    h.read_until(prompt)
                echo_times(h, 20, prompt)
                res[("host", name)] = echo_times(h, n, prompt)
                h.close()
        load1 = os.getloadavg()[0]
    finally:
        for s in hutch.Sandbox.list(tags=TAG):
            s.terminate()
        stop_daemon(daemon, 20)
        shutil.rmtree(run_dir, ignore_errors=True)

    def num(x):
        return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"

    def cell(k):
        s = summary(res[k])
        return f"{num(s['p50'])} / {num(s['p99'])}"

    rows = []
    for name, what in (("cat", "the line discipline's echo (`cat`)"), ("bash", "bash's line editor (readline)")):
        host = summary(res[("host", name)])["p50"]
        for via, how in (("sdk", "SDK (`PtyProcess`)"), ("cli", "CLI (`hutch sandbox exec -it`)")):
            p50 = summary(res[(via, name)])["p50"]
            ok = "met" if p50 <= 5 else "NOT met"
            rows.append(f"| {what}, {how} | {cell((via, name))} | {cell(('host', name))} | {p50 / host:.0f}x | "
                        f"<= 5 ms: {ok} |")
    lines = [
        f"Run of {started} ({os.cpu_count()} cores, load average {load0:.1f} at the start, {load1:.1f} at the end); "
        f"{n} keystrokes each, p50 / p99 in ms; the peer is the same program on a pty of this host (os.openpty) "
        "in the same run.",
        "",
        "| keystroke -> its echo | hutch | host pty | ratio (p50) | target (p50) |",
        "|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines)
    print(text)
    if a.write:
        write_section(Path(a.write), "terminal.py", "Terminal", text)


if __name__ == "__main__":
    main()
