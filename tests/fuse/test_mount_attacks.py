"""Code in a sandbox attacks the memory mount: nothing outside the store is read or written, no git
configuration or attribute reaches the store, the view server neither hangs nor dies, and a read-only mount
stays read-only. Real daemon, real namespaces, real FUSE, real git; secrets are canaries of the test's own.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

import hutch
from hutch.fuse._writes import MAX_FILE_BYTES, MAX_SCRATCH_FILES

from sandbox_support import views_settled

SECRET = "SECRET-CANARY-51c9"




@pytest.fixture
def planted(store, tmp_path):
    """A store holding what a hostile clone or hand could plant, and a directory outside it with a canary."""
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "canary.txt"
    canary.write_text(SECRET + "\n")
    (outside / "planted.md").write_text(f"---\ntitle: Planted\n---\n{SECRET}\n")
    mem = store  # tests/fuse/conftest.py: actors/alice-chen -works_at-> orgs/acme, topics/pricing
    root = mem.root
    os.symlink(canary, root / "topics" / "evil.md")
    os.symlink(outside, root / "evilclass")
    rdir = root / "actors" / "alice-chen.links" / "knows"
    rdir.mkdir()
    os.symlink(canary, rdir / "abs.md")
    os.symlink("../" * 12 + str(canary).lstrip("/"), rdir / "dotdot.md")
    os.mkfifo(root / "topics" / "fifo.md")
    with open(os.path.join(os.fsencode(str(root)), b"topics", b"bad\xff.md"), "wb") as f:  # not UTF-8
        f.write(b"---\ntitle: Bad\n---\nlaughing at a bad name\n")
    try:
        yield mem, outside
    finally:
        try:  # a reader left blocked on the FIFO (a failed run) is released
            os.close(os.open(root / "topics" / "fifo.md", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def _state(mem, outside):
    """What the host has: the files outside the store, the store's files and its history."""
    files = sorted(str(p.relative_to(outside)) + ":" + (p.read_text() if p.is_file() else "")
                   for p in outside.rglob("*"))
    tree = sorted(str(p.relative_to(mem.root)) for p in mem.root.rglob("*") if ".git/" not in str(p) + "/"
                  and not str(p.relative_to(mem.root)).startswith((".git", ".hutch")))
    modes = {str(p.relative_to(mem.root)): stat.S_IMODE(os.lstat(p).st_mode) for p in mem.root.rglob("*.md")}
    return files, tree, modes, mem.git.run("rev-parse", "HEAD").strip()


def _bomb(depth=8) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, depth + 1)]
    return "---\n" + "\n".join(lines) + f"\ntitle: *a{depth}\n---\nlaughing words\n"


