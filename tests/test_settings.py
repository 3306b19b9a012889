"""One settings table (hutch/_core/settings.py): no other module reads the environment, every HUTCH_* name the
code and docs use is in it, docs/settings.md is it, and a bad value is an error naming the variable and the fix."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hutch._core import settings
from hutch._core.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_structure_imports import STDLIB_ONLY, path_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HUTCH = ROOT / "hutch"
SETTINGS = HUTCH / "_core" / "settings.py"
#: Code that never sees hutch's settings: the zygote's and inits' modules (python -I -S, an empty environment
#: by design) and what runs inside a sandbox (sent as source, the sandbox's own environment).
EXEMPT = {path_of(m) for m in STDLIB_ONLY} | set((HUTCH / "sandbox" / "_inside").rglob("*.py"))
NAME = re.compile(r"\bHUTCH_[A-Z0-9_]+\b")


def environment_reads(path: Path) -> list[str]:
    """Where the file reads the process's environment: os.environ / os.getenv / os.putenv / os.unsetenv,
    `from os import environ`; except the environment passed on whole to a child: `dict(os.environ, ...)`,
    `{**os.environ, ...}`."""
    tree = ast.parse(path.read_text(), str(path))
    passed_on = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
                and node.args and _is_environ(node.args[0])):
            passed_on.add(id(node.args[0]))
        if isinstance(node, ast.Dict):
            passed_on.update(id(v) for k, v in zip(node.keys, node.values) if k is None and _is_environ(v))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                node.attr in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv") and \
                id(node) not in passed_on:
            out.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [f"line {node.lineno}: from os import {a.name}" for a in node.names
                    if a.name in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")]
    return sorted(out, key=lambda s: int(s.split()[1].rstrip(":")))


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


@pytest.mark.parametrize("path", sorted(p for p in HUTCH.rglob("*.py") if p != SETTINGS and p not in EXEMPT),
                         ids=lambda p: str(p.relative_to(HUTCH)))
def test_no_module_but_the_settings_table_reads_the_environment(path):
    bad = environment_reads(path)
    assert bad == [], (f"{path.relative_to(ROOT)} reads the environment ({bad}): add the variable to "
                       "hutch/_core/settings.py and read it with SETTING.get() (caller-named variables: "
                       "settings.caller_environ())")


def test_the_check_sees_what_it_forbids(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
                 "c = dict(os.environ, Z='1')\nd = {**os.environ, 'Z': '1'}\ne = dict(os.environ)\n"
                 "os.environ['W'] = '1'\nf = dict(x=os.environ['V'])\n")
    assert environment_reads(f) == ["line 2: from os import getenv", "line 3: os.environ", "line 4: os.getenv",
                                    "line 8: os.environ", "line 9: os.environ"]
    assert all(p.exists() for p in EXEMPT) and path_of("hutch.sandbox._host.native.zygote") in EXEMPT


def test_the_exempt_modules_read_no_hutch_setting():
    """The zygote, the inits and the inside of a sandbox may touch os.environ (their own), never a HUTCH_* name."""
    for p in sorted(EXEMPT):
        assert not _string_names(p), f"{p.relative_to(ROOT)} names a HUTCH_* variable"


def _string_names(path: Path) -> set[str]:
    """The HUTCH_* names in a file's string literals (a Python name like idmap.SANDBOX_HOST_IDS is not one)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.update(NAME.findall(node.value))
    return out


def test_every_hutch_variable_the_code_names_is_in_the_table():
    unknown = {}
    for p in sorted(HUTCH.rglob("*.py")):
        for name in _string_names(p) - set(settings.SETTINGS):
            unknown.setdefault(name, []).append(str(p.relative_to(ROOT)))
    assert unknown == {}, f"HUTCH_* names the code uses that hutch/_core/settings.py does not list: {unknown}"


def setup_names() -> set[str]:
    """The HUTCH_* names scripts/setup.sh reads (`${NAME:-default}`): setup's own, not hutch's."""
    return set(re.findall(r"\$\{(HUTCH_[A-Z0-9_]+)", (ROOT / "scripts" / "setup.sh").read_text()))


def test_every_hutch_variable_the_docs_name_is_in_the_table():
    """Every HUTCH_* name in README.md and docs/ is one hutch reads, or one setup.sh reads (its own)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unknown = {}
    for p in docs:
        for name in set(NAME.findall(p.read_text())) - set(settings.SETTINGS) - setup_names():
            unknown.setdefault(name, []).append(p.name)
    assert unknown == {}, f"the docs name variables hutch does not read: {unknown}"


def test_docs_settings_md_is_the_table():
    doc = ROOT / "docs" / "settings.md"
    assert doc.read_text() == settings.markdown(), (
        "docs/settings.md is stale: python -m hutch._core.settings --markdown > docs/settings.md")
    out = subprocess.run([sys.executable, "-m", "hutch._core.settings", "--markdown"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out == doc.read_text()
    for s in settings.SETTINGS.values():
        assert s.meaning and s.kind and f"`{s.name}`" in out


def test_each_setting_parses_its_own_default_text():
    """The table's default is a value the variable could hold (when it is a plain value, not a description)."""
    for s in settings.SETTINGS.values():
        if s.shown_default is None and s.default is not None:
            assert s.parse_text(s.default_text) == s.default, s.name


