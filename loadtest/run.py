#!/usr/bin/env python3
"""chatd's load benchmark: the same streams measured three ways in one run.

  direct   client -> mockllm                   (the physical limit)
  chatd    client -> chatd -> mockllm          (SQLite, traces and the event log on)
  litellm  client -> LiteLLM proxy -> mockllm  (with --litellm; installed in its own venv)

Scenarios: (a) throughput, (b) latency under concurrency, (c) capacity of open streams,
(d) a tool-calling run, (f) new chats while a thousand runs end at once, and (e) 50,000
open streams (only when named: --scenarios e --provider-http http2; over HTTP/1.1 from the
client each stream is a descriptor in chatd and in the load generator, and the bench raises
its descriptor limit, which needs root past the hard limit; with --client-http2 they share
500 connections). Prints one table and writes
target/bench/results.json. Figures are ratios against the direct path of the same run.
Usage:

  loadtest/run.py [--quick] [--litellm] [--scenarios a,b,c,d,f] [--backends sqlite,postgres]
                  [--provider-http http2,http1] [--repeat N] [--chatd BIN]
                  [--encodings native,ui,agui,responses] [--postgres URL] [--extra-config FILE]
                  [--client-http2] [--e-streams N] [--users N]

--backends measures chatd on each database in turn (both by default). On Postgres each
scenario gets a database of its own, made beside the one --postgres URL names (else
CHATD_TEST_POSTGRES_URL's, else the one scripts/postgres.sh starts; it must allow CREATE
DATABASE) and dropped after. Where that server runs on this machine, its processes' CPU
over chatd's run is reported beside chatd's (`postgres_cpu_us_per_event`): the two share
the cores.

--extra-config FILE adds its TOML to chatd's config: webhooks or telemetry on, to measure
what they cost against a run without (a receiver for them is the caller's to start).

--hooks turns both on with a receiver of the bench's own: a signed webhook endpoint for every
run's end and traces exported over OTLP/HTTP, both to a small HTTP server in this process that
answers 204 and counts what it got (reported per scenario). Their cost is chatd's CPU per
event against a run without --hooks (run the two in turn).

--encodings also measures the same streams through chatd's other vocabularies of a run: the AI
SDK's UI message stream (`ui`, POST /api/ui/chat), AG-UI (`agui`, POST /api/agui) and the OpenAI Responses API
(`responses`, POST /v1/responses with stream: true), each
reported as its CPU against the native stream's in the same run.

Single runs on a shared 2-core machine vary by 20 % and more; --repeat N measures the
direct and chatd paths N times in turn, on the same processes, and also prints the medians.

--provider-http says how chatd reaches the mock, each in turn (both by default): `http2`
(`http2 = true` on the provider: its streams share one connection) and `http1` (one HTTP/1.1
connection per stream, as Ollama, vLLM and llama.cpp are reached). --provider-http1 is
--provider-http http1.

--client-http2: the load generator reaches chatd and the mock over HTTP/2 without TLS (prior
knowledge), 100 streams to a connection, as a proxy in front of chatd that speaks h2c to it
would; HTTP/1.1, a connection to each stream, otherwise.

--users N: the streams (and the probes) are spread over N users, stream n running as
`bench-<n mod N>` (`X-Client-Id`, which chatd without auth takes as the user), as a service's
many users would; by default all are the one local user, so that a start's check of its
user's running runs meets every run going (1,000 at (b)): the worst case, and what the
figures before this option measured.
"""
import argparse, base64, http.server, json, os, resource, shutil, signal, socket, subprocess, sys, tempfile, threading, time
import urllib.request
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "target", "bench")
REL = os.path.join(ROOT, "target", "release")
CLIENT_HTTP2 = False  # --client-http2
USERS = 0  # --users
LITELLM_VERSION = "1.80.0"
MASTER_KEY = "sk-bench-master-7d1f"


_tried = 0


def free_port():
    """A port for a process this script starts, from below the kernel's own range (where
    neither port-0 listeners nor the load's outgoing connections get theirs), checked free:
    a port taken from the kernel and let go of could be given to a connection meanwhile."""
    global _tried
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            kernels_first = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        kernels_first = 32768
    first = max(kernels_first - 17000, 1024)
    count = max(kernels_first - first, 1)
    while True:
        port = first + (os.getpid() * 7919 + _tried * 104729) % count
        _tried += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def wait_http(url, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.1)
    raise SystemExit(f"{url} never answered")


def proc_cpu(pid):
    """A process's command name and the CPU seconds it has spent (user and system)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_stats(pid):
    _, cpu = proc_cpu(pid)
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return cpu, rss, hwm


class WalSize:
    """The largest size SQLite's WAL file at `path` has from now until `stop()`, sampled every
    0.2 s (MB). chatd makes it start over past 64 MiB written (docs/operations.md), so what
    passes that by much is writes between two checkpoints, or a WAL that does not start over."""

    def __init__(self, path):
        self.path, self.largest, self.done = path, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self):
        try:
            self.largest = max(self.largest, os.path.getsize(self.path))
        except OSError:
            pass

    def run(self):
        while not self.done.wait(0.2):
            self.sample()

    def stop(self):
        self.done.set()
        self.thread.join()
        self.sample()
        return self.largest / 1e6


class ServerCpu:
    """The CPU seconds processes named `name` (the local Postgres server's) spend from now
    until `stop()`: /proc sampled every 0.2 s, each process at its last reading, those that
    come and go meanwhile (pool connections) included but for their last 0.2 s. Where no such
    process is on this machine (a remote server), `stop()` gives None."""

    def __init__(self, name="postgres"):
        self.name, self.seen, self.done = name, {}, threading.Event()
        self.base = self.sample()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self):
        now = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                comm, cpu = proc_cpu(pid)
            except OSError:
                continue
            if comm == self.name:
                now[pid] = cpu
        return now

    def run(self):
        while not self.done.wait(0.2):
            self.seen.update(self.sample())

    def stop(self):
        self.done.set()
        self.thread.join()
        self.seen.update(self.sample())
        if not self.seen:
            return None
        return sum(cpu - self.base.get(pid, 0) for pid, cpu in self.seen.items())


def start(cmd, env=None, log=None):
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop(p):
    if p and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def loadgen(label, url, body, streams, headers=(), verify=None, probes=0, ended=None):
    """Runs the load generator; its figures. `ended` is called once every stream has ended,
    before the load generator checks what chatd persisted (`verify`): that check's reads are
    not the streams' cost."""
    # One loopback source address per 20,000 streams (each has ~28,000 ephemeral ports),
    # past 20,000 bound ones: the direct path's from 127.0.0.1, chatd's from 127.0.0.101 (a
    # bound socket takes a port none of its address holds, TIME_WAIT included, and the run
    # before left its ports in TIME_WAIT).
    # Over HTTP/2 (`--client-http2`) 100 streams share a connection: one address is plenty.
    sources = 1 if CLIENT_HTTP2 else streams // 20000 + 1
    cmd = [os.path.join(REL, "loadgen"), "--label", label, "--url", url, "--body", json.dumps(body), "--streams", str(streams),
           "--probes", str(probes), "--sources", str(sources)]
    if CLIENT_HTTP2:
        cmd += ["--http2", "100"]
    if USERS:
        cmd += ["--users", str(USERS)]
    if sources > 1 and label != "direct":
        cmd += ["--source-base", "100"]
    for h in headers:
        cmd += ["--header", h]
    if verify:
        cmd += ["--verify", verify]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Its one line on stdout comes last; on stderr it says when the streams have ended.
    for line in proc.stderr:
        if line.strip() == "streams ended":
            if ended:
                ended()
            break
        sys.stderr.write(line)
    out, err = proc.communicate()
    sys.stderr.write(err)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return json.loads(out.strip().splitlines()[-1])


def install_litellm():
    venv = os.path.join(OUT, "litellm-venv")
    marker = os.path.join(venv, ".installed")
    if not (os.path.exists(marker) and open(marker).read() == LITELLM_VERSION):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"], check=True)
        open(marker, "w").write(LITELLM_VERSION)
    return os.path.join(venv, "bin", "litellm")


class Receiver(http.server.ThreadingHTTPServer):
    """Takes webhook deliveries and OTLP exports: answers 204, counts them by path."""

    daemon_threads = True

    def __init__(self):
        self.got = {}
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):
                handler.rfile.read(int(handler.headers.get("content-length", 0)))
                with lock:
                    key = "otlp" if handler.path.endswith("/v1/traces") else "webhooks"
                    self.got[key] = self.got.get(key, 0) + 1
                handler.send_response(204)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def config(self):
        port = self.server_address[1]
        return f"""
[webhooks.bench]
url = "http://127.0.0.1:{port}/hooks"
events = ["run.completed", "run.failed", "run.cancelled"]
secret_env = "CHATD_BENCH_WEBHOOK_SECRET"
[telemetry]
otlp_endpoint = "http://127.0.0.1:{port}"
"""


def chatd_config(port, database, mock_port, http1, tools="none", connections=10000):
    """chatd's config for the bench: no rate limits, the mock as its one model."""
    return f"""[server]
port = {port}
max_connections = {connections}
[database]
url = "{database}"
[limits]
requests_per_minute = 0
max_concurrent_runs_per_user = 100000
[tools]
builtins = ["calculator"]
[providers.mock]
kind = "openai_compatible"
base_url = "http://127.0.0.1:{mock_port}/v1"
max_retries = 0
http2 = {'false' if http1 else 'true'}
[profiles.default]
provider = "mock"
model = "mock"
tools = ["{tools}"]
"""


def database_name(url):
    """The database a Postgres URL names, without the URL's parameters."""
    return url.partition("?")[0].rpartition("/")[2]


def drop_postgres(url, database):
    """Drops the database `database` (a URL) names, through the server `url` names."""
    subprocess.run(["psql", url, "-q", "-c", f"drop database if exists {database_name(database)} with (force)"])


def fresh_postgres(url, name):
    """Makes an empty database beside `url`'s for one scenario; returns its URL."""
    name = "bench_" + "".join(c if c.isalnum() else "_" for c in name).lower()
    path, _, query = url.partition("?")
    base, _, _ = path.rpartition("/")
    subprocess.run(["psql", url, "-q", "-c", f"drop database if exists {name}", "-c", f"create database {name}"], check=True)
    # The URL's parameters (sslmode=disable, say) hold for the new database too.
    return f"{base}/{name}" + (f"?{query}" if query else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller scenarios")
    ap.add_argument("--litellm", action="store_true", help="also measure the LiteLLM proxy")
    ap.add_argument("--scenarios", default="a,b,c,d,f")
    ap.add_argument("--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres (each in turn)")
    ap.add_argument("--provider-http", default="http2,http1",
                    help="comma-separated: http2 (one shared connection to the mock), http1 (one per stream)")
    ap.add_argument("--provider-http1", action="store_true", help="the same as --provider-http http1")
    ap.add_argument("--repeat", type=int, default=1, help="measure the direct and chatd paths this many times each")
    ap.add_argument("--chatd", default=os.path.join(REL, "chatd"), help="the chatd binary to measure (to compare two builds)")
    ap.add_argument("--postgres", metavar="URL", help="the Postgres to make each scenario's database beside")
    ap.add_argument("--extra-config", metavar="FILE", help="TOML added to chatd's config (webhooks, telemetry: their cost)")
    ap.add_argument("--hooks", action="store_true", help="webhooks and OTLP export on, to a receiver in this process")
    ap.add_argument("--e-streams", type=int, help="(e)'s stream count, instead of 50,000")
    ap.add_argument("--client-http2", action="store_true",
                    help="the load generator speaks HTTP/2 without TLS to chatd and to the mock, 100 streams a connection "
                         "(as a proxy in front of chatd would); HTTP/1.1, a connection a stream, otherwise")
    ap.add_argument("--users", type=int, default=0, help="spread the streams over this many users (X-Client-Id)")
    ap.add_argument("--encodings", default="native",
                    help="comma-separated: native (always), ui (the AI SDK's stream), agui (AG-UI's), responses (the OpenAI Responses API's)")
    args = ap.parse_args()
    global CLIENT_HTTP2, USERS
    CLIENT_HTTP2 = args.client_http2
    USERS = args.users
    # The bench needs many sockets (chatd holds two per stream: the client's and the model's);
    # it raises its own limit, inherited by what it starts. chatd's defaults do not change.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 65536), max(hard, 65536)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.makedirs(OUT, exist_ok=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bins"], cwd=ROOT, check=True)

    q = args.quick
    scenarios = {
        "a": dict(name="throughput", streams=16 if q else 64, tokens=500 if q else 2000, delay=0),
        # 1,000 streams at 20 tokens/s, 10 s each; once all stream, 200 more open one every
        # 20 ms: their time to first event is the latency a new chat sees at that load.
        "b": dict(name="latency", streams=200 if q else 1000, tokens=100 if q else 200, delay=50, probes=50 if q else 200),
        # The same, but 3 s each: the 1,000 runs end all at once while the 200 new chats
        # open, and their ends' writes are what the new chats' starts wait behind.
        "f": dict(name="ends", streams=200 if q else 1000, tokens=60, delay=50, probes=50 if q else 200),
        "c": dict(name="capacity", streams=1000 if q else 10000, tokens=5 if q else 10, delay=1000),
        "d": dict(name="tools", streams=16 if q else 64, tokens=50, delay=0, tool="calculator"),
        # 50,000 streams open at once on one process (HTTP/2 to the model: HTTP/1.1 would
        # need 50,000 more connections to it), 60 s each at 1 token/s; not run by default.
        "e": dict(name="capacity-50k", streams=args.e_streams or (5000 if q else 50000), tokens=60, delay=1000),
    }
    # Each stream is a descriptor in chatd and one in the load generator: past the hard
    # limit (which only root with CAP_SYS_RESOURCE can raise) (e) holds what fits.
    room = resource.getrlimit(resource.RLIMIT_NOFILE)[1] - 1000
    if "e" in args.scenarios.split(",") and scenarios["e"]["streams"] > room and not CLIENT_HTTP2:
        print(f"(e): the descriptor limit ({room + 1000}) holds {room} streams, not {scenarios['e']['streams']}")
        scenarios["e"]["streams"] = room
    litellm_bin = install_litellm() if args.litellm else None
    backends = args.backends.split(",")
    postgres = args.postgres or os.environ.get("CHATD_TEST_POSTGRES_URL")
    if "postgres" in backends and not postgres:
        started = subprocess.run([os.path.join(ROOT, "scripts", "postgres.sh")], capture_output=True, text=True)
        postgres = started.stdout.strip() if started.returncode == 0 else None
        if not postgres:
            raise SystemExit("no Postgres to measure on: give --postgres URL, or --backends sqlite")
    transports = ["http1"] if args.provider_http1 else args.provider_http.split(",")
    results = []
    for backend in backends:
        for http in transports:
            print(f"\n== chatd on {backend}, HTTP/{'1.1' if http == 'http1' else '2'} to the model ==")
            for key in args.scenarios.split(","):
                results.extend(run_scenario(args, key, scenarios[key], postgres if backend == "postgres" else None,
                                            http == "http1", litellm_bin, {"backend": backend, "provider_http": http,
                                                                          "client_http": "http2" if CLIENT_HTTP2 else "http1"}))
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=2)


def run_scenario(args, key, sc, postgres, http1, litellm_bin, labels):
    """One scenario on one backend and transport: its rows, reported as they come."""
    work = tempfile.mkdtemp(prefix="chatd-bench-")
    mock_port, chatd_port, litellm_port = free_port(), free_port(), free_port()
    mock_cmd = [os.path.join(REL, "mockllm"), "--port", str(mock_port), "--tokens", str(sc["tokens"]), "--delay-ms", str(sc["delay"])]
    if sc.get("tool"):
        mock_cmd += ["--tool", sc["tool"]]
    mock = start(mock_cmd)
    config = os.path.join(work, "chatd.toml")
    database = f"sqlite://{work}/chatd.db"
    if postgres:
        database = fresh_postgres(postgres, os.path.basename(work))
    with open(config, "w") as f:
        f.write(chatd_config(chatd_port, database, mock_port, http1, "*" if sc.get("tool") else "none",
                             connections=max(10000, sc["streams"] + 1000)))
        if args.extra_config:
            with open(args.extra_config) as extra:
                f.write("\n" + extra.read())
        receiver = Receiver() if args.hooks else None
        if receiver:
            f.write(receiver.config())
    chatd_log = open(os.path.join(work, "chatd.log"), "w")
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    chatd = start([args.chatd, "--config", config], env={"RUST_LOG": "warn", "CHATD_BENCH_WEBHOOK_SECRET": secret}, log=chatd_log)
    litellm, reps = None, []
    try:
        wait_http(f"http://127.0.0.1:{chatd_port}/readyz")
        openai_body = {"model": "mock", "messages": [{"role": "user", "content": "go"}], "stream": True}
        if sc.get("tool"):
            openai_body["tools"] = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        time.sleep(0.2)
        probes = sc.get("probes", 0)
        for rep in range(max(args.repeat, 1)):
            row = {"scenario": key, **sc, **labels, "run": rep + 1}
            measure(row, sc, mock_port, chatd_port, chatd, openai_body, probes,
                    wal=None if postgres else os.path.join(work, "chatd.db-wal"))
            for encoding in [e for e in args.encodings.split(",") if e in ENCODINGS]:
                measure_encoding(row, encoding, sc, chatd_port, chatd, probes)
            reps.append(row)
            if rep + 1 < args.repeat:
                report(row)
        if litellm_bin:
            with open(os.path.join(work, "litellm.yaml"), "w") as f:
                f.write(f"""model_list:
  - model_name: mock
    litellm_params:
      model: openai/mock
      api_base: http://127.0.0.1:{mock_port}/v1
      api_key: sk-unused
general_settings:
  master_key: {MASTER_KEY}
""")
            litellm = start([litellm_bin, "--config", os.path.join(work, "litellm.yaml"), "--port", str(litellm_port), "--num_workers", "1"],
                            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
                            log=open(os.path.join(work, "litellm.log"), "w"))
            wait_http(f"http://127.0.0.1:{litellm_port}/health/liveliness", 180)
            row["litellm"] = loadgen("litellm", f"http://127.0.0.1:{litellm_port}/v1/chat/completions", openai_body, sc["streams"],
                                     headers=[f"Authorization: Bearer {MASTER_KEY}"], probes=probes)
        report(row)
        if len(reps) > 1:
            report_medians(reps)
    finally:
        stop(litellm)
        if receiver:
            time.sleep(6)  # the exporter sends its batches every 5 s
        stop(chatd)
        if receiver:
            receiver.shutdown()
            print(f"  hooks on: the receiver got {receiver.got.get('webhooks', 0)} webhook deliveries and "
                  f"{receiver.got.get('otlp', 0)} OTLP exports")
            for rep in reps:
                rep["hooks_received"] = dict(receiver.got)
        stop(mock)
        chatd_log.close()
        shutil.rmtree(work, ignore_errors=True)
        if postgres:
            drop_postgres(postgres, database)
    return reps


