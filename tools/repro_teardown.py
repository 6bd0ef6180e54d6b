"""Count the DDP runs whose ranks abort at exit, with and without the lessons' leave_process.

    python tools/repro_teardown.py --lesson 07_sharding     # 20 runs each way, at most 120 s each
    python tools/repro_teardown.py --runs 5 --lesson 04_checkpointing --modes plain

Every DDP lesson ends a rank that finished with leave_process(): destroy_process_group, then
os._exit(0). Without it, with torch 2.14, a finished rank sometimes aborts while Python tears down
the interpreter ("terminate called without an active exception"), failing a job whose results
are written (pytorch/pytorch#190489; pytorch/pytorch#179291 explains gloo work that outlives the
interpreter). Each run here is the lesson itself, `python <lesson>/train.py --backend gloo
--epochs 2` (and --strategy zero1 for lesson 07, where the abort was seen), in a fresh folder:
"plain" replaces leave_process with nothing, so ranks end as any Python program does;
"os._exit" runs the lesson as it is. A run that exits non-zero, or does not end within --timeout
seconds, counts as failed. The script prints a line per run and the counts per mode, and exits
0: it reports, it does not judge. Every wait is bounded: a run still going at --timeout is killed
with its whole process group.
"""

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ in ("__main__", "__mp_main__") and sys.argv[1:2] == ["--run"]:
    # One run: load the lesson, in the launching process and (spawn re-runs this top level as
    # __mp_main__) in every rank, with the chosen way out of a rank.
    _, _, MODE, LESSON, *LESSON_ARGS = sys.argv
    spec = importlib.util.spec_from_file_location("lesson", ROOT / LESSON / "train.py")
    lesson = importlib.util.module_from_spec(spec)
    sys.modules["lesson"] = lesson  # so that the ranks can unpickle lesson.worker
    spec.loader.exec_module(lesson)
    if MODE == "plain":
        def leave_as_python_does(code=0):
            if code:
                sys.exit(code)  # return to the interpreter, which tears itself down

        lesson.leave_process = leave_as_python_does  # rank_guard looks the name up at the end
    if __name__ == "__main__":
        lesson.start(lesson.launch, lambda: lesson.parse_args(LESSON_ARGS), torchrun_ok=False)
        sys.exit(0)


LESSON_FLAGS = {"07_sharding": ["--strategy", "zero1"]}


def run_many(mode, lesson, runs, timeout):
    failed, hung, seconds = 0, 0, []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as out_dir:
            start = time.monotonic()
            process = subprocess.Popen(
                [sys.executable, __file__, "--run", mode, lesson, "--backend", "gloo",
                 "--epochs", "2", "--out-dir", out_dir, *LESSON_FLAGS.get(lesson, [])],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            try:
                _, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                hung += 1
                print(f"  {mode}: a run did not end within {timeout:g} s (killed)", flush=True)
                continue
        seconds.append(time.monotonic() - start)
        if process.returncode != 0:
            failed += 1
            lines = [line for line in err.splitlines() if "terminate" in line or "error" in line]
            print(f"  {mode}: a run exited {process.returncode}: "
                  f"{(lines or err.splitlines() or ['?'])[-1][:160]}", flush=True)
        else:
            print(f"  {mode}: run {len(seconds) + hung} of {runs} ended well "
                  f"({seconds[-1]:.0f} s)", flush=True)
    median = sorted(seconds)[len(seconds) // 2] if seconds else float("nan")
    print(f"{mode}: {failed} of {runs} runs failed, {hung} of {runs} hung "
          f"(median run {median:.1f} s)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per mode")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one run may take")
    parser.add_argument("--lesson", default="02_multi_gpu_spawn",
                        help="a DDP lesson's folder: 02_multi_gpu_spawn to 07_sharding")
    parser.add_argument("--modes", default="plain,os._exit", help="which modes, in order")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.lesson}: "
          f"{args.runs} runs per mode", flush=True)
    for mode in args.modes.split(","):
        run_many(mode, args.lesson, args.runs, args.timeout)


if __name__ == "__main__":
    main()
