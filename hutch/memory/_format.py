"""Parse and render SMF entity files. Pure functions, no I/O (see docs/smf-format.md).

An entity file is YAML front matter between two `---` lines, then a Markdown
body. Edits are surgical: changing a key rewrites only that key's lines,
changing facts rewrites only the `## Facts` section, so bytes a person wrote by
hand stay exactly as they were (comments, key order, quoting, CRLF).
"""

from __future__ import annotations

import json
import re
import unicodedata
from datetime import date, datetime, timezone
from typing import Any

import yaml

from hutch._core.errors import MalformedEntityError

#: Keys hutch writes, in the order it writes them for a new entity.
STANDARD_KEYS = (
    "id", "class", "title", "created", "updated", "valid_from", "valid_to",
    "recorded_at", "source", "tags", "confidence",
)
#: Names that may never be an entity class (derived state, git, link dirs).
RESERVED_CLASSES = frozenset({".hutch", ".git"})
LINKS_SUFFIX = ".links"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\Z")
_SLUG_RE = re.compile(r"^[^\s/\\.][^/\\]{0,119}\Z")
MAX_SLUG = 80

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrDatesLoader(_Loader):  # type: ignore[misc, valid-type]
    """SafeLoader that keeps timestamps as the strings the file holds (round trips stay exact)."""


_StrDatesLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in _Loader.yaml_implicit_resolvers.items()
}


# --------------------------------------------------------------------- names

def slugify(title: str) -> str:
    """A stable file-name slug for a title: lower case, ASCII where possible, words joined by '-'."""
    s = unicodedata.normalize("NFKD", title)
    s = "".join(c for c in s if not unicodedata.combining(c))
    s = s.lower()
    s = re.sub(r"[^\w]+", "-", s, flags=re.UNICODE).replace("_", "-")
    s = re.sub(r"-{2,}", "-", s).strip("-")
    if len(s) > MAX_SLUG:
        s = s[:MAX_SLUG].rstrip("-")
    return s or "untitled"


def is_name(name: str) -> bool:
    """True if `name` may name a class or a relation: 1-64 characters of a-z, 0-9, '_' or '-'."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def check_class(name: str) -> str:
    """Validate an entity class name (a directory under the store)."""
    if not isinstance(name, str) or name in RESERVED_CLASSES or not _NAME_RE.match(name):
        from hutch._core.errors import StorePathError

        raise StorePathError(
            f"{name!r} is not a valid entity class: use 1-64 characters of a-z, 0-9, '_' or '-', "
            f"starting with a letter or digit (and not one of {sorted(RESERVED_CLASSES)})."
        )
    return name


def check_relation(name: str) -> str:
    """Validate a relation name (a directory under `<slug>.links/`)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        from hutch._core.errors import StorePathError

        raise StorePathError(
            f"{name!r} is not a valid relation name: use 1-64 characters of a-z, 0-9, '_' or '-', "
            "for example 'works_at'."
        )
    return name


#: characters no slug holds: C0 and C1 controls and DEL; the bidirectional marks, embeddings, overrides and
#: isolates and the line and paragraph separators (a name that shows as another one in ls, git or a terminal);
#: surrogates (a name that is not UTF-8)
_NOT_IN_SLUG = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
#: what check_slug accepts, as one expression
_SLUG_OK = re.compile(f"^[^\\s/\\\\.{_NOT_IN_SLUG}][^/\\\\{_NOT_IN_SLUG}]{{0,119}}\\Z")


def is_slug(slug: str) -> bool:
    """True if check_slug accepts `slug`: the test for names found on disk (an `*.md` file whose name is no slug,
    such as one with a newline a hand or a hostile clone made, is no entity: listing and search leave it out,
    check() names it), fast enough for a scan of 100,000 names."""
    return _SLUG_OK.match(slug) is not None and not slug.endswith((LINKS_SUFFIX, ".md"))


