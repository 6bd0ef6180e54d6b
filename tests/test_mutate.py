"""The mutation check (tools/mutate.py) on a tiny repository of one function and its test, and
every entry of its list (tools/mutants.py) against the course as it is. No lesson runs here."""

import re
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402
from mutants import MUTANTS, Mutant  # noqa: E402


@pytest.fixture
def repository(tmp_path):
    """A git checkout holding lib.py, with three functions, and a test of two of them."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "lib.py").write_text("def add(a, b):\n    return a + b\n\n\n"
                                 "def untested():\n    return 1\n\n\n"
                                 "def zero():\n    return 0\n")
    (repo / "test_lib.py").write_text(
        "import pytest\n\nfrom lib import add, zero\n\n\n"
        "@pytest.fixture\ndef start():\n    assert zero() == 0\n\n\n"  # fails as an error
        "def test_add(start):\n    assert add(2, 3) == 5\n")
    return repo


@pytest.mark.parametrize("find, replace, status, exit_status", [
    ("return a + b", "return a - b", "caught", 0),  # test_add fails
    ("return 1", "return 2", "SURVIVED", 1),  # no test looks at untested()
    ("return a * b", "return a", "stale", 1),  # the text is not in lib.py
    ("return a + b", "return a +", "error", 1),  # a syntax error: pytest cannot collect
    ("return 0", "return 9", "error", 1),  # the fixture fails: no test ran to fail
])
def test_each_mistake_is_reported_with_its_outcome(repository, capsys, find, replace, status,
                                                   exit_status):
    mistake = Mutant(id="lib-mistake", file="lib.py", find=find, replace=replace, claim="",
                     readme="", tests=("test_lib.py::test_add",))
    assert mutate.main([], mutants=[mistake], root=repository) == exit_status
    line, summary = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == [status, "lib-mistake"]
    if status == "caught":
        assert line.endswith("by test_lib.py::test_add")
    assert re.fullmatch(rf"1 mistakes: 1 {status}; \d+ s", summary)
    assert "return a + b" in (repository / "lib.py").read_text()  # the original is untouched


def readme_anchors(path):
    """The anchors GitHub gives the headings of a markdown file."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_mistake_names_text_tests_and_a_claim_that_exist():
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "two mistakes share an id"
    for m in MUTANTS:
        assert (ROOT / m.file).read_text().count(m.find) == 1, f"{m.id}: stale, see --list"
        assert m.replace != m.find and m.claim and m.tests and m.kind in ("learner", "refactor")
        readme, _, anchor = m.readme.partition("#")
        assert anchor in readme_anchors(ROOT / readme), f"{m.id}: no section #{anchor}"
    files = sorted({t.split("::")[0] for m in MUTANTS for t in m.tests})
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
         "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # A parametrized test's name alone stands for all its cases.
    node_ids = {name for word in collected.stdout.split() for name in (word, word.split("[")[0])}
    for m in MUTANTS:
        for test in m.tests:
            assert test in node_ids, f"{m.id}: no test {test}"


def test_the_table_in_tests_readme_is_generated_from_the_list():
    text = mutate.TABLE.read_text()
    stored = text[text.index(mutate.TABLE_START) + len(mutate.TABLE_START):
                  text.index(mutate.TABLE_END)]
    assert stored.strip() == mutate.table(MUTANTS).strip(), \
        "run python tools/mutate.py --write-table"
