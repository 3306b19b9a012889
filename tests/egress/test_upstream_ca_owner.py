"""The CA bundle the egress gateway trusts when it sends a brokered credential to its host
(HUTCH_EGRESS_UPSTREAM_CA) is refused unless root's and writable by nobody else, as are the directories above
it: whoever may change it adds a CA of theirs, answers for the credential's host, and reads every credential
the gateway sends there. The other user is a real host account, made and removed here."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hutch_testing import HOST_PYTHON, host_user, run_as

import hutch

pytestmark = pytest.mark.skipif(HOST_PYTHON is None, reason="needs the host's python3.11 for the second account")

SYSTEM = Path("/etc/ssl/certs/ca-certificates.crt")


@pytest.fixture
def public():
    d = Path(tempfile.mkdtemp(prefix="hutch-upca-"))
    os.chmod(d, 0o1777)   # as /tmp: every user may make names here
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_an_upstream_ca_another_user_may_change_is_refused(public, monkeypatch):
    from hutch.sandbox._host.egress.broker import ENV_UPSTREAM_CA, upstream_context

    ours = public / "ours.pem"
    shutil.copyfile(SYSTEM, ours)
    os.chmod(ours, 0o644)
    monkeypatch.setenv(ENV_UPSTREAM_CA, str(ours))
    upstream_context()   # root's, in a sticky directory: taken
    with host_user() as other:
        theirs = public / "theirs.pem"
        r = run_as(other, "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2]); print('made')",
                   str(SYSTEM), str(theirs))
        assert r.returncode == 0, r.stderr
        monkeypatch.setenv(ENV_UPSTREAM_CA, str(theirs))
        with pytest.raises(hutch.ConfigError) as e:
            upstream_context()
        assert f"{theirs} belongs to uid {other.pw_uid}" in str(e.value) and "chown root" in str(e.value)
        assert ENV_UPSTREAM_CA in str(e.value)
        # root's file in a directory of theirs: they would swap it
        d = public / "theirdir"
        r = run_as(other, "import os, sys; os.mkdir(sys.argv[1], 0o755); print('made')", str(d))
        assert r.returncode == 0, r.stderr
        inner = d / "ca.pem"
        os.chmod(d, 0o777)
        shutil.copyfile(SYSTEM, inner)
        os.chmod(d, 0o755)
        with pytest.raises(hutch.ConfigError, match=f"{d} belongs to uid {other.pw_uid}"):
            upstream_context(str(inner))
    os.chmod(ours, 0o666)   # root's, but every user may write it
    monkeypatch.setenv(ENV_UPSTREAM_CA, str(ours))
    with pytest.raises(hutch.ConfigError, match="is writable by other users"):
        upstream_context()
