"""Repro: a launcher whose ranks came from a fork server ends seconds after its last line.

    python tools/repro_slow_exit.py            # 5 runs of each case, interleaved
    python tools/repro_slow_exit.py --runs 9

A launcher like lesson 02's imports torch, starts 2 ranks from a fork server that has imported
torch too (start_method="forkserver", preload ["torch"]), and prints its last line once they
have ended. Two teardowns follow it, one after the other: the launcher's own (Python collects
every object before it exits), and then the fork server's, which leaves only when it sees the
launcher gone and tears down its own torch while it holds the launcher's stdout open, so a
reader of that output (a pipe, `| tee`, a test) waits for both. For each case this prints the
median seconds, over the runs, from the last line to the launcher's exit and to the end of its
output, with their spread:
  - as Python leaves it;
  - guard_rails.leave_quickly() after the ranks (lesson 02's copy, as every lesson calls it):
    the server stopped at once, and the launcher's objects frozen (gc.freeze) before its exit.

Python behaves so by design, not by a bug: the server's loop exits by raising SystemExit
(multiprocessing/forkserver.py, main), and gc.freeze's documentation describes what it skips.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

LESSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "02_multi_gpu_spawn")


def rank(index):
    print(f"rank {index} done", flush=True)


def launcher(quickly):
    import torch.multiprocessing as mp
    mp.set_forkserver_preload(["torch"])
    mp.start_processes(rank, nprocs=2, start_method="forkserver")
    print("last line", flush=True)
    if quickly:
        sys.path.insert(0, LESSON)
        from guard_rails import leave_quickly
        leave_quickly()


def measure(quickly):
    """Seconds from the launcher's last line to its exit, and to the end of its output."""
    process = subprocess.Popen([sys.executable, __file__, "--launcher", str(int(quickly))],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    exited = []
    waiter = threading.Thread(target=lambda: (process.wait(), exited.append(time.perf_counter())))
    waiter.start()
    last_line = None
    for line in process.stdout:
        if line.strip() == "last line":
            last_line = time.perf_counter()
    output_ended = time.perf_counter()
    waiter.join()
    if process.returncode != 0 or last_line is None:
        sys.exit(f"the launcher failed (exit code {process.returncode})")
    return exited[0] - last_line, output_ended - last_line


def spread(values):
    return f"{statistics.median(values):4.2f} s (from {min(values):.2f} to {max(values):.2f})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each case")
    parser.add_argument("--launcher", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launcher is not None:
        launcher(quickly=args.launcher == "1")
        sys.exit()
    cases = {"as Python leaves it": False, "guard_rails.leave_quickly()": True}
    results = {name: [] for name in cases}
    for _ in range(args.runs):  # interleaved, so that a busier minute hits every case
        for name, quickly in cases.items():
            results[name].append(measure(quickly))
    print(f"from the launcher's last line, median of {args.runs} runs:")
    for name, runs in results.items():
        to_exit, to_end = zip(*runs, strict=True)
        print(f"  {name:28}  to its exit {spread(to_exit)}   to the end of its output "
              f"{spread(to_end)}")
