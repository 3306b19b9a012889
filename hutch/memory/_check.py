"""`Memory.check()`: walk the store and report what is broken, where, and how to fix it.

Checks: malformed or missing front matter, an id or class that disagrees with
the file's place, bad dates, links that dangle, escape the store or are not
symlinks, link directories without an entity or that are symbolic links, entities without any link
(orphans, a warning), entities larger than search splits into units (a
warning; docs/retrieval.md, "Large entities"), bytes that are not UTF-8 in an
entity's first MiB (a warning: search reads them as U+FFFD), stray temp files, and what stands where an entity
file, a links directory or a link belongs but is something else (a directory, a FIFO, a device, a file that
cannot be read: search leaves each out; one of them must never make check() raise or block). `.git` and
`.hutch` are skipped.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from hutch._core.atomic import TEMP_PREFIX
from hutch._core.errors import ConfigError, MalformedEntityError
from hutch.memory import _format as fmt
from hutch.memory._entity import CheckIssue, CheckReport
from hutch.memory._index import _units
from hutch.memory._layout import Layout
from hutch.memory._links import is_entity

if TYPE_CHECKING:  # pragma: no cover
    from hutch.memory._store import Memory


def check(mem: "Memory") -> CheckReport:
    issues: list[CheckIssue] = []
    # a path on disk may hold control characters or bytes that are not UTF-8: each issue names it on one line
    add = lambda sev, code, path, msg, fix: issues.append(CheckIssue(sev, code, shown(path), msg, fix))  # noqa: E731
    entities: set[str] = set()
    linked: set[str] = set()
    link_dirs: list[tuple[str, str, str]] = []  # (class, slug, path)
    n_links = 0
    root = mem.root
    layout = Layout(root)

    with os.scandir(root) as it:
        tops = sorted((e for e in it), key=lambda e: e.name)
    for top in tops:
        if top.name.startswith("."):
            continue  # .git, .hutch (derived index, lock), .gitignore ...
        if not top.is_dir(follow_symlinks=False):
            if top.is_symlink():
                add("error", "symlink-class", shown(top.name), "is a symbolic link at the top of the store.",
                    f"replace it with a real directory or remove it: rm {_sh(top.name)}")
            continue
        cls = top.name
        if not fmt.is_name(cls):
            add("warning", "bad-class-name", shown(cls) + "/", "is not a valid class name (a-z, 0-9, '_', '-'); "
                "hutch does not read entities in it.",
                f"rename the directory, e.g. mv {_sh(cls)} {_sh(fmt.slugify(cls))}")
            continue
        try:
            with os.scandir(top.path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue  # gone since the listing
        except OSError as err:
            add("error", *unreadable_dir(cls, err))
            continue
        for e in entries:
            rel = f"{cls}/{e.name}"
            if e.name.startswith(TEMP_PREFIX):
                add("warning", "stray-temp", shown(rel), "is a temp file left by an interrupted write.",
                    f"remove it: rm {_sh(rel)}")
                continue
            if e.name.endswith(fmt.LINKS_SUFFIX) and e.is_dir(follow_symlinks=False):
                link_dirs.append((cls, e.name[: -len(fmt.LINKS_SUFFIX)], e.path))
                continue
            if e.name.endswith(fmt.LINKS_SUFFIX) and e.is_symlink():
                add("error", "symlink-links-dir", rel, "is a symbolic link where a links directory belongs: "
                    "hutch does not follow it (it could lead outside the store), so the links behind it count "
                    "for nothing.", f"replace it with a real directory of links, or remove it: rm {_sh(rel)}")
                continue
            if e.name.endswith(fmt.LINKS_SUFFIX):
                add("error", "links-not-dir", rel, f"is {_kind(e.path)} where a links directory belongs: the "
                    f"links of {cls}/{e.name[:-len(fmt.LINKS_SUFFIX)]} count for nothing.",
                    f"remove it (rm {_sh(rel)}) and link with `hutch mem link`")
                continue
            if not e.name.endswith(".md"):
                continue  # attachments and other files are allowed
            why = left_out(cls, e.name, e.path)
            if why is not None:
                add("error", *why)
                continue
            if not e.is_file(follow_symlinks=False):
                continue  # gone since the listing: nothing to say
            slug = e.name[:-3]
            entity_id = f"{cls}/{slug}"
            try:
                # never through a link, never blocking on a FIFO (either may replace the file since the listing);
                # the front matter is in the head: never the whole of a big file
                fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed since the listing
            except OSError as err:
                add("error", "unreadable", rel, f"cannot be read ({err.strerror}).",
                    unreadable_fix(rel))
                continue
            entities.add(entity_id)
            try:
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        raise IsADirectoryError(0, "not a regular file")
                    head = f.read(_units.UNIT_BYTES + 1)
                    size = st.st_size
                if size > _units.UNIT_BYTES:
                    head = head[:_units.cut(head, _units.UNIT_BYTES)]
                    mib = _units.UNIT_BYTES >> 20
                    add("warning", "large-entity", rel,
                        f"is {size / (1 << 20):.1f} MiB: search splits only its first {mib} MiB into units, its "
                        f"words up to {_units.LEXICAL_BYTES >> 20} MiB are searchable, the rest is not.",
                        f"split it into several entities of at most {mib} MiB")
                try:
                    head.decode("utf-8")
                except UnicodeDecodeError as bad:
                    add("warning", "not-utf8", rel,
                        f"has bytes that are not UTF-8 (the first at byte {bad.start}): search reads each as U+FFFD "
                        "(the file itself is kept as it is).",
                        f"convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 {_sh(rel)} > {_sh(rel + '.new')} && "
                        f"mv {_sh(rel + '.new')} {_sh(rel)}")
                meta, _ = fmt.parse(head.decode("utf-8", errors="surrogateescape"), rel)
            except MalformedEntityError as err:
                add("error", "bad-front-matter", rel, str(err).removeprefix(rel + " "), front_matter_fix(rel))
                continue
            except OSError as err:  # replaced by something else meanwhile, or an I/O error
                entities.discard(entity_id)
                add("error", "unreadable", rel, f"cannot be read ({err.strerror}).",
                    unreadable_fix(rel))
                continue
            _check_meta(add, rel, entity_id, cls, meta)

    for cls, slug, path in link_dirs:
        src = f"{cls}/{slug}"
        rel_dir = f"{cls}/{slug}{fmt.LINKS_SUFFIX}"
        if src not in entities:
            add("warning", "orphan-links-dir", rel_dir, f"holds links of {src}, which does not exist.",
                f"remove it (rm -r {_sh(rel_dir)}) or restore {src}.md")
        try:
            rnames = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            rnames = []
        except OSError as err:
            add("error", *unreadable_dir(rel_dir, err))
            rnames = []
        for rname in sorted(rnames):
            rpath = os.path.join(path, rname)
            if not os.path.isdir(rpath) or os.path.islink(rpath):
                add("error", "bad-link-entry", shown(f"{rel_dir}/{rname}"), "is not a relation directory.",
                    f"remove it: rm {_sh(f'{rel_dir}/{rname}')}")
                continue
            if not fmt.is_name(rname):
                add("warning", "bad-relation-name", shown(f"{rel_dir}/{rname}"), "is not a valid relation name.",
                    "rename it with a-z, 0-9, '_', '-' only")
            try:
                lnames = os.listdir(rpath)
            except (FileNotFoundError, NotADirectoryError):
                lnames = []
            except OSError as err:
                add("error", *unreadable_dir(f"{rel_dir}/{rname}", err))
                lnames = []
            for lname in sorted(lnames):
                lrel = f"{rel_dir}/{rname}/{lname}"
                lpath = os.path.join(rpath, lname)
                if not os.path.islink(lpath):
                    kind = _kind(lpath)
                    if kind:
                        add("error", "not-a-symlink", lrel, f"is {kind} where a link (symlink) belongs.",
                            f"remove it (rm {'-r ' if 'directory' in kind else ''}{_sh(lrel)}) and link with "
                            "`hutch mem link`")
                    continue
                if any("\ud800" <= c <= "\udfff" for c in rname + lname):
                    # links, neighbors and the index leave out a name that is not UTF-8 (SQLite cannot hold it)
                    add("error", "bad-link-name", lrel, "is a link whose name (or its relation's) is not UTF-8: "
                        "hutch leaves it out (links, neighbors, search).",
                        f"remove it (rm {_sh(lrel)}) and link again with `hutch mem link`")
                    continue
                n_links += 1
                tid = mem.link_target(lrel)
                if tid is not None and any("\ud800" <= c <= "\udfff" for c in tid):
                    tid = None  # a target named with bytes that are not UTF-8 is no entity (link_entries: None)
                if tid is None:
                    add("error", "link-escapes", lrel, escape_message(lpath), escape_fix(lrel))
                    continue
                if tid not in entities and not is_entity(layout, tid):
                    add("error", "dangling-link", lrel, dangling_message(tid), dangling_fix(src, rname, tid, lrel))
                    continue
                linked.add(src)
                linked.add(tid)

    for entity_id in sorted(entities - linked):
        add("warning", "orphan", f"{entity_id}.md", "has no links in or out.",
            f"link it to something (hutch mem link {entity_id} <relation> <class/slug>) or ignore this warning")
    return CheckReport(len(entities), n_links, tuple(issues))


def unreadable_fix(rel: str) -> str:
    return f"make it a readable regular file (chmod u+r {_sh(rel)}), or remove it: rm {_sh(rel)}"


def unreadable_dir(rel: str, err: OSError) -> tuple[str, str, str, str]:
    """(code, path, what, fix) for a class or links directory that cannot be listed (mode 000 for a user
    without CAP_DAC_OVERRIDE): check() and doctor() say the same."""
    return ("unreadable", f"{rel}/", f"is a directory that cannot be read ({err.strerror}): search, ls and check "
            "leave out everything in it.", f"make it readable (chmod u+rwx {_sh(rel)}) or move it out of the store")


def left_out(cls: str, name: str, path: str) -> tuple[str, str, str, str] | None:
    """Why the `*.md` entry `name` of class `cls` (at `path`) is no entity that search, ls and the FUSE view read:
    (code, path relative to the store, what, fix), or None if it is an entity file (or gone). check() and
    doctor() say the same."""
    rel = f"{cls}/{name}"
    if not fmt.is_slug(name[:-3]):
        return ("bad-entity-name", rel, f"is not a valid entity file name ({_no_slug_why(name)}): hutch reads no "
                "entity from it (ls and search leave it out).",
                f"rename it to a valid slug, e.g. mv {_sh(rel)} {_sh(f'{cls}/{fmt.slugify(name[:-3])}.md')}")
    kind = _kind(path)
    if kind == "a symbolic link":
        return ("symlink-entity", rel, "is a symbolic link, not an entity file: hutch never follows it (search, "
                "ls and the FUSE view leave it out).", f"replace it with a regular file or remove it: rm {_sh(rel)}")
    if kind and kind != "a regular file":
        return ("not-a-file", rel, f"is {kind}, not an entity file: hutch reads no entity from it (search, ls and "
                "the FUSE view leave it out).",
                f"remove it, or move it out of the store: rm {'-r ' if 'directory' in kind else ''}{_sh(rel)}")
    return None


def front_matter_fix(rel: str) -> str:
    """How to fix an entity file `rel` whose front matter does not parse (check() and doctor() say the same)."""
    return f"edit {rel} so it starts with '---', valid YAML 'key: value' lines and a closing '---'"


def escape_message(lpath) -> str:
    try:
        target = os.readlink(lpath)
    except OSError:
        target = "?"
    return (f"points to '{_escaped(target, chr(39))}', which is not an entity inside the store (links are relative: "
            "../../../<class>/<slug>.md); hutch never follows it.")


def escape_fix(lrel: str) -> str:
    return f"remove it: rm {_sh(lrel)}"


def dangling_message(tid: str) -> str:
    return (f"points to {tid}, which is not an entity file (deleted, or not a regular file): neighbors, links and "
            "search leave it out.")


def dangling_fix(src: str, relation: str, tid: str, lrel: str) -> str:
    return f"remove it (hutch mem unlink {src} {relation} {tid}, or rm {_sh(lrel)}) or create {tid}"


def _quoted(path: str, root) -> str:
    """`path` relative to the store, quoted for a shell (see _sh)."""
    return _sh(os.path.relpath(path, root))


def _escaped(rel: str, quote: str = "") -> str:
    """`rel` on one printable line: a control character as its escape (\\n, \\x01, \\u2028), a byte that is not
    UTF-8 (os gives it as a lone surrogate) as \\xHH, and `quote` with a backslash: what bash's $'...' reads back
    as the same bytes."""
    out = []
    for c in rel:
        if "\udc80" <= c <= "\udcff":
            out.append(f"\\x{ord(c) - 0xdc00:02x}")
        elif c == "\\" or c == quote:
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        elif ord(c) < 0x100:
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, f"\\x{ord(c):02x}"))
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out)


def shown(rel: str) -> str:
    """A path relative to the store as a CheckIssue names it: itself, or (holding a control character or bytes
    that are not UTF-8) _escaped, so that the report stays one line of valid text."""
    return rel if rel.isprintable() else _escaped(rel)


def _sh(rel: str) -> str:
    """A path relative to the store quoted for a POSIX shell, so that a fix line can be pasted as it is:
    shlex.quote, or bash's $'...' with escapes when it holds control characters or bytes that are not UTF-8."""
    import shlex

    if rel.isprintable():
        return shlex.quote(rel)
    return "$'" + _escaped(rel, "'") + "'"


