"""Image archives: `export` writes an image's nodes and layers (not its base) as a tar; `import_`
reads one back as hostile input (untar.py) and stores nothing it has not verified.

The tar holds `hutch-image.json` first (format 1: the nodes bottom to top, the base reference, each
layer's metadata with its opaque directories, which tar does not carry as xattrs), then
`layers/<digest>/...`. Import validates the manifest (a linear chain of nodes from the base to
`top`, every field typed and bounded, every layer used), extracts each layer into a private temp
dir without ever following a link (untar.py), recomputes every layer's digest with the store's own
canonical walk, and only then renames the layers into the store and records the nodes.
"""

from __future__ import annotations

import io
import json
import tarfile
import time

from hutch._core.errors import ConfigError, InvalidArchiveError, StateError
from hutch.sandbox._host.layers import (
    ID_RE, KINDS, NAME_POLICIES, NAME_RE, PREFIX, chain, chain_digest, commit_dir, find, is_own_snapshot, layer_fs,
    layers_dir, measure_tree, name_moves, private_dir, put_nodes,
)
from hutch.sandbox._host.untar import MANIFEST, ImportLimits, components, read_archive, refuse

MAX_NODES = 4096           # nodes in one manifest
_TEXT_MAX = 4096           # a workdir, base path, description, env name
_ENV_MAX = 1024            # env entries of one node
_VALUE_MAX = 32 << 10      # one env value


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


def _text(value, what: str, limit: int = _TEXT_MAX) -> str:
    if not isinstance(value, str) or "\0" in value or len(value) > limit:
        raise refuse(MANIFEST, f"has {what} that is not a string of at most {limit} characters without NUL")
    return value


def _node(n, parent: str, layers: dict) -> dict:
    if not isinstance(n, dict) or not isinstance(n.get("id"), str) or not ID_RE.match(n["id"]):
        raise refuse(MANIFEST, "has a node that is not an object with a 64-hex-digit id")
    what = f"node {n['id'][:12]}"
    if n.get("parent") != parent:
        raise refuse(MANIFEST, f"has {what} whose parent is not {parent[:70]!r} (the nodes must be one chain "
                     "from the base up to `top`)")
    layer = n.get("layer")
    if layer is not None and layer not in layers:
        raise refuse(MANIFEST, f"has {what} whose layer is not among the archive's layers")
    kind = n.get("kind", "import")
    if kind not in KINDS:
        raise refuse(MANIFEST, f"has {what} of kind {str(kind)[:20]!r} (one of {', '.join(KINDS)})")
    env = n.get("env") or {}
    if not isinstance(env, dict) or len(env) > _ENV_MAX:
        raise refuse(MANIFEST, f"has {what} whose env is not an object of at most {_ENV_MAX} entries")
    for k, v in env.items():
        if not _text(k, f"an env name in {what}") or "=" in k:
            raise refuse(MANIFEST, f"has an env name in {what} that is empty or holds '='")
        _text(v, f"an env value in {what}", _VALUE_MAX)
    workdir = n.get("workdir")
    if workdir is not None and not _text(workdir, f"the workdir of {what}").startswith("/"):
        raise refuse(MANIFEST, f"has {what} whose workdir is not an absolute path")
    name = n.get("name")
    if name is not None and (not isinstance(name, str) or not NAME_RE.match(name)):
        raise refuse(MANIFEST, f"has {what} whose name is not letters, digits, '_', '.', ':', '-'")
    pinned = n.get("pinned", False)
    if not isinstance(pinned, bool):
        raise refuse(MANIFEST, f"has {what} whose pinned flag is not true or false")
    return {"id": n["id"], "parent": parent, "layer": layer, "kind": kind, "env": dict(env), "workdir": workdir,
            "name": name, "pinned": pinned, "description": _text(n.get("description", ""), f"the description of {what}")}


def _layer_meta(digest, meta) -> dict:
    if not isinstance(digest, str) or not ID_RE.match(digest) or not isinstance(meta, dict):
        raise refuse(MANIFEST, "lists a layer that is not a 64-hex-digit digest with an object of metadata")
    files, size, opaque = meta.get("files"), meta.get("size"), meta.get("opaque", [])
    if type(files) is not int or type(size) is not int or files < 1 or size < 0:
        raise refuse(MANIFEST, f"declares no entry count or size for layer {digest[:12]}")
    if not isinstance(opaque, list) or len(opaque) > files:
        raise refuse(MANIFEST, f"lists more opaque directories than entries for layer {digest[:12]}")
    return {"files": files, "size": size, "opaque": list(opaque)}


