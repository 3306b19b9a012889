"""Each adapter without its library: one ImportError line naming the extra; and the adapters use hutch's
public API only (no private module of the sandbox or memory wing)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import hutch

ADAPTERS = {  # module -> (extra, a module of its library to hide)
    "langchain": ("langchain", "langchain_core"),
    "langgraph": ("langchain", "langgraph"),
    "llamaindex": ("llamaindex", "llama_index"),
    "anthropic": ("anthropic", "anthropic"),
    "openai": ("openai", "openai"),
    "smolagents": ("smolagents", "smolagents"),
}

HIDE_AND_IMPORT = r"""
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1] or name.startswith(sys.argv[1] + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
import importlib
importlib.import_module("hutch.integrations." + sys.argv[2])
"""


@pytest.mark.parametrize("module", sorted(ADAPTERS))
def test_an_adapter_without_its_library_names_the_extra(module):
    extra, hidden = ADAPTERS[module]
    r = subprocess.run([sys.executable, "-c", HIDE_AND_IMPORT, hidden, module], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: hutch.integrations.") and f"pip install 'hutch[{extra}]'" in last, r.stderr
    assert hidden.split(".")[0] in last


def test_adapters_use_only_the_public_api():
    root = pathlib.Path(hutch.__file__).parent / "integrations"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for n in names:
                if n.startswith("hutch."):
                    assert n.startswith("hutch.integrations"), f"{path.name} imports {n}: use `import hutch` only"


def test_the_extras_are_declared():
    import tomllib

    extras = tomllib.loads((pathlib.Path(hutch.__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for extra in {e for e, _ in ADAPTERS.values()}:
        assert extras[extra], extra
        assert f"hutch[{extra}" in "".join(extras["integrations"]) or extra in extras["integrations"][0]
    assert not any("torch" in d for deps in extras.values() for d in deps)


PUBLIC = {
    "langchain": ["HutchToolkit"], "langgraph": ["HutchStore"], "llamaindex": ["HutchToolSpec", "HutchRetriever"],
    "anthropic": ["HutchMemoryTool", "HutchBashTool", "HutchTextEditorTool", "handle", "tools", "tool_params"],
    "openai": ["HutchTools", "handle"], "openai_sandbox": ["HutchSandboxClient", "HutchSandboxClientOptions"],
    "smolagents": ["HutchExecutor"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_documented(module):
    import importlib

    m = importlib.import_module(f"hutch.integrations.{module}")
    docs = (pathlib.Path(hutch.__file__).parent.parent / "docs" / "integrations.md").read_text()
    assert m.__doc__ and f"hutch.integrations.{module}" in docs
    for name in PUBLIC[module]:
        obj = getattr(m, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"{module}.{name} has no docstring"
        assert name in docs, f"{module}.{name} is not in docs/integrations.md"
