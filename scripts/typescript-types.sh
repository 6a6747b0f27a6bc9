#!/usr/bin/env bash
# Generates the TypeScript types of the API (clients/typescript/src/schema.ts) from
# docs/openapi.json with openapi-typescript (npm, pinned, installed under target/).
# With --check it changes nothing and fails when the committed types have drifted.
set -euo pipefail
cd "$(dirname "$0")/.."

version=7.13.0
tools=target/ts-tools
if [ "$(cat "$tools/.installed" 2>/dev/null)" != "$version" ]; then
  echo "installing openapi-typescript $version (npm) under $tools" >&2
  rm -rf "$tools" && mkdir -p "$tools"
  npm install --prefix "$tools" --loglevel=error --no-audit --no-fund --no-update-notifier \
    "openapi-typescript@$version" >/dev/null
  echo "$version" >"$tools/.installed"
fi

out=clients/typescript/src/schema.ts
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$tools/node_modules/.bin/openapi-typescript" docs/openapi.json --output "$tmp" >/dev/null 2>&1
if [ "${1:-}" = "--check" ]; then
  if ! diff -q "$out" "$tmp" >/dev/null; then
    diff -u "$out" "$tmp" | head -40 >&2
    echo "clients/typescript/src/schema.ts is stale: run scripts/typescript-types.sh" >&2
    exit 1
  fi
else
  mkdir -p "$(dirname "$out")"
  cp "$tmp" "$out"
fi