def check_manifest(m, limits: ImportLimits) -> dict:
    """The manifest, validated like any other input (see the module docstring); refused as an InvalidArchiveError."""
    if not isinstance(m, dict) or m.get("format") != 1:
        raise refuse(MANIFEST, "is not a hutch image manifest of format 1")
    nodes, layers, base = m.get("nodes"), m.get("layers"), m.get("base")
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise refuse(MANIFEST, f"lists no image, or more than {MAX_NODES} nodes")
    if not isinstance(layers, dict):
        raise refuse(MANIFEST, "has no object of layers")
    if base != "debian-slim" and not (isinstance(base, str) and base.startswith("dir:/")
                                      and _text(base, "a base reference")):
        raise refuse(MANIFEST, "names a base that is neither 'debian-slim' nor 'dir:/<absolute path>'")
    metas = {d: _layer_meta(d, meta) for d, meta in layers.items()}
    if sum(v["files"] for v in metas.values()) >= limits.entries:
        raise InvalidArchiveError(f"the image archive declares more than {limits.entries} entries (HUTCH_IMPORT_MAX_ENTRIES "
                         "of the daemon); raise that limit if the archive is yours.")
    out, parent, seen = [], base, set()
    for n in nodes:
        node = _node(n, parent, metas)
        if node["id"] in seen:
            raise refuse(MANIFEST, f"lists node {node['id'][:12]} twice")
        seen.add(node["id"])
        out.append(node)
        parent = PREFIX + node["id"]
    if m.get("top") != out[-1]["id"]:
        raise refuse(MANIFEST, "names a `top` that is not the last node of its chain")
    unused = set(metas) - {n["layer"] for n in out}
    if unused:
        raise refuse(MANIFEST, f"lists layer {sorted(unused)[0][:12]}, which no node of it uses")
    for d, meta in metas.items():
        for rel in meta["opaque"]:
            if not isinstance(rel, str) or not rel.startswith("/"):
                raise refuse(MANIFEST, f"names an opaque directory of layer {d[:12]} that is not an absolute path")
            if rel != "/":
                components(rel[1:], f"opaque directory {rel[:100]!r}")
    return {"top": out[-1]["id"], "base": base, "nodes": out, "layers": metas}


#: `import_(base=ANY_BASE)`: whatever base the manifest names (an importer told the chain's digest by its source).
ANY_BASE = "*"


def _base_allowed(manifest: dict, base: str | None) -> dict:
    """A "dir:" base is a host directory that every sandbox of the image sees as its root: the archive may not
    choose it. The importer names the base it means (`base`), or accepts any (ANY_BASE) when it was given the
    image's digest by a source it runs (a fleet node); with neither, only "debian-slim" is taken."""
    got = manifest["base"]
    if base == ANY_BASE:
        return manifest
    if base is not None and base != got:
        raise InvalidArchiveError(f"the image archive sits on base {got[:200]!r}, which is not the base {base[:200]!r} "
                                  "its importer named; nothing was imported.")
    if base is None and got.startswith("dir:"):
        raise InvalidArchiveError(
            f"the image archive sits on the host directory {got[4:][:200]} (base {got[:200]!r}), which every sandbox "
            "of it would see as its root; an archive may not choose a host directory, so nothing was imported. If you "
            f"mean to give its sandboxes that directory, import it with base={got[:200]!r} (`hutch image import FILE "
            f"--base {got[:200]}`).")
    return manifest


def _expected(manifest: dict, digest: str | None) -> dict:
    if digest is not None and chain_digest(manifest["nodes"], manifest["base"]) != digest:
        raise InvalidArchiveError(f"the image archive is not the image of digest {digest[:12]} its importer was told "
                                  f"to expect (its manifest's chain digests to "
                                  f"{chain_digest(manifest['nodes'], manifest['base'])[:12]}); nothing was imported: "
                                  "the transfer was damaged or forged, fetch it again.")
    return manifest


