"""`hutch.Image`: which root filesystem a sandbox starts from, defined in Python.

    image = (hutch.Image.debian_slim()
             .apt_install("git")
             .run_commands("useradd -m agent")
             .copy_local_dir("./tools", "/opt/tools")
             .env({"PYTHONUNBUFFERED": "1"}).workdir("/work"))
    sb = hutch.Sandbox.create(image=image)     # builds once (with progress), then a cache hit

An Image is a frozen value: a base reference (see hutch/sandbox/_host/images.py) and a
tuple of steps. Each step becomes a layer keyed by the hash of its parent and its
definition (and of the copied files' contents), so an unchanged step is never rebuilt
and a changed one rebuilds it and what follows (hutch/sandbox/_build.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from hutch._core.errors import InvalidSpecError, NotFoundError
from hutch.sandbox._spec import DEFAULT_IMAGE, Network, abs_path

#: What `Image.code_interpreter()` adds to the default image (which has python3, pip and venv).
CODE_INTERPRETER_PIP = ("ipykernel>=7,<8", "jupyter_client>=8,<9", "numpy>=2,<3", "pandas>=2,<4",
                        "matplotlib>=3.8,<4")
_APT_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(:[a-z0-9-]+)?(=[A-Za-z0-9.+:~_-]+)?\Z")


@dataclass(frozen=True)
class Step:
    """One build step: its kind and its canonical JSON definition (plus local sources of a copy)."""

    kind: str           # run, apt, pip, copy, env, workdir
    spec: str           # canonical JSON: what the step's key hashes
    local: str = ""     # the host path a copy step reads (its content, not its name, is hashed)

    @property
    def args(self) -> dict:
        return json.loads(self.spec)

    def describe(self) -> str:
        a = self.args
        if self.kind == "run":
            return "RUN " + " && ".join(c if isinstance(c, str) else " ".join(c) for c in a["commands"])
        if self.kind == "apt":
            return "APT " + " ".join(a["packages"])
        if self.kind == "pip":
            return "PIP " + " ".join(a["packages"])
        if self.kind == "copy":
            return f"COPY {self.local} {a['remote']}"
        if self.kind == "env":
            return "ENV " + " ".join(f"{k}={v}" for k, v in a["env"].items())
        return f"WORKDIR {a['workdir']}"


def _step(kind: str, local: str = "", **args) -> Step:
    return Step(kind, json.dumps(args, sort_keys=True, separators=(",", ":")), local)


@dataclass(frozen=True)
class Image:
    """A sandbox image. Start from `Image.debian_slim()` or `Image.from_directory(path)` and add steps."""

    ref: str
    steps: tuple[Step, ...] = ()

    # --- bases ------------------------------------------------------------------------------------

    @classmethod
    def debian_slim(cls) -> "Image":
        """The default image: a minimal Debian 12 with python3 (the whole standard library), pip and venv,
        built once on first use and cached."""
        return cls(DEFAULT_IMAGE)

    @classmethod
    def code_interpreter(cls) -> "Image":
        """The default image plus a Jupyter kernel and the data stack (numpy, pandas, matplotlib, ipykernel,
        jupyter_client): what `Sandbox.run_code` needs. Built once per host through the image builder's
        cached steps; extend it like any image, e.g. `Image.code_interpreter().pip_install("scipy")`."""
        return (cls.debian_slim().pip_install(*CODE_INTERPRETER_PIP)
                # ipykernel imports debugpy (JupyterLab's visual debugger, of no use here) at every start,
                # a quarter of a cold kernel's imports; without it ipykernel starts with the debugger off
                .run_commands("python3 -m pip uninstall -y --break-system-packages debugpy",
                              # the unprivileged user the interpreter runs as (Sandbox.run_code), owning its home
                              # and /srv (for data and the contexts' directories: its root cannot chown)
                              "useradd --uid 1000 --user-group --home-dir /home/user --no-create-home "
                              "--shell /bin/bash user && chown user:user /home/user /srv"))

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Image":
        """A prepared root directory on the host, used read-only as the sandbox's lower layer.

        It must hold what the commands need (a shell or busybox, their libraries); the
        sandbox's writes go to a throw-away layer above it and never reach `path`.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidSpecError(f"Image.from_directory path={path!r} must be a host directory path.")
        root = os.path.abspath(os.fspath(path))
        if not os.path.isdir(root):
            raise NotFoundError(
                f"Image.from_directory: {root} is not a directory; give the path of a prepared root filesystem."
            )
        return cls(f"dir:{root}")

    @classmethod
    def from_name(cls, name: str) -> "Image":
        """A built image or snapshot stored on the daemon's host, by name, id or id prefix (`hutch image ls`)."""
        from hutch.sandbox import _client

        node = _client.default_client().json("GET", f"/v1/images/{_name(name)}")
        return cls(node["ref"])

    @classmethod
    def import_(cls, path: str | os.PathLike, *, base: "Image | str | None" = None, replace: bool = False) -> "Image":
        """Import an image archive written by `Image.export` (on this or another host); returns the image.

        Its base (the default image, or the same directory path) must exist here. An archive on a directory
        base is refused unless `base` names that directory (`Image.from_directory(path)` or "dir:/path"):
        its sandboxes see that host directory as their root, which an archive must not choose.
        A name the archive gives an image never moves from another image here (nor off this image, here under
        another name) unless `replace=True`: else the import is refused (StateError) and stores nothing.
        """
        from hutch.sandbox import _build

        return _build.import_image(path, base=None if base is None else Image.of(base).ref, replace=replace)

    @classmethod
    def of(cls, value: "Image | str | None") -> "Image":
        """An Image from an Image, a reference string, or None (the default image)."""
        if value is None:
            return cls.debian_slim()
        if isinstance(value, Image):
            return value
        if isinstance(value, str) and value:
            return cls(value)
        raise InvalidSpecError(
            f"image={value!r} is not an image; use hutch.Image.debian_slim() or hutch.Image.from_directory(path)."
        )

    # --- steps ------------------------------------------------------------------------------------

    def _then(self, step: Step) -> "Image":
        return Image(self.ref, self.steps + (step,))

    def apt_install(self, *packages: str) -> "Image":
        """Install Debian packages (apt-get). The step may reach only the Debian archive's names
        (HUTCH_APT_HOSTS, default deb.debian.org and security.debian.org)."""
        pkgs = _strings(packages, "apt_install")
        for p in pkgs:
            if not _APT_RE.match(p):
                raise InvalidSpecError(f"apt_install: {p!r} is not a Debian package name (like 'git' or 'curl=7.88*').")
        return self._then(_step("apt", packages=pkgs))

    def pip_install(self, *packages: str, index_url: str | None = None) -> "Image":
        """Install Python packages with pip (the image needs pip: `.apt_install("python3-pip")` on Debian).

        The step may reach only PyPI's names (HUTCH_PIP_HOSTS, default pypi.org and
        files.pythonhosted.org), plus the host of `index_url` when one is given.
        """
        pkgs = _strings(packages, "pip_install")
        for p in pkgs:
            if p.startswith("-") or any(c.isspace() for c in p):
                raise InvalidSpecError(f"pip_install: {p!r} is not a requirement (like 'numpy==2.*'); options "
                                       "are not accepted here.")
        if index_url is not None and not re.match(r"^https?://[^/\s]+", str(index_url)):
            raise InvalidSpecError(f"pip_install index_url={index_url!r} must be an http(s) URL.")
        return self._then(_step("pip", packages=pkgs, index_url=index_url))

    def run_commands(self, *commands: "str | list[str]", network: Network | None = None) -> "Image":
        """Run commands in order (a string through `sh -c`, a list as argv); all must exit 0.

        No network unless `network=` says so (a `hutch.Network`). The step's key is the commands'
        text: a command that fetches something changing is rebuilt only when its text changes.
        """
        if not commands:
            raise InvalidSpecError("run_commands needs at least one command, like run_commands('useradd -m agent').")
        cmds: list[str | list[str]] = []
        for c in commands:
            if isinstance(c, str) and c.strip():
                cmds.append(c)
            elif isinstance(c, (list, tuple)) and c and all(isinstance(a, str) for a in c):
                cmds.append(list(c))
            else:
                raise InvalidSpecError(f"run_commands: {c!r} must be a shell string or a non-empty argv list.")
        if network is not None and not isinstance(network, Network):
            raise InvalidSpecError(f"network={network!r} is not a Network; use hutch.Network.allow(...).")
        if network is not None and network.credentials:   # the step's definition is hashed and stored
            raise InvalidSpecError("run_commands network= takes no credentials: a build step's definition is "
                                   "stored with the image; give credentials to the sandbox's network instead.")
        return self._then(_step("run", commands=cmds, network=network.to_dict() if network else None))

    def copy_local_file(self, local_path: str | os.PathLike, remote_path: str) -> "Image":
        """Copy a host file into the image at `remote_path` (its mode is kept)."""
        src = os.path.abspath(os.fspath(local_path))
        if not os.path.isfile(src):
            raise NotFoundError(f"copy_local_file: {src} is not a file on this host; fix the path.")
        return self._then(_step("copy", local=src, remote=abs_path(remote_path, "copy_local_file remote_path"),
                                dir=False))

    def copy_local_dir(self, local_path: str | os.PathLike, remote_path: str) -> "Image":
        """Copy a host directory's contents into the image at `remote_path` (modes kept, symlinks followed)."""
        src = os.path.abspath(os.fspath(local_path))
        if not os.path.isdir(src):
            raise NotFoundError(f"copy_local_dir: {src} is not a directory on this host; fix the path.")
        return self._then(_step("copy", local=src, remote=abs_path(remote_path, "copy_local_dir remote_path"),
                                dir=True))

    def env(self, variables: dict) -> "Image":
        """Set environment variables for the later steps and for every sandbox made from the image."""
        if not isinstance(variables, dict) or not variables or not all(
                isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in variables.items()):
            raise InvalidSpecError(f"env({variables!r}) needs a non-empty dict of str to str, like {{'A': '1'}}.")
        return self._then(_step("env", env=dict(sorted(variables.items()))))

    def workdir(self, path: str) -> "Image":
        """The working directory of the later steps and of sandboxes made from the image (made if missing)."""
        return self._then(_step("workdir", workdir=abs_path(path, "workdir")))

    # --- building and moving ----------------------------------------------------------------------

    def build(self, *, name: str | None = None, quiet: bool = False) -> "Image":
        """Build what is not cached yet and return the built image (`Image("image:<id>")`).

        Progress (steps, bytes, time) goes to stderr unless `quiet`. `name` names the result
        and keeps it from `hutch image prune`. A failing step raises `hutch.ImageError` carrying
        its output, and leaves no layer behind.
        """
        from hutch.sandbox import _build

        return _build.build(self, name=name, quiet=quiet)

    def export(self, path: str | os.PathLike) -> None:
        """Write the image (built first if needed) as a tar archive: its layers, not its base."""
        from hutch.sandbox import _build

        _build.export_image(self if not self.steps else self.build(), path)

    def __str__(self) -> str:
        return self.ref


def _strings(values, what: str) -> list[str]:
    if not values:
        raise InvalidSpecError(f"{what} needs at least one package.")
    if not all(isinstance(v, str) and v for v in values):
        raise InvalidSpecError(f"{what}: packages must be non-empty strings, got {values!r}.")
    return list(values)


def _name(name: str) -> str:
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9:][A-Za-z0-9_.:-]{0,127}$", name):
        raise InvalidSpecError(f"image name {name!r} must be letters, digits, '_', '.', '-' (or an image id).")
    return name
