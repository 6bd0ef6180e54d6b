"""Run every command the course prints, in order, as a learner types them, and check each one.

    python tools/check_listings.py                               # every file below, 2 at a time
    python tools/check_listings.py 02_multi_gpu_spawn/README.md  # one file
    python tools/check_listings.py --jobs 1                      # one file after another
    python tools/check_listings.py --list                        # what would run; runs nothing
    python tools/check_listings.py --fresh                       # each command a Python of its own

The files, by default: the root README.md, every numbered lesson's README.md (00_preflight on),
INSTRUCTORS.md and the exercises' pages (exercises/*.md). The conventions a README author
follows, which this check enforces:

- Every ```bash block of a file runs, top to bottom. Each file runs in a fresh copy of the
  repository (its git-tracked files and the untracked ones git does not ignore; no runs/), from
  the copy's root, and all blocks of one file run in one bash process, so an `export` or a `cd`
  carries on to the blocks below it. Whatever a command writes (runs/...) stays in the copy.
  ```text and ```console blocks are output samples and never run.
- Every ```text (or ```console) block says, in the line right before its opening fence, whether
  it is checked:

      <!-- output: exact lines -->
      <!-- output of `--node-rank 1`: exact lines -->
      <!-- output: illustrative (from a machine with 4 GPUs) -->

  "exact lines": the output of the last command of the latest ```bash block above it that
  runs, or of that block's first command that shows the text in backquotes (in its code or its
  comment), must hold the block's lines, each in turn and one right after the other; a line
  that is only `...` stands for any number of lines, and `…` within a line for any text (a
  time, a port, a path).
  "illustrative": not compared, for the reason in the parentheses.
- A block that cannot run on a single CPU-only machine (it needs GPUs, two machines, a Slurm
  cluster) has this line right before its opening fence, with the reason in the parentheses:

      <!-- listing: not run (needs 2 GPUs) -->

  A marker without a reason, or one not right before a ```bash fence, is an error.
- A block whose commands another file of this check also shows and runs (INSTRUCTORS.md
  repeating a lesson's command) names that file, or several, in the line right before its
  opening fence; its commands are not run here:

      <!-- listing: same as exercises/02_ddp_with_spawn.md, exercises/README.md -->

  Each command must be one of the named files' commands that run, with the same script (what
  bash runs: comments dropped, continuations joined, here-documents included), alike in the
  background or not, and with the same `# fails:` text; if not, it is an error. After every
  file has run, each is reported ok or FAIL as its match in the named file was, or "not
  checked" when this run did not check that file (CI checks every file). A later command
  must not need what a skipped one did (a file written, a `cd`, an `export`): mark it too.
- A block may instead name a test file that runs the same commands, as they stand, from the
  repository's root (TEST_COMMANDS lists those files and how each names its commands):

      <!-- listing: same as tests/test_troubleshooting.py -->

  Each command must be one the file runs, plain (not in the background, no `# fails:`). It is
  reported ok when the test that runs it passed in the pytest run whose outcomes --pytest-outcomes
  names (CI's pytest step writes them: tests/conftest.py, PYTEST_OUTCOMES), FAIL when that test
  failed, was skipped or did not run, and "not checked" without --pytest-outcomes.
- A command is a line; a line ending in a backslash goes on to the next, a here-document
  (`python - <<'PY'` ... `PY`) belongs to the command that opens it, and so do the lines of an
  unfinished `if`, `for` or quote. A line that is only a comment is not run.
- A command must exit 0, unless its trailing comment starts with `# fails:`: then it must exit
  non-zero, and its output (stdout and stderr) must contain the text after `# fails:` verbatim.

      python 02_multi_gpu_spawn/train.py --world-size 0   # fails: --world-size must be at least 1

- A lesson run (python or torchrun starting NN_name/train.py) that exits 0 must print
  `test accuracy` (lessons 11 to 13, language models: `validation loss`), or say `nothing left to
  train` (a run that found a finished checkpoint),
  unless it asks for `--help` or is a node other than node 0 (`--node-rank 1`: rank 0, which
  prints the result, runs on node 0): a run that trains nothing and says nothing is a failure.
- A command that names another machine (an IPv4 address outside 127.0.0.0/8, or a
  `--master-addr` / `--rdzv-endpoint` that is not loopback) is an error unless its block is
  marked not run: the check sends nothing off this machine.
- A command ending in `&` runs in the background, and a later `wait` waits for it; it is checked
  like any other when it ends (at the latest when the file's commands are done).
- A command still running after --timeout seconds (300) is stopped and fails as hung; the
  commands after it still run (if the shell itself hangs, in a loop, the rest of the file fails
  as not run).

A plain run of a lesson whose ranks fork from a server (SHARED_STARTS, tests/lesson_runner.py),
`python NN_name/train.py` and its flags with nothing else on the line, not in the background,
runs as the tests' plain runs do: in one Python per lesson and file (tools/lesson_client.py),
which imports torch and starts the fork server on the lesson's first run of the file, and runs
each later one as `__main__` with its arguments, in the same folder and environment (else it
starts another). Its exit status, its output and its files are a fresh Python's
(tests/test_lesson_runner.py compares them); what it leaves out is a Python's start and exit,
so a lesson's first plain run in its own README runs as typed, in a Python of its own. --fresh
runs every command in a Python of its own, exactly as a learner's terminal does.

The check is the CPU path, also on a machine with GPUs: every command sees
CUDA_VISIBLE_DEVICES="" (torch finds no GPU) and PYTHONUNBUFFERED=1, and none of the variables a
launcher or Slurm sets (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...), as in a fresh terminal.
`python` is the one on PATH when the check starts: activate the virtual environment first.

Two files run at a time (--jobs 2; --jobs 1 runs them one after another, in the order given):
the longest first (TYPICAL_SECONDS below), and never two at once that use the same fixed TCP
port, one that a command names (--master-port, MASTER_PORT=, --rdzv-endpoint) or takes without
naming it (lesson 03's 29500 with several nodes, torchrun's without --standalone, the
preflight's look at 29500). Each file has its own copy: the two share only the machine and what
lies outside the copies (TMPDIR, caches).
In CI's last step (CI_SLOTS set, tools/ci_slots.py) a file also waits for one of the two slots
it shares with the mutation check and the exercises' tests, and a file marked to run alone for
both.

It prints, for each file, its first line, one line per command (file:line, seconds, ok or
FAIL), for a failure the command and the end of its output, and the file's last line: as they
come with --jobs 1; else all together when the file is done, after a `-- started` line when it
starts, so that two files' lines never mix. Then a line per file and the total time. It exits 1
if a command failed or a file breaks the conventions. Stopped (Ctrl-C, SIGTERM), it ends every
running file's commands and removes the copies. Needs bash, git and ps (Linux or macOS).
"""

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ci_slots import SLOTS  # tools/, beside this file: on sys.path for a script and its importers
from lesson_client import end_runners

sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))
from lesson_runner import SHARED_STARTS  # noqa: E402 - the lessons whose plain runs share a Python

ROOT = Path(__file__).resolve().parent.parent

OPEN_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
MARKER = re.compile(r"<!--\s*listing\b")
NOT_RUN = re.compile(r"^\s*<!--\s*listing:\s*not run\s*\((.*)\)\s*-->\s*$")
SAME_AS = re.compile(r"^\s*<!--\s*listing:\s*same as\s+(.*?)\s*-->\s*$")
OUTPUT_MARKER = re.compile(r"<!--\s*output\b")
OUTPUT = re.compile(r"^\s*<!--\s*output(?:\s+of\s+`([^`]+)`)?:\s*"
                    r"(?:(exact lines)|illustrative\s*\((.*)\))\s*-->\s*$")
OUTPUT_FORMS = ("`<!-- output: exact lines -->` (or `<!-- output of `text of the command`: exact "
                "lines -->`) or `<!-- output: illustrative (the reason) -->`")
HEREDOC = re.compile(r"<<(-?)[ \t]*(?:'([^']*)'|\"([^\"]*)\"|\\?([\w.-]+))")
# python, python3, python3.12 or torchrun (or `python -m torch.distributed.run`) starting a
# numbered lesson's train.py, within one simple command; not another script that is given one
# (exercises/check.py 02 02_multi_gpu_spawn/train.py).
LESSON_RUN = re.compile(r"(?:^|[\s;&|(/])(?:python[\d.]*|torchrun)\s(?:(?!\.py\b)[^;&|\n])*?"
                        r"\b\d\d_[\w-]+/train\.py\b")
HELP = re.compile(r"(?:^|\s)(?:--help|-h)(?=\s|$)")
# A plain run of a lesson, nothing else on the line: python, the lesson's train.py, its flags.
PLAIN_RUN = re.compile(r"python\s+((\d\d_[\w-]+)/train\.py(?:\s+[\w./=,:+-]+)*)")
CLIENT = Path(__file__).resolve().parent / "lesson_client.py"
# A node other than node 0 (lesson 03's --node-rank, torchrun's): rank 0, which prints the result,
# runs on node 0.
OTHER_NODE = re.compile(r"--node[-_]rank[= ]+(?!0\b)\d+")
TRAINED = ("test accuracy", "validation loss", "nothing left to train")
IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")
# Flags that name where rank 0 or the rendezvous listens (torchrun's and lesson 03's).
ADDRESS_FLAG = re.compile(r"--(?:master[-_]addr|rdzv[-_]endpoint)[= ]+(\S+)")
# What a launcher (torchrun, mp.spawn's parent, Slurm) puts in the environment: a learner's fresh
# terminal has none of them, and a leftover one would change what a lesson does.
LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "PMI_", "OMPI_")
OUTPUT_TAIL = 30  # lines of a failed command's output that are printed
POLL = 0.1  # seconds between looks at the running commands
GRACE = 5  # seconds a stopped command has to end after SIGTERM, and again after SIGKILL


@dataclass
class Command:
    path: str  # the markdown file, relative to the repository
    line: int  # where the command starts in it, from 1
    shown: str  # the command as the file shows it
    script: str  # what bash runs: comments dropped, a trailing & too
    code: str  # its lines without comments or here-document bodies, continuations joined
    comment: str  # its trailing comment, without the #
    background: bool
    expected: list = field(default_factory=list)  # (line, lines) of the text blocks it prints

    @property
    def where(self):
        return f"{self.path}:{self.line}"


@dataclass
class TestRun:
    """A command that a test of a test file runs as it stands (TEST_COMMANDS)."""
    path: str  # the test file, relative to the repository
    test: str  # the test's name
    script: str  # the command, as bash would run it

    @property
    def where(self):
        return f"{self.path}::{self.test}"


@dataclass
class Listing:
    path: str
    commands: list = field(default_factory=list)
    not_run: list = field(default_factory=list)  # (line, reason) of each marked block
    same_as: list = field(default_factory=list)  # (command, its match in another file), not run
    errors: list = field(default_factory=list)  # (line, message): the conventions broken


@dataclass
class Result:
    command: Command
    returncode: int | None  # None: the command never ended (its shell was stopped)
    seconds: float
    output: str
    hung: bool = False
    problem: str = ""  # why it failed; empty when it is ok

    @property
    def ok(self):
        return not self.problem


