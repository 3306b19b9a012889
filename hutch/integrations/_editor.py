"""A text editor over a sandbox's files (Anthropic's str_replace_based_edit_tool); framework-free.

Commands: view (a file with line numbers, or a directory two levels deep), create (make or replace a file),
str_replace (replace text that occurs exactly once), insert (after a line). Paths are absolute paths inside
the sandbox; a file is read only if it is a regular file of at most MAX_FILE bytes and valid UTF-8.
"""

from __future__ import annotations

import posixpath
from typing import Any

import hutch
from hutch.integrations._common import MAX_ENTRIES, MAX_FILE, Toolbox, text_arg
from hutch.integrations._memfiles import capped_view, insert_lines, replace_once, snippet, view_range


class Editor:
    """`run(input)` -> text for one call of the text editor tool over `toolbox`'s sandbox."""

    def __init__(self, toolbox: Toolbox, *, max_characters: int | None = None) -> None:
        self.tb = toolbox
        self.max_characters = max_characters

    def run(self, input: Any) -> str:
        if not isinstance(input, dict):
            raise hutch.ConfigError("The editor's input is an object with a 'command' and a 'path'.")
        cmd = input.get("command")
        fn = {"view": self.view, "create": self.create, "str_replace": self.str_replace,
              "insert": self.insert}.get(cmd)
        if fn is None:
            raise hutch.ConfigError(f"Unknown command {cmd!r}: use view, create, str_replace or insert"
                                    + (" (undo_edit is not part of this editor)." if cmd == "undo_edit" else "."))
        return fn(input)

    def _path(self, a: dict) -> str:
        p = text_arg("path", a.get("path"))
        if not p.startswith("/") or "\x00" in p:
            raise hutch.ConfigError(f"The path {p} is not an absolute path: give one such as /home/user/app.py.")
        return posixpath.normpath(p)

    def _read(self, p: str) -> str:
        self.tb.stat_file(p)
        data = self.tb.sandbox.files.read(p)[:MAX_FILE]
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise hutch.ConfigError(f"{p} is not UTF-8 text: this editor edits text files only.") from None

    def view(self, a: dict) -> str:
        p = self._path(a)
        if self.tb.sandbox.files.stat(p).type == "dir":
            lines, stack = [], [(p, 0)]
            while stack and len(lines) < MAX_ENTRIES:
                d, depth = stack.pop()
                for e in sorted(self.tb.sandbox.files.list(d), key=lambda e: e.name, reverse=True):
                    if e.name.startswith("."):
                        continue
                    lines.append(e.path + ("/" if e.type == "dir" else ""))
                    if e.type == "dir" and depth < 1:
                        stack.append((e.path, depth + 1))
            return (f"Here are the files and directories up to 2 levels deep in {p}, excluding hidden items:\n"
                    + "\n".join([p, *sorted(lines)][:MAX_ENTRIES + 1]))
        lines = self._read(p).split("\n")
        lo, hi = view_range(a.get("view_range"), len(lines))
        out = capped_view(lines[lo:hi], lo + 1)
        if self.max_characters is not None and len(out) > self.max_characters:
            out = out[:self.max_characters] + f"\n[cut at {self.max_characters:,} characters: view a line range]"
        return out

    def create(self, a: dict) -> str:
        p = self._path(a)
        text = text_arg("file_text", a.get("file_text"), limit=MAX_FILE)
        self.tb.write_file(p, text)
        return f"File created successfully at: {p}"

    def str_replace(self, a: dict) -> str:
        p = self._path(a)
        old = text_arg("old_str", a.get("old_str"), limit=MAX_FILE)
        new = text_arg("new_str", a.get("new_str") if a.get("new_str") is not None else "", limit=MAX_FILE)
        text, line = replace_once(self._read(p), old, new, p)
        self.tb.write_file(p, text)
        return f"The file {p} has been edited. Here is the snippet showing the change (with line numbers):\n" \
               + snippet(text, line)

    def insert(self, a: dict) -> str:
        p = self._path(a)
        new = text_arg("insert_text", a.get("insert_text", a.get("new_str")), limit=MAX_FILE)
        self.tb.write_file(p, insert_lines(self._read(p), a.get("insert_line"), new))
        return f"The file {p} has been edited."
