"""Guards for the repository as a whole: current diffs, lint, and lessons that stand alone."""

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

LESSON_SCRIPTS = sorted(ROOT.glob("[0-9][0-9]_*/*.py"))
# What a lesson may import: the standard library and the packages in requirements.txt.
ALLOWED_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "torchvision", "sklearn", "numpy"}


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
    lessons = sorted(p.parent for p in ROOT.glob("[0-9][0-9]_*/train.py"))
    for lesson in lessons[1:]:
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
    # or a shared module, only the standard library and the packages in requirements.txt.
    tree = ast.parse(script.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"{script.name} uses a relative import"
    assert imported <= ALLOWED_TOP_LEVEL, f"unexpected imports: {imported - ALLOWED_TOP_LEVEL}"


def guard_rails(lesson):
    """The shared guard-rails section of a lesson's train.py: from its banner to the lesson's
    own guard rails, if any, or to parse_args."""
    text = (ROOT / lesson / "train.py").read_text()
    start = text.index("# Guard rails: ")
    ends = [text.find(marker, start) for marker in ("# Guard rails of this lesson",
                                                     "\ndef parse_args(")]
    return text[start:min(end for end in ends if end >= 0)].rstrip("# -\n")


def own_guard_rails(lesson):
    """{name: source} of the functions in a lesson's own guard rails, after the shared ones."""
    text = (ROOT / lesson / "train.py").read_text()
    start = text.find("# Guard rails of this lesson")
    if start < 0:
        return {}
    section = text[start:text.index("\ndef parse_args(", start)]
    return {chunk.split("(", 1)[0]: chunk.rstrip() for chunk in section.split("\ndef ")[1:]}


def test_a_guard_rail_that_lessons_share_is_the_same_in_each():
    # Lessons 04 and 07 both need restart_store for torchrun's restarts: a fix made in one copy
    # and not in the other fails here.
    seen = {}
    for lesson in sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]_*/train.py")):
        for name, source in own_guard_rails(lesson).items():
            first_lesson, first_source = seen.setdefault(name, (lesson, source))
            assert source == first_source, f"{name} differs between {first_lesson} and {lesson}"
    assert "restart_store" in seen


def test_guard_rails_are_worded_the_same_in_every_lesson():
    # The diff from lesson 02 to 03, 04, 05, 06 and 07 then shows only what each lesson teaches; the
    # section is new in 02 alone (01 has its part that needs no ranks).
    shared = guard_rails("02_multi_gpu_spawn")
    for lesson in ("03_multi_node", "04_checkpointing", "05_model_parallel_ddp",
                   "06_ddp_in_practice", "07_sharding"):
        assert guard_rails(lesson) == shared, f"{lesson}: copy lesson 02's guard rails"
    first = guard_rails("01_single_gpu")
    for function in first.split("\n\n\ndef ")[1:]:
        if not function.startswith("start("):  # 02's start also stops the ranks on Ctrl-C
            assert f"\n\n\ndef {function}" in shared, function.splitlines()[0]
