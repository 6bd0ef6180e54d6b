"""Run one lesson's train.py many times in one Python, each run as `python <lesson>/train.py
args` runs it: the tests' way of paying for a Python that imports torch, and for the fork server
of the lesson's ranks (lesson 02's README), once per lesson instead of once per run.

    python tests/lesson_runner.py REQUESTS_FD ANSWERS_FD <lesson>/train.py

tests/helpers.py's run_lesson sends a test's plain runs here, and tools/lesson_client.py a
listing's (tools/check_listings.py): each run of a lesson in SHARED_STARTS that sets nothing of
its own (no environment, no folder, no patch).

Each line read from REQUESTS_FD is a JSON list, one run's arguments. The script runs as
`__main__` with those in sys.argv (runpy), its folder first on sys.path as Python puts it, so
`if __name__ == "__main__"` starts the lesson as a learner's command does. Its exit status, as
Python would make it, goes back as a line on ANSWERS_FD, once everything it printed is written
to this process's stdout and stderr (files that tests/helpers.py's run_lesson reads).

What differs from a fresh `python train.py`, on purpose and nowhere else:
- The fork server stays up between runs (leave_quickly, which stops it at the end of a run, does
  nothing here), so a run's ranks are forked at once, from the server the first run started.
  That server keeps the environment it started with: MASTER_ADDR and MASTER_PORT are set before
  the first run (a port this runner reserves for its life), and every run meets there.
- Each run starts with Python's warning filters as they were, and with no warning remembered as
  shown, so a run prints the warnings a fresh Python would; the environment and the working
  folder go back to what they were too.
Anything about the process itself (its start, its exit, signals, the fork server) is tested on a
fresh Python: run_lesson starts one for any run with an env, a cwd or a patch of its own."""

import fcntl
import json
import os
import random
import runpy
import sys
import tempfile
import traceback
import warnings

# The lessons whose launcher forks its ranks from a server (lesson 02's start_ranks) and sets
# nothing of its own in the environment but MASTER_ADDR and MASTER_PORT: lesson 01 trains in its
# one process, and lesson 03 takes its port from its flags.
SHARED_STARTS = {"02_multi_gpu_spawn", "04_checkpointing", "05_model_parallel_ddp",
                 "06_ddp_in_practice", "07_sharding", "08_ddp_from_scratch",
                 "09_tensor_parallel", "10_pipeline_parallel", "11_context_parallel",
                 "12_expert_parallel", "13_capstone"}


def reserve_port(port_in_use):
    """A port for this runner's ranks to meet at, and a lock that keeps it this runner's while
    the lock file stays open (to the end of this process).

    Below the range the system hands out when a program asks for any free port (32768 and up
    on Linux), so a lesson's own free port never collides with it; and locked, so no other runner
    takes it. port_in_use is the lessons' own check of MASTER_PORT (guard_rails.py)."""
    while True:
        port = random.randrange(10000, 20000)
        lock = open(os.path.join(tempfile.gettempdir(), f"lesson-runner-port-{port}.lock"), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        if not port_in_use(port):
            return port, lock
        lock.close()


def run_once(script, args):
    """The exit status `python script *args` would end with."""
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:  # as Python's own exit: None is 0, a message is printed, then 1
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - an uncaught error, as Python reports one
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main():
    requests = os.fdopen(int(sys.argv[1]), "r")
    answers = os.fdopen(int(sys.argv[2]), "w")
    script = sys.argv[3]  # as given, as sys.argv[0] and __file__ are in `python script`
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # where it looks first, not tests/
    import guard_rails  # the one train.py imports: the same module object in every run

    guard_rails.leave_quickly = lambda: None  # the next run forks its ranks from this server
    port, _lock = reserve_port(guard_rails.port_in_use)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    environment, folder, filters = dict(os.environ), os.getcwd(), warnings.filters[:]
    for line in requests:
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(folder)
        # Python marks each warning it has shown in a registry that resetwarnings empties:
        # each run prints the warnings a fresh Python would print.
        warnings.resetwarnings()
        warnings.filters[:] = filters
        code = run_once(script, json.loads(line))
        answers.write(f"{code}\n")
        answers.flush()


if __name__ == "__main__":
    main()
