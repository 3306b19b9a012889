"""What the benchmarks share: writing one benchmark's section of docs/benchmarks.md (not a benchmark)."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, bench: str, title: str, text: str) -> None:
    """Replace the section of `path` between bench/<bench>'s markers with `title` and `text` (other benchmarks
    keep theirs); append it if there is none yet."""
    begin, end = f"<!-- bench/{bench}: begin -->", f"<!-- bench/{bench}: end -->"
    section = f"{begin}\n## {title} (bench/{bench})\n\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + section + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)