def _name_refusal(manifest: dict, moves: list[tuple[dict, dict]]) -> StateError:
    """The refusal of an import that would move a name of this host (layers.name_moves), naming the image that
    has it here, the archive's image (its digest: what it runs) and the flag that would move it."""
    node, here = moves[0]
    ids = [n["id"] for n in manifest["nodes"]]
    digest = chain_digest(manifest["nodes"][:ids.index(node["id"]) + 1], manifest["base"]) \
        if node["id"] in ids else "?"
    if here["id"] != node["id"]:
        what = (f"the name {node['name']!r} names image {PREFIX}{here['id'][:12]} here, and the archive gives it to "
                f"its image {PREFIX}{node['id'][:12]} (digest {digest[:12]})")
    else:
        what = (f"image {PREFIX}{here['id'][:12]} is here under the name {here['name']!r}, and the archive names it "
                f"{node['name']!r} (digest {digest[:12]}), which would take {here['name']!r} from it")
    more = f" (and {len(moves) - 1} more name(s) of it)" if len(moves) > 1 else ""
    return StateError(f"{what}{more}; an import does not move a name to other content unless told to, so nothing "
                      "was imported. If that name is to run the archive's image, import it with replace=True "
                      "(`hutch image import FILE --replace`, POST /v1/images/import?replace=1); else remove or rename "
                      "the image here first (`hutch image rm`).")


def _names_free(manifest: dict, names: str) -> dict:
    """With names="refuse", an archive whose names would move one of this host's is refused before any layer
    is read (put_nodes checks again under the store lock, where it counts)."""
    if names == "refuse" and (moves := name_moves(manifest["nodes"])):
        raise _name_refusal(manifest, moves)
    return manifest


#: import_'s `names`: layers.NAME_POLICIES, or "none": no name of the archive's is taken (a memory snapshot's
#: filesystem, which its snapshot names by id).
IMPORT_NAMES = (*NAME_POLICIES, "none")


def import_(fileobj, limits: ImportLimits | None = None, *, digest: str | None = None,
            base: str | None = None, names: str = "refuse", name_check=None) -> dict:
    """Read a tar made by export(); nothing is stored unless every layer matches its digest (see above) and,
    given `digest` (the source's chain_digest of the image), the manifest's chain has that digest; its base
    must be the `base` the importer names, and may be a host directory only then (`_base_allowed`). A name the
    archive gives a node never moves from another image of this host, nor off a node here under another name,
    unless `names` (layers.NAME_POLICIES) is "replace": "refuse" refuses such an archive (StateError), "keep"
    stores it with this host's names left where they are, "none" takes none of the archive's. `name_check(name)`
    raises for a name the archive may not bring (the daemon's: a tenant's, unless imported for that tenant).
    All of it is checked before any layer is read."""
    if names not in IMPORT_NAMES:
        raise ConfigError(f"names={names!r} must be one of {', '.join(IMPORT_NAMES)}.")
    limits = limits or ImportLimits.from_env()
    store = layers_dir()
    private_dir(store)

    def check(m):
        m = _base_allowed(_expected(check_manifest(m, limits), digest), base)
        if names == "none":
            m = {**m, "nodes": [{**n, "name": None} for n in m["nodes"]]}
        for n in m["nodes"]:
            if n["name"] and name_check is not None:
                name_check(n["name"])
        return _names_free(m, names)

    manifest, trees = read_archive(fileobj, store, limits, check)
    try:
        metas = {}
        for layer, tree in trees.items():
            meta = measure_tree(tree.fs)
            if meta["digest"] != layer:
                raise InvalidArchiveError(f"layer {layer[:12]} in the archive does not match its digest (got "
                                 f"{meta['digest'][:12]}); nothing was imported: the file is damaged or forged, "
                                 "export it again.")
            metas[layer] = meta
        for layer, tree in trees.items():
            commit_dir(tree.dir, layer, {**metas[layer], "created_at": time.time()})
        # A step's id is its recipe's hash, not its content's: an archive's "step" is no build cache of this
        # host (a build of that recipe makes its own and replaces it), unless the importer was given the
        # chain's digest by its source (ANY_BASE: a fleet's transfer between its own nodes).
        # A "snapshot" is one only if its id is the hash of what it runs (is_own_snapshot): else its id may be
        # one a sandbox of this host snapshots later, which would then run the archive's layer.
        put_nodes([{**n, "kind": "import" if base != ANY_BASE and (n["kind"] == "step" or n["kind"] == "snapshot"
                                                                   and not is_own_snapshot(n)) else n["kind"],
                    "pinned": n["id"] == manifest["top"] or n["pinned"]} for n in manifest["nodes"]],
                  names="keep" if names == "none" else names, refuse=lambda moves: _name_refusal(manifest, moves))
        return {"ref": PREFIX + manifest["top"], "id": manifest["top"], "base": manifest["base"],
                "layers": len(manifest["layers"]), "digest": chain_digest(manifest["nodes"], manifest["base"])}
    finally:
        for tree in trees.values():
            tree.discard()   # a committed one was renamed away: nothing left to remove


__all__ = ["ANY_BASE", "IMPORT_NAMES", "MANIFEST", "ImportLimits", "check_manifest", "export", "import_"]
