"""The lesson runner (tests/lesson_runner.py) that run_lesson sends a lesson's plain runs to: a
run there must be the run a fresh `python <lesson>/train.py` makes, or every test that reads
one proves nothing about the command a learner types."""

import re
import subprocess
from pathlib import Path

import pytest

from helpers import (
    NO_GPUS,
    ROOT,
    LessonRunner,
    live_processes_in_group,
    max_weight_difference,
    run_lesson,
)

LESSON = "02_multi_gpu_spawn"
SCRIPT = str(ROOT / LESSON / "train.py")
RUN = ["--backend", "gloo", "--world-size", 2, "--epochs", 2]


def comparable(text, out_dir):
    """The output, less what differs between two runs of one command: the port, the folder."""
    text = re.sub(r"listens on 127\.0\.0\.1:\d+", "listens on 127.0.0.1:PORT", text)
    text = re.sub(r"\| \d+\.\d+ s", "| SECONDS s", text)  # an epoch's time
    return text.replace(str(out_dir), "OUT_DIR")


def fork_servers_of(runner):
    """Pids of the fork servers that a runner process started (its children that run one)."""
    servers = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(re.search(r"^PPid:\s+(\d+)", status.read_text(), re.M)[1])
            command = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue  # it ended while we looked
        if ppid == runner.process.pid and b"forkserver" in command:
            servers.append(int(status.parent.name))
    return servers


def test_a_run_in_the_runner_is_the_run_of_a_fresh_python(tmp_path):
    fresh = run_lesson(LESSON, *RUN, "--out-dir", tmp_path / "fresh", fresh=True)
    shared = [run_lesson(LESSON, *RUN, "--out-dir", tmp_path / f"shared{i}") for i in (1, 2)]
    assert fresh.returncode == 0, fresh.stderr
    expected = comparable(fresh.stdout, tmp_path / "fresh")
    for i, run in enumerate(shared, start=1):
        assert run.returncode == 0, run.stderr
        assert run.stderr == fresh.stderr
        assert comparable(run.stdout, tmp_path / f"shared{i}") == expected
        assert max_weight_difference(tmp_path / "fresh", tmp_path / f"shared{i}") == 0.0
    # An error that ends the launcher itself: the same status, the same one line.
    errors = [run_lesson(LESSON, "--world-size", 0, "--out-dir", tmp_path / "e", fresh=fresh)
              for fresh in (True, False)]
    assert errors[0].returncode == errors[1].returncode == 1
    assert errors[0].stderr == errors[1].stderr and errors[0].stdout == errors[1].stdout == ""
    # The runner kept its fork server for the next run: leave_quickly would have stopped it.
    assert len(fork_servers_of(LessonRunner.for_lesson(SCRIPT))) == 1
    # A run that hides the GPUs goes to a runner of its own, started in that environment.
    hidden = run_lesson(LESSON, *RUN, "--out-dir", tmp_path / "hidden", env=NO_GPUS)
    assert hidden.returncode == 0, hidden.stderr
    runner = LessonRunner.for_lesson(SCRIPT, NO_GPUS)
    assert runner is not LessonRunner.for_lesson(SCRIPT)
    environ = Path(f"/proc/{runner.process.pid}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=" in environ


def test_a_run_past_its_timeout_ends_with_its_runner_its_server_and_its_ranks(tmp_path):
    group = LessonRunner.for_lesson(SCRIPT).process.pid  # its process group: server and ranks
    with pytest.raises(subprocess.TimeoutExpired):
        run_lesson(LESSON, *RUN[:-1], 100000, "--out-dir", tmp_path, timeout=20)
    assert (SCRIPT, ()) not in LessonRunner.running, "a runner that timed out is not used again"
    assert live_processes_in_group(group) == []
    # The next run starts a runner of its own.
    done = run_lesson(LESSON, *RUN, "--out-dir", tmp_path / "after")
    assert done.returncode == 0, done.stderr
