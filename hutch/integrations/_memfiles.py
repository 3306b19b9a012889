"""The memory tool's files (`/memories/...`) kept in an SMF store; framework-free (used by the Anthropic adapter).

The tool's commands (view, create, str_replace, insert, delete, rename) and their answers follow Anthropic's
reference implementation of the memory tool; what is under /memories is the store:

    /memories                    the store (view lists it two levels deep)
    /memories/<class>/           an entity class: 1-64 characters of a-z, 0-9, '_' and '-'
    /memories/<class>/<name>.md  the entity <class>/<name>; any other name (todo.txt, a.json) is the entity
                                 of that slug, whose file is <name>.md in the store

A file's content is the entity's Markdown body; the front matter (title, created, updated, source) is the
store's and is kept for it. Every command that changes something is one commit whose source is the tool
call's (`source=`); delete is `forget` with its reason; rename moves the entity and its links, in and out.
Files sit one directory deep (the store's layout): /memories/notes.md is refused with the path to use.
"""

from __future__ import annotations

import os
import re
from typing import Any

import hutch
from hutch.integrations._common import MAX_ENTRIES, MAX_TEXT, number_arg, text_arg

ROOT = "/memories"
_CLASS = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\Z")
_FACT_BULLETS = re.compile(r"(?m)^##[ \t]+Facts[ \t]*\r?\n(?:[ \t]*\r?\n)*[ \t]*[-*] ")
NUMBER_WIDTH = 6
#: Characters a view shows at most (a model's context is not a place for megabytes): past it, view a range.
MAX_VIEW = 200_000


def numbered(lines: list[str], start: int = 1) -> str:
    return "\n".join(f"{str(i).rjust(NUMBER_WIDTH)}\t{line}" for i, line in enumerate(lines, start))


def capped_view(lines: list[str], start: int) -> str:
    """Numbered lines, cut at MAX_VIEW characters with a note naming the range to view next."""
    out, size = [], 0
    for i, line in enumerate(lines, start):
        row = f"{str(i).rjust(NUMBER_WIDTH)}\t{line}"
        if size + len(row) > MAX_VIEW:
            out.append(f"[cut at {MAX_VIEW:,} characters: view_range [{i}, -1] shows the rest]")
            break
        out.append(row)
        size += len(row) + 1
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{int(v)}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def view_range(value: Any, n_lines: int) -> tuple[int, int]:
    """[start, end] (1-based, end -1 = the last line) -> a slice of the lines."""
    if value is None:
        return 0, n_lines
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise hutch.ConfigError("'view_range' must be two line numbers, [start, end] (end -1: to the last line).")
    a = number_arg("view_range[0]", value[0], lo=1, hi=max(1, n_lines), default=1, integer=True)
    b = number_arg("view_range[1]", value[1], lo=-1, hi=max(1, n_lines), default=-1, integer=True)
    if b != -1 and b < a:
        raise hutch.ConfigError(f"'view_range' [{a}, {b}] ends before it starts.")
    return a - 1, n_lines if b == -1 else b