def scan(line, quote):
    """Split a line of shell into (code, comment, quote, here-documents, continued): quote is the
    quote still open at its end (or at its start, passed in), continued whether it ends in a
    backslash that joins it to the next line."""
    heredocs = []
    i = 0
    while i < len(line):
        c = line[i]
        if quote == "'":
            if c == "'":
                quote = None
        elif c == "\\":
            if i == len(line) - 1:
                return line[:-1], "", quote, heredocs, True
            i += 1
        elif quote == '"':
            if c == '"':
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t;&|()"):
            return line[:i].rstrip(), line[i + 1:].strip(), quote, heredocs, False
        elif line.startswith("<<", i) and not line.startswith("<<<", i):
            match = HEREDOC.match(line, i)
            if match:
                dash, *words = match.groups()
                heredocs.append((next(w for w in words if w is not None), bool(dash)))
                i = match.end()
                continue
        i += 1
    return line, "", quote, heredocs, False


def syntax(text):
    """'complete', 'incomplete' (bash wants more lines) or bash's syntax error message."""
    checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    if checked.returncode == 0:
        return "complete"
    if "unexpected end of file" in checked.stderr or "unexpected EOF" in checked.stderr:
        return "incomplete"
    return checked.stderr.strip()


def split_commands(path, lines, first, listing):
    """Add the commands of one ```bash block (its lines, the first at line `first`)."""
    i = 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].strip().startswith("#"):
            i += 1
            continue
        start, script, logical, quote, pending, problem = i, [], [], None, "", None
        while True:
            if i == len(lines):
                problem = "the block ends before this command does"
                break
            code, comment, quote, heredocs, continued = scan(lines[i], quote)
            i += 1
            pending += code
            if continued:
                continue
            logical.append((len(script), pending, comment))
            script.append(pending)
            pending = ""
            for delimiter, strip_tabs in heredocs:
                while i < len(lines):
                    script.append(lines[i])
                    i += 1
                    if (lines[i - 1].lstrip("\t") if strip_tabs else lines[i - 1]) == delimiter:
                        break
                else:
                    problem = f"the here-document has no closing `{delimiter}` line"
            if problem:
                break
            if quote:
                continue  # a quote goes on to the next line
            state = syntax("\n".join(script))
            if state == "complete":
                break
            if state != "incomplete":
                problem = f"bash cannot parse it: {state}"
                break
        shown = "\n".join(lines[start:i])
        if problem:
            listing.errors.append((first + start, f"{problem}:\n{indent(shown)}"))
            continue
        index, last, comment = logical[-1]
        last = last.rstrip()
        background = last.endswith("&") and not re.search(r"[&|<>]&$", last)
        if background:
            script[index] = last[:-1]
        listing.commands.append(Command(
            path, first + start, shown, "\n".join(script),
            "\n".join(code for _, code, _ in logical).strip(), comment, background))


def parse(path, text, root=ROOT, resolve=True):
    """The Listing of one markdown file: its commands to run, its marked blocks, its errors.
    root holds the files that `same as` markers name; resolve=False leaves those blocks out."""
    listing = Listing(path)
    lines = text.splitlines()
    marked = set()  # the line numbers of fences right after a marker, good or not
    outputs = {}  # the line number of a fence right after an output marker: that marker
    last_block = []  # the commands of the latest ```bash block that runs
    same_as = {}  # the line number of a fence right after a same-as marker: the files it names
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = OPEN_FENCE.match(line)
        if line.lstrip().startswith("<!--") and OUTPUT_MARKER.search(line):
            outputs[i + 2] = line
            i += 1
            continue
        if line.lstrip().startswith("<!--") and MARKER.search(line):
            marker = NOT_RUN.match(line)
            following = OPEN_FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            same = SAME_AS.match(line)
            if same and following and following.group(3) == "bash":
                same_as[i + 2] = [name.strip() for name in same.group(1).split(",")]
            elif same:
                listing.errors.append((i + 1, "a same-as marker is the line right before a "
                                       "```bash fence"))
            elif not marker:
                listing.errors.append((i + 1, "a listing marker reads "
                                       "`<!-- listing: not run (the reason) -->` or "
                                       "`<!-- listing: same as FILE -->`"))
            elif not marker.group(1).strip():
                listing.errors.append((i + 1, "a not-run marker names its reason in the "
                                       "parentheses"))
            elif not following or following.group(3) != "bash":
                listing.errors.append((i + 1, "a not-run marker is the line right before a "
                                       "```bash fence"))
            else:
                listing.not_run.append((i + 2, marker.group(1).strip()))
            marked.add(i + 2)
            i += 1
            continue
        if not fence:
            i += 1
            continue
        margin, ticks, language = fence.groups()
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{ticks[0]}{{{len(ticks)},}}\s*$", lines[i]):
            body.append(lines[i][len(margin):] if lines[i].startswith(margin) else lines[i])
            i += 1
        start = i - len(body) + 1  # the line number of the block's first line
        i += 1
        if language in ("text", "console"):
            expect_output(listing, start - 1, body, outputs.pop(start - 1, None), last_block)
        if language == "bash" and start - 1 in same_as:
            last_block = []  # its commands run elsewhere: no output shown here is theirs
            names = same_as[start - 1]
            if resolve and names[0] in TEST_COMMANDS and len(names) == 1:
                match_test(listing, body, start, names[0], root)
            elif resolve:
                match_elsewhere(listing, body, start, names, root)
        if language == "bash" and start - 1 not in marked:
            before = len(listing.commands)
            split_commands(path, body, start, listing)
            for command in listing.commands[before:]:
                if elsewhere(command.code):
                    listing.errors.append((command.line, (
                        f"this command reaches {elsewhere(command.code)}, another machine: the "
                        "check sends nothing off this one; mark its block not run")))
            listing.commands[before:] = [c for c in listing.commands[before:]
                                         if not elsewhere(c.code)]
            last_block = listing.commands[before:]
    for line in outputs:
        listing.errors.append((line - 1, "an output marker is the line right before a ```text "
                               "fence"))
    return listing


