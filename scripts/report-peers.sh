#!/usr/bin/env bash
# Installs what the webhook and telemetry tests receive chatd's messages with, and the
# Responses API's Python client, under target/report/venv (ignored by git), from PyPI at
# pinned versions:
#   standardwebhooks      the Standard Webhooks specification's own library: every delivery
#                         is verified with it, not with a verifier of ours
#   opentelemetry-proto   OpenTelemetry's own protobuf classes: every OTLP export is decoded
#                         with them
#   openai                the official Python SDK, driving chatd's Responses API
#                         (tests/fixtures/openai_client.py)
# Safe to run again: a complete install (its marker written last) is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

STANDARDWEBHOOKS_VERSION=1.1.0
OTEL_PROTO_VERSION=1.45.2
PROTOBUF_VERSION=6.33.6
OPENAI_VERSION=3.57.0
marker="$STANDARDWEBHOOKS_VERSION $OTEL_PROTO_VERSION $PROTOBUF_VERSION $OPENAI_VERSION"

venv=target/report/venv
mkdir -p target/report
if [ "$(cat "$venv/.chatd-installed" 2>/dev/null)" != "$marker" ]; then
  echo "installing standardwebhooks $STANDARDWEBHOOKS_VERSION, opentelemetry-proto $OTEL_PROTO_VERSION and openai $OPENAI_VERSION (PyPI) under $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    "standardwebhooks==$STANDARDWEBHOOKS_VERSION" "opentelemetry-proto==$OTEL_PROTO_VERSION" \
    "protobuf==$PROTOBUF_VERSION" "openai==$OPENAI_VERSION"
  echo "$marker" >"$venv/.chatd-installed"
fi
