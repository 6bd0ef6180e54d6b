"""Every time in seconds that INSTRUCTORS.md's prose quotes from its timing table is in that
table's section, so a new measurement in the table cannot leave an old figure in the prose."""

import re

from helpers import ROOT

GUIDE = ROOT / "INSTRUCTORS.md"
SECTION = "## How long things take to run"
# How a sentence says its figures come from that section: by its link, or, next to it, as
# "the table above".
CITATIONS = ("(#how-long-things-take-to-run)", "the table above")


def timing_section(text):
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end != -1 else len(text)]


def sentences(text):
    """The guide's prose, one sentence at a time (a paragraph's lines joined); tables and code
    blocks are not prose."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for paragraph in re.split(r"\n\s*\n", prose):
        if paragraph.lstrip().startswith("|"):
            continue
        yield from re.split(r"(?<=[.?!])\s+(?=[A-Z*(\[])", " ".join(paragraph.split()))


def seconds(text):
    """The times in seconds that text states: "0.13 s", and both ends of "4.5 to 5.3 s"."""
    pairs = re.findall(r"(\d+(?:\.\d+)?)(?: to (\d+(?:\.\d+)?))? s\b", text)
    return [figure for pair in pairs for figure in pair if figure]


def measured(section):
    """Every figure of the table's last column (seconds), and every time the section's prose
    states."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [row.strip().strip("|").split("|")[-1] for row in rows[2:]]  # past the header
    table = re.findall(r"\d+(?:\.\d+)?", " ".join(cells))
    prose = [figure for sentence in sentences(section) for figure in seconds(sentence)]
    return set(table) | set(prose)


def test_figures_quoted_from_the_timing_table_are_in_it():
    text = GUIDE.read_text(encoding="utf-8")
    figures = measured(timing_section(text))
    quoting = [s for s in sentences(text) if any(c in s for c in CITATIONS) and seconds(s)]
    # The guide quotes the table in its answer on why DDP is slower on a laptop; a test that
    # found no such sentence would check nothing.
    assert len(quoting) >= 2, quoting
    for sentence in quoting:
        for figure in seconds(sentence):
            assert figure in figures, (
                f"INSTRUCTORS.md quotes {figure} s from its timing table, which does not have "
                f"it: {sentence}")
