"""Run every command the course prints, in order, as a learner types them, and check each one.

    python tools/check_listings.py                               # every file below
    python tools/check_listings.py 02_multi_gpu_spawn/README.md  # one file
    python tools/check_listings.py --list                        # what would run; runs nothing

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
- A command is a line; a line ending in a backslash goes on to the next, a here-document
  (`python - <<'PY'` ... `PY`) belongs to the command that opens it, and so do the lines of an
  unfinished `if`, `for` or quote. A line that is only a comment is not run.
- A command must exit 0, unless its trailing comment starts with `# fails:`: then it must exit
  non-zero, and its output (stdout and stderr) must contain the text after `# fails:` verbatim.

      python 02_multi_gpu_spawn/train.py --world-size 0   # fails: --world-size must be at least 1

- A lesson run (python or torchrun starting NN_name/train.py) that exits 0 must print
  `test accuracy`, or say `nothing left to train` (a run that found a finished checkpoint),
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

The check is the CPU path, also on a machine with GPUs: every command sees
CUDA_VISIBLE_DEVICES="" (torch finds no GPU) and PYTHONUNBUFFERED=1, and none of the variables a
launcher or Slurm sets (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...), as in a fresh terminal.
`python` is the one on PATH when the check starts: activate the virtual environment first.

It prints one line per command (file:line, seconds, ok or FAIL), and for a failure the command
and the end of its output; then a line per file and the total time. It exits 1 if a command
failed or a file breaks the conventions. Needs bash, git and ps (Linux or macOS).
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OPEN_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
MARKER = re.compile(r"<!--\s*listing\b")
NOT_RUN = re.compile(r"^\s*<!--\s*listing:\s*not run\s*\((.*)\)\s*-->\s*$")
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
# A node other than node 0 (lesson 03's --node-rank, torchrun's): rank 0, which prints the result,
# runs on node 0.
OTHER_NODE = re.compile(r"--node[-_]rank[= ]+(?!0\b)\d+")
TRAINED = ("test accuracy", "nothing left to train")
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
class Listing:
    path: str
    commands: list = field(default_factory=list)
    not_run: list = field(default_factory=list)  # (line, reason) of each marked block
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


def parse(path, text):
    """The Listing of one markdown file: its commands to run, its marked blocks, its errors."""
    listing = Listing(path)
    lines = text.splitlines()
    marked = set()  # the line numbers of fences right after a marker, good or not
    outputs = {}  # the line number of a fence right after an output marker: that marker
    last_block = []  # the commands of the latest ```bash block that runs
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
            if not marker:
                listing.errors.append((i + 1, "a listing marker reads "
                                       "`<!-- listing: not run (the reason) -->`, with a reason"))
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


def bash_script(commands, status):
    """One bash script that runs every command in turn, in the same shell, each with its output
    in status/N.log; status/N.start is made as it starts, and status/N.end holds its exit status
    once it has ended. A background command runs in a subshell that writes its own N.end; its pid
    is in status/N.pid."""
    parts = []
    for n, command in enumerate(commands):
        files = {kind: shlex.quote(str(status / f"{n}.{kind}"))
                 for kind in ("start", "log", "end", "pid")}
        parts.append(f": > {files['start']}")
        if command.background:
            parts.append(f"{{ {{ {command.script}\n}} > {files['log']} 2>&1; "
                         f"printf '%s\\n' \"$?\" > {files['end']}; }} &")
            parts.append(f"printf '%s\\n' \"$!\" > {files['pid']}")
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
        return "a lesson run that exits 0 prints 'test accuracy' or says 'nothing left to train'"
    return ""


def run_listing(root, listing, timeout, report):
    """Run one file's commands in a fresh copy of root; report(result) is called for each, in
    the file's order, as soon as it and every command before it have ended."""
    commands = listing.commands
    results = [None] * len(commands)
    with ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="check_listings-"))
        repository, status = Path(scratch) / "repository", Path(scratch) / "status"
        copy_repository(root, repository)
        status.mkdir()
        script = Path(scratch) / "listing.sh"
        script.write_text(bash_script(commands, status))
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


def report(result, failed):
    """Print one command's line, and for a failure what failed and the end of its output."""
    print(f"{result.command.where:<36} {result.seconds:6.1f} s  {'ok  ' if result.ok else 'FAIL'}"
          f"  {one_line(result.command.shown)}", flush=True)
    if not result.ok:
        failed.append(result)
        print(f"    {result.problem}\n    $ {result.command.shown.strip()}")
        tail = result.output.splitlines()[-OUTPUT_TAIL:]
        print(indent("\n".join(tail), "    | ") if tail else "    (no output)", flush=True)


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
    args = parser.parse_args(argv)
    # Stopped from outside (a cancelled CI job), end the way Ctrl-C does: the finally blocks
    # stop the shell's processes and remove the copy, rather than leave them running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    root = args.root.resolve()
    files = args.files or default_files(root)
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        parser.error(f"no such file under {root}: {', '.join(missing)}")

    began = time.monotonic()
    failures, totals = 0, []
    for name in files:
        listing = parse(name, (root / name).read_text())
        print(f"== {name}: {len(listing.commands)} commands, {len(listing.not_run)} blocks "
              f"marked not run", flush=True)
        for line, message in listing.errors:
            print(f"{name}:{line}  ERROR  {message}", flush=True)
        failures += len(listing.errors)
        for line, reason in listing.not_run:
            print(f"{name}:{line}  not run ({reason})", flush=True)
        if args.list:
            for command in listing.commands:
                print(f"{command.where}  {'[background] ' * command.background}"
                      f"{one_line(command.shown, 200)}")
            continue
        file_began = time.monotonic()
        failed = []
        returncode, shell_output, results = run_listing(root, listing, args.timeout,
                                                    partial(report, failed=failed))
        never_ran = len(listing.commands) - len(results)
        if never_ran:
            print(f"{name}: the shell ended (status {returncode}) after {len(results)} of "
                  f"{len(listing.commands)} commands; the other {never_ran} did not run, "
                  f"and fail")
            if shell_output.strip():
                print(indent(shell_output.strip(), "    | "))
        seconds = time.monotonic() - file_began
        failures += len(failed) + never_ran
        totals.append((name, len(listing.commands),
                       len(failed) + never_ran + len(listing.errors), seconds))
        print(f"== {name}: {len(listing.commands)} commands, {len(failed) + never_ran} failed, "
              f"{len(listing.errors)} errors, {duration(seconds)}\n", flush=True)

    if not args.list:
        print("file                                    commands  failed     time")
        for name, count, failed, seconds in totals:
            print(f"{name:<40} {count:>8} {failed:>7} {duration(seconds):>12}")
    print(f"total: {duration(time.monotonic() - began)}, "
          f"{'no failures' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
