"""Image archives: `export` writes an image's nodes and layers (not its base) as a tar; `import_`
reads one back, verifying every layer against its digest before it enters the store.

The tar holds `hutch-image.json` (format 1: the nodes bottom to top, the base reference, each
layer's metadata with its opaque directories, which tar does not carry as xattrs) and
`layers/<digest>/...`. Import refuses hard links, devices other than whiteouts, and any entry
whose path passes through a symlink.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from hutch._core.errors import ImageError
from hutch.sandbox._layers import (
    _ID_RE, _TMP, OPAQUE_XATTRS, PREFIX, _commit_dir, chain, find, layer_fs, layers_dir, private_dir, put_node,
    tree_digest,
)

MANIFEST = "hutch-image.json"


def export(key: str, fileobj) -> dict:
    """Write image `key` (its nodes and layers, not its base) as a tar stream to `fileobj`."""
    top = find(key)
    nodes, base = chain(top["id"])
    manifest = {"format": 1, "top": top["id"], "base": base, "nodes": list(reversed(nodes)),
                "layers": {}}
    for n in nodes:
        if n.get("layer"):
            manifest["layers"][n["layer"]] = json.loads((layers_dir() / n["layer"] / "layer.json").read_text())
    data = json.dumps(manifest).encode()
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for digest in manifest["layers"]:
            tar.add(layer_fs(digest), arcname=f"layers/{digest}", recursive=True)
    return {"ref": PREFIX + top["id"], "id": top["id"], "layers": len(manifest["layers"])}


_NO_FILTER = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _through_symlink(root: Path, parts) -> bool:
    p = root
    for part in parts:
        p = p / part
        if p.is_symlink():
            return True
    return False


def import_(fileobj) -> dict:
    """Read a tar made by export(); every layer is verified against its digest before it is stored."""
    base = layers_dir()
    private_dir(base)
    work = Path(tempfile.mkdtemp(prefix=_TMP, dir=base))
    try:
        manifest = None
        try:
            with tarfile.open(fileobj=fileobj, mode="r|") as tar:
                for m in tar:
                    if m.name == MANIFEST:
                        manifest = json.loads(tar.extractfile(m).read())
                        continue
                    parts = Path(m.name).parts
                    if len(parts) < 2 or parts[0] != "layers" or not _ID_RE.match(parts[1]) or ".." in parts \
                            or m.islnk():
                        raise ImageError(f"the image archive holds an unexpected entry {m.name!r}; "
                                         "import only files made by `hutch image export`.")
                    if m.isblk() or m.isfifo() or (m.ischr() and (m.devmajor or m.devminor)) or \
                            _through_symlink(work, parts[:-1]):
                        raise ImageError(f"the image archive holds an unsafe entry {m.name!r} (a device, or a "
                                         "path through a symlink); import only files made by `hutch image export`.")
                    tar.extract(m, work, set_attrs=True, numeric_owner=True, **_NO_FILTER)
        except (tarfile.TarError, ValueError, KeyError) as e:
            raise ImageError(f"the image archive is not readable ({e}); give a file made by `hutch image export`.") from e
        if not isinstance(manifest, dict) or manifest.get("format") != 1:
            raise ImageError("the archive has no hutch image manifest; give a file made by `hutch image export`.")
        for digest, meta in manifest["layers"].items():
            tree = work / "layers" / digest
            if not tree.is_dir():
                tree.mkdir(parents=True)   # an empty layer has no entries in the archive
            for rel in meta.get("opaque", ()):   # both: see _layers._Walker.walk_dir
                for x in OPAQUE_XATTRS:
                    os.setxattr(tree / rel.lstrip("/"), x, b"y")
            got = tree_digest(tree)
            if got != digest:
                raise ImageError(f"layer {digest[:12]} in the archive does not match its digest (got {got[:12]}); "
                                 "the file is damaged: export it again.")
            tmp = Path(tempfile.mkdtemp(prefix=_TMP, dir=base))
            os.rename(tree, tmp / "fs")
            _commit_dir(tmp, digest, meta)
        for n in manifest["nodes"]:
            put_node(n["id"], n["parent"], layer=n.get("layer"), kind=n.get("kind", "import"), env=n.get("env"),
                     workdir=n.get("workdir"), name=n.get("name"), description=n.get("description", ""),
                     pinned=n["id"] == manifest["top"] or bool(n.get("pinned")))
        return {"ref": PREFIX + manifest["top"], "id": manifest["top"], "base": manifest["base"],
                "layers": len(manifest["layers"])}
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["MANIFEST", "export", "import_"]