def insert_lines(text: str, at: Any, new: str) -> str:
    """`text` with `new` inserted after line `at` (0: at the top), as the reference tool does."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    n = number_arg("insert_line", at, lo=0, hi=len(lines), default=None, integer=True)
    if n is None:
        raise hutch.ConfigError(f"'insert_line' is required: a line number from 0 to {len(lines)}.")
    lines.insert(n, new.rstrip("\n"))
    return "\n".join(lines) + "\n"


def replace_once(text: str, old: str, new: str, path: str) -> tuple[str, int]:
    """`text` with its one occurrence of `old` replaced; the line (0-based) where the change starts."""
    count = text.count(old) if old else 0
    if count == 0:
        raise hutch.ConfigError(f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}.")
    if count > 1:
        lines, start = [], 0
        while (pos := text.find(old, start)) != -1:
            lines.append(text[:pos].count("\n") + 1)
            start = pos + 1
        raise hutch.ConfigError(f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines: "
                                f"{', '.join(map(str, lines))}. Please ensure it is unique")
    pos = text.find(old)
    return text.replace(old, new, 1), text[:pos].count("\n")


def snippet(text: str, line: int) -> str:
    lines = text.split("\n")
    lo, hi = max(0, line - 2), min(len(lines), line + 3)
    return numbered(lines[lo:hi], lo + 1)


class MemoryFiles:
    """The /memories tree of one hutch.Memory. `run(input, source=)` answers one tool call with text, or
    raises a hutch error (a ConfigError for bad input) whose message the model reads."""

    def __init__(self, memory) -> None:
        self.mem = memory

    # ------------------------------------------------------------ paths

    def parse(self, path: Any, name: str = "path") -> tuple[str | None, str | None]:
        """(class, slug): (None, None) is /memories, (class, None) a directory."""
        p = text_arg(name, path)
        if p != ROOT and not p.startswith(ROOT + "/"):
            raise hutch.ConfigError(f"Path must start with {ROOT}, got: {p}")
        parts = [x for x in p[len(ROOT):].split("/") if x]
        if any(x in (".", "..") or x.startswith(".") for x in parts):
            raise hutch.StorePathError(f"Path {p} would escape {ROOT} or reach hidden files: use names such as "
                                       f"{ROOT}/notes/todo.md.")
        if not parts:
            return None, None
        if len(parts) > 2:
            raise hutch.ConfigError(f"{p} is too deep: memory files sit one directory deep, "
                                    f"{ROOT}/<topic>/<name>.md (e.g. {ROOT}/{parts[0]}/{parts[-1]}).")
        if len(parts) == 1 and "." in parts[0]:
            raise hutch.ConfigError(f"Memory files go in a directory: {ROOT}/notes/{parts[0]} "
                                    f"(a topic of your choice instead of 'notes'), not {p}.")
        if not _CLASS.match(parts[0]):
            raise hutch.StorePathError(f"{parts[0]!r} is not a valid directory name here: use 1-64 characters of "
                                       "a-z, 0-9, '_' or '-', e.g. 'project-notes'.")
        if len(parts) == 1:
            return parts[0], None
        leaf = parts[1]
        stem = leaf[:-3] if leaf.endswith(".md") else None
        if stem is not None and "." in stem:
            raise hutch.StorePathError(f"{leaf!r}: name a memory file like 'notes.md' or 'notes.txt', not "
                                       f"'<name>.<ext>.md'.")
        if stem == "":
            raise hutch.StorePathError(f"{leaf!r} is not a file name.")
        return parts[0], stem if stem is not None else leaf

    @staticmethod
    def display(cls: str, slug: str | None = None) -> str:
        if slug is None:
            return f"{ROOT}/{cls}"
        return f"{ROOT}/{cls}/{slug if '.' in slug else slug + '.md'}"

    def _text(self, eid: str) -> str:
        body = self.mem.get(eid).body
        return body[1:] if body.startswith("\n") else body   # the blank line after the front matter

    def _exists(self, cls: str, slug: str | None) -> bool:
        if slug is None:
            return cls in self.mem.classes()
        return self.mem.exists(f"{cls}/{slug}")

    def _file(self, path: Any) -> tuple[str, str, str]:
        cls, slug = self.parse(path)
        shown = text_arg("path", path)
        if cls is None or slug is None:
            raise hutch.ConfigError(f"The path {shown} is a directory, not a file.")
        if not self._exists(cls, slug):
            raise hutch.EntityNotFoundError(f"The path {shown} does not exist. Please provide a valid path.")
        return cls, slug, shown

    def _write(self, eid: str, text: str, source: str) -> None:
        body = "\n" + text
        # facts=[] unless the text lists facts: the store would otherwise put back facts the edit removed
        self.mem.update(eid, body=body, facts=None if _FACT_BULLETS.search(body) else [], source=source)

    # ------------------------------------------------------------ commands

    def run(self, input: Any, *, source: str) -> str:
        if not isinstance(input, dict):
            raise hutch.ConfigError("The memory tool's input is an object with a 'command'.")
        cmd = input.get("command")
        fn = {"view": self.view, "create": self.create, "str_replace": self.str_replace, "insert": self.insert,
              "delete": self.delete, "rename": self.rename}.get(cmd)
        if fn is None:
            raise hutch.ConfigError(f"Unknown memory command {cmd!r}: use view, create, str_replace, insert, "
                                    "delete or rename.")
        return fn(input) if cmd == "view" else fn(input, source)

    def view(self, a: dict) -> str:
        cls, slug = self.parse(a.get("path"))
        shown = a["path"]
        if slug is None:
            if cls is not None and not self._exists(cls, None):
                raise hutch.EntityNotFoundError(f"The path {shown} does not exist. Please provide a valid path.")
            rows, total = [], 0
            for c in [cls] if cls else self.mem.classes():
                ids = self.mem.ls(c)
                rows.append((None, c))
                rows.extend((i, c) for i in ids)
            lines = [f"{_size(0)}\t{shown}"]
            for eid, c in rows[:MAX_ENTRIES]:
                if eid is None:
                    if cls is None:
                        lines.append(f"-\t{self.display(c)}/")
                    continue
                size = len(self._text(eid).encode())
                total += size
                lines.append(f"{_size(size)}\t{self.display(c, eid.split('/', 1)[1])}")
            lines[0] = f"{_size(total)}\t{shown}"
            if len(rows) > MAX_ENTRIES:
                lines.append(f"... and {len(rows) - MAX_ENTRIES:,} more entries not shown")
            return (f"Here're the files and directories up to 2 levels deep in {shown}, excluding hidden items:\n"
                    + "\n".join(lines))
        cls, slug, shown = self._file(shown)
        lines = self._text(f"{cls}/{slug}").split("\n")
        lo, hi = view_range(a.get("view_range"), len(lines))
        return f"Here's the content of {shown} with line numbers:\n" + capped_view(lines[lo:hi], lo + 1)

    def create(self, a: dict, source: str) -> str:
        cls, slug = self.parse(a.get("path"))
        shown = a["path"]
        text = text_arg("file_text", a.get("file_text"), limit=MAX_TEXT)
        if slug is None:
            raise hutch.ConfigError(f"{shown} is a directory path: give a file, e.g. {shown.rstrip('/')}/notes.md.")
        if self._exists(cls, slug):
            raise hutch.EntityExistsError(f"File {shown} already exists")
        title = " ".join(slug.rsplit(".", 1)[0].replace("_", " ").replace("-", " ").split()) or slug
        self.mem.put(cls, title, body="\n" + text, slug=slug, source=source)
        return f"File created successfully at: {shown}"

    def str_replace(self, a: dict, source: str) -> str:
        cls, slug, shown = self._file(a.get("path"))
        old = text_arg("old_str", a.get("old_str"), limit=MAX_TEXT)
        new = text_arg("new_str", a.get("new_str") if a.get("new_str") is not None else "", limit=MAX_TEXT)
        text, line = replace_once(self._text(f"{cls}/{slug}"), old, new, shown)
        self._check_size(text)
        self._write(f"{cls}/{slug}", text, source)
        return ("The memory file has been edited. Here is the snippet showing the change (with line numbers):\n"
                + snippet(text, line))

    def insert(self, a: dict, source: str) -> str:
        cls, slug, shown = self._file(a.get("path"))
        new = text_arg("insert_text", a.get("insert_text"), limit=MAX_TEXT)
        text = insert_lines(self._text(f"{cls}/{slug}"), a.get("insert_line"), new)
        self._check_size(text)
        self._write(f"{cls}/{slug}", text, source)
        return f"The file {shown} has been edited."

    def delete(self, a: dict, source: str) -> str:
        cls, slug = self.parse(a.get("path"))
        shown = a["path"]
        if cls is None:
            raise hutch.ConfigError(f"Cannot delete the {ROOT} directory itself")
        if not self._exists(cls, slug):
            raise hutch.EntityNotFoundError(f"The path {shown} does not exist")
        reason = "deleted with the memory tool"
        if slug is not None:
            self.mem.forget(f"{cls}/{slug}", reason=reason, source=source)
        else:
            with self.mem.transaction(f"memory tool: delete {shown}", source=source, reason=reason):
                for eid in self.mem.ls(cls):
                    self.mem.forget(eid, reason=reason, source=source)
            self._drop_dir(cls)
        return f"Successfully deleted {shown}"

    def rename(self, a: dict, source: str) -> str:
        ocls, oslug = self.parse(a.get("old_path"), "old_path")
        ncls, nslug = self.parse(a.get("new_path"), "new_path")
        op, np_ = a["old_path"], a["new_path"]
        if ocls is None or ncls is None:
            raise hutch.ConfigError(f"Cannot rename the {ROOT} directory itself")
        if (oslug is None) != (nslug is None):
            raise hutch.ConfigError("Rename a file to a file path, or a directory to a directory path.")
        if not self._exists(ocls, oslug):
            raise hutch.EntityNotFoundError(f"The path {op} does not exist")
        if self._exists(ncls, nslug):
            raise hutch.EntityExistsError(f"The destination {np_} already exists")
        moves = ({f"{ocls}/{oslug}": f"{ncls}/{nslug}"} if oslug is not None
                 else {e: f"{ncls}/{e.split('/', 1)[1]}" for e in self.mem.ls(ocls)})
        self._move(moves, source, f"memory tool: rename {op} to {np_}")
        if oslug is None:
            self._drop_dir(ocls)
        return f"Successfully renamed {op} to {np_}"

    def _move(self, moves: dict[str, str], source: str, message: str) -> None:
        """Give entities new ids in one commit: same text and front matter, every link in and out kept."""
        links = [(s, r, d) for s, r, d, _ in self.mem.iter_links() if s in moves or d in moves]
        with self.mem.transaction(message, source=source):
            for old, new in moves.items():
                e = self.mem.get(old)
                cls, slug = new.split("/", 1)
                meta = {k: v for k, v in e.meta.items() if k not in ("id", "class", "title", "updated")}
                self.mem.put(cls, e.title, body=e.body, slug=slug, meta=meta, source=source)
            for old in moves:
                self.mem.forget(old, reason=f"renamed to {moves[old]}", source=source)
            for s, r, d in links:
                self.mem.link(moves.get(s, s), r, moves.get(d, d), source=source)

    def _drop_dir(self, cls: str) -> None:
        """Remove a class directory left empty (git keeps no directories: history does not change)."""
        try:
            os.rmdir(self.mem.root / cls)
        except OSError:
            pass   # not empty (a stray file): check() names it

    @staticmethod
    def _check_size(text: str) -> None:
        if len(text) > MAX_TEXT:
            raise hutch.ConfigError(f"The edit would make the file {len(text):,} characters; a memory file holds "
                                    f"at most {MAX_TEXT:,}: split it into several files.")
