"""Time each lesson's default run, and what of it is start-up rather than training.

    python tools/time_lessons.py            # every lesson, 3 runs each, in rounds
    python tools/time_lessons.py --runs 5 02_multi_gpu_spawn

For each lesson it runs `python <lesson>/train.py` with no arguments in a scratch folder and
reports the median wall time seen from outside (with the fastest and slowest run), the training
loop's time (train_seconds in
metrics.json), and the rest: interpreter start, imports, process spawn, process-group set-up and
exit. Then it times the pieces that make up that rest, each in a fresh interpreter.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PIECES = {
    "python, no imports": "pass",
    "import torch": "import torch",
    "import scikit-learn (data loading)": "import sklearn.datasets, sklearn.model_selection, "
                                          "sklearn.preprocessing",
    "construct DDP (imports torch._dynamo)": (
        "import os, torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "import time; t = time.perf_counter(); DDP(torch.nn.Linear(2, 2))\n"
        "print(time.perf_counter() - t)\n"
        "dist.destroy_process_group()"
    ),
}


def wall(command, cwd=None):
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed:\n{result.stderr}")
    return time.perf_counter() - start, result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lesson folders (default: all)")
    parser.add_argument("--runs", type=int, default=3, help="runs per lesson; the median counts")
    args = parser.parse_args()
    lessons = args.lessons or sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/train.py"))

    # Round robin, one run of each lesson per round: a slow spell of the machine then touches
    # every lesson alike instead of one lesson's runs.
    walls = {lesson: [] for lesson in lessons}
    trains = {lesson: [] for lesson in lessons}
    for _ in range(args.runs):
        for lesson in lessons:
            with tempfile.TemporaryDirectory() as cwd:
                seconds, _ = wall([sys.executable, str(ROOT / lesson / "train.py")], cwd=cwd)
                metrics = json.loads((Path(cwd) / "runs" / lesson / "metrics.json").read_text())
            walls[lesson].append(seconds)
            trains[lesson].append(metrics["train_seconds"])
    print(f"{'lesson (default run)':32} {'wall s':>7} {'(min-max)':>11} {'training s':>11} "
          f"{'start-up+exit s':>16}")
    for lesson in lessons:
        w, t = statistics.median(walls[lesson]), statistics.median(trains[lesson])
        spread = f"{min(walls[lesson]):.2f}-{max(walls[lesson]):.2f}"
        print(f"{lesson:32} {w:7.2f} {spread:>11} {t:11.2f} {w - t:16.2f}")

    print(f"\n{'start-up piece (fresh interpreter)':40} {'median s':>9}")
    for name, code in PIECES.items():
        times = []
        for _ in range(args.runs):
            seconds, out = wall([sys.executable, "-c", code])
            times.append(float(out) if out.strip() else seconds)
        note = " (inside the process)" if name.startswith("construct") else " (whole process)"
        print(f"{name + note:40} {statistics.median(times):9.2f}")


if __name__ == "__main__":
    main()
