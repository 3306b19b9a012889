#!/usr/bin/env bash
# Set up everything hutch needs on a fresh Debian 12 machine (run as root).
# Idempotent: a second run only re-checks. Installs Debian packages listed in
# scripts/debian-packages.txt and the project into ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=$(grep -vE '^\s*(#|$)' scripts/debian-packages.txt | tr '\n' ' ')
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup: missing Debian packages:$missing; run this as root on Debian 12 (it installs them with apt-get)" >&2
    exit 1
  fi
  echo "setup: installing Debian packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# a venv made before python3-venv was installed has a python but no pip: make it again
if [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/pip ]; then
  echo "setup: creating .venv"
  "$PY" -m venv --clear .venv
  rm -f .venv/.hutch-installed
fi
stamp=.venv/.hutch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  echo "setup: installing hutch and its dependencies into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[dev]"
  touch "$stamp"
fi