def test_a_setting_is_read_when_it_is_used(monkeypatch, tmp_path):
    from hutch._core import paths

    monkeypatch.setenv("HUTCH_RUN_DIR", str(tmp_path / "a"))
    monkeypatch.delenv("HUTCH_SOCKET", raising=False)
    assert paths.daemon_socket() == tmp_path / "a" / "hutch.sock"
    monkeypatch.setenv("HUTCH_RUN_DIR", str(tmp_path / "b"))
    assert paths.daemon_socket() == tmp_path / "b" / "hutch.sock"
    monkeypatch.setenv("HUTCH_RUN_DIR", "")   # empty is unset
    assert paths.run_dir() == settings.RUN_DIR.default == Path("/run/hutch")


@pytest.mark.parametrize("name,value,says", [
    ("HUTCH_WARM_POOL", "many", "must be a whole number, 0 or more"),
    ("HUTCH_WARM_POOL", "-1", "must be a whole number, 0 or more"),
    ("HUTCH_USERNS", "maybe", "must be 1 or 0"),
    ("HUTCH_LAYERS", "ssd", "must be one of disk, tmpfs"),
    ("HUTCH_IMPORT_MAX_BYTES", "0", "must be a positive whole number"),
    ("HUTCH_FUZZ_SECONDS", "soon", "must be a number of seconds"),
    ("HUTCH_DEBIAN_MIRROR", "deb.debian.org", "must be a URL"),
    ("HUTCH_PIP_HOSTS", " , ", "must be a comma-separated list"),
])
def test_a_bad_value_names_the_variable_and_the_fix(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        settings.SETTINGS[name].get()
    msg = str(e.value)
    assert msg.startswith(f"${name}={value!r} {says}") and "unset it for the default" in msg, msg


def test_the_flags_and_lists_read_as_documented(monkeypatch):
    for text, value in (("0", False), ("1", True), ("off", False), ("YES", True)):
        monkeypatch.setenv("HUTCH_USERNS", text)
        assert settings.USERNS.get() is value
    monkeypatch.setenv("HUTCH_PIP_HOSTS", " pypi.example , files.example,")
    assert settings.PIP_HOSTS.get() == ("pypi.example", "files.example")
    monkeypatch.delenv("HUTCH_PIP_HOSTS")
    assert settings.PIP_HOSTS.get() == ("pypi.org", "files.pythonhosted.org")


def test_a_secret_is_never_printed(monkeypatch):
    bad = settings.Setting("HUTCH_TEST_SECRET", "secret", settings._positive_int, None, "x", "dev", secret=True)
    monkeypatch.setenv("HUTCH_TEST_SECRET", "hunter2-hunter2")
    with pytest.raises(ConfigError) as e:
        bad.get()
    assert "hunter2" not in str(e.value) and "HUTCH_TEST_SECRET" in str(e.value)


def test_pop_takes_the_variable_out_of_the_environment(monkeypatch):
    import os

    monkeypatch.setenv("HUTCH_MCP_TOKEN", "t" * 32)
    assert settings.MCP_TOKEN.pop() == "t" * 32
    assert "HUTCH_MCP_TOKEN" not in os.environ and settings.MCP_TOKEN.pop() is None


def test_the_daemon_refuses_a_bad_setting_at_start_naming_it(tmp_path):
    """A real `hutch serve` with a bad value: it stops at once with the variable's name and fix, not a traceback."""
    env = {"PATH": "/usr/bin:/bin", "HUTCH_RUN_DIR": str(tmp_path / "run"), "HUTCH_STATE_DIR": str(tmp_path / "st"),
           "HUTCH_WARM_POOL": "lots"}
    r = subprocess.run([sys.executable, "-m", "hutch", "serve"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode != 0
    assert "$HUTCH_WARM_POOL='lots' must be a whole number" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists(), "the daemon made its run directory before it read its settings"


def test_check_names_the_first_bad_setting(monkeypatch):
    monkeypatch.setenv("HUTCH_LAYERS", "ssd")
    r = subprocess.run([sys.executable, "-m", "hutch._core.settings", "--check"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith("$HUTCH_LAYERS='ssd' must be one of disk, tmpfs"), r.stderr
    monkeypatch.delenv("HUTCH_LAYERS")
    settings.check()
