"""What the MCP server's clients may make the host do, beyond running code in a sandbox.

A tool call comes from a model, and a model does what its context tells it: a prompt
injection must not turn `sandbox_create` into a read of the host. So, over stdio as over
HTTP, a client may not name a host directory as an image (`dir:/...`, or an `image:` or a
built image's name built on one) nor bind host paths into a sandbox; the operator allows both by starting
the server with `--allow-host-dirs`. The operator's own `--image` is always allowed, and
so are images built on it (the operator chose that directory); a memory mount of the
server's store is not a host bind (the store is what the memory tools already write).
"""

from __future__ import annotations

from dataclasses import dataclass

from hutch._core.errors import ConfigError
from hutch.sandbox._spec import DEFAULT_IMAGE

#: Parents walked from an `image:` ref to its base before giving up.
MAX_IMAGE_DEPTH = 128
_DIR = "dir:"
_LAYERED = "image:"


@dataclass(frozen=True)
class HostAccess:
    """`allow_host_dirs`: clients may use `dir:` images and host binds. `default_image`: the operator's `--image`."""

    allow_host_dirs: bool = False
    default_image: str | None = None

    def check_image(self, ref: str | None) -> str | None:
        """Refuse an image a client named that reads a host directory, unless allowed; return the reference to
        create from: a built image's name as the `image:<id>` it names now, so that what was checked is what runs
        (a name may move to another image at any time)."""
        if ref is None or ref == self.default_image:
            return ref
        if not ref.startswith((_DIR, _LAYERED)) and ref != DEFAULT_IMAGE:
            from hutch.sandbox import _client

            ref = _client.default_client().json("GET", f"/v1/images/{ref}")["ref"]   # a name (NotFoundError if none)
        if self.allow_host_dirs:
            return ref
        base = _base_of(ref)
        if base.startswith(_DIR) and base != self.default_image:
            shown = ref if ref == base else f"{ref} (built on {base})"
            raise ConfigError(f"image {shown} is a directory of the MCP server's host, which its clients may not "
                              "use; name a built image, or leave image out for the default. The operator can allow "
                              "host directories by starting `hutch mcp --allow-host-dirs`.")
        return ref

    def check_mounts(self, mounts) -> None:
        """Refuse host binds and volumes among `mounts` (memory mounts of the store are fine), unless allowed."""
        if self.allow_host_dirs:
            return
        for m in mounts:
            if getattr(m, "kind", None) in ("bind", "volume"):
                raise ConfigError(f"mounting {m.source} into a sandbox is a host path, which this MCP server's "
                                  "clients may not use; start `hutch mcp --allow-host-dirs` to allow it.")


def _base_of(ref: str) -> str:
    """The base an image reference is built on: `dir:...`, `debian-slim`, or itself if it is a base."""
    if not ref.startswith(_LAYERED):
        return ref
    from hutch.sandbox import _client

    client = _client.default_client()
    for _ in range(MAX_IMAGE_DEPTH):
        node = client.json("GET", f"/v1/images/{ref}")
        ref = node.get("parent") or ""
        if not ref.startswith(_LAYERED):
            return ref
    raise ConfigError(f"image {ref} has more than {MAX_IMAGE_DEPTH} ancestors; name another image.")


__all__ = ["HostAccess"]
