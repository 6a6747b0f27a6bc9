#!/usr/bin/env bash
# Runs schemathesis (PyPI, pinned, in its own virtualenv under target/) against a real chatd
# started on a temporary SQLite file: every documented operation gets generated requests;
# no answer may be a 5xx or break its own schema. It runs in target/schemathesis-run: what it
# stores between runs (its .schemathesis/ folder, in the folder it runs in) stays out of the
# source tree.
set -euo pipefail
cd "$(dirname "$0")/.."

version=4.32.5
venv=target/schemathesis
if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$version" ]; then
  echo "installing schemathesis $version (PyPI) under $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input "schemathesis==$version"
  echo "$version" >"$venv/.installed"
fi

echo "building chatd (cargo build --bin chatd; minutes the first time)" >&2
cargo build --quiet --bin chatd
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/chatd.toml" <<TOML
[server]
port = $port
[database]
url = "sqlite://$work/chatd.db"
[limits]
requests_per_minute = 0
max_concurrent_runs_per_user = 1000
[providers.mock]
kind = "mock"
delay_ms = 0
[profiles.default]
provider = "mock"
model = "mock-1"
TOML
RUST_LOG=warn target/debug/chatd --config "$work/chatd.toml" >"$work/chatd.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done

mkdir -p target/schemathesis-run
schemathesis="$PWD/$venv/bin/schemathesis"
cd target/schemathesis-run
"$schemathesis" run "http://127.0.0.1:$port/openapi.json" \
  --checks not_a_server_error,response_schema_conformance,status_code_conformance \
  --max-examples "${SCHEMATHESIS_EXAMPLES:-25}" \
  --request-timeout 10 \
  --no-color
