"""`hutch mem ...` through click's runner: every command works, has help with an example, and exits predictably."""

import json

import pytest
from click.testing import CliRunner

from hutch.cli import cli
from hutch.cli._mem import EXIT_CHECK_FAILED, mem as mem_group

COMMANDS = ["init", "add", "show", "ls", "link", "unlink", "log", "diff", "check", "forget", "ingest"]


@pytest.fixture
def run(store_dir):
    runner = CliRunner()

    def go(*args, input=None):
        return runner.invoke(cli, ["mem", "-s", str(store_dir), *args], input=input, catch_exceptions=False)

    return go


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_with_an_example(name):
    cmd = mem_group.commands[name]
    assert cmd.help and "Example" in cmd.help, name
    r = CliRunner().invoke(cli, ["mem", name, "--help"])
    assert r.exit_code == 0 and "Example" in r.output


def test_cli_round_trip(run, store_dir):
    assert run("init", str(store_dir)).exit_code == 0
    r = run("add", "actors", "Alice Chen", "-b", "Head of data.", "-f", "prefers weekly reports",
            "--source", "chat:1")
    assert (r.exit_code, r.output) == (0, "actors/alice-chen\n")
    assert run("add", "orgs", "Acme").exit_code == 0
    r = run("link", "actors/alice-chen", "works_at", "orgs/acme")
    assert r.exit_code == 0 and r.output.strip().endswith("alice-chen.links/works_at/acme.md")
    r = run("show", "actors/alice-chen")
    assert "prefers weekly reports" in r.output and "-> works_at orgs/acme" in r.output
    assert "<- works_at actors/alice-chen" in run("show", "orgs/acme").output
    data = json.loads(run("show", "actors/alice-chen", "--json").output)
    assert data["facts"] == ["prefers weekly reports"] and data["links"] == {"works_at": ["orgs/acme"]}
    assert run("show", "actors/alice-chen", "--raw").output == (store_dir / "actors/alice-chen.md").read_text()
    assert run("ls").output.split() == ["actors/alice-chen", "orgs/acme"]
    assert json.loads(run("ls", "orgs", "--json").output) == ["orgs/acme"]
    log = json.loads(run("log", "actors/alice-chen", "--json").output)
    assert [row["op"] for row in log] == ["link", "put"] and log[1]["source"] == "chat:1"
    assert "link" in run("log").output
    assert "works_at" in run("diff", "actors/alice-chen").output
    r = run("check")
    assert r.exit_code == 0 and "0 errors" in r.output
    assert run("unlink", "actors/alice-chen", "works_at", "orgs/acme").exit_code == 0
    assert run("forget", "orgs/acme", "--reason", "test").exit_code == 0
    assert run("ls").output.split() == ["actors/alice-chen"]


def test_errors_exit_1_with_one_line_and_usage_errors_exit_2(run, store_dir):
    run("init", str(store_dir))
    r = CliRunner().invoke(cli, ["mem", "-s", str(store_dir), "show", "actors/nobody"])
    assert r.exit_code == 1 and r.output.startswith("hutch: error: There is no entity actors/nobody")
    r = CliRunner().invoke(cli, ["mem", "-s", str(store_dir), "forget", "actors/x"])
    assert r.exit_code == 2 and "--reason" in r.output
    r = CliRunner().invoke(cli, ["mem", "-s", str(store_dir / "nope"), "ls"])
    assert r.exit_code == 1 and "hutch mem init" in r.output


def test_check_exit_code_when_broken(run, store_dir):
    run("init", str(store_dir))
    (store_dir / "notes").mkdir()
    (store_dir / "notes" / "bad.md").write_text("no front matter\n")
    r = CliRunner().invoke(cli, ["mem", "-s", str(store_dir), "check", "--json"])
    assert r.exit_code == EXIT_CHECK_FAILED
    out = json.loads(r.output)
    assert out["ok"] is False and out["issues"][0]["path"] == "notes/bad.md"


def test_ingest_command(run, store_dir, tmp_path):
    run("init", str(store_dir))
    doc = tmp_path / "notes.md"
    doc.write_text("# Notes\n\n## One\n\nfirst\n\n## Two\n\nsecond\n")
    r = run("ingest", str(doc))
    assert r.exit_code == 0 and "3 documents" in r.output
    conv = tmp_path / "c-1.json"
    conv.write_text(json.dumps({"session_1_date_time": "1:00 pm on 1 May, 2023",
                                "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}]}))
    r = run("ingest", str(conv))
    assert r.exit_code == 0 and "1 interactions" in r.output
    assert "interactions/c-1-session-1" in run("ls").output


def test_init_without_path_uses_store_option_and_env(tmp_path, monkeypatch):
    # a store is created where --store / $HUTCH_MEMORY point, never in the current directory (which here is
    # a git repository of its own that must stay untouched)
    cwd = tmp_path / "project"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r = CliRunner().invoke(cli, ["mem", "--store", str(tmp_path / "a"), "init"], catch_exceptions=False)
    assert r.exit_code == 0 and (tmp_path / "a" / ".git").is_dir()
    monkeypatch.setenv("HUTCH_MEMORY", str(tmp_path / "b"))
    r = CliRunner().invoke(cli, ["mem", "init"], catch_exceptions=False)
    assert r.exit_code == 0 and (tmp_path / "b" / ".git").is_dir()
    assert not any(cwd.iterdir())
