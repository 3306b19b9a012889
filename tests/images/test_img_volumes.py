"""Volumes: shared between sandboxes, read-only even for root, host-side file calls confined, rm."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import hutch
from hutch.cli import cli


def test_volume_shared_between_two_sandboxes(make_sandbox):
    vol = hutch.Volume.from_name("shared-test", create=True)
    try:
        a = make_sandbox(mounts=[hutch.Mount.volume(vol, "/data")])
        b = make_sandbox(mounts=[hutch.Mount.volume("shared-test", "/mnt/v")])
        a.run("sh", "-c", "echo from-a > /data/a.txt && mkdir -p /data/d && echo x > /data/d/x", check=True)
        assert b.run("cat", "/mnt/v/a.txt", check=True).stdout == "from-a\n"
        b.run("sh", "-c", "echo from-b > /mnt/v/b.txt.tmp && mv /mnt/v/b.txt.tmp /mnt/v/b.txt", check=True)
        assert a.run("cat", "/data/b.txt", check=True).stdout == "from-b\n"
        # the host-side API sees the same files
        assert [e.name for e in vol.list("/")] == ["a.txt", "b.txt", "d"]
        assert vol.read("/d/x") == b"x\n"
        vol.write("/c/new.bin", b"\x00\x01", mode=0o600)
        assert a.run("sh", "-c", "stat -c %a /data/c/new.bin; wc -c < /data/c/new.bin", check=True).stdout.split() \
            == ["600", "2"]
        vol.remove("/d", recursive=True)
        assert b.run("ls", "/mnt/v").stdout.split() == ["a.txt", "b.txt", "c"]
        # a volume outlives its sandboxes
        a.terminate()
        b.terminate()
        c = make_sandbox(mounts=[hutch.Mount.volume(vol, "/data")])
        assert c.run("cat", "/data/a.txt").stdout == "from-a\n"
        c.terminate()
    finally:
        hutch.Volume.delete("shared-test", force=True)


def test_read_only_volume_refuses_writes_even_as_root(make_sandbox):
    vol = hutch.Volume.from_name("ro-test", create=True)
    try:
        vol.write("/f", b"keep")
        sb = make_sandbox(mounts=[hutch.Mount.volume(vol, "/data", readonly=True)])
        r = sb.run("sh", "-c", "id -u; echo x > /data/f; echo x > /data/g; rm /data/f; mount -o remount,rw /data")
        assert r.stdout.startswith("0\n")
        assert r.returncode != 0 and r.stderr.count("Read-only file system") >= 3, r.stderr
        assert vol.read("/f") == b"keep" and [e.name for e in vol.list()] == ["f"]
    finally:
        hutch.Volume.delete("ro-test", force=True)


def test_volume_file_calls_never_leave_the_volume(make_sandbox):
    vol = hutch.Volume.from_name("escape-test", create=True)
    try:
        sb = make_sandbox(mounts=[hutch.Mount.volume(vol, "/data")])
        sb.run("sh", "-c", "ln -s /etc/hostname /data/host; ln -s ../../../../etc /data/up; mkdir /data/etc", check=True)
        # a symlink resolves inside the volume (there is no /etc/hostname there), never on the host
        with pytest.raises(hutch.NotFoundError):
            vol.read("/host")
        with pytest.raises(hutch.NotFoundError):
            vol.read("/up/hostname")   # the volume's own (empty) /etc
        with pytest.raises(hutch.NotFoundError):
            vol.read("/../../etc/hostname")
        vol.write("/up/planted", b"x")   # lands in the volume's own /etc, not the host's
        assert vol.read("/etc/planted") == b"x"
        assert sb.run("cat", "/data/etc/planted").stdout == "x"
    finally:
        hutch.Volume.delete("escape-test", force=True)


def test_volume_errors_and_cli(make_sandbox):
    runner = CliRunner()
    with pytest.raises(hutch.NotFoundError, match="create=True"):
        hutch.Volume.from_name("no-such-volume")
    with pytest.raises(hutch.NotFoundError, match="create=True"):
        make_sandbox(mounts=[hutch.Mount.volume("no-such-volume", "/data")])
    with pytest.raises(hutch.ConfigError):
        hutch.Volume.from_name("../etc", create=True)
    r = runner.invoke(cli, ["volume", "create", "cli-test"])
    assert r.exit_code == 0, r.output
    sb = make_sandbox(mounts=[hutch.Mount.volume("cli-test", "/data")])
    r = runner.invoke(cli, ["volume", "ls"])
    assert "cli-test" in r.output and sb.id in r.output
    r = runner.invoke(cli, ["volume", "rm", "cli-test"])
    assert r.exit_code == 1 and "mounted by running sandbox" in r.output and "--force" in r.output
    sb.terminate()
    r = runner.invoke(cli, ["volume", "rm", "cli-test"])
    assert r.exit_code == 0 and "removed" in r.output
    assert "cli-test" not in runner.invoke(cli, ["volume", "ls"]).output


def test_setuid_files_from_sandboxes_stay_out_of_host_users_reach(make_sandbox, daemon):
    vol = hutch.Volume.from_name("suid-test", create=True)
    try:
        sb = make_sandbox(mounts=[hutch.Mount.volume(vol, "/data")])
        sb.run("sh", "-c", "cp /bin/busybox /data/sh && chmod 4755 /data/sh && cp /data/sh /root/sh", check=True)
        sb.snapshot_filesystem()
        assert (daemon.state_dir / "volumes" / "suid-test" / "sh").stat().st_mode & 0o4000
        for d in (daemon.state_dir / "volumes", daemon.state_dir / "layers"):
            assert d.stat().st_mode & 0o777 == 0o700, d
    finally:
        hutch.Volume.delete("suid-test", force=True)