# The test files that run some of the listed commands as they stand, from the repository's root:
# for each, what in a test's code names a command, and that command. test_troubleshooting.py's
# run_demo("hang.py") runs `python troubleshooting/hang.py` (its [sys.executable, path], cwd the
# root; tests/test_listings.py checks that this stays so).
TEST_COMMANDS = {
    "tests/test_troubleshooting.py": (re.compile(r'\brun_demo\("(\w+\.py)"\)'),
                                      "python troubleshooting/{}"),
    # Lesson 14's proofs, each run once in the Python its tests share, its output compared with
    # the README's by test_the_readme_shows_what_each_proof_prints.
    "tests/test_14_planning.py": (re.compile(r'\bproof\(worker, "(prove_\w+)"\)'),
                                  "python 14_planning/{}.py"),
    # Lesson 13's proof, its output compared with the README's in the same test.
    "tests/test_13_capstone.py": (re.compile(r'str\(ROOT / LESSON / "(prove_layouts)\.py"\)\], '
                                             r'cwd=ROOT'), "python 13_capstone/{}.py"),
}


def test_runs(name, root):
    """The TestRun of each command that the test file name runs, in the order of its tests."""
    pattern, command = TEST_COMMANDS[name]
    runs, test = [], None
    for line in (root / name).read_text().splitlines():
        defined = re.match(r"def (test_\w+)\(", line)
        test = defined.group(1) if defined else test
        runs += [TestRun(name, test, command.format(found)) for found in pattern.findall(line)
                 if test]
    return runs


def match_test(listing, body, first, name, root):
    """Give each command of a block marked `same as name`, a test file, the test that runs it
    as it stands (see the docstring), or an error."""
    block = Listing(listing.path)
    split_commands(listing.path, body, first, block)
    listing.errors.extend(block.errors)
    runs = {run.script: run for run in test_runs(name, root)}
    for command in block.commands:
        run = runs.get(command.script.strip())
        if run and not command.background and not command.comment.startswith("fails:"):
            listing.same_as.append((command, run))
        else:
            listing.errors.append((command.line, f"`{command.shown.strip()}` is not a command "
                                   f"that {name} runs as it stands; run it here"))


def match_elsewhere(listing, body, first, names, root):
    """Give each command of a block marked `same as names` its match among the commands those
    files run (see the docstring), or an error."""
    block = Listing(listing.path)
    split_commands(listing.path, body, first, block)
    listing.errors.extend(block.errors)
    runs = default_files(root)
    originals = []
    for name in names:
        if name not in runs:
            listing.errors.append((first - 2, f"same as {name}: not one of the files this check "
                                   "runs"))
        else:
            originals += parse(name, (root / name).read_text(), root, resolve=False).commands
    for command in block.commands:
        match = next((o for o in originals if same_command(o, command)), None)
        if match:
            listing.same_as.append((command, match))
        elif all(name in runs for name in names):
            listing.errors.append((command.line, f"`{command.shown.strip()}` is not a command "
                                   f"of {', '.join(names)}; run it here or name the file that "
                                   "runs it"))


def same_command(a, b):
    """Whether a and b run the same script and expect the same (see the docstring)."""
    def fails(command):
        return command.comment if command.comment.startswith("fails:") else ""
    return (a.script, a.background, fails(a)) == (b.script, b.background, fails(b))


def expect_output(listing, fence, body, marker, last_block):
    """Give the text block at line fence to the command whose output it shows, if it is exact."""
    match = OUTPUT.match(marker or "")
    if not match:
        where, problem = (fence - 1, "an output marker reads") if marker else (
            fence, "a ```text block has, right before it,")
        listing.errors.append((where, f"{problem} {OUTPUT_FORMS}"))
        return
    fragment, exact, reason = match.groups()
    if not exact:
        if not reason.strip():
            listing.errors.append((fence - 1, "an illustrative output names its reason"))
        return
    shown = [c for c in last_block if fragment in c.shown] if fragment else last_block[-1:]
    if not shown:
        listing.errors.append((fence, f"no command of the ```bash block above shows `{fragment}`"
                               if fragment else "exact lines, but no ```bash block above runs"))
        return
    shown[0].expected.append((fence + 1, body))


def elsewhere(code):
    """The first address in code that is not this machine's loopback (127.x, localhost), or "".
    A listing that talks to another machine (a node's address, a placeholder such as HOST0)
    cannot run here, and its traffic must never leave this machine."""
    for address in IPV4.findall(code):
        if not address.startswith("127.") and address != "0.0.0.0":
            return address
    for address in ADDRESS_FLAG.findall(code):
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        if host not in ("localhost", "$(hostname)") and not host.startswith(("127.", "$")):
            return host
    return ""


def indent(text, prefix="    "):
    return "\n".join(prefix + line for line in text.splitlines())


