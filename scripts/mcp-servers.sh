#!/usr/bin/env bash
# Installs the real MCP servers the API tests talk to, under target/mcp/ (ignored by git):
#   target/mcp/venv  mcp-server-time from PyPI, in its own virtualenv
#   target/mcp/node  @modelcontextprotocol/server-everything from npm
# Pinned versions, so every machine tests against the same servers. Safe to run again: an
# install that is complete (its marker written last) is left alone, so a second run needs
# no network. Prints a line for each install it makes, and errors (on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."

TIME_VERSION=2026.10.19
EVERYTHING_VERSION=2026.8.31

root=target/mcp
mkdir -p "$root"

# A half-finished install (interrupted, offline) has no marker and is redone from scratch.
installed() { [ "$(cat "$1/.chatd-installed" 2>/dev/null)" = "$2" ]; }

venv=$root/venv
if ! installed "$venv" "$TIME_VERSION"; then
  echo "installing mcp-server-time $TIME_VERSION (PyPI) under $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    "mcp-server-time==$TIME_VERSION"
  echo "$TIME_VERSION" >"$venv/.chatd-installed"
fi

node=$root/node
if ! installed "$node" "$EVERYTHING_VERSION"; then
  echo "installing @modelcontextprotocol/server-everything $EVERYTHING_VERSION (npm) under $node" >&2
  rm -rf "$node"
  mkdir -p "$node"
  npm install --prefix "$node" --loglevel=error --no-audit --no-fund --no-update-notifier \
    "@modelcontextprotocol/server-everything@$EVERYTHING_VERSION" >/dev/null
  echo "$EVERYTHING_VERSION" >"$node/.chatd-installed"
fi
