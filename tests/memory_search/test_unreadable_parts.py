"""Parts of a store this process may not read (issue 16): a class directory, an entity file, a links directory
and a relation directory of mode 000, seen by a process without CAP_DAC_OVERRIDE (root with that capability
dropped by setpriv, as a store shared with another user is seen). search answers from the rest, check() names
each, doctor() names what search leaves out, and nothing raises: one unreadable class directory made search,
check(), doctor() and ls() raise PermissionError, and doctor called an unreadable file a stale index. Real
store, real SQLite, the real CLI."""

import json
import os
import shutil
import subprocess
import sys

import pytest

_DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]

_CHILD = r"""
import json, sys, warnings
import hutch
m = hutch.Memory(sys.argv[1])
out = {}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out["search"] = [h.entity_id for h in m.search("walrus", k=10)]
    out["again"] = [h.entity_id for h in m.search("walrus", k=10)]
out["check"] = {i.path: [i.code, i.fix] for i in m.check().errors}
d = m.doctor()
out["doctor"] = {"ok": d.ok, "fresh": d.fresh, "missing": list(d.missing), "problems": list(d.problems)}
out["ls"] = m.ls()
out["neighbors"] = [n.id for n in m.neighbors("actors/carol")]
print(json.dumps(out))
"""


@pytest.fixture
def planted(mem, store_dir):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    mem.put("notes", "Alpha", body="walrus alpha")
    mem.put("notes", "Beta", body="walrus beta")
    mem.put("actors", "Carol", body="walrus carol")
    mem.link("notes/alpha", "knows", "actors/carol")
    mem.link("notes/beta", "knows", "actors/carol")
    mem.search("walrus")
    (store_dir / "notes" / "locked.md").write_text("---\ntitle: Locked\n---\nwalrus locked\n")
    (store_dir / "vault").mkdir()
    (store_dir / "vault" / "x.md").write_text("---\ntitle: X\n---\nwalrus vault\n")
    modes = [store_dir / "notes" / "locked.md", store_dir / "vault", store_dir / "notes" / "alpha.links",
             store_dir / "notes" / "beta.links" / "knows"]
    for p in modes:
        os.chmod(p, 0)
    try:
        yield store_dir
    finally:
        for p in modes:
            os.chmod(p, 0o755)


def test_unreadable_parts_break_nothing_and_are_named(planted):
    r = subprocess.run(_DROP + [sys.executable, "-c", _CHILD, str(planted)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert set(got["search"]) == {"notes/alpha", "notes/beta", "actors/carol"} and got["again"] == got["search"]
    assert {p: c for p, (c, _) in got["check"].items()} == {
        "vault/": "unreadable", "notes/locked.md": "unreadable", "notes/alpha.links/": "unreadable",
        "notes/beta.links/knows/": "unreadable"}
    assert "chmod u+rwx vault" in got["check"]["vault/"][1]
    doc = got["doctor"]
    assert doc["fresh"] and not doc["ok"] and doc["missing"] == []   # not "out of date: run reindex"
    assert sorted(p.split(": ", 1)[0] for p in doc["problems"]) == ["notes/locked.md", "vault/"]
    assert all(str(planted) not in p for p in doc["problems"])
    assert got["ls"] == ["actors/carol", "notes/alpha", "notes/beta", "notes/locked"]
    cli = _DROP + [sys.executable, "-m", "hutch", "mem", "--store", str(planted)]
    r = subprocess.run(cli + ["search", "walrus"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "notes/alpha" in r.stdout
    assert "locked" not in r.stdout and "vault" not in r.stdout
    for cmd, rc in (("check", 3), ("doctor", 3), ("ls", 0)):
        r = subprocess.run(cli + [cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == rc and "Traceback" not in r.stderr, (cmd, r.returncode, r.stderr)
