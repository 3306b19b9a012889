"""Rebuild the wheel of an installed distribution from its installed files, each checked against its RECORD.

    python third_party/rebuild_wheel.py OUTDIR NAME [NAME ...]      (run with the venv's python)

What third_party/wheels/ holds was made so (third_party/README.md says why): a wheel's RECORD names the sha256
of every file it installed, and pip copies them into the installed RECORD, so a file whose hash matches is the
wheel's file, byte for byte. Files pip made at install time are left out, as a wheel never held them: the
__pycache__ byte code, INSTALLER, REQUESTED, direct_url.json and the console scripts of entry_points.txt (pip
writes them again); a script pip gave the venv's python in its first line gets back the wheel's `#!python`. A
file that does not match its RECORD stops the rebuild: only unmodified wheels are rebuilt.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import sys
import zipfile
from importlib import metadata

_MADE_BY_PIP = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rebuild(name: str, outdir: str) -> str:
    dist = metadata.distribution(name)
    info = os.path.normpath(str(dist._path))  # type: ignore[attr-defined]  # the .dist-info directory
    site = os.path.dirname(info)
    infoname = os.path.basename(info)
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    scripts = {ep.name for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}
    stem = infoname[: -len(".dist-info")]
    datadir = stem + ".data"
    entries: list[tuple[str, bytes]] = []
    for row in csv.reader(io.StringIO(dist.read_text("RECORD") or "")):
        path, digest = row[0], row[1] if len(row) > 1 else ""
        parts = path.split("/")
        if "__pycache__" in parts or path.endswith(".pyc"):
            continue
        if parts[0] == infoname and parts[-1] in _MADE_BY_PIP:
            continue
        full = os.path.normpath(os.path.join(site, path))
        with open(full, "rb") as f:
            data = f.read()
        if not digest or _digest(data) != digest:
            raise SystemExit(f"{name}: {path} differs from its RECORD ({digest or 'no hash'}); not rebuilt")
        if path.startswith("../"):
            bindir = os.path.join(sys.prefix, "bin")
            if os.path.dirname(full) == bindir and os.path.basename(full) in scripts:
                continue  # a console script pip writes from entry_points.txt
            if os.path.dirname(full) == bindir:
                if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
                    data = b"#!python\n" + data.split(b"\n", 1)[1]  # the shebang pip rewrote
                path = f"{datadir}/scripts/{os.path.basename(full)}"
            elif full.startswith(sys.prefix + os.sep):
                path = f"{datadir}/data/{os.path.relpath(full, sys.prefix)}"
            else:
                raise SystemExit(f"{name}: {path} lies outside the venv; not rebuilt")
        entries.append((path, data))
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in entries:
        writer.writerow([path, _digest(data), len(data)])
    writer.writerow([f"{infoname}/RECORD", "", ""])
    def part(i: int) -> str:   # python, abi or platform tags of the WHEEL file, as a filename joins them
        return ".".join(sorted({t.split("-")[i] for t in tags}))

    out = os.path.join(outdir, f"{stem}-{part(0)}-{part(1)}-{part(2)}.whl")
    tmp = out + ".tmp"
    members = sorted(entries, key=lambda e: (e[0].startswith(infoname + "/"), e[0]))
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for path, data in [*members, (f"{infoname}/RECORD", record.getvalue().encode())]:
            zi = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            z.writestr(zi, data)
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    os.makedirs(argv[0], exist_ok=True)
    for name in argv[1:]:
        print(rebuild(name, argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
