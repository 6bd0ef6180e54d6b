"""Run one lesson's train.py many times in one Python, each run as `python <lesson>/train.py
args` runs it: the tests' way of paying for a Python that imports torch, and for the fork server
of the lesson's ranks (lesson 02's README), once per lesson instead of once per run.

    python tests/lesson_runner.py REQUESTS_FD ANSWERS_FD <lesson>/train.py

Each line read from REQUESTS_FD is a JSON list, one run's arguments. The script runs as
`__main__` with those in sys.argv (runpy), its folder first on sys.path as Python puts it, so
`if __name__ == "__main__"` starts the lesson as a learner's command does. Its exit status, as
Python would make it, goes back as a line on ANSWERS_FD, once everything it printed is written
to this process's stdout and stderr (files that tests/helpers.py's run_lesson reads).

What differs from a fresh `python train.py`, on purpose and nowhere else:
- The fork server stays up between runs (leave_quickly, which stops it at the end of a run, does
  nothing here), so a run's ranks are forked at once, from the server the first run started.
  That server keeps the environment it started with: MASTER_ADDR and MASTER_PORT are set before
  the first run (tests/helpers.py picks the port), and every run meets there.
- Each run starts with Python's warning filters as they were, and with no warning remembered as
  shown, so a run prints the warnings a fresh Python would; the environment and the working
  folder go back to what they were too.
Anything about the process itself (its start, its exit, signals, the fork server) is tested on a
fresh Python: run_lesson starts one for any run with an env, a cwd or a patch of its own."""

import json
import os
import runpy
import sys
import traceback
import warnings


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
    script = os.path.abspath(sys.argv[3])
    sys.path[0] = os.path.dirname(script)  # where `python script` looks first, not tests/
    import guard_rails  # the one train.py imports: the same module object in every run

    guard_rails.leave_quickly = lambda: None  # the next run forks its ranks from this server
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