def check_slug(slug: str) -> str:
    """Validate a slug given by a caller (a file name without `.md`)."""
    from hutch._core.errors import StorePathError

    if (
        not isinstance(slug, str)
        or not _SLUG_RE.match(slug)
        or slug.endswith(LINKS_SUFFIX)
        or slug.endswith(".md")
        or slug in (".", "..")
        or not is_slug(slug)   # a control or bidirectional character, or a surrogate (a name that is not UTF-8)
    ):
        raise StorePathError(
            f"{slug!r} is not a valid slug: use a UTF-8 file name without '/', without a leading '.', "
            "without control or bidirectional-text characters, not ending in '.md' or '.links', at most 120 "
            "characters (hutch.memory slugify() makes one)."
        )
    return slug


def split_id(entity_id: str) -> tuple[str, str]:
    """'actors/alice-chen' (or 'actors/alice-chen.md') -> ('actors', 'alice-chen'), validated."""
    from hutch._core.errors import StorePathError

    if not isinstance(entity_id, str) or entity_id.count("/") != 1:
        raise StorePathError(
            f"{entity_id!r} is not an entity id: write '<class>/<slug>', for example 'actors/alice-chen'."
        )
    cls, slug = entity_id.split("/")
    if slug.endswith(".md"):
        slug = slug[:-3]
    return check_class(cls), check_slug(slug)


# ----------------------------------------------------------------- parsing

def newline_of(text: str) -> str:
    """The line ending a file uses ('\\r\\n' if its first line ends so, else '\\n')."""
    i = text.find("\n")
    return "\r\n" if i > 0 and text[i - 1] == "\r" else "\n"


def split_front_matter(text: str) -> tuple[str, str, str] | None:
    """Split into (opening fence + front matter, front matter body, Markdown body), or None if there is none.

    The first returned part ends right after the closing fence line, so
    `head + body == text` always holds.
    """
    if not _opens(text):
        return None
    start = text.index("\n") + 1
    pos = start
    while True:
        end = text.find("\n", pos)
        line = text[pos:] if end < 0 else text[pos:end]
        if line.rstrip("\r") in ("---", "..."):
            stop = len(text) if end < 0 else end + 1
            return text[:stop], text[start:pos], text[stop:]
        if end < 0:
            return None
        pos = end + 1


#: A UTF-8 byte order mark, which some editors put first: a file may start with it (kept as it is on updates)
BOM = "\ufeff"
#: Front matter is metadata: at most this many characters between its fences (so that it always closes within
#: the first MiB that search and check() read of a file); a longer one is malformed, the same for every reader
MAX_FRONT_MATTER = 256 << 10


def _opens(text: str) -> bool:
    """True if `text` starts with an opening fence line ('---', after a byte order mark if there is one)."""
    lead = 1 if text.startswith(BOM) else 0
    return text.startswith("---\n", lead) or text.startswith("---\r\n", lead)


def parse(text: str, where: str = "<text>") -> tuple[dict[str, Any], str]:
    """Parse an entity file into (front matter mapping, body). Raises MalformedEntityError naming `where`."""
    parts = split_front_matter(text)
    too_long = (f"{where} has front matter longer than {MAX_FRONT_MATTER >> 10} KiB: front matter is metadata "
                "(title, dates, tags...). Move long values into the Markdown body below the closing '---' line.")
    if parts is None and _opens(text):
        if len(text) > MAX_FRONT_MATTER:
            raise MalformedEntityError(too_long, path=where)
        raise MalformedEntityError(
            f"{where} has front matter that never ends: no closing '---' line after the opening one. Add it after "
            "the last 'key: value' line.", path=where)
    if parts is not None and len(parts[1]) > MAX_FRONT_MATTER:
        raise MalformedEntityError(too_long, path=where)
    if parts is None:
        raise MalformedEntityError(
            f"{where} has no front matter: an entity file must start with a '---' line, YAML keys, "
            "and a closing '---' line. Add them (at least 'title: ...') or move the file out of the store.",
            path=where,
        )
    _, fm, body = parts
    fast = fast_meta(fm)
    if fast is not None:
        return fast, body
    try:
        meta = yaml.load(fm, Loader=_StrDatesLoader) if fm.strip() else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (front matter line {mark.line + 1})" if mark is not None else ""
        raise MalformedEntityError(
            f"{where} has malformed YAML front matter{at}: {getattr(e, 'problem', None) or e}. "
            "Fix the YAML between the '---' lines (quote values that contain ': ' or start with a special character).",
            path=where,
        ) from e
    if meta is None:
        meta = {}
    if _too_many_nodes(meta):
        raise MalformedEntityError(
            f"{where} has front matter that expands to more than {MAX_META_NODES} values (YAML aliases: '*name' "
            "repeating an '&name' anchor, or a value that contains itself). Write the values out instead of "
            "aliasing them.",
            path=where,
        )
    if not isinstance(meta, dict):
        raise MalformedEntityError(
            f"{where} has front matter that is not a mapping of keys to values: write 'key: value' lines "
            "between the '---' lines.",
            path=where,
        )
    return meta, body


