"""The README's two commands work on a host with only bash, python3 and git, and CI runs the same one.

The whole path (apt, pip, the image build, the suite) runs in a fresh Debian 12 root through
../shared/tools/fresh-machine.sh; this keeps the contract that makes that possible.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what scripts/setup.sh and the two scripts call once everything is installed; no make among them
_TOOLS = ("bash", "sh", "env", "dirname", "grep", "tr", "id", "touch", "rm", "mv", "gcc", "as", "ld", "dpkg-query", "dpkg", "cat", "sleep",
          "python3", "python3.11", "git")


def readme_commands() -> list[str]:
    """The commands of the README's first code block, comments stripped."""
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_names_two_executable_scripts_and_ci_runs_the_test_one():
    cmds = readme_commands()
    assert cmds == ["scripts/demo", "scripts/test"], cmds
    for c in cmds:
        assert os.access(ROOT / c, os.X_OK), f"{c} is not executable"
    ci = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ci[-1].split()[-1] == "scripts/test", ci


def test_the_test_command_runs_without_make(tmp_path):
    """scripts/test with a PATH that holds only the basic tools: it sets up, then hands its arguments
    to pytest (here: collect one module)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in _TOOLS:
        if (found := shutil.which(tool)):
            os.symlink(found, bindir / tool)
    assert not (bindir / "make").exists()
    test_cmd = ROOT / readme_commands()[1]
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    r = subprocess.run([str(bindir / "bash"), "-c", f'exec "{test_cmd}" --co tests/test_public_api.py'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_all_is_sorted_and_importable" in r.stdout, r.stdout
