#!/usr/bin/env python3
"""Runs that wait, measured with real processes (CONTRACT.md §15, §16):

  queued    --conversations conversations, each sent --messages messages at once (one runs,
            the rest queue, CONTRACT.md §16), to one replica and (Postgres) to two in turn:
            how long each stream takes to open, and the hand-off from one run's end (its
            trace's `ended_at`) to the next queued run's first event; every stream whole, every conversation
            one branch with every message answered
  approval  a run that waits for an approval, decided on the replica that streams it and
            (Postgres) on another: from the decision's POST to the stream's next event, with
            1 and with --waiting runs waiting and decided at once

Usage: loadtest/waits.py [--backends sqlite,postgres] [--parts queued,approval] [--conversations 100]
                         [--messages 10] [--trials 50] [--waiting 100] [--chatd BIN] [--postgres URL]

The in-process mock model answers (no provider). --postgres names a database whose server
allows CREATE DATABASE (a database of its own is made beside it and dropped after). The
release binary is built when --chatd is not given.
"""
import argparse, json, os, sys, tempfile, threading, time, urllib.request
from statistics import median

from takeover import Replica, at, chatd_binary, fresh_database, psql

threading.stack_size(512 * 1024)

APPROVE_CALCULATOR = '[tools]\nrequire_approval = ["calculator"]\n'
ADD = 'Add [mock:tool=calculator {"expression": "1 + 2"}] [mock:think=off]'
TERMINAL = ("complete", "cancelled", "error")


def pct(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def figures(values):
    ms = [v * 1000 for v in values]
    return f"p50 {pct(ms, 50):6.1f} ms, p99 {pct(ms, 99):6.1f} ms, worst {max(ms):6.1f} ms (of {len(ms)})"


class Stream:
    """One POST /api/chat/stream read event by event, each event with the time it was read."""

    def __init__(self, base, body, user):
        request = urllib.request.Request(f"{base}/api/chat/stream", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json", "x-client-id": user})
        self.sent = time.monotonic()
        self.response = urllib.request.urlopen(request, timeout=600)
        self.events = []

    def next(self):
        """The next event (type, data) and when it came; None at the end."""
        for line in self.response:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                self.events.append((time.monotonic(), event))
                return self.events[-1]
        return None

    def until(self, kind):
        while (event := self.next()) is not None:
            if event[1]["type"] == kind:
                return event
        raise SystemExit(f"the stream ended before a {kind}: {[e['type'] for _, e in self.events]}")

    def rest(self):
        while self.next() is not None:
            pass
        self.response.close()
        return self.events

    def first(self, kind):
        return next(((at, e) for at, e in self.events if e["type"] == kind), None)


def assert_whole(events, what):
    kinds = [e["type"] for _, e in events]
    if sum(k in TERMINAL for k in kinds) != 1 or kinds[-1] != "done" or kinds.count("done") != 1:
        raise SystemExit(f"{what}: not one terminal event then done: {kinds}")
    if "complete" not in kinds:
        raise SystemExit(f"{what}: did not complete: {events[-2][1]}")


def post(base, path, body, user):
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "x-client-id": user})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def get(base, path, user):
    request = urllib.request.Request(f"{base}{path}", headers={"x-client-id": user})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def in_threads(count, work):
    """Runs work(i) for i in range(count), each in its own thread; returns the results."""
    results, errors = [None] * count, []

    def one(i):
        try:
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{len(errors)} of {count} failed; the first: {errors[0]!r}")
    return results


