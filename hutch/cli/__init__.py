"""The `hutch` command line. Each command is a thin wrapper over a library call.

Subcommands live in their own modules and are registered in `_COMMANDS`
below (module path, attribute): add one line to add a command group.
Library errors (`hutch.Error`) become a one-line message on stderr and exit
code 1; usage errors exit 2 (click's convention).
"""

from __future__ import annotations

import importlib
import sys

import click

from hutch._core.errors import Error

# (module, attribute) of each top-level command or group, in help order.
_COMMANDS: list[tuple[str, str]] = [
    ("hutch.cli._sandbox", "run"),
    ("hutch.cli._repl", "repl"),
    ("hutch.cli._sandbox", "sandbox"),
    ("hutch.cli._sandbox", "serve"),
    ("hutch.cli._tenant", "tenant"),
    ("hutch.cli._sandbox", "tls_fingerprint"),
    ("hutch.cli._sandbox", "validate"),
    ("hutch.cli._doctor", "doctor"),
    ("hutch.cli._image", "image"),
    ("hutch.cli._snapshot", "snapshot"),
    ("hutch.cli._volume", "volume"),
    ("hutch.cli._mem", "mem"),
    ("hutch.cli._mcp", "mcp"),
    ("hutch.cli._fleet", "fleet"),
]


class _LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used."""

    def list_commands(self, ctx):
        return [self._load(m, a).name for m, a in _COMMANDS]

    def get_command(self, ctx, name):
        for m, a in _COMMANDS:
            cmd = self._load(m, a)
            if cmd.name == name:
                return cmd
        return None

    @staticmethod
    def _load(module: str, attr: str) -> click.Command:
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Error as e:
            click.echo(f"hutch: error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hutch")
def cli() -> None:
    """hutch: sandboxes for untrusted code and memory as plain files.

    \b
    Examples:
      hutch run -- python3 -c 'print(1)'
      hutch mem init ./agent-memory
      hutch mem search "customer churn" -k 5
    """


def main() -> None:
    cli(prog_name="hutch")
