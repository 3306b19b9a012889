"""hutch's version: the one place it is written (pyproject.toml reads it from here; `hutch.__version__`)."""

VERSION = "0.1.0"