def queued(binary, database, conversations, messages, replicas=1):
    """The messages go to `replicas` replicas in turn (more than one: Postgres only)."""
    sending = [Replica(binary, database) for _ in range(replicas)]
    replica = sending[0]
    try:
        def open_conversation(i):
            stream = Stream(replica.base, {"message": "hello [mock:words=2] [mock:think=off]"}, f"u{i}")
            return stream.until("start")[1]["conversation_id"], stream.rest()

        ids = [c for c, _ in in_threads(conversations, open_conversation)]
        gate = threading.Barrier(conversations * messages)

        def send(n):
            conversation, k = divmod(n, messages)
            body = {"message": f"message {k} [mock:words=20] [mock:delay=5] [mock:think=off]",
                    "conversation_id": ids[conversation]}
            gate.wait()
            stream = Stream(sending[n % replicas].base, body, f"u{conversation}")
            stream.rest()
            return stream

        began = time.monotonic()
        streams = in_threads(conversations * messages, send)
        took = time.monotonic() - began
        opened, handoffs, queued_count = [], [], 0
        for c in range(conversations):
            mine = streams[c * messages:(c + 1) * messages]
            for s in mine:
                assert_whole(s.events, f"conversation {c}")
                opened.append(s.events[0][0] - s.sent)
            # In the order they ran, by the server's clock: each run's first event after its
            # `start` (and its "Queued") against the end of the run before it, as stored
            # (its `ended_at`; its `complete` is said after), which it must follow.
            runs = []
            for s in mine:
                trace = get(replica.base, f"/api/trace/{s.events[0][1]['trace_id']}", f"u{c}")
                events = trace["events"]
                was_queued = events[1]["type"] == "status" and events[1]["data"]["message"] == "Queued"
                going = events[2 if was_queued else 1]
                runs.append((at(going["at"]), at(trace["ended_at"]), was_queued, trace["trace_id"], going["type"]))
            runs.sort()
            for (_, before_ended, _, before, _), (began, _, was_queued, after, kind) in zip(runs, runs[1:]):
                if began < before_ended:
                    raise SystemExit(f"conversation {c}: run {after} ({kind}, queued: {was_queued}) began "
                                     f"{(before_ended - began) * 1000:.1f} ms before run {before} ended")
                if was_queued:
                    queued_count += 1
                    handoffs.append(began - before_ended)
            branch = get(replica.base, f"/api/conversations/{ids[c]}", f"u{c}")["messages"]
            roles = [m["role"] for m in branch]
            if roles != ["user", "assistant"] * (messages + 1):
                raise SystemExit(f"conversation {c}: the branch is not every message answered: {roles}")
            asked = sorted(m["content"] for m in branch[2::2])
            if asked != sorted(f"message {k} [mock:words=20] [mock:delay=5] [mock:think=off]" for k in range(messages)):
                raise SystemExit(f"conversation {c}: the branch lost a message: {asked}")
        return took, opened, handoffs, queued_count
    finally:
        for r in sending:
            r.kill()


def approvals(binary, database, other, waiting, trials):
    """Decision to next event, `trials` times with `waiting` runs waiting and decided at once."""
    a = Replica(binary, database, APPROVE_CALCULATOR)
    b = Replica(binary, database, APPROVE_CALCULATOR) if other else a
    try:
        measured, answered = [], []
        rounds = max(1, trials // waiting)
        for _ in range(rounds):
            gate = threading.Barrier(waiting)

            def one(i):
                stream = Stream(a.base, {"message": ADD}, f"u{i % 50}")
                request = stream.until("tool_approval_request")[1]
                gate.wait()
                decided = time.monotonic()
                replied = []
                poster = threading.Thread(target=lambda: replied.append(
                    (post(b.base, f"/api/approvals/{request['approval_id']}", {"approved": True}, f"u{i % 50}"),
                     time.monotonic())))
                poster.start()
                at, event = stream.next()
                poster.join()
                if replied[0][0]["status"] != "approved" or event["type"] in TERMINAL:
                    raise SystemExit(f"after the approval: {event}, {replied}")
                events = stream.rest()
                assert_whole(events, "approved run")
                return at - decided, replied[0][1] - decided

            for gap, reply in in_threads(waiting, one):
                measured.append(gap)
                answered.append(reply)
        return measured, answered
    finally:
        a.kill()
        if b is not a:
            b.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", default=os.environ.get("CHATD_TEST_POSTGRES_URL", "postgres://postgres:postgres@127.0.0.1:5432/test"))
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--parts", default="queued,approval")
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--messages", type=int, default=10)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--waiting", type=int, default=100)
    ap.add_argument("--chatd")
    args = ap.parse_args()
    binary = chatd_binary(args.chatd)
    parts = args.parts.split(",")
    for backend in args.backends.split(","):
        def database(name):
            if backend == "sqlite":
                return f"sqlite://{tempfile.mkdtemp(prefix='chatd-waits-')}/chatd.db"
            return fresh_database(args.postgres, f"bench_waits_{name}")

        print(f"== {backend}")
        if "queued" in parts:
            for replicas in (1, 2) if backend == "postgres" else (1,):
                took, opened, handoffs, count = queued(binary, database("queued"), args.conversations, args.messages,
                                                       replicas)
                total = args.conversations * args.messages
                print(f"queued: {args.conversations} conversations x {args.messages} messages sent at once "
                      f"to {replicas} replica(s), {total} runs in {took:.2f} s ({count} of them queued)")
                print(f"  stream open (POST to its first event):  {figures(opened)}")
                print(f"  hand-off (a run's end to the next's first event, chatd's clock): {figures(handoffs)}")
        if "approval" in parts:
            print("approval: from the decision's POST to the stream's next event; the POST's answer")
            where = [("the streaming replica", False)] + ([("another replica", True)] if backend == "postgres" else [])
            for label, other in where:
                for waiting in (1, args.waiting):
                    gaps, replies = approvals(binary, database("approval"), other, waiting, max(args.trials, waiting))
                    print(f"  decided on {label}, {waiting:3d} waiting: next event {figures(gaps)}")
                    print(f"  {'':>{len(label) + 24}}POST answered {figures(replies)}")
        if backend == "postgres":
            for name in ("queued", "approval"):
                psql(args.postgres, f"drop database if exists bench_waits_{name} with (force)")


if __name__ == "__main__":
    sys.exit(main())