#: Values front matter may hold once YAML aliases are expanded: a tiny file of nested aliases (a "billion
#: laughs") expands exponentially in whatever walks it (str(), the indexer), and one that contains itself never ends.
MAX_META_NODES = 10_000


def _too_many_nodes(value: Any) -> bool:
    stack, n = [value], 0
    while stack:
        v = stack.pop()
        n += 1
        if n > MAX_META_NODES:
            return True
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set)):
            stack.extend(v)
    return False


_FAST_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*):(?: (.*))?$")
_FAST_PLAIN = re.compile(r"^[A-Za-z0-9_(./][^#:\[\]{}\"',]*$")
_FAST_LIST_ITEM = re.compile(r"^[A-Za-z0-9_(./][^#:\[\]{}\"',]*$")
_INT = re.compile(r"^-?[1-9][0-9]*$|^0$")
_FLOAT = re.compile(r"^-?[0-9]+\.[0-9]*$|^\.[0-9]+$")
_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?$")


def _fast_scalar(v: str):
    """YAML's reading of a simple scalar, or ... when it is not simple enough to be sure."""
    if v in ("null", "~", ""):
        return None
    if v in ("true", "false"):
        return v == "true"
    if v.startswith('"'):
        if not v.endswith('"') or len(v) < 2 or "\\" in v:
            return ...
        return v[1:-1] if '"' not in v[1:-1] else ...
    if _INT.match(v):
        return int(v)
    if _FLOAT.match(v):
        return float(v)
    if _ISO.match(v):
        return v  # timestamps stay strings (see _StrDatesLoader)
    if _FAST_PLAIN.match(v) and not _AMBIGUOUS_RE.match(v) and v == v.strip():
        return v
    return ...


def fast_meta(fm: str) -> dict[str, Any] | None:
    """Parse front matter made only of `key: simple-value` lines without YAML; None when unsure.

    Most files (everything hutch writes) take this path; anything unusual
    (comments, block values, anchors, escapes, quoting styles) goes to YAML.
    """
    out: dict[str, Any] = {}
    for line in fm.split("\n"):
        line = line.rstrip("\r")
        if not line:
            continue
        m = _FAST_LINE.match(line)
        if m is None or m.group(1) in out:
            return None
        v = (m.group(2) or "").strip()
        if v.startswith("["):
            if not v.endswith("]"):
                return None
            inner = v[1:-1].strip()
            items = [] if not inner else [x.strip() for x in inner.split(",")]
            vals = []
            for x in items:
                if not _FAST_LIST_ITEM.match(x) or _AMBIGUOUS_RE.match(x) or _ISO.match(x):
                    return None
                vals.append(x)
            out[m.group(1)] = vals
            continue
        val = _fast_scalar(v)
        if val is ...:
            return None
        out[m.group(1)] = val
    return out


# ----------------------------------------------------------------- rendering

_PLAIN_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9 _.:/@+\-]*\Z")
_AMBIGUOUS_RE = re.compile(
    r"^(?:y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF"
    r"|null|Null|NULL|~|[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|0x[0-9a-fA-F_]+|0o?[0-7_]+"
    r"|[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)|[0-9]+(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$"
)


