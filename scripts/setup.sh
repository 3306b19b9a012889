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

# gVisor (runtime="gvisor"): runsc from bookworm-backports. Its own step: backports are pinned at priority 100,
# so the plain install above would take bookworm main's 0.0~20221219 build (no systrap platform, a checkpoint
# that never returns, images no newer build reads). The version is checked, not just "installed".
RUNSC_MIN=0.0~20240729
runsc_v=$(dpkg-query -W -f='${Version}' runsc 2>/dev/null || true)
if [ -z "$runsc_v" ] || dpkg --compare-versions "$runsc_v" lt "$RUNSC_MIN"; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup: runsc >= $RUNSC_MIN (gVisor, from bookworm-backports) is missing; run this as root on Debian 12" >&2
    exit 1
  fi
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "setup: adding Debian's bookworm-backports source (for runsc)"
    cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'EOS'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
  fi
  echo "setup: installing runsc from bookworm-backports"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
  runsc_v=$(dpkg-query -W -f='${Version}' runsc)
  if dpkg --compare-versions "$runsc_v" lt "$RUNSC_MIN"; then
    echo "setup: runsc $runsc_v was installed, but hutch needs >= $RUNSC_MIN (bookworm-backports)" >&2
    exit 1
  fi
fi

# The native runtime's C init (hutch/sandbox/_host/native/initd.c): static, so it runs inside any image's root;
# built again when its source is newer. Without it sandboxes keep the Python init (HUTCH_NATIVE_INIT=0 does too).
initd=hutch/sandbox/_host/native/initd.c
initbin=hutch/sandbox/_host/native/hutch-init
if [ ! -x "$initbin" ] || [ "$initd" -nt "$initbin" ]; then
  echo "setup: building $initbin"
  gcc -static -Os -Wall -Wextra -Werror -D_FORTIFY_SOURCE=2 -fstack-protector-strong -o "$initbin.tmp" "$initd"
  mv -f "$initbin.tmp" "$initbin"
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# a venv made before python3-venv was installed has a python but no pip: make it again
if [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/pip ]; then
  echo "setup: creating .venv"
  "$PY" -m venv --clear .venv
  rm -f .venv/.hutch-installed
fi
# pip install, from where scripts/pip-env says: as the machine's pip configuration says, and third_party/wheels
# (the few that the machine's local copies of the index lack). When the package index does not answer (a DNS or
# network fault outside the machine; CI machines went without one for days), from the machine's local copies of
# the index instead, rather than asking the dead index for every package (minutes each). Only if that fails too
# does it wait for the index: pip is retried while the index cannot be reached, for up to HUTCH_SETUP_NET_WAIT
# seconds (default 40 minutes) of wall clock, counted from the first failure (one attempt against a dead resolver
# takes minutes of its own, so the clock, not the number of attempts, bounds the wait), then the error.
# Any other failure stops at once.
pipenv=()   # scripts/pip-env's answer, asked once (its probe waits up to 15 s for a dead index)
pip_install() {
  local log=.venv/.pip-install.log start=$SECONDS limit=${HUTCH_SETUP_NET_WAIT:-2400} waited
  [ "${#pipenv[@]}" -gt 0 ] || mapfile -t pipenv < <(bash scripts/pip-env)
  if [ "${#pipenv[@]}" -gt 1 ]; then   # the index does not answer: the local copies
    if env "${pipenv[@]}" .venv/bin/pip install "$@" 2>"$log"; then cat "$log" >&2; return 0; fi
    cat "$log" >&2
    echo "setup: the machine's local copies of the index lack something (above); waiting for the index" >&2
  fi
  until env "${pipenv[0]}" .venv/bin/pip install "$@" 2>"$log"; do
    cat "$log" >&2
    if ! grep -qE 'name resolution|NameResolutionError|NewConnectionError|ConnectTimeout|ReadTimeout|Connection (reset|refused)|Network is unreachable' "$log"; then
      return 1
    fi
    waited=$((SECONDS - start))
    if [ $((waited + 60)) -ge "$limit" ]; then
      echo "setup: the package index has been unreachable for $waited s; check the machine's DNS and network (pip's errors above), then run scripts/setup.sh again" >&2
      return 1
    fi
    echo "setup: the package index is unreachable (a network fault, above); trying again in 60 s ($waited s of $limit so far)" >&2
    sleep 60
  done
  cat "$log" >&2
}
stamp=.venv/.hutch-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
   || [ third_party/wheels -nt "$stamp" ]; then
  echo "setup: installing hutch and its dependencies into .venv"
  pip_install -q --upgrade pip
  pip_install -q -e ".[all,dev]"   # every wing's extra (pyproject.toml), and the test tools
  touch "$stamp"
fi
