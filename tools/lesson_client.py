"""Run `python <lesson>/train.py args` in a Python that has already imported torch: the listings
check's way (tools/check_listings.py) of paying once per lesson and file for what every run of
a lesson pays at its start, as the tests do (tests/lesson_runner.py, tests/README.md).

    python tools/lesson_client.py FOLDER <lesson>/train.py ARGS...

FOLDER holds, for each lesson, one tests/lesson_runner.py process and what talks to it: two
named pipes (its requests and its answers), the file its output goes to (stdout and stderr
together, with its fork server's and every rank's, in the order they wrote), and its process
group's id. This command starts the runner on the lesson's first run, or when the working
folder or the environment differs from the one it started in; it then sends the run's
arguments, copies to its own stdout what the run printed, while it prints it, and exits with the
run's exit status. Stopped (SIGTERM, a command that ran past the check's time limit), it ends
the runner, its fork server and its ranks. The check ends every runner of a file when the file
is done (end_runners)."""

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "tests" / "lesson_runner.py"
POLL = 0.1  # seconds between looks at the run's output


def start_runner(state, script):
    """A new runner for script in this folder and environment; its state in state.json."""
    end_runner(state)
    for name in ("requests", "answers"):
        (state / name).unlink(missing_ok=True)
        os.mkfifo(state / name)
    # The runner holds both pipes open for reading and writing, so they stay open between runs.
    requests, answers = (os.open(state / name, os.O_RDWR) for name in ("requests", "answers"))
    with open(state / "output", "ab") as output:
        runner = subprocess.Popen([sys.executable, str(RUNNER), str(requests), str(answers),
                                   script], stdin=subprocess.DEVNULL, stdout=output,
                                  stderr=output, pass_fds=(requests, answers), process_group=0)
    os.close(requests)
    os.close(answers)
    (state / "state.json").write_text(json.dumps({"group": runner.pid, "script": script,
                                                  "cwd": os.getcwd(),
                                                  "environment": dict(os.environ)}))


def end_runner(state):
    """End the runner described in state (its process group: runner, fork server, ranks)."""
    try:
        group = json.loads((state / "state.json").read_text())["group"]
    except FileNotFoundError:
        return
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it has ended
    (state / "state.json").unlink()
    (state / "running").unlink(missing_ok=True)


def end_runners(folder):
    """End every runner a listing's commands started in folder."""
    for state in Path(folder).glob("*/"):
        end_runner(state)


def usable(state, script):
    """Whether the runner in state can take this run: alive, with nothing unread in its answers,
    and started for this script, in this folder and environment."""
    try:
        started = json.loads((state / "state.json").read_text())
    except FileNotFoundError:
        return False
    # Only the runner writes to its answers: with it alive and nothing left there, a read that
    # does not wait finds nothing yet; with it ended (a zombie too), the end of the pipe.
    answers = os.open(state / "answers", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.read(answers, 1)
        return False
    except BlockingIOError:
        pass
    finally:
        os.close(answers)
    return (started["script"], started["cwd"], started["environment"]) == (
        script, os.getcwd(), dict(os.environ))


def main():
    folder, script, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    state = folder / os.path.basename(os.path.dirname(os.path.abspath(script)))
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time per runner (a background `&`)
        # A run whose client was killed before its answer (SIGKILL) may still be running, or
        # have left its answer unread: its runner is not used again.
        if (state / "running").exists() or not usable(state, script):
            start_runner(state, script)
        (state / "running").touch()
        signal.signal(signal.SIGTERM, lambda *_: (end_runner(state), sys.exit(143)))
        output = os.open(state / "output", os.O_RDONLY)
        os.lseek(output, 0, os.SEEK_END)  # what this run prints from here on
        with open(state / "requests", "w") as requests:
            requests.write(json.dumps(args) + "\n")
        answers = os.open(state / "answers", os.O_RDONLY | os.O_NONBLOCK)
        answer = b""
        while not answer.endswith(b"\n"):
            ready, _, _ = select.select([answers], [], [], POLL)
            copy(output)
            if ready:
                chunk = os.read(answers, 64)
                if not chunk:  # the runner itself ended: it crashed, or something killed it
                    print("error: the lesson's runner (tests/lesson_runner.py) ended during the "
                          "run", file=sys.stderr)
                    end_runner(state)
                    return 1
                answer += chunk
        copy(output)
        (state / "running").unlink()
        return int(answer)


def copy(output):
    """Copy to stdout what the run has printed since the last look."""
    while chunk := os.read(output, 1 << 16):
        os.write(1, chunk)


if __name__ == "__main__":
    sys.exit(main())
