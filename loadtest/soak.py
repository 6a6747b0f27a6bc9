#!/usr/bin/env python3
"""chatd's soak: a release chatd on the mock model, driven by the `soak` binary for a while
with random provider faults, client disconnects, resumes and cancels; then every run is
checked (its trace is not `running`; its replayed stream has exactly one terminal event and
ends with `done`) and chatd's RSS over time is reported. Beside the runs, two users race over
shared files (uploads and deletes of the same bytes); none may be lost. On Postgres, every
connection chatd holds is killed every 15-45 s. Exits non-zero on any violation.

  loadtest/soak.py [--minutes 10] [--runs 1000] [--postgres postgres://user@host:5432/db]

With --postgres, a fresh database is created on that server (with psql) and dropped after.
"""
import argparse, json, os, subprocess, sys, tempfile, time

from run import REL, ROOT, free_port, start, stop, wait_http


def psql(admin_url, sql):
    subprocess.run(["psql", admin_url, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--postgres", help="an admin URL of a Postgres server to soak on instead of SQLite")
    args = ap.parse_args()

    subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "chatd", "--bin", "soak"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="chatd-soak-")
    database = None
    if args.postgres:
        database = f"chatd_soak_{int(time.time())}"
        psql(args.postgres, f"create database {database}")
        base, _, _ = args.postgres.rpartition("/")
        url = f"{base}/{database}"
    else:
        url = f"sqlite://{work}/chatd.db"
    port = free_port()
    config = os.path.join(work, "chatd.toml")
    with open(config, "w") as f:
        f.write(f"""
[server]
port = {port}
[database]
url = "{url}"
[providers.mock]
kind = "mock"
delay_ms = 5
chunk_chars = 8
[profiles.default]
provider = "mock"
model = "mock-1"
[files]
url = "file://{work}/files"
# The soak is about what breaks under faults, not about the rate limit: its two file users
# send tens of requests a second.
[limits]
requests_per_minute = 100000
""")
    log = open(os.path.join(work, "chatd.log"), "w")
    chatd = start([os.path.join(REL, "chatd"), "--config", config], env={"RUST_LOG": "warn,chatd::store::postgres=info"}, log=log)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        label = "postgres" if args.postgres else "sqlite"
        kill = ["--kill-postgres", args.postgres, "--database", database] if args.postgres else []
        soak = subprocess.run([os.path.join(REL, "soak"), "--base", f"http://127.0.0.1:{port}", "--runs", str(args.runs),
                               "--minutes", str(args.minutes), "--concurrency", str(args.concurrency),
                               "--pid", str(chatd.pid), "--label", label] + kill, capture_output=True, text=True)
        sys.stderr.write(soak.stderr)
        summary = json.loads(soak.stdout.strip().splitlines()[-1])
        print(json.dumps(summary, indent=2))
        alive = chatd.poll() is None
        log.flush()
        relistened = open(log.name).read().count("notice listener connected again")
        print(f"chatd still running: {alive}; its notice listener connected again {relistened} times; its log: {log.name}")
        return 0 if soak.returncode == 0 and alive else 1
    finally:
        stop(chatd)
        if database:
            psql(args.postgres, f"drop database if exists {database} with (force)")


if __name__ == "__main__":
    sys.exit(main())
