"""An image archive names the base its layers sit on; a "dir:" base is a directory of the host, which every
sandbox of the image then sees as its root. So the archive must not choose it: an import takes a directory
base only when the importer names that same base (or a digest it was given vouches for the whole chain)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

import hutch
from img_support import one_layer_archive


def _archive_on(path: Path, base: str, tmp: Path) -> tuple[Path, str]:
    """An archive of one image: one layer holding only /from-the-archive, over `base`; (path, its node id)."""
    tree = tmp / f"tree-{secrets.token_hex(4)}"
    tree.mkdir(mode=0o755)
    (tree / "from-the-archive").write_text("layer\n")
    node = secrets.token_hex(32)
    return one_layer_archive(path, tree, base, node, "import"), node


@pytest.fixture
def host_secret(tmp_path):
    """A host directory that is a usable root (busybox) holding a secret nobody gave a sandbox."""
    from hutch_testing import make_busybox_root
    root = make_busybox_root(tmp_path / "host-dir")
    (root / "secret").write_text("the host's own\n")
    return root


def test_an_archive_cannot_choose_a_host_directory_as_its_base(daemon, make_sandbox, tmp_path, host_secret):
    archive, node = _archive_on(tmp_path / "evil.tar", f"dir:{host_secret}", tmp_path)
    with pytest.raises(hutch.ImageError) as refused:
        hutch.Image.import_(archive)
    msg = str(refused.value)
    assert f"dir:{host_secret}" in msg and "base=" in msg, msg
    with pytest.raises(hutch.NotFoundError):
        hutch.Image.from_name(node)
    # Everything in the host's root filesystem, /etc/shadow among it, would be a sandbox's to read.
    archive, _ = _archive_on(tmp_path / "root.tar", "dir:/", tmp_path)
    with pytest.raises(hutch.ImageError, match="dir:/"):
        hutch.Image.import_(archive)


def test_the_importer_may_name_the_directory_base_it_means(daemon, make_sandbox, tmp_path, host_secret):
    archive, node = _archive_on(tmp_path / "ok.tar", f"dir:{host_secret}", tmp_path)
    with pytest.raises(hutch.ImageError, match="is not the base"):
        hutch.Image.import_(archive, base=f"dir:{tmp_path}")   # another directory than the archive's
    img = hutch.Image.import_(archive, base=f"dir:{host_secret}")
    assert img.ref == f"image:{node}"
    assert make_sandbox(image=img).run("cat", "/secret", "/from-the-archive").stdout == "the host's own\nlayer\n"


def test_an_archive_cannot_plant_a_build_step_of_this_host(daemon, base, make_sandbox, tmp_path):
    # A build step's id is the hash of its recipe (sha256 of the parent's key and the step), not of what it
    # made, so an archive can name a node by a step's id and carry any layer; the build of that recipe must not
    # take it for its own cached step.
    from hutch.sandbox import _build

    recipe = base.run_commands("echo real > /f")
    key = _build.step_key(_build._base_key(None, base.ref, None), recipe.steps[0])
    tree = tmp_path / "evil"
    tree.mkdir(mode=0o755)
    (tree / "f").write_text("planted\n")
    archive = one_layer_archive(tmp_path / "plant.tar", tree, base.ref, key, "step")
    img = hutch.Image.import_(archive, base=base)   # imported as what it is: an image of its own
    assert make_sandbox(image=img).run("cat", "/f").stdout == "planted\n"
    built = recipe.build(quiet=True)
    assert built.ref == f"image:{key}"
    assert make_sandbox(image=built).run("cat", "/f").stdout == "real\n"
