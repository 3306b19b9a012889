"""Temporal expressions in text: the time span a question (or a conversation turn) speaks of.

Pure (no I/O, stdlib only). Explicit dates need nothing else ("8 May, 2023",
"May 8, 2023", "2023-05-08", "May 2023", "in 2023"); relative ones are read
against a reference day ("yesterday", "last week", "two weeks ago", "last
Friday", "earlier this month", "in June"), and combinations wrap either kind
("since May 2023", "before last week", "between March and May 2023", "the week
before August 3, 2023", "last weekend before April 10, 2023", "late May 2023").

Every span is half-open [start, end) in seconds since the epoch, at UTC day
boundaries (the reference is taken as a UTC day); an open end is -inf / +inf.
What is not understood is not read: a question without a parseable expression
has no time span, never an error. Calendar rules (documented in
docs/retrieval.md): weeks run Monday..Sunday; "last week" / "N weeks ago" is
the calendar week holding the day N*7 days back; "N days ago" is that day;
"on Friday" / "last Friday" is the latest Friday strictly before the reference
day; a month or season without a year is the latest one that began on or
before the reference day; early / mid / late split a month at days 10 and 20
and a year into thirds of four months.
"""

from __future__ import annotations

import bisect
import calendar
import math
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

__all__ = ["TimeSpan", "find", "find_all", "event_span", "explicit_window"]


@dataclass(frozen=True)
class TimeSpan:
    """A time span named in a text: [start, end) in epoch seconds (open ends are -inf / +inf), the
    characters that named it (`span`, `text`), and whether reading it needed the reference time."""

    start: float
    end: float
    span: tuple[int, int]
    text: str
    relative: bool
    kind: str = "date"  # "date", "open" (since/before/after), "yearless" (a month or day without its year),
                         # "weekday" ("on Friday": past or planned), used to pick what describes an event

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.start) and math.isfinite(self.end)

    def contains(self, t: float) -> bool:
        return self.start <= t < self.end


# ------------------------------------------------------------------ vocabulary

_MONTH_FULL = {m.lower(): i for i, m in enumerate(calendar.month_name) if m}
_MONTHS = dict(_MONTH_FULL)
_MONTHS.update({m.lower(): i for i, m in enumerate(calendar.month_abbr) if m})
_MONTHS["sept"] = 9
_WEEKDAY_FULL = {d.lower(): i for i, d in enumerate(calendar.day_name)}
_WEEKDAYS = dict(_WEEKDAY_FULL)
_WEEKDAYS.update({d.lower(): i for i, d in enumerate(calendar.day_abbr)})
_WEEKDAYS.update({"tues": 1, "thur": 3, "thurs": 3})
_SEASONS = {"spring": 3, "summer": 6, "autumn": 9, "fall": 9, "winter": 12}  # first month (northern hemisphere)
_NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
_NUMBERS.update({"a": 1, "an": 1, "the": 1, "fifteen": 15, "twenty": 20, "thirty": 30})
# loose quantities: (fewest, most) units
_LOOSE = {"a couple of": (2, 3), "couple of": (2, 3), "a couple": (2, 3), "couple": (2, 3), "a few": (2, 5),
          "few": (2, 5),
          "several": (3, 7)}


def _alt(words) -> str:
    return "|".join(sorted((re.escape(w) for w in words), key=len, reverse=True))


_MON = _alt(_MONTHS)
_MONF = _alt(_MONTH_FULL)
_WD = _alt(_WEEKDAYS)
_NUM = r"\d{1,3}|" + _alt(_NUMBERS)
_QTY = r"(?P<loose>" + _alt(_LOOSE) + r")|(?P<num>" + _NUM + r")"
_UNIT = r"(?P<unit>day|week|fortnight|month|year|decade)s?"
_ORD = r"(?:st|nd|rd|th)?"

# Words a bare year or a month without a year must follow to be read as a date ("in 2023", "in June");
# "the 2023 plan", "May I ask" and "March on" are not dates.
_YEAR_LEAD = {"in", "during", "of", "throughout", "since", "before", "after", "until", "till", "from", "between",
              "and", "to", "early", "mid", "late", "by", "through", "summer", "winter", "spring", "autumn", "fall"}
_MONTH_LEAD = _YEAR_LEAD | {"on", "last", "this", "next", "of", "around", "mid-", "over"}


