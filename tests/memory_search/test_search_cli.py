"""`hutch mem search | reindex | doctor` through click's runner, on a real store."""

import json

from click.testing import CliRunner

from hutch.cli import cli
from hutch.cli._mem_search import EXIT_INDEX_STALE, doctor, reindex, search
from _search_helpers import CONVERSATION


def run(store, *args):
    return CliRunner().invoke(cli, ["mem", "--store", str(store), *args], catch_exceptions=False)


def test_search_explain_json_reindex_doctor(mem, store_dir):
    mem.ingest_conversation(CONVERSATION, conv_id="c1")
    r = run(store_dir, "reindex")
    assert r.exit_code == 0 and "state: ok" in r.output and "pending: 0" in r.output
    r = run(store_dir, "search", "sailing boat", "-k", "2", "--class", "interactions", "--explain")
    assert r.exit_code == 0
    first = r.output.splitlines()[0]
    assert "interactions/c1-session-" in first and "#D" in first
    assert "bm25 #" in r.output and "dense #" in r.output
    assert "Tomas: " in r.output  # the turn's text names who said it
    r = run(store_dir, "search", "sailing boat", "--json", "-k", "1")
    hit = json.loads(r.output)[0]
    assert hit["anchor"].startswith("D") and "bm25" in hit["channels"] and hit["speaker"] == "Tomas"
    (store_dir / "notes").mkdir()
    (store_dir / "notes" / "x.md").write_text("---\ntitle: X\n---\nnew\n")
    r = run(store_dir, "doctor")
    assert r.exit_code == EXIT_INDEX_STALE and "missing: 1: notes/x" in r.output
    r = run(store_dir, "doctor", "--json")
    assert json.loads(r.output)["missing"] == ["notes/x"]
    assert run(store_dir, "reindex").exit_code == 0
    assert run(store_dir, "doctor").exit_code == 0


def test_every_command_has_help_and_an_example():
    for cmd in (search, reindex, doctor):
        assert cmd.help and "Example" in cmd.help
        r = CliRunner().invoke(cli, ["mem", cmd.name, "--help"])
        assert r.exit_code == 0 and "Example" in r.output


def test_missing_store_is_a_clear_error(store_dir):
    r = CliRunner().invoke(cli, ["mem", "--store", str(store_dir / "nope"), "search", "x"])
    assert r.exit_code == 1 and "hutch mem init" in r.output


def test_search_now_reads_relative_time_words(mem, store_dir):
    mem.put("decisions", "Pricing page copy", body="We decided on the pricing page copy.", valid_from="2026-11-18")
    mem.put("decisions", "Pricing tiers", body="We decided on three pricing tiers.", valid_from="2026-10-02")
    r = run(store_dir, "search", "pricing decided two days ago", "--now", "2026-11-20", "--json")
    hits = json.loads(r.output)
    assert r.exit_code == 0
    assert [h["id"] for h in hits if "time" in h["channels"]] == ["decisions/pricing-page-copy"]
    r = run(store_dir, "search", "pricing decided two days ago", "--now", "2026-10-04", "--json")
    assert [h["id"] for h in json.loads(r.output) if "time" in h["channels"]] == ["decisions/pricing-tiers"]
