#!/usr/bin/env bash
# Builds and tests the TypeScript client (clients/typescript) with Node's test runner against
# a real chatd (the debug binary; built here if needed). Installs its pinned npm packages.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet --bin chatd
cd clients/typescript
echo "installing the TypeScript client's npm packages (npm ci in clients/typescript)" >&2
npm ci --loglevel=error --no-audit --no-fund --no-update-notifier >/dev/null
CHATD_BIN="$(pwd)/../../target/debug/chatd" npm test --silent