def _rx(p: str) -> re.Pattern:
    return re.compile(p, re.I)


# ------------------------------------------------------------------ day arithmetic

def _month_start(y: int, m: int, shift: int = 0) -> date:
    k = y * 12 + (m - 1) + shift
    return date(k // 12, k % 12 + 1, 1)


def _add(d: date, unit: str, n: int) -> date:
    """d moved by n units (months and years on the calendar, the day clamped to the month's length)."""
    if unit == "day":
        return d + timedelta(days=n)
    if unit in ("week", "fortnight"):
        return d + timedelta(days=n * (14 if unit == "fortnight" else 7))
    months = n * {"month": 1, "year": 12, "decade": 120}[unit]
    first = _month_start(d.year, d.month, months)
    return first.replace(day=min(d.day, calendar.monthrange(first.year, first.month)[1]))


def _week_of(d: date) -> tuple[date, date]:
    start = d - timedelta(days=d.weekday())
    return start, start + timedelta(days=7)


def _period(d: date, unit: str) -> tuple[date, date]:
    """The calendar day / week / month / year / decade holding d."""
    if unit == "day":
        return d, d + timedelta(days=1)
    if unit in ("week", "fortnight"):
        return _week_of(d)
    if unit == "month":
        return date(d.year, d.month, 1), _month_start(d.year, d.month, 1)
    if unit == "decade":
        y = d.year - d.year % 10
        return date(y, 1, 1), date(y + 10, 1, 1)
    return date(d.year, 1, 1), date(d.year + 1, 1, 1)


def _unit(word: str) -> str:
    return word.lower().rstrip("s")  # "weeks" -> "week"


def _qty(m: re.Match) -> tuple[int, int] | None:
    loose = m.group("loose")
    if loose:
        return _LOOSE[" ".join(loose.lower().split())]
    num = m.group("num").lower()
    n = int(num) if num.isdigit() else _NUMBERS[num]
    return (n, n) if 0 <= n <= 500 else None


def _year_ok(y: int) -> bool:
    return 1000 <= y <= 2999


# ------------------------------------------------------------------ base expressions
# Each reader gets the match, the whole text and the reference day (None: relative ones fail) and answers
# (start day, end day, relative, kind) or None.

_PREV = re.compile(r"([^\W\d_]+-?)\s*$")


def _prev_word(text: str, i: int) -> str:
    m = _PREV.search(text, max(0, i - 40), i)
    return m.group(1).lower() if m else ""


def _is_month_word_ok(word: str) -> bool:
    # "May" and "March" are also a verb: without a day or year only their capitalised spelling is a month
    return word.lower() not in ("may", "march") or word[0].isupper()


def _iso(m, text, ref):
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    day = date(y, mo, d)
    return day, day + timedelta(days=1), False, "date"


def _d_month_y(m, text, ref):
    day = date(int(m.group("y")), _MONTHS[m.group("mon").lower()], int(m.group("d")))
    return day, day + timedelta(days=1), False, "date"


def _month_y(m, text, ref):
    y = int(m.group("y"))
    if not _year_ok(y):
        return None
    mo = _MONTHS[m.group("mon").lower()]
    return date(y, mo, 1), _month_start(y, mo, 1), False, "date"


def _iso_month(m, text, ref):
    y, mo = int(m.group(1)), int(m.group(2))
    return date(y, mo, 1), _month_start(y, mo, 1), False, "date"


def _latest(ref: date, month: int, day: int = 1) -> date:
    """The latest date with this month (and day) on or before ref."""
    for y in range(ref.year, max(ref.year - 8, 0), -1):  # a 29 February is at most 8 years back
        try:
            d = date(y, month, day)
        except ValueError:  # 29 February outside a leap year
            continue
        if d <= ref:
            return d
    raise ValueError(f"no {month}/{day} on or before {ref}")


def _d_month(m, text, ref):
    if ref is None or not _is_month_word_ok(m.group("mon")):
        return None
    mo, d = _MONTH_FULL[m.group("mon").lower()], int(m.group("d"))
    if not 1 <= d <= 31 or d > max(calendar.monthrange(2000, mo)[1], 0):
        return None
    day = _latest(ref, mo, d)
    return day, day + timedelta(days=1), True, "yearless"


def _month(m, text, ref):
    word = m.group("mon")
    if ref is None or not _is_month_word_ok(word) or _prev_word(text, m.start()) not in _MONTH_LEAD:
        return None
    mo = _MONTH_FULL[word.lower()]
    start = _latest(ref, mo)
    return start, _month_start(start.year, mo, 1), True, "yearless"


def _year(m, text, ref):
    y = int(m.group(1))
    if not _year_ok(y) or _prev_word(text, m.start()) not in _YEAR_LEAD:
        return None
    return date(y, 1, 1), date(y + 1, 1, 1), False, "date"


def _decade(m, text, ref):
    y = int(m.group(1))
    if not _year_ok(y):
        return None
    return date(y, 1, 1), date(y + 10, 1, 1), False, "date"


def _day_word(m, text, ref):
    if ref is None:
        return None
    w = " ".join(m.group(0).lower().split())
    shift = {"yesterday": -1, "last night": -1, "the day before yesterday": -2, "the day after tomorrow": 2,
             "tomorrow": 1}.get(w, 0)
    day = ref + timedelta(days=shift)
    return day, day + timedelta(days=1), True, "date"


def _this_last_next(m, text, ref):
    """last / this / next / past week, month, year, weekend, fortnight."""
    if ref is None:
        return None
    which = " ".join(m.group("which").lower().split())
    unit = _unit(m.group("u"))
    step = {"last": -1, "past": -1, "this past": -1, "previous": -1, "this": 0, "next": 1, "coming": 1,
            "this coming": 1}[which]
    if unit == "weekend":
        if step < 0:
            sat = ref - timedelta(days=(ref.weekday() - 5) % 7)  # latest Saturday on or before ref
            if sat + timedelta(days=2) > ref:  # that weekend is not over: the one before it
                sat -= timedelta(days=7)
        else:
            sat = ref + timedelta(days=(5 - ref.weekday()) % 7) if ref.weekday() != 6 else ref - timedelta(days=1)
            if step > 0:
                sat += timedelta(days=7)
        return sat, sat + timedelta(days=2), True, "date"
    if unit == "fortnight":
        start, _ = _week_of(ref)
        return _add(start, "week", 2 * step), _add(start, "week", 2 * step + 2), True, "date"
    start, _ = _period(ref, unit)
    return _add(start, unit, step), _add(start, unit, step + 1), True, "date"


def _season(m, text, ref):
    word = m.group("season").lower()
    first = _SEASONS[word]
    which = (m.group("which") or "").lower()
    y = m.group("y")
    if y:
        y = int(y)
        if not _year_ok(y):
            return None
        start = date(y, first, 1)  # winter 2023 = December 2023 .. February 2024
        return start, _month_start(y, first, 3), False, "date"
    if ref is None or (not which and _prev_word(text, m.start()) not in _MONTH_LEAD):
        return None
    # the season that began latest on or before ref (this one), then step
    start = _latest(ref, first)
    if which in ("last", "past", "previous"):
        if _month_start(start.year, first, 3) > ref:  # still running: the one before
            start = date(start.year - 1, first, 1)
    elif which == "next":
        start = date(start.year + 1, first, 1)
    # "in (the) summer" names no year, like "in June": as likely a habit or a plan as a memory
    return start, _month_start(start.year, first, 3), True, "date" if which else "yearless"


def _rel_month(m, text, ref):
    """last / this / next June."""
    if ref is None or not _is_month_word_ok(m.group("mon")):
        return None
    which = m.group("which").lower()
    mo = _MONTH_FULL[m.group("mon").lower()]
    if which == "this":
        start = date(ref.year, mo, 1)
    elif which == "next":
        start = date(ref.year + (mo <= ref.month), mo, 1)
    else:
        start = date(ref.year - (mo >= ref.month), mo, 1)
    return start, _month_start(start.year, mo, 1), True, "date"


def _weekday(m, text, ref):
    """last / on / this / next Friday: "last" and "on" are the latest such day strictly before ref."""
    if ref is None:
        return None
    which = (m.group("which") or "").lower()
    word = m.group("wd")
    if word.lower() not in _WEEKDAY_FULL and not word[0].isupper():  # "sun", "sat", "wed" are words too
        return None
    wd = _WEEKDAYS[word.lower()]
    if not which and _prev_word(text, m.start()) != "on":
        return None
    if which in ("this",):
        day = _week_of(ref)[0] + timedelta(days=wd)
    elif which in ("next", "coming"):
        day = ref + timedelta(days=(wd - ref.weekday()) % 7 or 7)
    else:
        day = ref - timedelta(days=(ref.weekday() - wd) % 7 or 7)
    kind = "weekday" if which in ("", "on") else "date"
    return day, day + timedelta(days=1), True, kind


def _ago(m, text, ref):
    if ref is None:
        return None
    q = _qty(m)
    if q is None:
        return None
    unit = _unit(m.group("unit"))
    lo, hi = q
    first = _period(_add(ref, unit, -hi), unit)[0]
    last = _period(_add(ref, unit, -lo), unit)[1]
    return first, last, True, "date"


def _past_n(m, text, ref):
    """(in / over) the last / past N days, weeks ...: up to and including the reference day."""
    if ref is None:
        return None
    q = _qty(m) if (m.group("num") or m.group("loose")) else (1, 1)
    if q is None:
        return None
    unit = _unit(m.group("unit"))
    return _add(ref, unit, -q[1]), ref + timedelta(days=1), True, "date"


def _earlier_later(m, text, ref):
    if ref is None:
        return None
    unit = _unit(m.group("u"))
    start, end = _period(ref, unit)
    if m.group("el").lower() == "earlier":
        return start, ref + timedelta(days=1), True, "date"
    return ref, end, True, "date"


def _past_n_one(m, text, ref):
    """"the past week" (no number): the last 7 days up to the reference day, not the calendar week before."""
    if ref is None:
        return None
    unit = _unit(m.group("unit"))
    return _add(ref, unit, -1), ref + timedelta(days=1), True, "date"


_BASE = [
    (_rx(r"(\d{4})-(\d{1,2})-(\d{1,2})(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"), _iso),
    (_rx(r"(?P<d>\d{1,2})" + _ORD + r"\s+(?:of\s+)?(?P<mon>" + _MON + r")\.?,?\s+(?P<y>\d{4})\b"), _d_month_y),
    (_rx(r"(?P<mon>" + _MON + r")\.?\s+(?P<d>\d{1,2})" + _ORD + r",?\s+(?P<y>\d{4})\b"), _d_month_y),
    (_rx(r"(?P<mon>" + _MON + r")\.?,?\s+(?:of\s+)?(?P<y>\d{4})\b"), _month_y),
    (_rx(r"(\d{4})-(\d{2})\b(?!-\d)"), _iso_month),
    (_rx(r"(?P<d>\d{1,2})" + _ORD + r"\s+(?:of\s+)?(?P<mon>" + _MONF + r")\b"), _d_month),
    (_rx(r"(?P<mon>" + _MONF + r")\s+(?P<d>\d{1,2})" + _ORD + r"\b(?![:.]\d)"), _d_month),
    (_rx(r"(?P<which>last|this|next)\s+(?P<mon>" + _MONF + r")\b"), _rel_month),
    (_rx(r"(?P<mon>" + _MONF + r")\b"), _month),
    (_rx(r"(\d{3}0)'?s\b"), _decade),
    (_rx(r"(\d{4})\b(?!-\d|[.,:]\d|%)"), _year),
    (_rx(r"(?:the\s+day\s+(?:before\s+yesterday|after\s+tomorrow)|yesterday|last\s+night|today|tonight|tomorrow"
         r"|this\s+(?:morning|afternoon|evening))\b"), _day_word),
    (_rx(r"(?:(?:in|over|during|within)\s+)?(?:the\s+)?(?:last|past)\s+(?:" + _QTY + r")\s+" + _UNIT + r"\b"),
     _past_n),
    (_rx(r"(?:(?:in|over|during|within)\s+)?the\s+(?:last|past)\s+(?P<unit>week|month|year|fortnight)\b"),
     _past_n_one),
    (_rx(r"(?P<which>this\s+past|this\s+coming|last|past|previous|this|next|coming)\s+"
         r"(?P<u>weekend|week|month|year|fortnight)\b"), _this_last_next),
    (_rx(r"(?:(?P<which>last|this|next|past|previous)\s+|the\s+)?(?P<season>spring|summer|autumn|fall|winter)"
         r"(?:\s+(?:of\s+)?(?P<y>\d{4}))?\b"), _season),
    (_rx(r"(?:(?P<which>last|this|next|coming|past)\s+)?(?P<wd>" + _WD + r")\.?(?!\w)"), _weekday),
    (_rx(r"(?:" + _QTY + r")\s+" + _UNIT + r"\s+(?:ago|back)\b"), _ago),
    (_rx(r"(?P<el>earlier|later)\s+this\s+(?P<u>week|month|year)\b"), _earlier_later),
]


def _base_at(text: str, i: int, ref: date | None):
    """The longest base expression starting at i: (end, start day, end day, relative, kind) or None."""
    best = None
    for rx, read in _BASE:
        m = rx.match(text, i)
        if not m or (best and m.end() <= best[0]):
            continue
        try:
            w = read(m, text, ref)
        except (ValueError, OverflowError, KeyError):  # 30 February, year 0 ...
            w = None
        if w is not None:
            best = (m.end(), *w)
    return best


# ------------------------------------------------------------------ combinations

_BETWEEN = _rx(r"(?:between|from)\s+")
_AND = _rx(r"\s*(?:and|to|until|till|through|-)\s+")
_OPEN = _rx(r"(?P<op>since|after|before|until|till|prior\s+to|up\s+to)\s+")
_SHIFT = _rx(r"(?:(?:" + _QTY + r")\s+)?(?P<unit>day|week|fortnight|month|year)s?\s+(?P<dir>before|after|"
             r"earlier\s+than|later\s+than|prior\s+to)\s+")
_ANCHOR = _rx(r"the\s+(?:(?P<wknd>weekend)|(?P<wd>" + _WD + r"))\s+(?P<dir>before|after)\s+")
_PART = _rx(r"(?P<part>early|mid|late|the\s+(?:beginning|start|middle|end)\s+of)(?:\s+|-)")
_REANCHOR = _rx(r"\s+(?:before|prior\s+to)\s+")
_FAR = date(9999, 12, 31)  # a stand-in reference, only to find where a yearless first end stops
_PART_OF = {"early": 0, "beginning": 0, "start": 0, "mid": 1, "middle": 1, "late": 2, "end": 2}


def _part(start: date, end: date, which: int) -> tuple[date, date]:
    days = (end - start).days
    if days <= 1:
        return start, end
    if start.day == 1 and end == _month_start(start.year, start.month, 1):  # a month: 1-10, 11-20, 21-end
        cuts = [start, start.replace(day=11), start.replace(day=21), end]
    elif start.month == 1 and start.day == 1 and end == date(start.year + 1, 1, 1):  # a year: thirds of 4 months
        cuts = [start, date(start.year, 5, 1), date(start.year, 9, 1), end]
    else:
        third = days / 3
        cuts = [start, start + timedelta(days=round(third)), start + timedelta(days=round(2 * third)), end]
    return cuts[which], cuts[which + 1]


def _between(text: str, i: int, ref: date | None):
    """between X and Y, from X to Y; the first end may lack its year ("between March and May 2023")."""
    m = _BETWEEN.match(text, i)
    if not m:
        return None
    a = _base_at(text, m.end(), ref or _FAR)
    m2 = _AND.match(text, a[0]) if a else None
    b = _base_at(text, m2.end(), ref) if m2 else None
    if a and b and a[4] == "yearless":
        a = _base_at(text, m.end(), b[2] - timedelta(days=1))
        a = a and (*a[:3], b[3], b[4])
    elif a and ref is None and a[3]:
        a = None
    if a and b and b[2] > a[1]:
        return b[0], a[1], b[2], a[3] or b[3], "date"
    return None


def _open(text: str, i: int, ref: date | None):
    """since / after / before / until X: open-ended."""
    m = _OPEN.match(text, i)
    if not m:
        return None
    a = _expr_at_inner(text, m.end(), ref)
    if not a:
        return None
    op = " ".join(m.group("op").lower().split())
    if op == "since":
        return a[0], a[1], None, a[3], "open"
    if op == "after":
        return a[0], a[2], None, a[3], "open"
    if op in ("until", "till", "up to"):
        return a[0], None, a[2], a[3], "open"
    return a[0], None, a[1], a[3], "open"


def _shift(text: str, i: int, ref: date | None):
    """(N) days / weeks / months / years before / after X."""
    m = _SHIFT.match(text, i)
    if not (m and (m.group("num") or m.group("loose") or text[i:m.start("unit")].strip() == "")):
        return None
    q = _qty(m) if (m.group("num") or m.group("loose")) else (1, 1)
    a = _base_at(text, m.end(), ref)
    if not (a and q and q[0] >= 1):
        return None
    unit = _unit(m.group("unit"))
    lo, hi = q
    if m.group("dir").lower().startswith(("before", "earlier", "prior")):
        return a[0], _add(a[1], unit, -hi), _add(a[1], unit, -(lo - 1)), a[3], "date"
    return a[0], _add(a[2], unit, lo - 1), _add(a[2], unit, hi), a[3], "date"


def _around(text: str, i: int, ref: date | None):
    """the weekend / the Friday before / after X."""
    m = _ANCHOR.match(text, i)
    if not m:
        return None
    a = _base_at(text, m.end(), ref)
    if not a:
        return None
    after = m.group("dir").lower() == "after"
    if m.group("wknd"):
        if after:
            sat = a[2] + timedelta(days=(5 - a[2].weekday()) % 7)
        else:
            sat = a[1] - timedelta(days=(a[1].weekday() - 5) % 7 or 7)
            if sat + timedelta(days=2) > a[1]:
                sat -= timedelta(days=7)
        return a[0], sat, sat + timedelta(days=2), a[3], "date"
    wd = _WEEKDAYS[m.group("wd").lower()]
    if after:
        day = a[2] + timedelta(days=(wd - a[2].weekday()) % 7)
    else:
        day = a[1] - timedelta(days=(a[1].weekday() - wd) % 7 or 7)
    return a[0], day, day + timedelta(days=1), a[3], "date"


def _narrowed(text: str, i: int, ref: date | None):
    """early / mid / late X, the beginning / middle / end of X."""
    m = _PART.match(text, i)
    if not m:
        return None
    a = _base_at(text, m.end(), ref)
    if a is None:  # "early 2023": a bare year after early / mid / late
        y = re.match(r"(\d{4})\b", text[m.end():])
        if y and _year_ok(int(y.group(1))):
            yy = int(y.group(1))
            a = (m.end() + 4, date(yy, 1, 1), date(yy + 1, 1, 1), False, "date")
    if not a:
        return None
    words = m.group("part").lower().split()
    word = words[1] if words[0] == "the" else words[0]
    s, e = _part(a[1], a[2], _PART_OF[word])
    return a[0], s, e, a[3], a[4]


def _reanchored(text: str, i: int, ref: date | None, a):
    """A relative expression re-anchored on a date that follows it ("last weekend before April 10, 2023")."""
    m = _REANCHOR.match(text, a[0])
    if not m:
        return None
    b = _base_at(text, m.end(), ref)
    if b and not b[3]:
        again = _base_at(text, i, b[1])
        if again and again[0] == a[0]:
            return b[0], again[1], again[2], False, again[4]
    return None


#: The combinations tried before a base expression, in order (each: text, position, reference -> a reading or None).
_COMBOS = [_between, _open, _shift, _around]
#: Tried on the base expression's place, before it.
_NARROW = [_narrowed]
#: Tried after a relative base expression (with it as the last argument).
_AFTER = [_reanchored]


def _expr_at(text: str, i: int, ref: date | None):
    """The expression (combinations first, then a base one) starting at i:
    (end, start day | None, end day | None, relative, kind) or None."""
    for combo in _COMBOS:
        got = combo(text, i, ref)
        if got:
            return got
    return _expr_at_inner(text, i, ref)


def _expr_at_inner(text: str, i: int, ref: date | None):
    """A base expression, possibly narrowed (early / mid / late) or re-anchored ("last weekend before May 8")."""
    for narrow in _NARROW:
        got = narrow(text, i, ref)
        if got:
            return got
    a = _base_at(text, i, ref)
    if a and a[3]:
        for after in _AFTER:
            got = after(text, i, ref, a)
            if got:
                return got
    return a


# ------------------------------------------------------------------ scanning

_START = re.compile(r"(?<![\w-])(?=\w)")
_TRIGGER = _rx(r"\d{4}|\b(?:" + "|".join([_MON, _WD, "yesterday|today|tonight|tomorrow|morning|afternoon|evening|night",
                                          "day|days|week|weeks|weekend|fortnight|month|months|year|years|decades?",
                                          "spring|summer|autumn|fall|winter"]) + r")\b")


# Words an expression can begin with (or a digit): other positions are skipped without trying every pattern.
_STARTS = frozenset(
    "between from since after before until till prior up the a an couple few several early mid late yesterday "
    "today tonight tomorrow this last next past coming previous earlier later in over during within day week "
    "fortnight month year decade spring summer autumn fall winter".split()) | set(_NUMBERS) | set(_MONTHS) \
    | set(_WEEKDAYS)
_WORD = re.compile(r"[^\W_]+")
_REACH = 40  # characters from an expression's first word to its first trigger ("between the 1st of March")


def _epoch(d: date | None, default: float) -> float:
    if d is None:
        return default
    return datetime(d.year, d.month, d.day, tzinfo=timezone.utc).timestamp()


def _ref_day(ref: datetime | date | float | None) -> date | None:
    if ref is None:
        return None
    if isinstance(ref, (int, float)):
        return datetime.fromtimestamp(ref, timezone.utc).date()
    if isinstance(ref, datetime):
        return (ref.astimezone(timezone.utc) if ref.tzinfo else ref).date()
    return ref


def _scan(text: str, ref: datetime | date | float | None, first: bool) -> list[TimeSpan]:
    triggers = [m.start() for m in _TRIGGER.finditer(text)]
    if not triggers:
        return []
    day = _ref_day(ref)
    out: list[TimeSpan] = []
    pos = 0
    for sm in _START.finditer(text):
        i = sm.start()
        if i < pos:
            continue
        w = _WORD.match(text, i)
        if w is None or not (w.group(0)[0].isdigit() or w.group(0).lower() in _STARTS):
            continue
        # every expression holds a trigger word (a month, "week", a year ...) within its first few words
        k = bisect.bisect_left(triggers, i)
        if k == len(triggers) or triggers[k] - i > _REACH:
            continue
        try:
            got = _expr_at(text, i, day)
        except (ValueError, OverflowError, KeyError):
            got = None
        if got is None:
            continue
        end, s, e, relative, kind = got
        if s is not None and e is not None and e <= s:
            continue
        out.append(TimeSpan(_epoch(s, -math.inf), _epoch(e, math.inf), (i, end), text[i:end], relative, kind))
        if first:
            break
        pos = end
    return out


def find(text: str, ref: datetime | date | float | None = None) -> TimeSpan | None:
    """The first time expression in text (relative ones read against ref, a datetime / date / epoch
    seconds; without ref only explicit dates are read); None when there is none (never an error)."""
    got = _scan(text, ref, True)
    return got[0] if got else None


def find_all(text: str, ref: datetime | date | float | None = None) -> list[TimeSpan]:
    """Every time expression in text, left to right, none overlapping."""
    return _scan(text, ref, False)


#: The longest span a turn's own words may give it as its event time (a year: "last year" yes, "a few years ago"
#: no). The time channel counts the share of it inside the question's span, so a year-wide one weighs 31/365
#: for a question about one month of it.
MAX_EVENT_S = 366 * 86400


def event_span(text: str, ref: datetime | date | float | None) -> tuple[float, float] | None:
    """The time a conversation turn speaks of, read against its session's time: the hull of its bounded,
    dated expressions ("yesterday", "last week", "two days ago", "last Friday", "on 3 May 2023").

    Left out: open spans ("since May"), a month, season or day without its year and "on Friday" (said in
    May, "in October" or "on Friday" is as likely a plan as a memory), the session day itself ("today"),
    and spans longer than a year ("a few years ago"). A span of up to a year is kept ("last year", "last
    summer"): the time channel weighs it by the share of it inside the question's span (_channels.in_time),
    so it counts fully for a question about that year, little for one about a week of it."""
    if ref is None:
        return None
    spans = [s for s in _scan(text, ref, False) if s.bounded and s.kind == "date" and s.end - s.start <= MAX_EVENT_S]
    if not spans:
        return None
    day = _ref_day(ref)
    start = _epoch(day, 0.0)
    spans = [s for s in spans if (s.start, s.end) != (start, start + 86400)]
    if not spans:
        return None
    return min(s.start for s in spans), max(s.end for s in spans)


def explicit_window(text: str) -> tuple[float, float] | None:
    """The first explicit (reference-free) date, month or year in text as (start, end); None if none."""
    s = find(text, None)
    return (s.start, s.end) if s else None
