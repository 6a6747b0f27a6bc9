#!/usr/bin/env python3
"""`GET /api/usage` over a seeded database of --runs runs (CONTRACT.md §18), on SQLite and on
Postgres: the database sums, so the figure is the query's. Seeds `run_usage` with --users
users' runs spread over 90 days and 4 models (one user holds --share of them), then times,
each --repeat times, one user's month by day, by model and by profile, and an admin's month
of everyone by user; beside them, in the same run, `GET /api/profiles` (no database read)
as the baseline. Prints the median of each and its ratio to the baseline.

Usage: loadtest/usage.py [--chatd BIN] [--postgres URL] [--runs 1000000] [--repeat 20]

The release binary is built when --chatd is not given. --postgres names a database whose
server allows CREATE DATABASE (a database of its own is made beside it and dropped after).
"""
import argparse, os, sqlite3, subprocess, tempfile, time, urllib.request, uuid
from statistics import median

from takeover import ROOT, Replica, fresh_database, psql

MODELS = ["claude-sonnet-4-5", "gpt-4o", "gemini-2.5-flash", "mock-1"]
PROFILES = ["default", "fast", "smart"]
DAYS = 90


def seed_sqlite(path, runs, users, share):
    db = sqlite3.connect(path)
    now = time.time()
    rows = []
    for i in range(runs):
        user = "heavy" if i % int(1 / share) == 0 else f"user{i % users}"
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now - (i % (DAYS * 1440)) * 60)) + ".000000Z"
        rows.append((uuid.uuid4().bytes, user, PROFILES[i % 3], MODELS[i % 4], started,
                     1000 + i % 500, 100 + i % 50, 600 + i % 300, i % 200, None if i % 4 == 3 else 0.001 * (i % 7)))
        if len(rows) == 50_000:
            db.executemany("insert into run_usage (trace_id, user_id, profile, model, started_at, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_usd) values (?,?,?,?,?,?,?,?,?,?)", rows)
            rows.clear()
    db.executemany("insert into run_usage (trace_id, user_id, profile, model, started_at, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_usd) values (?,?,?,?,?,?,?,?,?,?)", rows)
    db.commit()
    db.execute("analyze")
    db.close()


def seed_postgres(url, runs, users, share):
    every = int(1 / share)
    psql(url, f"""insert into run_usage (trace_id, user_id, profile, model, started_at, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_usd) select gen_random_uuid(),
        case when i % {every} = 0 then 'heavy' else 'user' || (i % {users}) end,
        (array['default','fast','smart'])[i % 3 + 1], (array{MODELS})[i % 4 + 1],
        now() - make_interval(mins => i % ({DAYS} * 1440)),
        1000 + i % 500, 100 + i % 50, 600 + i % 300, i % 200,
        case when i % 4 = 3 then null else 0.001 * (i % 7) end
        from generate_series(0, {runs - 1}) i""", "analyze run_usage")


def timed(base, path, user, repeat):
    request = urllib.request.Request(base + path, headers={"x-client-id": user})
    urllib.request.urlopen(request).read()  # warm
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        urllib.request.urlopen(request).read()
        times.append(time.perf_counter() - started)
    return median(times) * 1000


def measure(binary, database, repeat, label):
    replica = Replica(binary, database, '[auth]\nadmins = ["root"]\n')
    try:
        month = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 30 * 86400))
        baseline = timed(replica.base, "/api/profiles", "heavy", repeat)
        print(f"{label}: baseline GET /api/profiles {baseline:.2f} ms")
        for what, path, user in [
            ("one user's month by day", f"/api/usage?from={month}&group_by=day", "heavy"),
            ("one user's month by model", f"/api/usage?from={month}&group_by=model", "heavy"),
            ("one user's month by profile", f"/api/usage?from={month}&group_by=profile", "heavy"),
            ("everyone's month by user (admin)", f"/api/usage?from={month}&group_by=user", "root"),
        ]:
            ms = timed(replica.base, path, user, repeat)
            print(f"{label}: {what}: {ms:.2f} ms (x{ms / baseline:.1f})")
    finally:
        replica.kill()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chatd")
    parser.add_argument("--postgres")
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--share", type=float, default=0.01, help="the share of runs that are one heavy user's")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    binary = args.chatd
    if not binary:
        subprocess.run(["cargo", "build", "--release", "-q"], cwd=ROOT, check=True)
        binary = os.path.join(ROOT, "target/release/chatd")
    folder = tempfile.mkdtemp(prefix="chatd-usage-")
    path = os.path.join(folder, "chatd.db")
    subprocess.run([binary, "migrate"], env={**os.environ, "CHATD_DATABASE__URL": f"sqlite://{path}"}, check=True,
                   capture_output=True)
    started = time.time()
    seed_sqlite(path, args.runs, args.users, args.share)
    print(f"sqlite: seeded {args.runs} runs in {time.time() - started:.0f} s")
    measure(binary, f"sqlite://{path}", args.repeat, "sqlite")
    if args.postgres:
        database = fresh_database(args.postgres, "bench_usage")
        subprocess.run([binary, "migrate"], env={**os.environ, "CHATD_DATABASE__URL": database}, check=True,
                       capture_output=True)
        started = time.time()
        seed_postgres(database, args.runs, args.users, args.share)
        print(f"postgres: seeded {args.runs} runs in {time.time() - started:.0f} s")
        measure(binary, database, args.repeat, "postgres")
        psql(args.postgres, "drop database if exists bench_usage with (force)")


if __name__ == "__main__":
    main()