def copy_repository(root, destination):
    """Copy root's git-tracked files and its untracked files that git does not ignore, but not
    runs/, into destination."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=root, capture_output=True, text=True)
    if listed.returncode != 0:
        sys.exit(f"error: {root} is not a git checkout: {listed.stderr.strip()}")
    destination.mkdir(parents=True)
    for name in sorted(set(listed.stdout.split("\0")) - {""}):
        source = root / name
        if name.startswith("runs/") or not os.path.lexists(source) or source.is_dir():
            continue  # runs/ is output; a deleted tracked file; a submodule
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination / name, follow_symlinks=False)


def shared_run(command, fresh_ones=None):
    """The `lesson/train.py flags` of a plain run of a lesson in SHARED_STARTS, else None. The
    first such run of a lesson in its own README runs as typed, in a Python of its own (its
    lesson's name is then added to the set fresh_ones, where given), so that every lesson's
    start and exit run in a fresh Python too."""
    match = PLAIN_RUN.fullmatch(command.code.strip())
    if command.background or not match or match[2] not in SHARED_STARTS:
        return None
    if fresh_ones is not None and command.path == f"{match[2]}/README.md" and \
            match[2] not in fresh_ones:
        fresh_ones.add(match[2])
        return None
    return match[1]


def bash_script(commands, status, runners=None):
    """One bash script that runs every command in turn, in the same shell, each with its output
    in status/N.log; status/N.start is made as it starts, and status/N.end holds its exit status
    once it has ended. A background command runs in a subshell that writes its own N.end; its pid
    is in status/N.pid. With runners (a folder), a plain run of a lesson in SHARED_STARTS runs in
    that lesson's runner there (tools/lesson_client.py)."""
    parts, fresh_ones = [], set()
    for n, command in enumerate(commands):
        files = {kind: shlex.quote(str(status / f"{n}.{kind}"))
                 for kind in ("start", "log", "end", "pid")}
        parts.append(f": > {files['start']}")
        run = shared_run(command, fresh_ones) if runners else None
        if command.background:
            parts.append(f"{{ {{ {command.script}\n}} > {files['log']} 2>&1; "
                         f"printf '%s\\n' \"$?\" > {files['end']}; }} &")
            parts.append(f"printf '%s\\n' \"$!\" > {files['pid']}")
        elif run:
            parts.append(f"{{ python {shlex.quote(str(CLIENT))} {shlex.quote(str(runners))} "
                         f"{run}\n}} > {files['log']} 2>&1")
            parts.append(f"printf '%s\\n' \"$?\" > {files['end']}")
        else:
            parts.append(f"{{ {command.script}\n}} > {files['log']} 2>&1")
            parts.append(f"printf '%s\\n' \"$?\" > {files['end']}")
    parts.append("wait")  # for background commands that no `wait` waited for
    return "\n".join(parts) + "\n"


def learner_environment():
    env = {name: value for name, value in os.environ.items()
           if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)
           and name not in ("BASH_ENV", "ENV")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def process_tree():
    """{pid: [child pids]} of every process on the machine."""
    listed = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True,
                            text=True)
    children = {}
    for row in listed.stdout.splitlines():
        pid, ppid = map(int, row.split())
        children.setdefault(ppid, []).append(pid)
    return children


def descendants(pid, children, skip=()):
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in skip:
            found.append(child)
            todo.extend(children.get(child, []))
    return found


