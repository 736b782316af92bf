"""Run a command and report the peak memory of its whole process tree (`python scripts/peak_rss.py
[--limit-gb N] -- cmd ...`): the sum of the resident set sizes of the command and every process it
started, sampled every 0.2 s, printed at the end; exit status 1 when it passed `--limit-gb` (the
command's own status otherwise). CI runs the test suite under it so a suite that creeps towards the
machine's memory fails here, not by the OOM killer."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import psutil


def tree_rss(root: psutil.Process) -> tuple[int, str]:
    """Bytes resident in `root` and its descendants, and the largest of them (for the report)."""
    total, largest, name = 0, 0, ""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, ""
    for process in processes:
        try:
            rss = process.memory_info().rss
            if rss > largest:
                largest, name = rss, " ".join(process.cmdline()[:3])[:80]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
    return total, f"{name} ({largest / 2**30:.2f} GiB)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gb", type=float, default=None, help="fail when the peak passes this")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak, peak_at, peak_largest = 0, 0.0, ""
    started = time.monotonic()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_at, peak_largest
        while not done.wait(0.2):
            total, largest = tree_rss(root)
            if total > peak:
                peak, peak_at, peak_largest = total, time.monotonic() - started, largest
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    status = child.wait()
    done.set()
    sampler.join()
    print(f"peak RSS of the process tree: {peak / 2**30:.2f} GiB at {peak_at:.0f} s "
          f"(largest process then: {peak_largest})", flush=True)
    if args.limit_gb is not None and peak > args.limit_gb * 2**30:
        print(f"peak RSS {peak / 2**30:.2f} GiB is over the limit of {args.limit_gb} GiB", flush=True)
        return status or 1
    return status


if __name__ == "__main__":
    sys.exit(main())
