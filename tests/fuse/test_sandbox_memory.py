"""Memory inside sandboxes: hutch.MemoryMount through a real daemon, real namespaces and a real FUSE view."""

from __future__ import annotations

import os
import shutil

import pytest

import hutch
from hutch._core.errors import ConfigError

from sandbox_support import views_alive, views_settled




def test_writable_memory_mount_commits_as_the_sandbox(daemon, image, store):
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        r = sb.run("sh", "-c", "ls '/memory/search/customer churn/' && "
                               "echo '- churn is highest in month two' >> /memory/orgs/acme.md && "
                               "cat /memory/profile.md", check=True)
        assert r.stdout.splitlines()[0] == "01-orgs-acme.md"
        assert "3 entities" in r.stdout
        v = store.history("orgs/acme")[0]
        assert v.source == f"sandbox:{sb.id}" and v.op == "update"
        assert store.get("orgs/acme").text.endswith("- churn is highest in month two\n")
        r = sb.run("sh", "-c", "printf 'Notes on churn.\\n' > /memory/topics/churn.md && cat /memory/topics/churn.md")
        assert r.returncode == 0 and "Notes on churn." in r.stdout
        assert store.history("topics/churn")[0].source == f"sandbox:{sb.id}"
        assert views_alive(), "the view should serve while the sandbox runs"
    assert views_settled() == [], "the memory view outlived its sandbox"


def test_concurrent_appends_in_a_sandbox_land_exactly_once(daemon, image, store):
    """Shells inside a sandbox append to one entity at once (`echo >>`, a fresh open each): every line lands
    once (two shells of 5 lines each used to give 15 lines, four of 10 gave 91)."""
    from collections import Counter

    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        for rnd, (shells, lines) in enumerate([(2, 5), (4, 10), (4, 10), (3, 8)]):
            script = (f'for s in $(seq {shells}); do (for i in $(seq {lines}); do '
                      f'echo "w$s line $i" >> /memory/topics/log-{rnd}.md; done) & done; wait; '
                      f'cat /memory/topics/log-{rnd}.md')
            r = sb.run("sh", "-c", script, check=True)
            want = Counter(f"w{s} line {i}" for s in range(1, shells + 1) for i in range(1, lines + 1))
            text = (store.root / "topics" / f"log-{rnd}.md").read_text()
            got = Counter(line for line in text.splitlines() if line.startswith("w"))
            assert got == want, f"round {rnd}: {sum(got.values())} lines, want {sum(want.values())}"
            assert Counter(line for line in r.stdout.splitlines() if line.startswith("w")) == want
            assert store.history(f"topics/log-{rnd}")[0].source == f"sandbox:{sb.id}"
    assert views_settled() == []


def test_read_only_memory_mount_refuses_even_root(daemon, image, store):
    n = len(store.git.log())
    sb = hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/mem")])
    try:
        r = sb.run("sh", "-c", "cat /mem/actors/alice-chen.md >/dev/null && echo read-ok; "
                               "echo x >> /mem/actors/alice-chen.md; echo y > /mem/topics/new.md; "
                               "rm /mem/topics/pricing.md; mkdir /mem/newclass; "
                               "mount -o remount,rw /mem; id -u")
        assert "read-ok" in r.stdout and r.stdout.strip().endswith("0")  # root inside
        assert r.stderr.count("Read-only file system") >= 4
        assert len(store.git.log()) == n
    finally:
        sb.terminate()
    assert views_settled() == []


def test_a_failed_create_leaves_no_view(daemon, store):
    with pytest.raises(hutch.Error):
        hutch.Sandbox.create(image="dir:/nonexistent-hutch-root", mounts=[hutch.MemoryMount(store, "/memory")])
    assert views_settled() == []


@pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed (scripts/setup.sh)")
def test_a_gvisor_sandbox_refuses_a_memory_mount_naming_native(daemon, image, store):
    with pytest.raises(hutch.UnsupportedError, match='FUSE.*runtime="native"'):
        hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory", writable=True)],
                             runtime="gvisor")
    assert views_settled() == [], "the memory view outlived the refused sandbox"


def test_memory_mount_validates(store, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not a memory store"):
        hutch.MemoryMount(tmp_path, "/memory")
    with pytest.raises(ConfigError, match="absolute path"):
        hutch.MemoryMount(store, "memory")
    with pytest.raises(ConfigError):
        hutch.Sandbox.create(memory=object())
    with pytest.raises(hutch.InvalidSpecError, match=r"RAM limit.*mounts=\[hutch.MemoryMount"):
        hutch.Sandbox.create(memory=hutch.MemoryMount(store, "/memory"))   # memory= is a size only
    monkeypatch.setenv("HUTCH_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="on this host"):
        hutch.Sandbox.create(mounts=[hutch.MemoryMount(store, "/memory")])


def test_async_sandbox_takes_a_memory_mount(daemon, image, store):
    import asyncio

    async def main():
        sb = await hutch.AsyncSandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory", writable=True)])
        try:
            r = await sb.run("sh", "-c", "echo 'from async' > /memory/topics/async-note.md && "
                                         "cat /memory/topics/async-note.md")
            assert r.returncode == 0 and "from async" in r.stdout
            return sb.id
        finally:
            await sb.terminate()

    sid = asyncio.run(main())
    assert store.history("topics/async-note")[0].source == f"sandbox:{sid}"
    assert views_settled() == []


def test_memory_mount_in_a_user_namespace_sandbox(daemon, image, store):
    """The default: root inside is an unprivileged host uid of its own range; the view (not idmappable,
    served with allow_other) still serves it, and a read-only mount still refuses, even root."""
    if os.environ.get("HUTCH_USERNS") == "0":
        pytest.skip("HUTCH_USERNS=0: this run opted out of user namespaces")
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory", writable=True)]) as sb:
        r = sb.run("sh", "-c", "cat /proc/self/uid_map; id -u; ls '/memory/search/customer churn/' && "
                               "echo '- from a user namespace' >> /memory/orgs/acme.md")
        inside, host = r.stdout.split()[:2]
        assert inside == "0" and int(host) >= 1_000_000_000, r.stdout   # really in a user namespace
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[3] == "0" and "01-orgs-acme.md" in r.stdout
        assert store.history("orgs/acme")[0].source == f"sandbox:{sb.id}"
    with hutch.Sandbox.create(image=image, mounts=[hutch.MemoryMount(store, "/memory")]) as sb:
        r = sb.run("sh", "-c", "echo x >> /memory/orgs/acme.md")
        assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert views_settled() == []
