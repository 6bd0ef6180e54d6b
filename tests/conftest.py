import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from helpers import ROOT, run_lesson

sys.path.insert(0, str(ROOT / "tools"))
from ci_slots import SLOTS  # noqa: E402

# Two workers run two lessons at once on the 2-core machine, and a run of one or two ranks gives
# each rank the cores' worth of threads (cores // ranks), so together they ask for more threads
# than there are cores. OpenMP's threads spin while they wait for work, on the cores the other
# run computes on; PASSIVE puts a waiting thread to sleep. It changes no result, only how
# threads wait. Every process the tests start inherits it (tests/README.md has the timings).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def shared_folder(tmp_path_factory):
    """A folder every pytest-xdist worker of this session sees: the session's base temporary
    folder, whose popen-gwN subfolders are the workers' own. Without xdist, this run's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def lesson_run(tmp_path_factory):
    """run(lesson, *args, patch=None, env=None) -> (finished process, out_dir), each distinct
    run made once per test session, even when tests in both workers ask for it.

    Several tests look at the same run from different sides; launching it once keeps the suite
    fast on a 2-core machine. The first worker to ask runs it, holding a lock, and writes what
    it printed next to its out_dir; a worker that asks later waits for the lock and reads that.
    Tests only read a shared run's folder (copy it to change it).

    The mutation check (tools/mutate.py) makes each mistake in a copy of its own and names the
    lesson it changed (LESSON_RUNS_MUTATED): the runs of every other lesson are the same in all
    copies, so they are made once, in the folder it names (LESSON_RUNS_SHARED), for all. CI
    names that folder for its pytest step too (no lesson is changed there: every run goes in
    it), so that the mutation check finds those runs made."""
    root = shared_folder(tmp_path_factory) / "lesson_runs"
    root.mkdir(exist_ok=True)
    shared = os.environ.get("LESSON_RUNS_SHARED")

    def run(lesson, *args, patch=None, env=None):
        key = json.dumps([lesson, list(map(str, args)), patch, sorted((env or {}).items())])
        runs = root
        if shared and lesson != os.environ.get("LESSON_RUNS_MUTATED"):
            runs = Path(shared)
        folder = runs / f"{lesson}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
        record = folder / "result.json"
        with FileLock(f"{folder}.lock"):
            if not record.exists():
                (folder / "out").mkdir(parents=True, exist_ok=True)
                result = run_lesson(lesson, *args, "--out-dir", folder / "out", patch=patch,
                                    env=env)
                done = {"key": key, "args": result.args, "returncode": result.returncode,
                        "stdout": result.stdout, "stderr": result.stderr}
                record.with_suffix(".tmp").write_text(json.dumps(done))
                record.with_suffix(".tmp").replace(record)
            done = json.loads(record.read_text())
        assert done["key"] == key, f"two runs share {folder.name}"
        result = subprocess.CompletedProcess(done["args"], done["returncode"], done["stdout"],
                                             done["stderr"])
        return result, folder / "out"

    return run


def pytest_runtest_logreport(report):
    """With PYTEST_OUTCOMES naming a file (CI's pytest step), add a line per test and phase to
    it: `tests/file.py::test_name outcome`. The listings check reads it: a command that
    INSTRUCTORS.md shows and a test runs as it stands passes when that test passed
    (tools/check_listings.py, `same as tests/...`). Written by pytest-xdist's controller, or the
    only process: its workers send it every report."""
    path = os.environ.get("PYTEST_OUTCOMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and (
            report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.nodeid} {report.outcome}\n")


# The longest test files first (seconds each took in one worker of a CI run). pytest-xdist
# then hands out its units of work (whole files with --dist loadfile, groups with loadgroup)
# ordered by their number of tests, its default (--loadscope-reorder, xdist/scheduler/
# loadscope.py), and keeps this order only among units of as many tests: in CI's last step,
# among its units of one test, the four notebook lines (70 to 160 s each) come first. In the
# pytest step, xdist's own order already ends both workers together: in a run of the README's
# test command on the 2-core machine (2026-11-28), at 1,216 and 1,198 s, where the files' 2,413
# seconds split evenly would end at 1,207.
LONGEST_FIRST = ["test_notebooks.py", "test_04_checkpointing.py", "test_07_sharding.py",
                 "test_03_multi_node.py", "test_benchmarks.py", "test_10_pipeline_parallel.py",
                 "test_08_ddp_from_scratch.py", "test_06_ddp_in_practice.py",
                 "test_09_tensor_parallel.py", "test_02_multi_gpu_spawn.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, pytest's order stays


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """In CI's last step each test, with the fixtures it sets up, runs in one of the two slots
    that it shares with the listings and the mutation check (tools/ci_slots.py). Outermost
    (tryfirst), so that pytest-timeout's clock starts once the test has its slot."""
    with SLOTS.held():
        yield
