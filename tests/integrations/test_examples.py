"""Every example under examples/integrations runs out of the box (its fake model, no key, no network),
against this suite's private daemon and the default image, and leaves no sandbox running."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest


from integ_support import running

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "integrations"
KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")

EXPECT = {
    "langchain_agent.py": ["The sum of 0..100 is 5050", "langchain:c2",
                           "Ada prefers short answers"],
    "llamaindex_agent.py": ["The y column sums to 6", "retrieved decisions/pricing"],
    "anthropic_tools.py": ["m2: 'File created successfully at: /memories/user/preferences.md'",
                           "memory user/preferences: source anthropic:m2"],
    "openai_agent.py": ["2**64 is 18446744073709551616", "source: openai:c2", "Wrote and ran fizz.py"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_with_its_fake_model(name, daemon, no_leaks, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env["TMPDIR"] = str(tmp_path)   # what the example leaves in its temporary directory shows there
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for want in EXPECT.get(name, []):
        assert want in r.stdout, (want, r.stdout[-3000:])
    assert not running()
    # nothing of hutch's is left in it (a third-party package of the langchain and llamaindex examples leaves a
    # session file, .ses, which is not ours to remove)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hutch")] == []
