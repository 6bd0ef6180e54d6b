"""Clear what running the notebooks leaves in them, so they are stored without outputs.

    python tools/clear_notebooks.py          # clear every notebooks/*.ipynb in place
    python tools/clear_notebooks.py --check  # exit 1 if any needs it (the test suite runs this)

The notebooks are stored without outputs: a diff then shows only what someone changed, and no
stored number or figure can disagree with the code. Clearing removes what a run adds: outputs,
execution counts, each cell's run times, and the kernel's version details. It keeps everything
else, such as the answer cells' collapsed state. (`jupyter nbconvert --clear-output` clears the
outputs but keeps the run times that `nbconvert --execute` records.)
"""

import argparse
import sys
from pathlib import Path

import nbformat

# Cell metadata that running or viewing a notebook writes, not its author.
RUN_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")


def cleared(text):
    """The notebook in text, cleared, as the text it is stored as."""
    notebook = nbformat.reads(text, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in RUN_METADATA:
            cell.metadata.pop(key, None)
    # The kernel adds its Python version and more on every run; the language's name is enough.
    language = notebook.metadata.get("language_info", {}).get("name", "python")
    notebook.metadata["language_info"] = {"name": language}
    notebook.metadata.pop("widgets", None)
    return nbformat.writes(notebook).rstrip("\n") + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; write nothing")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    stale = []
    for path in sorted((args.root / "notebooks").glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        clean = cleared(text)
        if clean != text:
            stale.append(path.relative_to(args.root))
            if not args.check:
                path.write_text(clean, encoding="utf-8")
    if args.check and stale:
        for path in stale:
            print(f"not cleared: {path}")
        print("clear them with: python tools/clear_notebooks.py")
        sys.exit(1)
    if not args.check:
        print(f"cleared {len(stale)} notebook(s)" if stale else "nothing to clear")


if __name__ == "__main__":
    main()