def scalar(value: Any, *, flow: bool = False) -> str:
    """Render one value as a YAML scalar (plain when unambiguous, else a JSON-style double-quoted string)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    s = str(value)
    if (
        _PLAIN_RE.match(s)
        and not _AMBIGUOUS_RE.match(s)
        and ": " not in s
        and not s.endswith(":")
        and not s.endswith(" ")
    ):
        return s
    return json.dumps(s, ensure_ascii=False)


def render_value(key: str, value: Any, nl: str) -> str:
    """Render `key: value` (one or more lines, each ending with `nl`)."""
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (list, tuple, dict)) for v in value):
        return f"{key}: [{', '.join(scalar(v, flow=True) for v in value)}]{nl}"
    if isinstance(value, dict) or isinstance(value, (list, tuple)):
        dumped = yaml.safe_dump({key: value}, allow_unicode=True, default_flow_style=False, sort_keys=False)
        return dumped.replace("\n", nl)
    return f"{key}: {scalar(value)}{nl}"


def render(meta: dict[str, Any], body: str, nl: str = "\n") -> str:
    """Render a new entity file from front matter and body."""
    out = ["---", nl]
    for k, v in meta.items():
        out.append(render_value(k, v, nl))
    out += ["---", nl]
    if body and not body.startswith(("\n", "\r\n")):
        out.append(nl)
    out.append(body)
    return "".join(out)


def set_keys(text: str, updates: dict[str, Any], where: str = "<text>") -> str:
    """Return `text` with only the front matter lines of `updates` rewritten (or appended).

    A value of `...` (Ellipsis) removes the key. Every other line, including
    comments and keys hutch does not know, stays byte for byte.
    """
    parts = split_front_matter(text)
    if parts is None:
        raise MalformedEntityError(f"{where} has no front matter to update.", path=where)
    head, fm, body = parts
    nl = newline_of(text)
    opening = head[: head.index("\n") + 1]
    closing = head[len(opening) + len(fm):]
    lines = fm.splitlines(keepends=True)
    remaining = dict(updates)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        key = _top_key(line)
        if key is not None and key in remaining:
            # skip the value's continuation lines (indented, list items, blank lines inside a block)
            j = i + 1
            while j < len(lines) and _is_continuation(lines[j]):
                j += 1
            value = remaining.pop(key)
            if value is not ...:
                out.append(render_value(key, value, nl))
            i = j
            continue
        out.append(line)
        i += 1
    if out and not out[-1].endswith("\n"):
        out[-1] += nl
    for key, value in remaining.items():
        if value is not ...:
            out.append(render_value(key, value, nl))
    return opening + "".join(out) + closing + body


def _top_key(line: str) -> str | None:
    if not line or line[0] in " \t#-\r\n":
        return None
    m = re.match(r"""^(?:"([^"]+)"|'([^']+)'|([^:#\s][^:]*?))\s*:(?:\s|$)""", line)
    if not m:
        return None
    return m.group(1) or m.group(2) or m.group(3)


def _is_continuation(line: str) -> bool:
    return line[:1] in (" ", "\t") or line.startswith("- ") or line.rstrip("\r\n") in ("-", "")


def replace_body(text: str, body: str, where: str = "<text>") -> str:
    """Return `text` with its Markdown body replaced and its front matter bytes untouched."""
    parts = split_front_matter(text)
    if parts is None:
        raise MalformedEntityError(f"{where} has no front matter.", path=where)
    head = parts[0]
    nl = newline_of(text)
    if nl == "\r\n":
        body = re.sub(r"(?<!\r)\n", "\r\n", body)
    if body and not body.startswith(("\n", "\r\n")):
        body = nl + body
    return head + body


# ----------------------------------------------------------------- facts and sections

_HEADING_RE = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t#]*\r?$")


def headings(body: str) -> list[tuple[int, int, str, int]]:
    """(offset, level, text, end-of-heading-line offset) for every ATX heading outside fenced code."""
    out = []
    pos = 0
    fence = None
    for line in body.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            marker = stripped[:3]
            fence = None if fence == marker else (fence or marker)
        elif fence is None:
            m = _HEADING_RE.match(line.rstrip("\n"))
            if m:
                out.append((pos, len(m.group(1)), m.group(2).strip(), pos + len(line)))
        pos += len(line)
    return out


def section_span(body: str, anchor: str, levels: tuple[int, ...] = (2, 3)) -> tuple[int, int, int] | None:
    """(start of heading, start of content, end) of the section whose heading text is `anchor`."""
    hs = headings(body)
    for n, (off, level, text, content) in enumerate(hs):
        if level in levels and text == anchor:
            end = len(body)
            for off2, level2, _, _ in hs[n + 1:]:
                if level2 <= level:
                    end = off2
                    break
            return off, content, end
    return None


