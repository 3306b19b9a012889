"""The README's Python examples, found by the heading of their section, to run as written."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def examples(heading: str) -> list[str]:
    """The ```python blocks of the README section that starts with the line `heading`, up to the next heading
    (a line starting with '#' outside a code block)."""
    lines = README.read_text().splitlines(keepends=True)
    start = lines.index(heading + "\n") + 1
    out, block, fence = [], None, False
    for line in lines[start:]:
        if line.startswith("```"):
            fence = not fence
            if fence and line.strip() == "```python":
                block = []
            elif not fence and block is not None:
                out.append("".join(block))
                block = None
            continue
        if not fence and line.startswith("#"):
            break
        if block is not None:
            block.append(line)
    return out


def workdir(tmp: Path) -> Path:
    """A directory to run them in, as from the repository's root: the files they name are there."""
    for name in ("examples", "README.md"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp
