#!/usr/bin/env python3
"""chatd's upload benchmark (CONTRACT.md §14): a 20 MiB file through POST /api/files, against
the physical limit measured in the same run.

  copy    cp of the same file into the same folder      (the disk's own speed: the baseline)
  upload  curl -F file=@… -> chatd (multipart, streamed to file storage, hashed, sniffed)

Both are timed over --repeat runs (medians printed). chatd's peak memory is read from
/proc/<pid>/status (VmHWM) before the first upload and after the last: what the uploads
added is what an upload costs in memory (the file itself is never held whole).

Usage: loadtest/upload.py [--repeat N] [--mib M] [--chatd BIN]
Builds the release binary unless --chatd names one. Needs curl.
"""
import argparse, json, os, shutil, signal, subprocess, sys, tempfile, time, urllib.request
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "loadtest"))
from run import free_port  # noqa: E402


def kib(field, pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mib", type=int, default=20)
    parser.add_argument("--chatd")
    args = parser.parse_args()
    binary = args.chatd
    if not binary:
        subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "chatd"], cwd=ROOT, check=True)
        binary = os.path.join(ROOT, "target", "release", "chatd")
    work = tempfile.mkdtemp(prefix="chatd-upload-")
    try:
        # A PDF's frame around random bytes: sniffed as a PDF, and no two runs share bytes
        # (content addressing would otherwise keep the second upload for free).
        size = args.mib * 1024 * 1024
        files = []
        for i in range(args.repeat):
            path = os.path.join(work, f"big-{i}.pdf")
            with open(path, "wb") as f:
                f.write(b"%PDF-1.4\n")
                f.write(os.urandom(size - 16))
                f.write(b"\n%%EOF\n")
            files.append(path)
        port = free_port()
        config = os.path.join(work, "chatd.toml")
        with open(config, "w") as f:
            f.write(f"[server]\nport = {port}\n[database]\nurl = \"sqlite://{work}/chatd.db\"\n"
                    f"[files]\nurl = \"file://{work}/files\"\nmax_bytes = {size + 1024}\n"
                    "[limits]\nrequests_per_minute = 0\n")
        chatd = subprocess.Popen([binary, "--config", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "RUST_LOG": "warn"})
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        before = kib("VmHWM", chatd.pid)
        copies, uploads = [], []
        for path in files:
            start = time.perf_counter()
            shutil.copyfile(path, os.path.join(work, "copy.bin"))
            os.sync()
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = subprocess.run(["curl", "-sS", "-f", "-H", "x-client-id: bench", "-F", f"file=@{path}",
                                  base + "/api/files"], capture_output=True, check=True)
            os.sync()
            uploads.append(time.perf_counter() - start)
            assert json.loads(out.stdout)["size"] == size, out.stdout
        after = kib("VmHWM", chatd.pid)
        rss = kib("VmRSS", chatd.pid)
        chatd.send_signal(signal.SIGTERM)
        chatd.wait(timeout=20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = args.mib
    copy, upload = median(copies), median(uploads)
    print(f"{mib} MiB, {args.repeat} runs each (medians)")
    print(f"  copy (baseline)  {copy * 1000:8.1f} ms   {mib / copy:8.1f} MiB/s")
    print(f"  chatd upload     {upload * 1000:8.1f} ms   {mib / upload:8.1f} MiB/s   {upload / copy:5.2f}× the copy's time")
    print(f"  chatd peak RSS   {before / 1024:.1f} MiB idle -> {after / 1024:.1f} MiB after the uploads "
          f"(+{(after - before) / 1024:.1f} MiB for a {mib} MiB file; RSS now {rss / 1024:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
