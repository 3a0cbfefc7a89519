"""Run a command and report the peak resident memory of its whole process tree (the command, its children, the
servers its tests start), sampled every --interval seconds, with the moment and the test (from pytest's -v
output, when the command is pytest) where it peaked.

    python scripts/peak_memory.py --out runs/test-memory.json -- .venv/bin/python -m pytest -m "not slow" -q

Exit status: the command's. The peak is of the tree's summed RSS (shared pages counted per process, so it is an
upper bound of what the tree holds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    root = psutil.Process(process.pid)
    last_line = [""]
    samples: list[tuple[float, int, str]] = []

    def relay() -> None:
        for line in process.stdout:
            sys.stdout.write(line)
            if "::" in line:
                last_line[0] = line.split(" ", 1)[0].strip()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    while process.poll() is None:
        samples.append((round(time.monotonic() - started, 1), tree_rss(root), last_line[0]))
        time.sleep(args.interval)
    reader.join(5)
    peak = max(samples, key=lambda s: s[1]) if samples else (0.0, 0, "")
    report = {"command": command, "returncode": process.returncode, "seconds": round(time.monotonic() - started, 1),
              "peak_rss_gib": round(peak[1] / 2**30, 2), "peak_at_s": peak[0], "peak_near": peak[2],
              "samples": [(t, round(rss / 2**30, 2), near) for t, rss, near in samples[:: max(1, len(samples) // 400)]]}
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
