"""The image store is the daemon's: no other host account reads an image's records (their env may hold a
build's settings and secrets, their names and descriptions a tenant's), as none reaches its layers."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hutch_testing import HOST_PYTHON, host_user, run_as

pytestmark = pytest.mark.skipif(HOST_PYTHON is None, reason="needs the host's python3.11 for the second account")

READ_NODES = r"""
import json, os, sys
out = {}
for sub in ("nodes", "layers"):
    try:
        names = os.listdir(os.path.join(sys.argv[1], sub))
        out[sub] = "listed"
        found = [n for n in names if n.endswith(".json")]
        if found:
            with open(os.path.join(sys.argv[1], sub, found[0])) as f:
                out[sub] = "read " + f.read()[:200]
    except OSError as e:
        out[sub] = type(e).__name__
print(json.dumps(out))
"""


def test_no_other_account_reads_the_image_records(daemon, base):
    img = base.env({"BUILD_TOKEN": "s3cret-of-the-build"}).build(quiet=True)
    st = os.stat(daemon.state_dir)
    os.chmod(daemon.state_dir, 0o755)   # as /var/lib/hutch is: every user may come this far
    try:
        with host_user() as other:
            r = run_as(other, READ_NODES, str(daemon.state_dir))
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout)
    finally:
        os.chmod(daemon.state_dir, stat.S_IMODE(st.st_mode))
    assert got == {"nodes": "PermissionError", "layers": "PermissionError"}, got
    node = daemon.state_dir / "nodes" / f"{img.ref.split(':', 1)[1]}.json"
    assert "s3cret-of-the-build" in node.read_text()   # it is there, for the daemon only