def _no_slug_why(name: str) -> str:
    """Why the file name `name` (a `*.md`) is no entity's: fmt.is_slug refused it."""
    slug = name[:-3]
    if any("\ud800" <= c <= "\udfff" for c in slug):
        return "it holds bytes that are not UTF-8"
    if any(not c.isprintable() and not c == " " for c in slug):
        return "it holds a control or bidirectional-text character (a newline, a tab, a right-to-left override...)"
    if slug[:1].isspace():
        return "it starts with white space"
    if slug[:1] == ".":
        return "it starts with '.'"
    if len(slug) > 120:
        return f"its slug is {len(slug)} characters long, past 120"
    return "it holds '\\', or ends in .md or .links"


def _kind(path: str) -> str:
    """What is at `path`, in words ('a directory', 'a FIFO', ...); '' if nothing is there now."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return ""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _check_meta(add, rel: str, entity_id: str, cls: str, meta: dict) -> None:
    if meta.get("id") is not None and str(meta["id"]) != entity_id:
        add("error", "id-mismatch", rel, f"says id {meta['id']!r}, but its place in the store makes it {entity_id!r}.",
            f"set 'id: {entity_id}' in its front matter (or move the file to {meta['id']}.md)")
    if meta.get("class") is not None and str(meta["class"]) != cls:
        add("error", "class-mismatch", rel, f"says class {meta['class']!r} but lives in {cls}/.",
            f"set 'class: {cls}' or move the file")
    if not meta.get("title"):
        add("warning", "no-title", rel, "has no title.", "add a 'title: ...' line to its front matter")
    times = {}
    for key in ("created", "updated", "valid_from", "valid_to", "recorded_at"):
        v = meta.get(key)
        if v is None or v == "":
            continue
        try:
            times[key] = fmt.parse_time(v, key)
        except ConfigError:
            add("error", "bad-date", rel, f"has {key}: {v!r}, which is not an ISO 8601 date.",
                "write it like 2026-11-20 or 2026-11-20T14:30:00Z")
    if "valid_from" in times and "valid_to" in times and times["valid_to"] <= times["valid_from"]:
        add("error", "bad-validity", rel, "has valid_to at or before valid_from.", "fix one of the two dates")
    conf = meta.get("confidence")
    if conf is not None and not (isinstance(conf, (int, float)) and 0 <= conf <= 1):
        add("warning", "bad-confidence", rel, f"has confidence {conf!r}, not a number in [0, 1].",
            "set confidence to a number between 0 and 1 or remove it")
