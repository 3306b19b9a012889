"""Appends through the mount land exactly once: concurrent shells, interleaved descriptors, API commits between."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter


def _lines(text: str, prefix: str = "w") -> Counter:
    return Counter(line for line in text.splitlines() if line.startswith(prefix))


def _shells(path: str, shells: int, lines: int) -> None:
    """`shells` shells at once, each appending `lines` lines to `path` with `echo >>` (a fresh open each)."""
    procs = [subprocess.Popen(["sh", "-c", f'for i in $(seq {lines}); do echo "w{s} line $i" >> "$0"; done', path])
             for s in range(shells)]
    for p in procs:
        assert p.wait(120) == 0


def test_concurrent_shell_appends_land_exactly_once(mounted):
    mem = mounted.mem
    for rnd, (shells, lines) in enumerate([(2, 5), (4, 10), (2, 5), (4, 10), (3, 8), (4, 10)]):
        name = f"log-{rnd}"
        if rnd % 2:  # half the rounds append to a file that does not exist yet (the first >> creates it)
            mem.put("topics", name, slug=name, body="start\n")
        _shells(mounted.p("topics", f"{name}.md"), shells, lines)
        want = Counter(f"w{s} line {i}" for s in range(shells) for i in range(1, lines + 1))
        on_disk = (mem.root / "topics" / f"{name}.md").read_text()
        assert _lines(on_disk) == want, f"round {rnd}: {sum(_lines(on_disk).values())} lines, want {sum(want.values())}"
        with open(mounted.p("topics", f"{name}.md")) as f:
            assert f.read() == on_disk
        assert mem.git.show("HEAD", f"topics/{name}.md") == on_disk
    assert mem.check().ok


def test_interleaved_appenders_and_one_descriptor_writing_many_times(mounted):
    mounted.mem.put("topics", "Interleaved", body="start\n")
    path = mounted.p("topics", "interleaved.md")
    a = open(path, "a")
    b = open(path, "a")
    a.write("wa 1\n"); a.flush()
    b.write("wb 1\n"); b.flush()
    a.write("wa 2\n"); a.flush()
    a.close()                      # commits what a appended
    b.write("wb 2\n"); b.flush()
    c = open(path, "a")            # opened after a's commit, while b is still open
    c.write("wc 1\n"); c.flush()
    b.close()
    c.write("wc 2\n"); c.flush()
    os.fsync(c.fileno())           # fsync commits too; close then has nothing new
    c.close()
    text = (mounted.mem.root / "topics" / "interleaved.md").read_text()
    assert _lines(text) == Counter(["wa 1", "wa 2", "wb 1", "wb 2", "wc 1", "wc 2"])
    assert text.startswith("---\n") and "\nstart\n" in text


def test_an_api_commit_between_open_and_close_is_kept(mounted):
    """The API writes from another process, started before the descriptor opens: a child forked while this
    process holds a descriptor of the mount closes it at exec, and that close is a flush (a commit)."""
    mem = mounted.mem
    helper = subprocess.Popen(
        [sys.executable, "-c", "import sys, hutch; sys.stdin.readline(); "
         "hutch.Memory(sys.argv[1]).update('actors/alice-chen', add_facts=['writes through the API']); "
         "print('done', flush=True)", str(mem.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with open(mounted.p("actors", "alice-chen.md"), "a") as f:
            f.write("- likes tea\n")
            f.flush()
            helper.stdin.write("go\n")
            helper.stdin.flush()
            assert helper.stdout.readline() == "done\n"
            f.write("- reads a lot\n")
    finally:
        helper.kill()
        helper.wait()
        helper.stdin.close()
        helper.stdout.close()
    e = mem.get("actors/alice-chen")
    assert e.facts == ["prefers weekly reports", "writes through the API", "likes tea", "reads a lot"]
    assert mem.history("actors/alice-chen")[0].source == f"fuse:{mounted.path}"


_APPENDER = """
import os, random, sys
path, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(who)
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
for i in range(n):
    # one write() each, of sizes from a byte to past the kernel's 128 KiB FUSE write (one syscall, several requests)
    size = rnd.choice([1, 7, 100, 4095, 4097, 65536, 131073, 300000])
    os.write(fd, f"{who} {i} {size} ".encode() + b"x" * size + b"\\n")
    if rnd.random() < 0.3:   # now and then a new descriptor (a close commits what this one appended)
        os.close(fd)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
os.close(fd)
"""


def _records(data: bytes) -> Counter:
    """Each `who i size xxx...` record, checked whole (no record cut or interleaved with another)."""
    out = Counter()
    for line in data.split(b"\n"):
        if line[:1] in (b"p", b"q", b"r", b"s") and line[1:2] == b" ":
            who, i, size, xs = line.split(b" ", 3)
            assert xs == b"x" * int(size), f"record {who} {i} is cut or mixed with another"
            out[(who.decode(), int(i))] += 1
    return out


def test_appends_of_different_sizes_from_separate_processes_land_exactly_once(mounted):
    """Four processes, each its own O_APPEND descriptors, one write() per record of 1 byte to 300 KB."""
    path = mounted.p("topics", "sizes.md")
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, path, who, "12"]) for who in "pqrs"]
    for p in procs:
        assert p.wait(300) == 0
    on_disk = (mounted.mem.root / "topics" / "sizes.md").read_bytes()
    assert _records(on_disk) == Counter({(who, i): 1 for who in "pqrs" for i in range(12)})
    assert mounted.mem.git.show("HEAD", "topics/sizes.md").encode() == on_disk
    assert mounted.mem.check().ok


def test_shell_appends_from_separate_processes_land_exactly_once(mounted):
    """`>>` from a new process for every line (printf from coreutils, not a shell builtin), 3 at a time."""
    mounted.mem.put("topics", "Procs", body="start\n")
    path = mounted.p("topics", "procs.md")
    for batch in range(10):
        procs = [subprocess.Popen(["sh", "-c", f'exec /usr/bin/printf "w{s} line {batch}\\n" >> "$0"', path])
                 for s in range(3)]
        for p in procs:
            assert p.wait(60) == 0
    want = Counter(f"w{s} line {b}" for s in range(3) for b in range(10))
    assert _lines((mounted.mem.root / "topics" / "procs.md").read_text()) == want
