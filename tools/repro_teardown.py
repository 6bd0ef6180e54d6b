"""Count the DDP runs whose ranks abort at exit, with and without the lessons' leave_process.

    python tools/repro_teardown.py --lesson 07_sharding     # 20 runs each way, at most 120 s each
    python tools/repro_teardown.py --runs 5 --lesson 04_checkpointing --modes plain
    python tools/repro_teardown.py --crash --lesson 07_sharding   # under torchrun, rank 1 raises

Every DDP lesson ends a rank that finished with leave_process(): destroy_process_group, then
os._exit(0). Without it, with torch 2.14, a finished rank sometimes aborts while Python tears down
the interpreter ("terminate called without an active exception"), failing a job whose results
are written (pytorch/pytorch#190489; pytorch/pytorch#179291 explains gloo work that outlives the
interpreter). Each run here is the lesson itself, `python <lesson>/train.py --backend gloo
--epochs 2` (and --strategy zero1 for lesson 07, where the abort was seen), in a fresh folder:
"plain" replaces leave_process with nothing, so ranks end as any Python program does;
"os._exit" runs the lesson as it is. A run that exits non-zero, or does not end within --timeout
seconds, counts as failed.

With --crash, each run is the lesson (03, 04, 05 or 07) under torchrun on two "nodes" of this
machine (see start_run), with its default flags (lesson 07: fsdp), and rank 1 raises at the
start of its second epoch: the job must fail, each rank with exit code 1 after its traceback or
its one line. A run counts as failed when a rank aborted instead ("terminate called", torchrun's
"SIGABRT"). In "plain" mode the rank that raised returns to the interpreter, as it did when
rank_guard let its exception go on up under torchrun too.

The script prints a line per run and the counts per mode, and exits 0: it reports, it does not
judge. Every wait is bounded: a run still going at --timeout is killed with its whole process
group.
"""

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bounded_wait import wait_all

ROOT = Path(__file__).resolve().parent.parent

if __name__ in ("__main__", "__mp_main__") and sys.argv[1:2] == ["one-run"]:
    # One run: load the lesson, in the launching process and (spawn re-runs this top level as
    # __mp_main__) in every rank, with the chosen way out of a rank. A word, not a --flag: after
    # the script's name torchrun still reads --run as its own --run-path.
    _, _, MODE, LESSON, CRASH, *LESSON_ARGS = sys.argv
    sys.path.insert(0, str(ROOT / LESSON))  # where train.py finds guard_rails.py
    spec = importlib.util.spec_from_file_location("lesson", ROOT / LESSON / "train.py")
    lesson = importlib.util.module_from_spec(spec)
    sys.modules["lesson"] = lesson  # so that the ranks can unpickle lesson.worker
    spec.loader.exec_module(lesson)
    if MODE == "plain":
        def leave_as_python_does(code=0):
            if code:
                sys.exit(code)  # return to the interpreter, which tears itself down

        # rank_guard looks the name up in its own module at the end
        sys.modules["guard_rails"].leave_process = leave_as_python_does
    if CRASH == "crash":
        train_epoch = lesson.Trainer.train_epoch

        def raise_on_rank_1(self, epoch):
            if self.rank == 1 and epoch == 1:
                raise RuntimeError("injected failure on rank 1")
            return train_epoch(self, epoch)

        lesson.Trainer.train_epoch = raise_on_rank_1
    if __name__ == "__main__":
        lesson.start(lesson.launch, lambda: lesson.parse_args(LESSON_ARGS),
                     torchrun_ok=CRASH == "crash")
        sys.exit(0)


LESSON_FLAGS = {"07_sharding": ["--strategy", "zero1"]}


def start_run(mode, lesson, crash, out_dir):
    """The processes of one run: the lesson under python; or, with crash, two torchrun nodes on
    this machine (static rendezvous, one rank each), each node on a core of its own, the layout
    in which the abort showed most often (lesson 07, plain: 8 of 12 runs here, against about 1
    in 10 under torchrun --standalone)."""
    args = [__file__, "one-run", mode, lesson, "crash" if crash else "-", "--backend", "gloo",
            "--epochs", "2", "--out-dir", out_dir]
    args += [] if crash else LESSON_FLAGS.get(lesson, [])
    commands = [[sys.executable, *args]]
    if crash:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cores = sorted(os.sched_getaffinity(0))
        commands = [["taskset", "-c", str(cores[node % len(cores)]), sys.executable, "-m",
                     "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                     "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                     str(port), *args] for node in (0, 1)]
    return [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True) for command in commands]


def run_many(mode, lesson, runs, timeout, crash):
    failed, hung, seconds = 0, 0, []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as out_dir:
            start = time.monotonic()
            processes = start_run(mode, lesson, crash, out_dir)
            err = wait_all(processes, timeout)
        if err is None:
            hung += 1
            print(f"  {mode}: a run did not end within {timeout:g} s (killed)", flush=True)
            continue
        seconds.append(time.monotonic() - start)
        returncode = next((p.returncode for p in processes if p.returncode), 0)
        aborted = "terminate called" in err or "SIGABRT" in err
        as_meant = ("injected failure on rank 1" in err and returncode != 0 if crash
                    else returncode == 0)
        if aborted or not as_meant:
            failed += 1
            lines = [line for line in err.splitlines() if "error" in line]
            lines += [line for line in err.splitlines() if "terminate" in line or "SIGABRT" in line]
            print(f"  {mode}: a run exited {returncode}: "
                  f"{(lines or err.splitlines() or ['?'])[-1][:160]}", flush=True)
        else:
            print(f"  {mode}: run {len(seconds) + hung} of {runs} ended as it should "
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
    parser.add_argument("--crash", action="store_true",
                        help="under torchrun, with rank 1 raising at its second epoch")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {args.lesson}"
          f"{' under torchrun, rank 1 raising' if args.crash else ''}: {args.runs} runs per mode",
          flush=True)
    for mode in args.modes.split(","):
        run_many(mode, args.lesson, args.runs, args.timeout, args.crash)


if __name__ == "__main__":
    main()
