#!/usr/bin/env python3
"""Runs that outlive their server (CONTRACT.md §19), measured on Postgres with real processes:

  delay   how long after a `kill -9` of the replica running it a run goes on on the other
          replica (its first event there, "Continued on another server"): median and worst
          of --trials kills, for each --settings pair heartbeat_secs:takeover_after_secs
  beat    the steady cost of heartbeats: statements per second on the database and CPU of
          two replicas, idle, then holding --runs running runs (idle answers)
  rate    runs continued per second: --runs answering runs on one replica, `kill -9` of it,
          and how fast the other takes them all over (its first and last take-over after
          the kill), with the first of --settings

Usage: loadtest/takeover.py [--postgres URL] [--trials 20] [--settings 2:10,0.5:2] [--runs 1000]
                            [--chatd BIN] [--parts delay,beat,rate]

--postgres names a database whose server allows CREATE DATABASE (a database of its own is
made beside it and dropped after). The release binary is built when --chatd is not given.
"""
import argparse, json, os, random, signal, subprocess, sys, tempfile, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "loadtest"))
from run import free_port  # noqa: E402


def psql(url, *sql):
    args = ["psql", url, "-qAt"]
    for statement in sql:
        args += ["-c", statement]
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


def fresh_database(url, name):
    base, _, _ = url.rpartition("/")
    psql(url, f"drop database if exists {name} with (force)", f"create database {name}")
    return f"{base}/{name}"


class Replica:
    def __init__(self, binary, database, extra=""):
        self.dir = tempfile.mkdtemp(prefix="chatd-takeover-")
        self.port = free_port()
        config = os.path.join(self.dir, "chatd.toml")
        with open(config, "w") as f:
            f.write(f'[server]\nport = {self.port}\n[database]\nurl = "{database}"\n'
                    f"[limits]\nmax_concurrent_runs_per_user = 100000\nrequests_per_minute = 0\n{extra}")
        # CHATD_BENCH_LOG=<RUST_LOG filter> keeps the replica's log in its directory.
        log = os.environ.get("CHATD_BENCH_LOG")
        self.log = os.path.join(self.dir, "chatd.log") if log else None
        out = open(self.log, "w") if log else subprocess.DEVNULL
        self.process = subprocess.Popen([binary, "--config", config], env={**os.environ, "RUST_LOG": log or "error"},
                                        stdout=out, stderr=out)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.base}/readyz", timeout=2)
                return
            except Exception:
                if time.time() > deadline:
                    raise SystemExit("chatd never became ready")
                time.sleep(0.05)

    def start_run(self, message, user="bench", until="text_delta"):
        """Starts a run and leaves its stream at its first event of type `until` (the run
        goes on)."""
        body = json.dumps({"message": message}).encode()
        request = urllib.request.Request(f"{self.base}/api/chat/stream", data=body,
                                         headers={"content-type": "application/json", "x-client-id": user})
        response = urllib.request.urlopen(request, timeout=30)
        trace_id = None
        for line in response:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if event["type"] == "start":
                    trace_id = event["trace_id"]
                if event["type"] == until:
                    break
        response.close()
        return trace_id

    def trace(self, trace_id, user="bench"):
        request = urllib.request.Request(f"{self.base}/api/trace/{trace_id}", headers={"x-client-id": user})
        return json.loads(urllib.request.urlopen(request, timeout=10).read())

    def cpu(self):
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


def chatd_binary(given):
    """The binary to measure: `given`, else the release build (built now)."""
    if given:
        return given
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "chatd"], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "release", "chatd")


def at(text):
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def delays(binary, url, beat, after, trials):
    database = fresh_database(url, "bench_takeover_delay")
    extra = f"[runs]\nheartbeat_secs = {beat}\ntakeover_after_secs = {after}\n"
    survivor = Replica(binary, database, extra)
    measured = []
    try:
        for _ in range(trials):
            doomed = Replica(binary, database, extra)
            trace_id = doomed.start_run("[mock:words=2000] [mock:delay=50] [mock:think=off]")
            # At any point of both replicas' beats (else each trial would begin in step with
            # the survivor's beat that took the previous one over).
            time.sleep(0.5 + random.uniform(0, 2 * beat))
            killed = time.time()
            doomed.kill()
            deadline = killed + after * 3 + 10
            while True:
                events = survivor.trace(trace_id)["events"]
                go_on = [e for e in events if e["type"] == "status" and e["data"]["message"] == "Continued on another server"]
                if go_on:
                    measured.append(at(go_on[0]["at"]) - killed)
                    break
                if time.time() > deadline:
                    raise SystemExit(f"{trace_id} was never taken over")
                time.sleep(0.05)
    finally:
        survivor.kill()
        psql(url, "drop database if exists bench_takeover_delay with (force)")
    return measured