# Each line: name, then a shell command run inside the sandbox; the script prints 'name rc'.
ATTACKS = [
    ("ln-entity-abs", "ln -s $CANARY /memory/topics/evil2.md"),
    ("ln-class", "ln -s /etc /memory/etcclass"),
    ("ln-relation-abs", "mkdir -p /memory/orgs/acme.links/knows && ln -s $CANARY /memory/orgs/acme.links/knows/x.md"),
    ("ln-relation-dotdot", "mkdir -p /memory/orgs/acme.links/knows && "
                           "ln -s ../../../../../../../..$CANARY /memory/orgs/acme.links/knows/y.md"),
    ("hardlink", "ln /memory/orgs/acme.md /memory/orgs/hard.md"),
    ("mkfifo", "mkfifo /memory/topics/f.md"),
    ("mknod", "mknod /memory/topics/zero.md c 1 5"),
    ("mkdir-git", "mkdir /memory/.git"),
    ("git-config", "printf '[core]\\n\\tfsmonitor = touch /tmp/x\\n' >> /memory/.git/config"),
    ("git-hook", "mkdir -p /memory/.git/hooks; echo 'touch /tmp/x' > /memory/.git/hooks/post-commit"),
    ("gitattributes", "echo '* filter=x' > /memory/.gitattributes"),
    ("gitignore", "echo '*' > /memory/.gitignore"),
    ("mkdir-hutch", "mkdir /memory/.hutch"),
    ("mv-onto-gitattributes", "printf '* filter=x\\n' > /memory/topics/scr && mv /memory/topics/scr /memory/.gitattributes"),
    ("mv-temp-to-git-config", "printf '[core]\\n' > /memory/topics/scr2 && mv /memory/topics/scr2 /memory/.git/config"),
    ("mv-temp-nowhere", "printf x > /memory/topics/scr3 && mv /memory/topics/scr3 /memory/nosuchclass/x"),
    ("mv-entity-to-git", "mv /memory/topics/pricing.md /memory/.git"),
    ("search-write", "echo x > /memory/search/pricing/01-topics-pricing.md"),
    ("search-rm", "rm /memory/search/pricing/.explain"),
    ("search-mkdir", "mkdir /memory/search/newq"),
    ("asof-write", "echo x > /memory/as-of/2020-01-01/topics/pricing.md"),
    ("profile-write", "echo x > /memory/profile.md"),
    ("truncate-1T", "truncate -s 1099511627776 /memory/topics/pricing.md"),
    ("seek-1T", "echo x | dd of=/memory/topics/pricing.md bs=1 seek=1099511627776 conv=notrunc"),
    ("write-70MB", f"head -c {MAX_FILE_BYTES + (1 << 20)} /dev/zero > /memory/topics/huge.md"),
    ("scratch-flood", f"i=0; while [ $i -lt {MAX_SCRATCH_FILES + 10} ]; do touch /memory/topics/.s$i || break; "
                      f"i=$((i+1)); done; rm -f /memory/topics/.s*; [ $i -ge {MAX_SCRATCH_FILES + 10} ]"),
    # a shell ignores the error close() returns for a refused write: the test asks what the view then holds
    ("linkdir-flood", f"i=0; while [ $i -lt {MAX_SCRATCH_FILES + 10} ]; do mkdir /memory/orgs/acme.links/r$i || break; "
                      f"i=$((i+1)); done; rmdir /memory/orgs/acme.links/r*; [ $i -ge {MAX_SCRATCH_FILES + 10} ]"),
    # every open of a temp file copies it: five opens of a 60 MiB one would hold 300 MiB in the server
    ("hold-copies", "head -c 62914560 /dev/zero > /memory/topics/.big && exec 3</memory/topics/.big "
                    "4</memory/topics/.big 5</memory/topics/.big 6</memory/topics/.big 7</memory/topics/.big"),
    ("yaml-bomb", "cat /tmp/bomb.md > /memory/topics/bomb.md; grep -q laughing /memory/topics/bomb.md"),
    ("read-entity-link", "cat /memory/topics/evil.md"),
    ("read-class-link", "cat /memory/evilclass/planted.md /memory/evilclass/canary.txt"),
    ("read-relation-abs", "cat /memory/actors/alice-chen.links/knows/abs.md"),
    ("read-relation-dotdot", "cat /memory/actors/alice-chen.links/knows/dotdot.md"),
    ("read-fifo", "timeout 2 cat /memory/topics/fifo.md"),
]
SHOULD_WORK = [
    ("search-after", "ls /memory/search/laughing/ /memory/search/secret/ && cat /memory/search/secret/* && "
                     "cat /memory/profile.md && ls /memory/topics/"),
    ("weird-query", "ls \"/memory/search/$(printf '..\\001\\n%%s;`id`')/\""),
    ("chmod-suid", "chmod 6755 /memory/orgs/acme.md && stat -c 'mode=%a' /memory/orgs/acme.md"),
    ("alive", "cat /memory/orgs/acme.md"),
]


def _script(steps) -> str:
    return "\n".join(f"( {cmd} ) >>/tmp/out 2>>/tmp/err; echo \"{name} $?\"" for name, cmd in steps)


def test_sandbox_code_cannot_escape_a_writable_mount(daemon, image, planted):
    mem, outside = planted
    canary = outside / "canary.txt"
    before = _state(mem, outside)
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(mem, "/memory", writable=True)]) as sb:
        r = sb.run("sh", "-c", f"CANARY={canary}\ncat > /tmp/bomb.md <<'EOF'\n{_bomb()}EOF\n" + _script(ATTACKS + SHOULD_WORK)
                   + "\ncat /tmp/out; grep ' /memory ' /proc/mounts", timeout=120)
        rcs = dict(line.split() for line in r.stdout.splitlines() if line.count(" ") == 1 and line.split()[1].isdigit())
        errs = sb.run("cat", "/tmp/err").stdout
        refused = [n for n, _ in ATTACKS if rcs.get(n) == "0"]
        assert refused == [], f"attacks that succeeded inside the sandbox: {refused}\n{errs}"
        failed = [n for n, _ in SHOULD_WORK if rcs.get(n) != "0"]
        assert failed == [], f"ordinary use failed after the attacks: {failed}\n{errs}"
        assert SECRET not in r.stdout, "a host file outside the store was read through the mount"
        assert "mode=644" in r.stdout  # chmod is accepted and ignored: no set-id bit reaches the store
        mounts = r.stdout.strip().splitlines()[-1]
        assert "nosuid" in mounts and "nodev" in mounts, mounts
        for why in ("File too large", "No space left on device", "Read-only file system", "Invalid argument",
                    "Cannot allocate memory"):
            assert why in errs, f"expected some attack to be refused with {why!r}:\n{errs}"
        assert "Acme worries" in r.stdout  # the view still serves
    after = _state(mem, outside)
    assert after[0] == before[0], "files outside the store changed"
    assert canary.read_text() == SECRET + "\n"
    assert after[1] == before[1], f"the store's files changed: {set(after[1]) ^ set(before[1])}"
    assert after[2] == before[2], "a file mode in the store changed"
    assert after[3] == before[3], mem.git.run("log", "--format=%s", f"{before[3]}..HEAD")
    assert views_settled() == [], "the memory view outlived its sandbox"


