"""Snapshots and volumes with HUTCH_USERNS=1: root in the sandbox is a host uid >= 1000000000, and a
snapshot's layer stores the sandbox's own ids (0, 1000 ...), as an image layer must."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hutch_testing import restore_env
from img_support import RUN_TAG, start_daemon, stop_daemon

import hutch

_ENV = ("HUTCH_RUN_DIR", "HUTCH_SOCKET", "HUTCH_URL", "HUTCH_TOKEN", "HUTCH_STATE_DIR")


@pytest.fixture(scope="module")
def userns_daemon():
    run_dir = Path(tempfile.mkdtemp(prefix="hutch-img-uns-run-"))
    state = Path(tempfile.mkdtemp(prefix="hutch-img-uns-state-"))
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(HUTCH_RUN_DIR=str(run_dir), HUTCH_SOCKET=str(run_dir / "hutch.sock"), HUTCH_STATE_DIR=str(state))
    os.environ.pop("HUTCH_URL", None)
    os.environ.pop("HUTCH_TOKEN", None)
    proc = None
    try:
        proc = start_daemon(run_dir, {"HUTCH_USERNS": "1"})
        yield state
    finally:
        try:
            if proc is not None:
                for sb in hutch.Sandbox.list(tags=RUN_TAG):
                    sb.terminate()
                stop_daemon(proc)
        finally:
            restore_env(saved)
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(state, ignore_errors=True)


def test_snapshot_in_a_user_namespace_keeps_sandbox_ids(userns_daemon, busybox_root):
    base = hutch.Image.from_directory(busybox_root)
    sb = hutch.Sandbox.create(image=base, tags=RUN_TAG, timeout=60)
    try:
        r = sb.run("sh", "-c", "mkdir -p /data && echo a > /data/a && rm /etc/passwd && "
                               "cut -c1-40 /proc/self/uid_map", check=True)
        assert int(r.stdout.split()[1]) >= 1_000_000_000   # really in a user namespace (a range of its own)
        snap = sb.snapshot_filesystem()
    finally:
        sb.terminate()
    layer = hutch.Image.from_name(snap.ref)
    from hutch.sandbox import _client

    digest = _client.default_client().json("GET", f"/v1/images/{snap.ref}")["layer"]
    st = (userns_daemon / "layers" / digest / "fs" / "data" / "a").stat()
    assert (st.st_uid, st.st_gid) == (0, 0)
    sb2 = hutch.Sandbox.create(image=layer, tags=RUN_TAG, timeout=60)
    try:
        assert sb2.run("sh", "-c", "cat /data/a; stat -c %u /data/a; test -e /etc/passwd || echo gone").stdout \
            == "a\n0\ngone\n"
    finally:
        sb2.terminate()