def signal_all(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # it ended meanwhile


def read_end(path):
    """A command's exit status from its .end file, or None while it has not ended."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.endswith("\n") and text.strip().isdigit() else None


def judge(result):
    """Why the command failed, or "" when it did what its line says and printed what the
    README shows it print."""
    problem = exit_problem(result)
    for line, shown in result.command.expected if not problem else []:
        missing = first_missing(result.output, shown)
        if missing is not None:
            problem = (f"the output shown at line {line} is not what it printed: no "
                       f"{missing!r} where the lines before it put it")
    return problem


def first_missing(output, shown):
    """None if output holds the shown lines (see the docstring: `...`, `…`), else the first
    shown line that it lacks."""
    printed = [line.rstrip() for line in output.splitlines()]
    runs = [[]]  # the shown lines between `...` lines, each run one right after the other
    for line in shown:
        if line.strip() in ("...", "…"):
            runs.append([])
        else:
            runs[-1].append(line.rstrip())
    position = 0
    for run in filter(None, runs):
        patterns = [re.compile(".*".join(map(re.escape, line.split("…")))) for line in run]
        best, where = 0, position  # the most lines of the run matched in a row, and where
        for start in range(position, len(printed)):
            matched = 0
            while (matched < len(run) and start + matched < len(printed)
                   and patterns[matched].fullmatch(printed[start + matched])):
                matched += 1
            if matched > best:
                best, where = matched, start
            if matched == len(run):
                break
        if best < len(run):
            return run[best]
        position = where + len(run)
    return None


def exit_problem(result):
    """Why the command failed, or "" when it did what its line says."""
    command, rc, output = result.command, result.returncode, result.output
    if result.hung:
        return "hung: still running after the time limit, stopped"
    if rc is None:
        return "the shell ended before this command did"
    if command.comment.startswith("fails:"):
        expected = command.comment[len("fails:"):].strip()
        if not expected:
            return "`# fails:` names the text the output must contain"
        if rc == 0:
            return "exit 0, but its comment says it fails"
        if expected not in output:
            return f"exit {rc} as its comment says, but the output lacks {expected!r}"
        return ""
    if rc != 0:
        return f"exit {rc}"
    if (LESSON_RUN.search(command.code) and not HELP.search(command.code)
            and not OTHER_NODE.search(command.code)
            and not any(word in output for word in TRAINED)):
        return ("a lesson run that exits 0 prints 'test accuracy' (lessons 11 to 13: "
                "'validation loss') or says 'nothing left to train'")
    return ""


def run_listing(root, listing, timeout, report, share=True):
    """Run one file's commands in a fresh copy of root; report(result) is called for each, in
    the file's order, as soon as it and every command before it have ended. With share, a plain
    run of a lesson in SHARED_STARTS runs in that lesson's runner (the module's docstring)."""
    commands = listing.commands
    results = [None] * len(commands)
    with ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="check_listings-"))
        repository, status = Path(scratch) / "repository", Path(scratch) / "status"
        copy_repository(root, repository)
        status.mkdir()
        script = Path(scratch) / "listing.sh"
        runners = Path(scratch) / "runners"
        stack.callback(end_runners, runners)  # the file is done, or stopped: they end too
        script.write_text(bash_script(commands, status, runners if share else None))
        shell_log = stack.enter_context(open(Path(scratch) / "shell.log", "w+"))
        shell = subprocess.Popen(["bash", str(script)], cwd=repository, env=learner_environment(),
                                 stdin=subprocess.DEVNULL, stdout=shell_log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        stopped = {}  # command number -> when it was stopped (SIGTERM) for running too long
        killed = set()  # the stopped commands that SIGTERM did not end, sent SIGKILL
        reported = 0
        try:
            while True:
                finished = shell.poll() is not None
                for n, command in enumerate(commands):
                    if results[n]:
                        continue
                    start = status / f"{n}.start"
                    rc = read_end(status / f"{n}.end")
                    if rc is None and not (finished and start.exists()):
                        if start.exists() and n not in stopped and \
                                time.time() - start.stat().st_mtime > timeout:
                            stop(shell.pid, commands, status, n)
                            stopped[n] = time.monotonic()
                        continue
                    end = (status / f"{n}.end").stat().st_mtime if rc is not None else time.time()
                    log = status / f"{n}.log"
                    output = log.read_text(errors="replace") if log.exists() else ""
                    results[n] = Result(command, rc, end - start.stat().st_mtime, output,
                                        hung=n in stopped)
                while reported < len(commands) and results[reported]:
                    results[reported].problem = judge(results[reported])
                    report(results[reported])
                    reported += 1
                if finished:
                    break
                late = [n for n, when in stopped.items()
                        if not results[n] and time.monotonic() - when > 2 * GRACE]
                if late:
                    # Killing the command's processes did not end it (a loop in the shell
                    # itself): end the shell; what has not run is reported as not run.
                    os.killpg(shell.pid, signal.SIGKILL)
                    shell.wait()
                    continue
                for n, when in stopped.items():
                    if not results[n] and n not in killed and time.monotonic() - when > GRACE:
                        stop(shell.pid, commands, status, n, signal.SIGKILL)
                        killed.add(n)
                time.sleep(POLL)
        finally:
            try:
                os.killpg(shell.pid, signal.SIGKILL)  # whatever a command left running
            except ProcessLookupError:
                pass
            shell.wait()
        shell_log.seek(0)
        return shell.returncode, shell_log.read(), [r for r in results if r]


def stop(shell_pid, commands, status, n, signum=signal.SIGTERM):
    """Signal the processes of command n: a background command's subshell's children, or the
    shell's children that belong to no background command."""
    children = process_tree()
    pid_file = status / f"{n}.pid"
    if commands[n].background and pid_file.exists():
        signal_all(descendants(int(pid_file.read_text()), children), signum)
        return
    background = {int(p.read_text()) for p in status.glob("*.pid") if p.read_text().strip()}
    signal_all(descendants(shell_pid, children, skip=background), signum)


def default_files(root):
    lessons = sorted(p.relative_to(root).as_posix() for p in root.glob("[0-9][0-9]_*/README.md"))
    exercises = sorted(p.relative_to(root).as_posix() for p in root.glob("exercises/*.md"))
    return ["README.md", *lessons, "INSTRUCTORS.md", *exercises]


def duration(seconds):
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s"


def one_line(text, width=70):
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def report(result, failed, checked=None, say=print):
    """Say (print) one command's line, and for a failure what failed and the end of its output.
    checked, if given, keeps every result by its command's file:line."""
    if checked is not None:
        checked[result.command.where] = result
    say(f"{result.command.where:<36} {result.seconds:6.1f} s  {'ok  ' if result.ok else 'FAIL'}"
        f"  {one_line(result.command.shown)}")
    if not result.ok:
        failed.append(result)
        say(f"    {result.problem}\n    $ {result.command.shown.strip()}")
        tail = result.output.splitlines()[-OUTPUT_TAIL:]
        say(indent("\n".join(tail), "    | ") if tail else "    (no output)")


def read_outcomes(path):
    """{test id: outcomes} from the file that tests/conftest.py writes (PYTEST_OUTCOMES): a line
    per test and phase, `tests/file.py::test_name[parameters] outcome`."""
    outcomes = {}
    for line in Path(path).read_text().splitlines():
        nodeid, outcome = line.rsplit(" ", 1)
        outcomes.setdefault(nodeid.split("[")[0], set()).add(outcome)
    return outcomes


def test_verdict(run, outcomes):
    """The verdict of a command a test runs: ok if every phase of that test passed."""
    if outcomes is None:
        return None, "not checked (no pytest outcomes: --pytest-outcomes, as CI gives)"
    seen = outcomes.get(run.where, set())
    if seen == {"passed"}:
        return True, f"ok    as {run.where}"
    return False, f"FAIL  as {run.where}, which " + (
        f"ended {', '.join(sorted(seen - {'passed'}))}" if seen else "did not run")