def beat_cost(binary, url, runs, seconds=30):
    database = fresh_database(url, "bench_takeover_beat")
    name = "bench_takeover_beat"
    replicas = [Replica(binary, database), Replica(binary, database)]

    def window():
        stat = f"select xact_commit + xact_rollback, tup_updated, tup_inserted from pg_stat_database where datname = '{name}'"
        tables = "select relname, n_tup_upd from pg_stat_user_tables"
        before = [int(v) for v in psql(url, stat).split("|")]
        updated = dict(line.split("|") for line in psql(database, tables).splitlines())
        cpu = [r.cpu() for r in replicas]
        time.sleep(seconds)
        after = [int(v) for v in psql(url, stat).split("|")]
        used = sum(r.cpu() for r in replicas) - sum(cpu)
        changed = {t: int(n) - int(updated.get(t, 0)) for t, n in (l.split("|") for l in psql(database, tables).splitlines())}
        print("    rows updated by table:", {t: n for t, n in changed.items() if n})
        return [(a - b) / seconds for a, b in zip(after, before)], used / seconds * 100

    try:
        idle = window()
        for i in range(runs):
            replicas[0].start_run("[mock:words=2] [mock:delay=3600000] [mock:think=off]", user=f"u{i % 50}", until="start")
        time.sleep(5)
        held = window()
    finally:
        for r in replicas:
            r.kill()
        psql(url, f"drop database if exists {name} with (force)")
    return idle, held


def take_over_rate(binary, url, runs, beat, after):
    """Kills a replica holding `runs` answering runs; returns the seconds from the kill to the
    other replica's first and last take-over, and how many it took over."""
    name = "bench_takeover_rate"
    database = fresh_database(url, name)
    extra = f"[runs]\nheartbeat_secs = {beat}\ntakeover_after_secs = {after}\n"
    doomed, survivor = Replica(binary, database, extra), Replica(binary, database, extra)
    try:
        # Long answers (a word every 100 ms for 200 s): every run is still going when the
        # replica dies, and each has a completed step's worth of events logged.
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: doomed.start_run("[mock:words=2000] [mock:delay=100] [mock:think=off]",
                                                     user=f"u{i % 50}", until="start"), range(runs)))
        time.sleep(1)
        held = psql(database, "select replica_id, count(*) from traces where status = 'running' group by 1")
        gone, count = held.split("|")
        if int(count) != runs:
            raise SystemExit(f"{count} of {runs} runs were running before the kill")
        killed = time.time()
        doomed.kill()
        first = last = None
        deadline = killed + after * 3 + 120
        while True:
            taken = int(psql(database, f"select count(*) from traces where status = 'running' and replica_id <> '{gone}'"))
            at_now = time.time() - killed
            if taken and first is None:
                first = at_now
            if taken == runs:
                last = at_now
                break
            if time.time() > deadline:
                raise SystemExit(f"only {taken} of {runs} runs were taken over")
            time.sleep(0.02)
        # Taken over is not yet going on: every run's stream, followed from the log on the
        # survivor, shows its continuation (sampled: ten of them).
        sample = psql(database, "select id, user_id from traces order by random() limit 10").split()
        for trace_id, user in (row.split("|") for row in sample):
            deadline = time.time() + 30
            while not any(e["type"] == "status" and e["data"]["message"] == "Continued on another server"
                          for e in survivor.trace(trace_id, user)["events"]):
                if time.time() > deadline:
                    raise SystemExit(f"{trace_id} was taken over but never went on")
                time.sleep(0.1)
        return first, last, runs
    finally:
        doomed.kill()
        survivor.kill()
        psql(url, f"drop database if exists {name} with (force)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", default=os.environ.get("CHATD_TEST_POSTGRES_URL", "postgres://postgres:postgres@127.0.0.1:5432/test"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--settings", default="2:10,0.5:2")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--chatd")
    ap.add_argument("--parts", default="delay,beat")
    args = ap.parse_args()
    binary = chatd_binary(args.chatd)
    parts = args.parts.split(",")
    if "delay" in parts:
        print("take-over delay after kill -9 (s), from the kill to the run's first event on the other replica")
        for pair in args.settings.split(","):
            beat, after = (float(v) for v in pair.split(":"))
            measured = sorted(delays(binary, args.postgres, beat, after, args.trials))
            print(f"  heartbeat_secs={beat:g} takeover_after_secs={after:g}: median {median(measured):.2f}, "
                  f"worst {measured[-1]:.2f}, best {measured[0]:.2f} (of {len(measured)})")
    if "beat" in parts:
        (idle, idle_cpu), (held, held_cpu) = beat_cost(binary, args.postgres, args.runs)
        print(f"heartbeats of two replicas (defaults), per second over 30 s:")
        print(f"  no runs:        {idle[0]:6.2f} transactions, {idle[1]:7.1f} rows updated, CPU {idle_cpu:5.2f} % of a core")
        print(f"  {args.runs} runs held: {held[0]:6.2f} transactions, {held[1]:7.1f} rows updated, CPU {held_cpu:5.2f} % of a core")
    if "rate" in parts:
        beat, after = (float(v) for v in args.settings.split(",")[0].split(":"))
        first, last, runs = take_over_rate(binary, args.postgres, args.runs, beat, after)
        print(f"take-over of {runs} answering runs after kill -9 (heartbeat_secs={beat:g}, takeover_after_secs={after:g}):")
        print(f"  first taken over {first:.2f} s after the kill, last {last:.2f} s: "
              f"{runs / max(last - first, 0.001):.0f} runs continued per second")


if __name__ == "__main__":
    sys.exit(main())
