#!/usr/bin/env bash
# Runs the web page's end-to-end tests (tests/e2e, Node's test runner + playwright-core) in
# headless Chromium against a real chatd (the debug binary, built here), and the client
# libraries' tests (the AI SDK's transports and useChat, AG-UI's HttpAgent) against it. Installs Debian's
# chromium package when /usr/bin/chromium is missing (as root, non-interactively) and the
# tests' pinned npm packages. Screenshots go to target/e2e-screenshots/.
set -euo pipefail
cd "$(dirname "$0")/.."

chromium=/usr/bin/chromium
if [ ! -x "$chromium" ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "browser tests need $chromium: install Debian's chromium package (run as root to let this script do it)" >&2
    exit 1
  fi
  echo "installing chromium (Debian package)" >&2
  export DEBIAN_FRONTEND=noninteractive
  # The package lists may be missing or stale: update them once if the install fails.
  if ! apt-get install -y -qq chromium >&2; then
    apt-get update -qq >&2
    apt-get install -y -qq chromium >&2
  fi
fi

cargo build --quiet --bin chatd
rm -rf target/e2e-screenshots
cd tests/e2e
echo "installing the browser tests' npm packages (npm ci in tests/e2e)" >&2
npm ci --loglevel=error --no-audit --no-fund --no-update-notifier >/dev/null
CHATD_BIN="$(pwd)/../../target/debug/chatd" CHROMIUM_BIN="$chromium" npm test --silent