def report_same_as(same_as, checked, files, outcomes=None):
    """After every file ran: print each command marked `same as` with the verdict of its match
    (see the docstring), and return how many failed. outcomes: read_outcomes's, or None."""
    if not same_as:
        return 0
    print(f"== the commands marked the same as another file's or a test's: {len(same_as)}",
          flush=True)
    failed = 0
    for command, original in same_as:
        result = checked.get(original.where)
        if isinstance(original, TestRun):
            ok, verdict = test_verdict(original, outcomes)
            failed += ok is False
        elif original.path not in files:
            verdict = f"not checked (this run does not check {original.path})"
        elif result and result.ok:
            verdict = f"ok    as {original.where}"
        else:
            failed += 1
            verdict = f"FAIL  as {original.where}" + ("" if result else ", which did not run")
        print(f"{command.where:<36} {verdict}  {one_line(command.shown)}", flush=True)
    print()
    return failed


# How long each file takes, in seconds, roughly (CI on the 2-core machine): for the order only,
# the longest first, so that the last files to start are short ones and two run together to the
# end. A file missing here counts as the longest and starts first. To refresh the numbers, copy
# the time column of the table the check prints at its end.
TYPICAL_SECONDS = {
    "INSTRUCTORS.md": 190, "README.md": 115, "10_pipeline_parallel/README.md": 90,
    "11_context_parallel/README.md": 90, "12_expert_parallel/README.md": 125,
    "13_capstone/README.md": 130, "exercises/13_which_dimension.md": 20,
    "06_ddp_in_practice/README.md": 60, "09_tensor_parallel/README.md": 60,
    "05_model_parallel_ddp/README.md": 55, "03_multi_node/README.md": 45,
    "02_multi_gpu_spawn/README.md": 40, "04_checkpointing/README.md": 35,
    "07_sharding/README.md": 35, "08_ddp_from_scratch/README.md": 25,
    "01_single_gpu/README.md": 20, "00_preflight/README.md": 20, "exercises/07_fsdp2.md": 20,
    "exercises/08_average_by_hand.md": 20, "exercises/README.md": 20,
    "exercises/02_ddp_with_spawn.md": 5, "exercises/03_global_ranks.md": 5,
    "exercises/04_snapshot_resume.md": 5, "exercises/09_tensor_parallel.md": 5,
    "exercises/10_pipeline_by_hand.md": 5,
}
# A fixed TCP port that a command names: --master-port 29513, MASTER_PORT=29513,
# --rdzv-endpoint 127.0.0.1:29400.
NAMED_PORT = re.compile(r"(?:--master[-_]port[= ]+|\bMASTER_PORT=|--rdzv[-_]endpoint[= ]+\S*:)"
                        r"(\d+)\b")
# The commands that take a fixed port without naming it, and the port.
UNNAMED_PORTS = [
    # lesson 03 with several nodes and no --master-port: rank 0 listens on 29500
    (re.compile(r"03_multi_node/train\.py\b(?!.*--master[-_]port).*--nnodes[= ]+(?!1\b)\d"),
     29500),
    # torchrun, unless --standalone (a free port) or the command names where to meet: 29500
    (re.compile(r"(?:\btorchrun|torch\.distributed\.run)\b"
                r"(?!.*(?:--standalone|--master[-_]port|--rdzv[-_]endpoint))"), 29500),
    # an --rdzv-endpoint without a port: the c10d rendezvous's default, 29400
    (re.compile(r"--rdzv[-_]endpoint[= ]+[^\s:]+(?!\S)"), 29400),
    # the preflight binds 29500 for a moment, to see whether lesson 03 could use it
    (re.compile(r"00_preflight/preflight\.py\b"), 29500),
]
# A file whose commands measure speed (a benchmark, a timed loop) says so in a line of its own,
# and runs with no other file beside it: on a 2-core machine a second file's ranks take the
# cores it times (beside another file, the README's quick benchmark and lesson 05's timed loop
# each ran past 300 s).
ALONE = re.compile(r"^<!-- listings: run alone \(.+\) -->$", re.MULTILINE)
PRINTING = threading.Lock()  # held while a file's lines are printed, so that no others cut in


def fixed_ports(listing):
    """The fixed TCP ports a file's commands listen on or connect to. Two files that share one
    never run at once: the second would find the port taken, or meet the first's rank 0."""
    ports = set()
    for command in listing.commands:
        for line in command.script.splitlines():
            ports.update(int(port) for port in NAMED_PORT.findall(line))
            ports.update(port for pattern, port in UNNAMED_PORTS if pattern.search(line))
    return ports


def announce(listing, say):
    """Say a file's first lines: how many commands, the conventions it breaks, what is not run."""
    say(f"== {listing.path}: {len(listing.commands)} commands, {len(listing.not_run)} blocks "
        f"marked not run")
    for line, message in listing.errors:
        say(f"{listing.path}:{line}  ERROR  {message}")
    for line, reason in listing.not_run:
        say(f"{listing.path}:{line}  not run ({reason})")
    for command, original in listing.same_as:
        say(f"{command.where}  same as {original.where}  {one_line(command.shown)}")


def check_file(root, listing, timeout, checked, live, alone=False, share=True):
    """Run one file's commands and print its lines: live, each as it comes; else all of them
    when the file is done, so that the lines of two files running at once never mix. Returns
    the file's failures (its commands' and the conventions it breaks) and its seconds."""
    lines = []
    say = partial(print, flush=True) if live else lines.append
    announce(listing, say)
    # In CI's last step a file waits for a slot (tools/ci_slots.py), and one marked ALONE for both.
    with SLOTS.held(2 if alone else 1):
        began, failed = time.monotonic(), []
        returncode, shell_output, results = run_listing(
            root, listing, timeout, partial(report, failed=failed, checked=checked, say=say),
            share)
    never_ran = len(listing.commands) - len(results)
    if never_ran:
        say(f"{listing.path}: the shell ended (status {returncode}) after {len(results)} of "
            f"{len(listing.commands)} commands; the other {never_ran} did not run, and fail")
        if shell_output.strip():
            say(indent(shell_output.strip(), "    | "))
    seconds = time.monotonic() - began
    say(f"== {listing.path}: {len(listing.commands)} commands, {len(failed) + never_ran} "
        f"failed, {len(listing.errors)} errors, {duration(seconds)}\n")
    with PRINTING:
        for line in lines:
            print(line, flush=True)
    return len(failed) + never_ran + len(listing.errors), seconds


