"""Write each lesson's diff from the previous lesson, and check that the written ones are current.

    python tools/make_diffs.py          # regenerate every diff file and README block
    python tools/make_diffs.py --check  # exit 1 if any of them is stale (the test suite runs this)

Every folder NN_name/ with a train.py is a lesson; each is diffed against the one before it, with
no exceptions. The diff goes to NN_name/from_<previous>.diff and into the lesson README between
the two marker lines below, so what the learner reads is always what the code does.
"""

import argparse
import difflib
import sys
from itertools import pairwise
from pathlib import Path

BEGIN = "<!-- begin generated diff (tools/make_diffs.py writes this block; do not edit it) -->"
END = "<!-- end generated diff -->"


def lessons(root):
    return sorted(p.parent.name for p in root.glob("[0-9][0-9]_*/train.py"))


def lesson_diff(root, previous, lesson):
    old = (root / previous / "train.py").read_text().splitlines(keepends=True)
    new = (root / lesson / "train.py").read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(old, new, f"{previous}/train.py", f"{lesson}/train.py"))


def readme_with_diff(readme_text, diff):
    before, begin, rest = readme_text.partition(BEGIN)
    _, end, after = rest.partition(END)
    if not begin or not end:
        return None
    return f"{before}{BEGIN}\n```diff\n{diff}```\n{END}{after}"


def expected_files(root):
    """{path: text} for every generated file, or raise ValueError for a README without markers."""
    files = {}
    for previous, lesson in pairwise(lessons(root)):
        diff = lesson_diff(root, previous, lesson)
        files[root / lesson / f"from_{previous}.diff"] = diff
        readme = root / lesson / "README.md"
        text = readme.read_text() if readme.exists() else ""
        new_text = readme_with_diff(text, diff)
        if new_text is None:
            raise ValueError(f"{readme.relative_to(root)} needs the lines {BEGIN!r} and {END!r}")
        files[readme] = new_text
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
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(args.root)}; run python tools/make_diffs.py")
        sys.exit(1 if stale else 0)
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path.relative_to(args.root)}")


if __name__ == "__main__":
    main()