def test_a_read_only_mount_refuses_every_write(daemon, image, planted):
    mem, outside = planted
    before = _state(mem, outside)
    attacks = [
        ("append", "echo x >> /memory/orgs/acme.md"),
        ("create", "echo x > /memory/topics/new.md"),
        ("truncate", "truncate -s 0 /memory/orgs/acme.md"),
        ("rm", "rm /memory/topics/pricing.md"),
        ("rm-link", "rm /memory/actors/alice-chen.links/works_at/acme.md"),
        ("ln", "mkdir -p /memory/orgs/acme.links/about && ln -s ../../../topics/pricing.md "
               "/memory/orgs/acme.links/about/pricing.md"),
        ("mkdir", "mkdir /memory/newclass"),
        ("rmdir", "rmdir /memory/topics"),
        ("mv", "mv /memory/topics/pricing.md /memory/topics/p.md"),
        ("chmod", "chmod 6755 /memory/orgs/acme.md"),
        ("touch", "touch /memory/orgs/acme.md"),
        ("mknod", "mknod /memory/topics/z.md c 1 5"),
        ("temp", "echo x > /memory/topics/.tmp1"),
        ("remount", "mount -o remount,rw /memory"),
        ("search", "echo x > /memory/search/pricing/.explain"),
    ]
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(mem, "/memory")]) as sb:
        r = sb.run("sh", "-c", _script(attacks) + "\ncat /tmp/err; cat /memory/orgs/acme.md")
        rcs = dict(line.split() for line in r.stdout.splitlines() if line.count(" ") == 1 and line.split()[1].isdigit())
        assert [n for n, _ in attacks if rcs.get(n) == "0"] == [], r.stdout
        assert r.stdout.count("Read-only file system") >= 10, r.stdout
        assert "Acme worries" in r.stdout
    assert _state(mem, outside) == before
    assert views_settled() == []


def test_concurrent_writers_in_a_sandbox_leave_a_valid_store(daemon, image, planted):
    mem, _ = planted
    n0 = int(mem.git.run("rev-list", "--count", "HEAD"))
    planted_errors = {(i.code, i.path) for i in mem.check().issues if i.severity == "error"}   # the fixture's
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(mem, "/memory", writable=True)]) as sb:
        r = sb.run("sh", "-c",
                   "for w in 1 2 3 4; do (for i in 1 2 3 4 5; do echo \"- w$w line $i\" >> /memory/orgs/acme.md; "
                   "printf 'note %s\\n' $w$i > /memory/topics/n$w.md; done) & done; "
                   "(for i in 1 2 3 4 5 6 7 8; do cat /memory/orgs/acme.md /memory/search/acme/* >/dev/null; done) & "
                   "wait; echo done", timeout=120)
        assert r.stdout.strip().endswith("done"), r.stderr
    text = mem.get("orgs/acme").text
    assert all(f"- w{w} line {i}" in text for w in range(1, 5) for i in range(1, 6)), text
    assert [mem.get(f"topics/n{w}").body.strip() for w in range(1, 5)] == [f"note {w}5" for w in range(1, 5)]
    assert int(mem.git.run("rev-list", "--count", "HEAD")) > n0
    assert subprocess.run(["git", "-C", str(mem.root), "fsck", "--no-progress"], capture_output=True).returncode == 0
    assert {(i.code, i.path) for i in mem.check().issues if i.severity == "error"} == planted_errors
    assert views_settled() == []


def test_extended_attributes_are_refused(mounted):
    """No xattr (a file capability, an ACL, a user attribute) reaches the store through the view."""
    import errno

    f = mounted.p("orgs", "acme.md")
    for name in ("user.x", "security.capability", "system.posix_acl_access", "trusted.x"):
        with pytest.raises(OSError) as e:
            os.setxattr(f, name, b"\x01\x00\x00\x02")
        assert e.value.errno in (errno.ENOTSUP, errno.EPERM, errno.EINVAL), (name, e.value)
    assert os.listxattr(mounted.mem.root / "orgs" / "acme.md") == []