def run_files(root, listings, timeout, jobs, checked, share=True):
    """Run the files (check_file), jobs at a time: the longest first (TYPICAL_SECONDS), never two at
    once that share a fixed port (fixed_ports), and a file marked ALONE beside no other. Returns
    each file's (failures, seconds), in the order given. Stopped (SIGTERM, Ctrl-C), it ends
    every running file's shell and lets the exception go on once each has removed its copy."""
    waiting = list(range(len(listings)))  # the files by their number in listings
    if jobs > 1:
        waiting.sort(key=lambda n: TYPICAL_SECONDS.get(listings[n].path, math.inf), reverse=True)
    ports = [fixed_ports(listing) for listing in listings]
    alone = [bool(ALONE.search((root / listing.path).read_text())) for listing in listings]
    outcomes, running = [None] * len(listings), {}  # running: each file's future -> its number
    with ThreadPoolExecutor(jobs) as pool:
        try:
            while waiting or running:
                taken = set().union(*(ports[n] for n in running.values()))
                free = [n for n in waiting if not ports[n] & taken and not (
                    running and (alone[n] or any(alone[r] for r in running.values())))]
                if free and len(running) < jobs:
                    n = free[0]
                    waiting.remove(n)
                    if jobs > 1:
                        with PRINTING:
                            print(f"-- started {listings[n].path}" + (
                                f" (fixed ports {', '.join(map(str, sorted(ports[n])))})"
                                if ports[n] else ""), flush=True)
                    running[pool.submit(check_file, root, listings[n], timeout, checked,
                                        jobs == 1, alone[n], share)] = n
                    continue
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    outcomes[running.pop(future)] = future.result()
        finally:
            # Stopped (or a file's run raised): a thread cannot be interrupted, so end each
            # running file's shell, whose end ends its run_listing (which then removes its
            # copy), and wait for every thread; a shell started meanwhile is ended next round.
            SLOTS.stopped.set()  # and a file still waiting for a slot starts not
            while running:
                stop_shells()
                done, _ = wait(running, timeout=POLL)
                for future in done:
                    del running[future]
    return outcomes


def stop_shells():
    """Kill every file's shell and all that its commands started: each shell is a child of this
    process that leads a process group of its own (run_listing starts it in a new session)."""
    for pid in process_tree().get(os.getpid(), []):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended meanwhile


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="markdown files, relative to --root (default: "
                        "README.md, every NN_*/README.md, INSTRUCTORS.md, exercises/*.md)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the repository whose files are checked and copied (default: this "
                        "one)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a command may run before it fails as hung (default: 300)")
    parser.add_argument("--list", action="store_true",
                        help="print the commands that would run, and the blocks marked not run; "
                        "run nothing")
    parser.add_argument("--jobs", type=int, default=2,
                        help="how many files run at a time (default: 2): the longest first, and "
                        "never two that use the same fixed port; 1 runs them one after another, "
                        "in order")
    parser.add_argument("--fresh", action="store_true",
                        help="run every command in a Python of its own, plain lesson runs too "
                        "(default: one Python per lesson and file for those)")
    parser.add_argument("--pytest-outcomes", type=Path,
                        help="the file of test outcomes that CI's pytest step wrote "
                        "(PYTEST_OUTCOMES): a command marked the same as a test file's passes "
                        "or fails with the test that runs it")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    # Stopped from outside (a cancelled CI job), end the way Ctrl-C does: the finally blocks
    # stop the shells' processes and remove the copies, rather than leave them running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("CI_SLOTS", None)  # the commands run inside this tool's slots (ci_slots.py)
    root = args.root.resolve()
    files = args.files or default_files(root)
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        parser.error(f"no such file under {root}: {', '.join(missing)}")

    began = time.monotonic()
    listings = [parse(name, (root / name).read_text(), root) for name in files]
    same_as = [pair for listing in listings for pair in listing.same_as]
    if args.list:
        for listing in listings:
            announce(listing, partial(print, flush=True))
            fresh_ones = set()
            for command in listing.commands:
                shared = not args.fresh and shared_run(command, fresh_ones)
                print(f"{command.where}  {'[background] ' * command.background}"
                      f"{'[one Python per lesson] ' * bool(shared)}"
                      f"{one_line(command.shown, 200)}")
        failures = sum(len(listing.errors) for listing in listings)
    else:
        checked = {}  # every command's result, by its file:line
        outcomes = run_files(root, listings, args.timeout, args.jobs, checked, not args.fresh)
        failures = sum(failed for failed, _ in outcomes)
        tests = read_outcomes(args.pytest_outcomes) if args.pytest_outcomes else None
        failures += report_same_as(same_as, checked, files, tests)
        print("file                                    commands  failed     time")
        for listing, (failed, seconds) in zip(listings, outcomes, strict=True):
            print(f"{listing.path:<40} {len(listing.commands):>8} {failed:>7} "
                  f"{duration(seconds):>12}")
    print(f"total: {duration(time.monotonic() - began)}, "
          f"{'no failures' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
