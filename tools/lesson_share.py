"""A lesson's share of CI's time: what each CI step runs for that lesson, run alone and timed.

    python tools/lesson_share.py 10        # lesson 10's share
    python tools/lesson_share.py 10 --list # the commands, without running them

CI (.ci/run) runs its steps on two slots: two pytest workers, two listing files at a time, two
mutants at a time. For lesson NN this runs, one after another and each in one slot, what those
steps run for it: its test files (tests/test_NN_*.py) and the notebook test that runs its
notebook (with the others on the README's line: an upper bound), the listings of
its README and exercise page, its mistakes in tools/mutants.py, and its exercise's tests. It
prints each command's seconds, their sum, and half the sum: the lesson's share of CI's wall
time, which tests/README.md limits to 300 s for a new lesson (on a day when `import torch`
takes about 3 s; the tool prints that import's time too). Run it on a quiet machine.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from mutants import MUTANTS  # noqa: E402

LIMIT = 300  # seconds of CI's wall time a new lesson may add (tests/README.md)


def commands(number):
    """(what, command) for each CI step's part that belongs to lesson `number`."""
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    found = []
    tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(f"tests/test_{number}_*.py"))
    if tests:
        found.append(("pytest: its test files", [*pytest, *tests]))
    notebooks = sorted(ROOT.glob(f"notebooks/{number}_*.ipynb"))
    if notebooks:
        # The README's line that runs its notebook (a line runs up to three: an upper bound).
        found.append(("notebooks: its notebook's line", [*pytest, "-m", "notebooks",
                                                         "tests/test_notebooks.py", "-k",
                                                         notebooks[0].stem]))
    pages = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob(f"{number}_*/README.md"),
                                                       *ROOT.glob(f"exercises/{number}_*.md")])
    if pages:
        found.append(("listings: its pages", [python, "tools/check_listings.py", "--jobs", "1",
                                              *pages]))
    mutants = [m.id for m in MUTANTS if m.id.startswith(f"{number}-")]
    if mutants:
        found.append(("mutation check: its mistakes", [python, "tools/mutate.py", *mutants]))
    if list(ROOT.glob(f"exercises/{number}_*.md")):
        found.append(("exercises: its tests", [*pytest, "-m", "exercises",
                                               "tests/test_exercises.py", "-k", number]))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lesson", help="the lesson's number, e.g. 10")
    parser.add_argument("--list", action="store_true", help="print the commands; run nothing")
    args = parser.parse_args(argv)
    found = commands(args.lesson)
    if not found:
        parser.error(f"nothing in CI belongs to lesson {args.lesson}")
    if args.list:
        for what, command in found:
            print(f"{what}: {' '.join(command)}")
        return 0
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    print(f"import torch: {time.perf_counter() - started:.1f} s", flush=True)
    total, failed = 0.0, []
    for what, command in found:
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        total += seconds
        # pytest's exit status 5: it selected no test (lesson 14's exercise is checked by its
        # own test file, tests/test_14_planning.py, which the first line ran).
        none = command[1:3] == ["-m", "pytest"] and result.returncode == 5
        verdict = "none selected" if none else "ok" if result.returncode == 0 else "FAILED"
        print(f"{what:<32} {seconds:7.1f} s  {verdict}", flush=True)
        if result.returncode and not none:
            failed.append(what)
            print(result.stdout[-3000:] + result.stderr[-3000:])
    print(f"{'sum':<32} {total:7.1f} s\nshare of CI's wall time (two slots): {total / 2:.0f} s, "
          f"against {LIMIT} s for a new lesson")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
