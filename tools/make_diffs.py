"""Write each lesson's diff from the lesson it builds on; check that the written ones are current.

    python tools/make_diffs.py          # regenerate every diff file
    python tools/make_diffs.py --check  # exit 1 if any is stale (the test suite runs this)

Every folder NN_name/ with a train.py is a lesson (lesson 14's program is its planner, plan.py,
diffed against its base's train.py). Every lesson but the first says in its
docstring which lesson it builds on ("Lesson 02's program, now ..."), and is diffed against that
one, with no exceptions: lesson 05 builds on lesson 02, not on 04. The diff goes to
NN_name/from_<base>.diff, which the lesson's README links (code hosts show it in colour) and its
notebook prints, so what the learner reads is always what the code does. It opens with the
lesson's own modules that train.py imports (08's grad_sync.py, 09's tensor_parallel.py, 10's
pipeline.py), the idea a learner reads first, each diffed against the base's file
of that name, or shown whole where the base has none; then train.py's diff, the few lines that
use them. The guard rails live in guard_rails.py, generated for each lesson
(tools/make_guard_rails.py), so no diff shows them.
"""

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

BASE = re.compile(r"^Lesson (\d\d)'s program", re.MULTILINE)
PROGRAMS = ("train.py", "plan.py")  # a lesson's program: train.py, or lesson 14's planner


def lessons(root):
    return sorted({p.parent.name for name in PROGRAMS for p in root.glob(f"[0-9][0-9]_*/{name}")})


def program(root, lesson):
    return next(name for name in PROGRAMS if (root / lesson / name).is_file())


def base_of(root, lesson, all_lessons):
    """The lesson that lesson's docstring says it builds on; ValueError if it says none."""
    match = BASE.search((root / lesson / program(root, lesson)).read_text())
    bases = [name for name in all_lessons if match and name.startswith(match.group(1) + "_")]
    if not bases or bases[0] >= lesson:
        raise ValueError(f"{lesson}/{program(root, lesson)} must name an earlier lesson it "
                         "builds on in its docstring, as a line starting \"Lesson NN's program\"")
    return bases[0]


def modules_of(root, lesson):
    """The lesson's own modules that its train.py imports (guard_rails.py aside, generated,
    which no diff shows): the file that holds the lesson's idea, such as 08's grad_sync.py."""
    folder = root / lesson
    tree = ast.parse((folder / program(root, lesson)).read_text())
    names = {alias.name for node in tree.body if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)
              and node.module}
    return sorted(f"{name}.py" for name in names - {"guard_rails"}
                  if (folder / f"{name}.py").is_file())


def unified_diff(old, new, old_name, new_name, context=3):
    """difflib.unified_diff's text, from a SequenceMatcher with autojunk off. With it on (the
    only way unified_diff runs), a file of 200 lines or more has its frequent lines (blank ones)
    taken as junk, which no match may start from, so the diff deletes and adds them again."""
    def span(start, stop):  # as a unified diff's header numbers lines: from 1, "start,length"
        return f"{start + 1}" if stop - start == 1 else f"{start + (stop > start)},{stop - start}"
    groups = difflib.SequenceMatcher(None, old, new, autojunk=False).get_grouped_opcodes(context)
    lines = []
    for group in groups:
        if not lines:
            lines += [f"--- {old_name}\n", f"+++ {new_name}\n"]
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        lines.append(f"@@ -{span(i1, i2)} +{span(j1, j2)} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                lines += [" " + line for line in old[i1:i2]]
            else:
                lines += ["-" + line for line in old[i1:i2]] + ["+" + line for line in new[j1:j2]]
    return "".join(lines)


def lesson_diff(root, previous, lesson):
    """Each module train.py imports (a new one whole), then train.py's diff from the base's."""
    diffs = []
    mine, theirs = program(root, lesson), program(root, previous)
    for name in [*modules_of(root, lesson), mine]:
        before = root / previous / (theirs if name == mine else name)
        old = before.read_text().splitlines(keepends=True) if before.is_file() else []
        new = (root / lesson / name).read_text().splitlines(keepends=True)
        old_name = f"{previous}/{before.name}" if before.is_file() else "/dev/null"
        diffs.append(unified_diff(old, new, old_name, f"{lesson}/{name}"))
    return "".join(diffs)


def expected_files(root):
    """{path: text} for every generated file, or raise ValueError for a README that does not
    link its lesson's diff."""
    files = {}
    all_lessons = lessons(root)
    for lesson in all_lessons[1:]:
        previous = base_of(root, lesson, all_lessons)
        name = f"from_{previous}.diff"
        files[root / lesson / name] = lesson_diff(root, previous, lesson)
        readme = root / lesson / "README.md"
        if readme.exists() and f"]({name})" not in readme.read_text():
            raise ValueError(f"{readme.relative_to(root)} must link its diff, as []({name})")
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; write nothing")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    try:
        files = expected_files(args.root)
    except ValueError as error:
        sys.exit(f"error: {error}")
    stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    # A diff from a lesson that is no longer the base would mislead: it goes.
    leftover = [p for p in sorted(args.root.glob("[0-9][0-9]_*/from_*.diff")) if p not in files]
    if args.check:
        for path in stale + leftover:
            print(f"stale: {path.relative_to(args.root)}; run python tools/make_diffs.py")
        sys.exit(1 if stale or leftover else 0)
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path.relative_to(args.root)}")
    for path in leftover:
        path.unlink()
        print(f"removed {path.relative_to(args.root)}")


if __name__ == "__main__":
    main()
