#!/usr/bin/env python3
"""Instructions chatd spends per relayed event, counted exactly by valgrind's callgrind.

Load on a shared machine moves CPU times by 10-20 % from one run to the next; an instruction
count does not move with it, so two builds compare to the percent (and a build of another
day, on another machine, compares at all). chatd runs under callgrind on a fresh SQLite
file, with instrumentation off until a warm-up run is done; then N streams of 2,000 tokens
from the mock, no delay by default; the count covers every thread of chatd over those
streams (user space: the kernel's share is not in it). Usage:

  loadtest/instructions.py [--chatd BIN ...] [--streams 8] [--tokens 2000] [--delay-ms 0]
                           [--provider-http http2|http1] [--postgres URL] [--obfuscation]

--postgres URL counts chatd on Postgres instead of SQLite: a fresh database beside the one URL
names, made and dropped for each count (the server's own instructions are not counted: they
are another process's; `pg_stat_statements` tells what it did).

With a pause between tokens (`--streams 50 --tokens 200 --delay-ms 20`) each token is a read,
a wake-up and a write of its own, as at (b)'s and (e)'s pace; without one, tokens come in
bursts, several to a read and a write, as in (a).

With short answers (`--streams 200 --tokens 10`) the count is mostly what a run costs
besides its tokens (its start, plan, end, trace and usage rows): it prints that per run too.

Several --chatd binaries are counted in turn. Needs valgrind (`apt-get install valgrind`).
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import REL, ROOT, chatd_config, drop_postgres, fresh_postgres, free_port, start, stop, wait_http  # noqa: E402


def loadgen(port, streams):
    cmd = [os.path.join(REL, "loadgen"), "--label", "chatd", "--url", f"http://127.0.0.1:{port}/api/chat/stream",
           "--body", json.dumps({"message": "go"}), "--streams", str(streams)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def count(chatd, streams, tokens, http1, keep=None, postgres=None, obfuscation=False, delay_ms=0):
    work = tempfile.mkdtemp(prefix="chatd-instructions-")
    database = fresh_postgres(postgres, os.path.basename(work)) if postgres else f"sqlite://{work}/chatd.db"
    mock_port, port = free_port(), free_port()
    mock = start([os.path.join(REL, "mockllm"), "--port", str(mock_port), "--tokens", str(tokens),
                  "--delay-ms", str(delay_ms)]
                 + (["--obfuscation"] if obfuscation else []))
    config = os.path.join(work, "chatd.toml")
    with open(config, "w") as f:
        f.write(chatd_config(port, database, mock_port, http1))
    out = os.path.join(work, "callgrind.out")
    chatd = start(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", chatd,
                   "--config", config], env={"RUST_LOG": "warn"}, log=open(os.path.join(work, "chatd.log"), "w"))
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", 120)
        loadgen(port, 2)
        time.sleep(1)
        subprocess.run(["callgrind_control", "-i", "on", str(chatd.pid)], check=True, capture_output=True)
        events = loadgen(port, streams)["events"]
        time.sleep(1)
        subprocess.run(["callgrind_control", "-i", "off", str(chatd.pid)], check=True, capture_output=True)
    finally:
        stop(chatd)
        stop(mock)
    totals = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True, check=True).stdout
    if keep:
        shutil.copy(out, keep)
    shutil.rmtree(work, ignore_errors=True)
    if postgres:
        drop_postgres(postgres, database)
    instructions = int(re.search(r"^([\d,]+) .*PROGRAM TOTALS", totals, re.M).group(1).replace(",", ""))
    return instructions, events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chatd", action="append", help="a chatd binary (repeat to compare several)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens in each answer")
    ap.add_argument("--delay-ms", type=int, default=0, help="milliseconds between two tokens of an answer")
    ap.add_argument("--provider-http", default="http2", choices=["http2", "http1"])
    ap.add_argument("--postgres", metavar="URL", help="count chatd on a fresh Postgres database beside this one")
    ap.add_argument("--obfuscation", action="store_true",
                    help="the mock ends every frame with an `obfuscation` member, as OpenAI's own API does")
    ap.add_argument("--keep", help="copy callgrind's output here (read it with callgrind_annotate --inclusive=yes)")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    binaries = args.chatd or [os.path.join(REL, "chatd")]
    if not args.chatd:
        subprocess.run(["cargo", "build", "--release", "--quiet", "--bins"], cwd=ROOT, check=True)
    for chatd in binaries:
        instructions, events = count(chatd, args.streams, args.tokens, args.provider_http == "http1", args.keep,
                                     args.postgres, args.obfuscation, args.delay_ms)
        print(f"{chatd}: {instructions / max(events, 1):,.0f} instructions per relayed event, "
              f"{instructions / args.streams:,.0f} per run ({instructions:,} over {events:,} events, "
              f"{args.streams} streams of {args.tokens} tokens {args.delay_ms} ms apart, {args.provider_http} to the model, "
              f"{'Postgres' if args.postgres else 'SQLite'})")


if __name__ == "__main__":
    main()