def measure(row, sc, mock_port, chatd_port, chatd, openai_body, probes, wal=None):
    """The direct path, then chatd's, with chatd's CPU and memory over its run (and, given
    `wal`, SQLite's WAL at its largest), into `row`."""
    row["direct"] = loadgen("direct", f"http://127.0.0.1:{mock_port}/v1/chat/completions", openai_body, sc["streams"],
                            probes=probes)
    try:
        # Resets the peak RSS, so that each run's growth is its own.
        with open(f"/proc/{chatd.pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    server = ServerCpu() if row.get("backend") == "postgres" else None
    wal_size = WalSize(wal) if wal else None
    cpu0, rss0, _ = proc_stats(chatd.pid)
    at_end = {}

    def streams_ended():
        # chatd's and the server's CPU for the streams, without the persisted answers' check.
        at_end["chatd"] = proc_stats(chatd.pid)
        at_end["server"] = server.stop() if server else None
        at_end["wal"] = wal_size.stop() if wal_size else None

    row["chatd"] = loadgen("chatd", f"http://127.0.0.1:{chatd_port}/api/chat/stream", {"message": "go"}, sc["streams"],
                           verify=f"http://127.0.0.1:{chatd_port}", probes=probes, ended=streams_ended)
    cpu1, rss1, hwm1 = at_end["chatd"]
    deltas = row["chatd"]["events"]
    server_cpu = at_end["server"]
    if server_cpu is not None:
        # The Postgres server's work for chatd: beside chatd's own on the same cores.
        row["postgres_cpu_s"] = server_cpu
        row["postgres_cpu_us_per_event"] = server_cpu * 1e6 / max(deltas, 1)
    if at_end["wal"] is not None:
        row["sqlite_wal_largest_mb"] = at_end["wal"]
    row["chatd_cpu_s"] = cpu1 - cpu0
    row["chatd_cpu_us_per_event"] = (cpu1 - cpu0) * 1e6 / max(deltas, 1)
    row["chatd_rss_kb"] = {"before": rss0, "after": rss1, "peak": hwm1}
    row["chatd_rss_kb_per_stream"] = (hwm1 - rss0) / row["chatd"]["streams"]
    row["chatd_ttfe_added_p99_ms"] = row["chatd"]["ttfe_ms"]["p99"] - row["direct"]["ttfe_ms"]["p99"]
    # The streams that start at once: their first token's p99 over the direct path's.
    row["chatd_ttft_p99_ratio"] = row["chatd"]["ttft_ms"]["p99"] / max(row["direct"]["ttft_ms"]["p99"], 1e-9)
    if probes:
        row["chatd_probe_ttfe_added_p99_ms"] = row["chatd"]["probe_ttfe_ms"]["p99"] - row["direct"]["probe_ttfe_ms"]["p99"]
        # To the first token: chatd's first event (`start`) goes out before the model is called.
        row["chatd_probe_ttft_added_p99_ms"] = row["chatd"]["probe_ttft_ms"]["p99"] - row["direct"]["probe_ttft_ms"]["p99"]


# The other vocabularies of a run: endpoint, and a body whose chat id differs per stream.
ENCODINGS = {
    "ui": ("/api/ui/chat", lambda tag: {"id": f"bench-{tag}-{{n}}",
                                         "messages": [{"id": "m", "role": "user", "parts": [{"type": "text", "text": "go"}]}]}),
    "agui": ("/api/agui", lambda tag: {"threadId": f"bench-{tag}-{{n}}", "runId": "r",
                                        "messages": [{"id": "m", "role": "user", "content": "go"}]}),
    "responses": ("/v1/responses", lambda tag: {"model": "default", "input": "go", "stream": True}),
}


def measure_encoding(row, encoding, sc, chatd_port, chatd, probes):
    """The same streams through another vocabulary, and chatd's CPU for them, into `row`."""
    path, body = ENCODINGS[encoding]
    cpu0, _, _ = proc_stats(chatd.pid)
    result = loadgen(encoding, f"http://127.0.0.1:{chatd_port}{path}", body(f"{encoding}-{row['scenario']}-{row['run']}"),
                     sc["streams"], probes=probes)
    cpu1, _, _ = proc_stats(chatd.pid)
    result["cpu_s"] = cpu1 - cpu0
    result["cpu_vs_native"] = (cpu1 - cpu0) / max(row["chatd_cpu_s"], 1e-9)
    row.setdefault("encodings", {})[encoding] = result


def report_medians(reps):
    cpu = [r["chatd_cpu_us_per_event"] for r in reps]
    ratio = [r["chatd"]["events_per_sec"] / max(r["direct"]["events_per_sec"], 1e-9) for r in reps]
    print(f"  over {len(reps)} runs: chatd CPU per event median {median(cpu):.2f} us ({min(cpu):.2f}-{max(cpu):.2f}); "
          f"throughput ratio chatd/direct median {median(ratio):.3f}", end="")
    server = [r["postgres_cpu_us_per_event"] for r in reps if "postgres_cpu_us_per_event" in r]
    if server:
        print(f"; Postgres server CPU per event median {median(server):.2f} us", end="")
    added = [r["chatd_probe_ttfe_added_p99_ms"] for r in reps if "chatd_probe_ttfe_added_p99_ms" in r]
    if added:
        print(f"; added ttfe p99 of probes at load median {median(added):.2f} ms ({min(added):.2f} to {max(added):.2f})", end="")
    added = [r["chatd_probe_ttft_added_p99_ms"] for r in reps if "chatd_probe_ttft_added_p99_ms" in r]
    if added:
        print(f"; to the first token median {median(added):.2f} ms ({min(added):.2f} to {max(added):.2f})", end="")
    print()


def report(row):
    d, c, l = row["direct"], row["chatd"], row.get("litellm")
    print(f"\n({row['scenario']}) {row['name']}: {row['streams']} streams x {row['tokens']} tokens, {row['delay']} ms apart, "
          f"run {row['run']}")
    for r in [d, c] + ([l] if l else []):
        print(f"  {r['label']:>8}: ended {r['ended']}/{r['streams']} ({r['peak_open']} open at once), errors {r['errors']}, "
              f"persisted {r['persisted']}, "
              f"{r['events_per_sec']:.0f} events/s, ttfe p50 {r['ttfe_ms']['p50']:.1f} ms p99 {r['ttfe_ms']['p99']:.1f} ms, "
              f"gap p99 {r['gap_ms']['p99']:.1f} ms, wall {r['wall_ms']:.0f} ms", end="")
        if (r.get("end_wait_ms") or {}).get("max") is not None:
            # From a stream's last token to its end: chatd writes the run's end before `done`.
            print(f", last token to end p50 {r['end_wait_ms']['p50']:.1f} ms p99 {r['end_wait_ms']['p99']:.1f} ms", end="")
        print()
        if r.get("probes"):
            print(f"            {r['probes']} probes while the others stream: ttfe p50 {r['probe_ttfe_ms']['p50']:.2f} ms "
                  f"p99 {r['probe_ttfe_ms']['p99']:.2f} ms max {r['probe_ttfe_ms']['max']:.2f} ms "
                  f"(p90 {r['probe_ttfe_ms']['p90']:.2f} ms, mean {r['probe_ttfe_ms']['mean']:.2f} ms); "
                  f"first token p50 {r['probe_ttft_ms']['p50']:.2f} ms p99 {r['probe_ttft_ms']['p99']:.2f} ms")
    print(f"  chatd CPU {row['chatd_cpu_s']:.3f} s = {row['chatd_cpu_us_per_event']:.2f} us per relayed event; "
          f"RSS {row['chatd_rss_kb']['before']} -> peak {row['chatd_rss_kb']['peak']} kB = {row['chatd_rss_kb_per_stream']:.1f} kB per stream; "
          f"added ttfe p99 {row['chatd_ttfe_added_p99_ms']:.1f} ms (all starting at once)", end="")
    if "chatd_probe_ttfe_added_p99_ms" in row:
        print(f", {row['chatd_probe_ttfe_added_p99_ms']:.2f} ms (probes at load)", end="")
    if "chatd_probe_ttft_added_p99_ms" in row:
        print(f", {row['chatd_probe_ttft_added_p99_ms']:.2f} ms to the probes' first token", end="")
    print(f"; all at once, first token p99 {row['chatd']['ttft_ms']['p99']:.1f} ms against "
          f"{row['direct']['ttft_ms']['p99']:.1f} ms direct = {row['chatd_ttft_p99_ratio']:.2f}x", end="")
    print()
    if "sqlite_wal_largest_mb" in row:
        print(f"  SQLite's WAL at its largest {row['sqlite_wal_largest_mb']:.1f} MB")
    if "postgres_cpu_s" in row:
        print(f"  Postgres server CPU beside it {row['postgres_cpu_s']:.3f} s = {row['postgres_cpu_us_per_event']:.2f} us per relayed event")
    print(f"  throughput ratio chatd/direct {c['events_per_sec'] / max(d['events_per_sec'], 1e-9):.3f}", end="")
    if l:
        print(f", chatd/litellm {c['events_per_sec'] / max(l['events_per_sec'], 1e-9):.1f}x", end="")
    print()
    for name, e in row.get("encodings", {}).items():
        print(f"  {name:>8}: ended {e['ended']}/{e['streams']}, errors {e['errors']}, {e['events_per_sec']:.0f} frames/s, "
              f"ttfe p99 {e['ttfe_ms']['p99']:.1f} ms; chatd CPU {e['cpu_s']:.3f} s = {e['cpu_vs_native']:.2f}x the native stream's")
        if e.get("probes"):
            print(f"            {e['probes']} probes while the others stream: ttfe p50 {e['probe_ttfe_ms']['p50']:.2f} ms "
                  f"p99 {e['probe_ttfe_ms']['p99']:.2f} ms")


if __name__ == "__main__":
    main()
