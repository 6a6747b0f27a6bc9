#!/usr/bin/env bash
# Makes a Postgres server answer on 127.0.0.1:5432 with a database `test`, starting the
# installed cluster or installing Debian's postgresql package (as root) where there is none.
# Prints the URL for CHATD_TEST_POSTGRES_URL on success; exits non-zero when it cannot.
set -euo pipefail

url="postgres://postgres:postgres@127.0.0.1:5432/test"
ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

start_cluster() {
  local version
  version=$(ls /etc/postgresql 2>/dev/null | sort -n | tail -n 1)
  [ -n "$version" ] || return 1
  pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
  for _ in $(seq 1 30); do ready && return 0; sleep 1; done
  return 1
}

if ! ready && ! start_cluster; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing postgresql from Debian's packages" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    start_cluster || { echo "postgres did not start" >&2; exit 1; }
    # A fresh cluster answers TCP with a password: give postgres the one in $url.
    su postgres -c "psql -qc \"alter user postgres password 'postgres'\"" >&2
  else
    echo "no Postgres on 127.0.0.1:5432 and no way to install one" >&2
    exit 1
  fi
fi

if ! psql "$url" -qAtc 'select 1' >/dev/null 2>&1; then
  psql "${url%/test}/postgres" -qc 'create database test' >&2 \
    || su postgres -c "psql -qc 'create database test'" >&2
fi
psql "$url" -qAtc 'select 1' >/dev/null
echo "$url"
