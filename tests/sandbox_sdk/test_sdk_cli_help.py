"""Every CLI command and group has help with an example."""

import click
from click.testing import CliRunner

from hutch.cli import cli


def _walk(cmd, path):
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _walk(cmd.get_command(ctx, name), path + [name])


def test_every_command_has_help_with_an_example():
    runner = CliRunner()
    seen = []
    for path, cmd in _walk(cli, []):
        seen.append(" ".join(path))
        assert (cmd.help or "").strip(), f"`hutch {' '.join(path)}` has no help"
        r = runner.invoke(cli, path + ["--help"])
        assert r.exit_code == 0, r.output
        assert "Example" in r.output and "hutch " in r.output, f"`hutch {' '.join(path)} --help` shows no example"
    for needed in ("run", "serve", "sandbox", "sandbox create", "sandbox exec", "sandbox ls", "sandbox kill"):
        assert needed in seen


def test_run_rejects_bad_options_before_creating_anything(tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["run", "--env", "NOEQUALS", "--", "true"])
    assert r.exit_code == 2 and "K=V" in r.output
    r = runner.invoke(cli, ["run", "--mount", f"{tmp_path}/missing:/data", "--", "true"])
    assert r.exit_code == 1 and "does not exist" in r.output
    r = runner.invoke(cli, ["serve", "--listen", "127.0.0.1:7450"], env={"HUTCH_TOKEN": ""})
    assert r.exit_code == 2 and "--token" in r.output
