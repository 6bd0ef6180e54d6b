"""Show why CI sets OMP_WAIT_POLICY=PASSIVE: two runs at once on a small machine, each given
threads for all its cores, wait for each other's spinning threads.

    python tools/repro_omp_wait.py            # 3 rounds; a round takes about a minute on 2 cores

CI runs two jobs at once, one per core (two pytest workers; the last step's two slots). A
lesson run of one rank gives it threads for every core (cores // ranks), so two such runs ask
for twice the cores. PyTorch's CPU kernels run on an OpenMP team (libgomp in the Linux wheels),
whose threads spin for a while when they run out of work before they sleep; under
oversubscription that spinning takes the cores the other run's threads compute on
(pytorch/pytorch#57715, #19163; libgomp's manual, OMP_WAIT_POLICY). With
OMP_WAIT_POLICY=PASSIVE a waiting thread sleeps at once. The results are the same; only the
wait changes.

Each round starts lesson 13's one-process run (float64, 2 epochs) twice at once, under the
default policy and then under PASSIVE, and times both pairs. It prints each round's seconds and
the medians, and exits 0 whether or not the gap shows (it measures; it does not judge).
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(ROOT / "13_capstone" / "train.py"), "--dp", "1", "--pp", "1", "--tp",
       "1", "--float64", "--batch-size", "64", "--epochs", "2", "--backend", "gloo"]


def two_at_once(policy, folder):
    """Seconds until both of two runs started together have ended."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    start = time.monotonic()
    runs = [subprocess.Popen([*RUN, "--out-dir", str(folder / f"{policy}{i}")], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in (1, 2)]
    for run in runs:
        _, err = run.communicate()
        if run.returncode:
            sys.exit(f"error: a run failed (exit {run.returncode}): {err.strip()[-300:]}")
    return time.monotonic() - start


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seconds = {"default": [], "PASSIVE": []}
    for r in range(rounds):
        for policy in seconds:
            folder = Path(tempfile.mkdtemp())
            try:
                seconds[policy].append(two_at_once("" if policy == "default" else policy, folder))
            finally:
                shutil.rmtree(folder)
        print(f"round {r + 1}: default {seconds['default'][-1]:.1f} s, "
              f"PASSIVE {seconds['PASSIVE'][-1]:.1f} s", flush=True)
    for policy, values in seconds.items():
        print(f"{policy}: median {statistics.median(values):.1f} s "
              f"({min(values):.1f} to {max(values):.1f}) for two runs at once")


if __name__ == "__main__":
    main()