def sections(body: str) -> dict[str, str]:
    """Anchor -> section text (without its heading) for every level-2/3 heading of the body."""
    out: dict[str, str] = {}
    # the headings once (one section_span per heading re-read them all: 514 turns in 1 MiB took 6 s, a 200 MB
    # conversation did not end); a section ends at the next heading of its level or above, found from the end
    hs = headings(body)
    ends = [len(body)] * len(hs)
    nxt = {1: len(body), 2: len(body), 3: len(body)}  # the offset of the next heading of level <= key
    for n in range(len(hs) - 1, -1, -1):
        off, level, _, _ = hs[n]
        ends[n] = nxt[min(level, 3)]
        for lv in range(level, 4):
            nxt[lv] = off
    for (_, level, text, content), end in zip(hs, ends):
        if level in (2, 3) and text not in out:
            out[text] = body[content:end].strip("\r\n")
    return out


def facts(body: str) -> list[str]:
    """The `- ` bullets of the body's `## Facts` section."""
    span = section_span(body, "Facts", levels=(2,))
    if span is None:
        return []
    out = []
    for line in body[span[1]:span[2]].splitlines():
        s = line.strip()
        if s.startswith(("- ", "* ")):
            out.append(s[2:].strip())
    return out


def _bullets(items, nl: str) -> str:
    return "".join(f"- {' '.join(str(f).split())}{nl}" for f in items)


def with_facts(body: str, new_facts, *, replace: bool, nl: str = "\n") -> str:
    """Body with facts appended to (or replacing) its `## Facts` section; other bytes untouched."""
    new_facts = [f for f in new_facts if str(f).strip()]
    span = section_span(body, "Facts", levels=(2,))
    if span is None:
        if not new_facts:
            return body
        sep = "" if not body else (nl if body.endswith(nl * 2) else (nl if body.endswith("\n") else nl * 2))
        return f"{body}{sep}## Facts{nl}{nl}{_bullets(new_facts, nl)}"
    start, content, end = span
    section = body[content:end]
    if replace:
        tail = nl if end < len(body) else ""
        return body[:content] + nl + _bullets(new_facts, nl) + tail + body[end:]
    existing = set(facts(body))
    add = [f for f in new_facts if " ".join(str(f).split()) not in existing]
    if not add:
        return body
    stripped = section.rstrip("\r\n")
    if not stripped:  # an empty section: bullets go right under the heading
        return body[:content] + nl + _bullets(add, nl) + body[content:]
    insert_at = content + len(stripped)  # right after the section's last non-blank line
    if insert_at == len(body):
        return body + nl + _bullets(add, nl)
    return body[:insert_at] + nl + _bullets(add, nl).rstrip("\r\n") + body[insert_at:]


# ----------------------------------------------------------------- time

def iso(value: datetime) -> str:
    """ISO 8601 with a 'Z' for UTC (seconds precision)."""
    if value.tzinfo is None:
        return value.replace(microsecond=0).isoformat()
    value = value.astimezone(timezone.utc).replace(microsecond=0)
    return value.isoformat().replace("+00:00", "Z")


def now_iso() -> str:
    return iso(datetime.now(timezone.utc))


def parse_time(value: Any, what: str = "date") -> datetime | None:
    """Parse an ISO 8601 date or date-time (str/date/datetime) into an aware UTC datetime; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, date):
        dt = datetime(value.year, value.month, value.day)
    else:
        try:
            dt = datetime.fromisoformat(str(value).strip())
        except ValueError:
            from hutch._core.errors import ConfigError

            raise ConfigError(
                f"{value!r} is not a valid {what}: write an ISO 8601 date such as '2026-11-20' "
                "or '2026-11-20T14:30:00Z'."
            ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc)


def time_str(value: Any, what: str = "date") -> str | None:
    """Normalize a user-given date for front matter: keep date-only strings, ISO-format the rest."""
    if value is None:
        return None
    if isinstance(value, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value.strip()):
        parse_time(value, what)
        return value.strip()
    if isinstance(value, date) and not isinstance(value, datetime):
        return value.isoformat()
    dt = parse_time(value, what)
    if isinstance(value, str):
        return value.strip()
    return iso(dt) if dt else None
