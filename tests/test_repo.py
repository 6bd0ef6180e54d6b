"""Guards for the repository as a whole: current diffs, lint, and lessons that stand alone."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, small_disk

LESSON_SCRIPTS = sorted(ROOT.glob("[0-9][0-9]_*/*.py"))
LESSONS = sorted(p.parent for p in ROOT.glob("[0-9][0-9]_*/train.py"))  # 01 on, not 00
# What a lesson may import: the standard library and the packages in requirements.txt.
ALLOWED_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "torchvision", "sklearn", "numpy"}
# Unix-only modules: a lesson imports none at module level, or it cannot start on Windows.
UNIX_ONLY = {"resource", "fcntl", "termios", "pwd", "grp", "posix", "pty", "tty", "syslog"}


def make_diffs(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "make_diffs.py"), *args],
                          capture_output=True, text=True)


def test_generated_diffs_are_current():
    result = make_diffs("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_diff_check_fails_when_a_lesson_changes_alone(tmp_path):
    # The guard must bite: a fix made in lesson 01 and not regenerated is reported as stale.
    for lesson in ("01_single_gpu", "02_multi_gpu_spawn"):
        shutil.copytree(ROOT / lesson, tmp_path / lesson)
    with open(tmp_path / "01_single_gpu" / "train.py", "a") as f:
        f.write("# a fix made here and nowhere else\n")
    result = make_diffs("--check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "stale: 02_multi_gpu_spawn/from_01_single_gpu.diff" in result.stdout


def test_every_lesson_after_the_first_has_a_diff():
    for lesson in LESSONS[1:]:
        assert list(lesson.glob("from_*.diff")), f"{lesson.name} has no generated diff"


def test_every_lesson_says_which_lesson_it_builds_on(tmp_path):
    # Without that line there is no diff to show, and the check says so instead of guessing.
    for lesson in ("01_single_gpu", "02_multi_gpu_spawn"):
        shutil.copytree(ROOT / lesson, tmp_path / lesson)
    script = tmp_path / "02_multi_gpu_spawn" / "train.py"
    script.write_text(script.read_text().replace("Lesson 01's program", "The program"))
    result = make_diffs("--check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "02_multi_gpu_spawn/train.py must name an earlier lesson" in result.stderr


def test_lint():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt)")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", LESSON_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lessons_stand_alone(script: Path):
    # A learner can copy one lesson folder and run it: no imports from another lesson, tests/
    # or a shared module, only the standard library, the packages in requirements.txt and the
    # guard_rails.py beside it. And it starts on macOS and Windows: no Unix-only module at the
    # top (one a function needs is imported there, behind a check of the platform).
    tree = ast.parse(script.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"{script.name} uses a relative import"
    allowed = ALLOWED_TOP_LEVEL | ({"guard_rails"} if (script.parent / "guard_rails.py").exists()
                                   else set())
    assert imported <= allowed, f"unexpected imports: {imported - allowed}"
    top_level = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
                 for alias in node.names}
    top_level |= {node.module.split(".")[0] for node in tree.body
                  if isinstance(node, ast.ImportFrom) and node.module}
    assert not top_level & UNIX_ONLY, f"Unix-only at module level: {top_level & UNIX_ONLY}"


def test_guard_rails_are_the_same_file_in_every_lesson():
    # The diff from one lesson to the next then shows only what the lesson teaches. A fix made
    # in one copy and not the others fails here: copy it to every lesson folder
    # (for d in 0*/; do cp 01_single_gpu/guard_rails.py "$d"; done).
    reference = (LESSONS[0] / "guard_rails.py").read_bytes()
    for lesson in LESSONS:
        assert (lesson / "guard_rails.py").read_bytes() == reference, (
            f"{lesson.name}/guard_rails.py differs from {LESSONS[0].name}'s")


def test_a_lesson_folder_copied_alone_still_starts(tmp_path):
    # A learner who copies one folder gets its guard rails with it: train.py finds
    # guard_rails.py beside itself, whatever the working directory.
    shutil.copytree(ROOT / "02_multi_gpu_spawn", tmp_path / "lesson")
    result = subprocess.run([sys.executable, str(tmp_path / "lesson" / "train.py"), "--help"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--world-size" in result.stdout


# A lesson reads in one sitting: its diff from the lesson it builds on adds about a hundred
# lines (07, with three strategies and a sharded checkpoint, and 08, with four ways to average
# gradients by hand, about 250), its README about 300.
DIFF_LIMIT = {"07_sharding": 250, "08_ddp_from_scratch": 250}
README_LIMIT = 300


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.name)
def test_each_lesson_reads_in_one_sitting(lesson):
    for diff in lesson.glob("from_*.diff"):
        added = [line for line in diff.read_text().splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
        limit = DIFF_LIMIT.get(lesson.name, 120)
        assert len(added) <= limit, f"{diff.name} adds {len(added)} lines, more than {limit}"
    lines = len((lesson / "README.md").read_text().splitlines())
    assert lines <= README_LIMIT, f"{lesson.name}/README.md: {lines} lines, over {README_LIMIT}"


def test_ci_stops_at_once_on_a_disk_too_small_and_leaves_nothing(tmp_path):
    # CI's first step: with less space than its virtual environments need, one line names the
    # folder and the fix before apt-get or pip start, and the folder CI made is removed again.
    small = tmp_path / "small"
    with small_disk(small):
        result = subprocess.run(["bash", str(ROOT / ".ci" / "run")], capture_output=True,
                                text=True, timeout=60, env={**os.environ, "TMPDIR": str(small)})
        left = list(small.iterdir())
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    assert f"free for its virtual environments in {small}, which has 0 GiB" in result.stderr
    assert left == []
