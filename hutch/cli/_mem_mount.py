"""`hutch mem mount` / `hutch mem umount`: the FUSE view of a store (hutch/fuse, docs/fuse.md).

Importing this module registers both commands on the `mem` group.
"""

from __future__ import annotations

import os

import click

from hutch.cli._mem import mem


@mem.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--read-only", "read_only", is_flag=True, help="Refuse every write (EROFS).")
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted (Ctrl-C unmounts).")
@click.option("--source", metavar="TEXT", help="Provenance recorded on each write (default fuse:<mountpoint>).")
@click.option("--log", "log_path", metavar="FILE", help="Where the background server writes its log.")
@click.option("--cache-seconds", type=float, default=60.0, show_default=True,
              help="How long the kernel may keep names, sizes and pages; every change invalidates them at once, "
                   "so this only bounds what the server cannot see. 0 asks the server on every lookup.")
def mount(store, mountpoint, read_only, foreground, source, log_path, cache_seconds) -> None:
    """Mount STORE at MOUNTPOINT: entities as files, a query as a directory, profile.md.

    Writes become commits (source: fuse:<mountpoint>); `search/<query>/` holds
    the hits best first with a `.explain`; `as-of/<date>/` is the past. The
    server runs in the background unless --foreground; if it dies, the mount
    goes with it.

    \b
    Example:
      hutch mem mount ./agent-memory /mnt/mem
      ls "/mnt/mem/search/customer churn/"
      hutch mem umount /mnt/mem
    """
    from hutch import fuse

    if foreground:
        try:
            fuse.serve(store, mountpoint, writable=not read_only, source=source, cache_seconds=cache_seconds)
        except RuntimeError as e:
            from hutch._core.errors import MemoryStoreError

            raise MemoryStoreError(f"libfuse could not mount at {mountpoint} ({e}); check that it is an empty "
                                   "directory and not already a mount point.") from None
        return
    proc = fuse.mount(store, mountpoint, writable=not read_only, source=source, log_path=log_path,
                      cache_seconds=cache_seconds)
    click.echo(f"mounted {os.path.abspath(store)} at {os.path.abspath(mountpoint)} (server pid {proc.pid}); "
               f"unmount with: hutch mem umount {mountpoint}")


@mem.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--lazy", "-z", is_flag=True, help="Detach now even if a process still uses the mount.")
def umount(mountpoint, lazy) -> None:
    """Unmount a view made by `hutch mem mount`; its server exits.

    \b
    Example:
      hutch mem umount /mnt/mem
    """
    from hutch import fuse

    fuse.umount(mountpoint, lazy=lazy)
