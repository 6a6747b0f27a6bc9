#!/usr/bin/env bash
# Installs the S3-compatible server the S3 attachment test talks to, under target/s3/ (ignored
# by git):
#   target/s3/venv  moto with its server extra from PyPI (moto_server), in its own virtualenv
# A pinned version, so every machine tests against the same server. It only installs: the test
# (tests/api/s3.rs) starts and stops its own moto_server. Safe to run again: an install that is
# complete (its marker written last) is left alone, so a second run needs no network. Prints
# a line when it installs (about 320 MB), and errors (on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."

MOTO_VERSION=5.2.5

root=target/s3
mkdir -p "$root"

# A half-finished install (interrupted, offline) has no marker and is redone from scratch.
installed() { [ "$(cat "$1/.chatd-installed" 2>/dev/null)" = "$2" ]; }

venv=$root/venv
if ! installed "$venv" "$MOTO_VERSION"; then
  echo "installing moto[server] $MOTO_VERSION (PyPI, the S3 server of the attachment tests, ~320 MB) under $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    "moto[server]==$MOTO_VERSION"
  echo "$MOTO_VERSION" >"$venv/.chatd-installed"
fi
