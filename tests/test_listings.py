"""The listings check (tools/check_listings.py) on tiny markdown files in a scratch repository:
it must fail what breaks the conventions and pass what keeps them. No lesson runs here."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import ROOT

FAKE_LESSON = "import sys\nprint(sys.argv[1] if len(sys.argv) > 1 else 'trained, says nothing')\n"


def check(tmp_path, markdown, *args, files=None, name="README.md"):
    """Make a git repository in tmp_path/repo with README.md, or the markdown file name (and
    files: {name: text}), run the check on it and return the finished process."""
    return subprocess.run(**check_command(tmp_path, markdown, *args, files=files, name=name),
                          capture_output=True, text=True, timeout=60)


def check_command(tmp_path, markdown, *args, files=None, name="README.md"):
    """Make the repository (see check) and return the check's command line and environment."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(textwrap.dedent(markdown))
    for path, text in (files or {}).items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    # `python` in a listing is this interpreter, as it is for a learner in the activated venv.
    env = {**os.environ,
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    return {"args": [sys.executable, str(ROOT / "tools" / "check_listings.py"), "--root",
                     str(repo), *args, name], "env": env}


def lines_of(result, status):
    """The README.md:N lines of the commands reported with status (ok or FAIL)."""
    return [line.split()[0] for line in result.stdout.splitlines()
            if line.startswith("README.md:") and f" {status} " in f"{line} "]


def test_commands_that_keep_their_word_pass(tmp_path):
    result = check(tmp_path, """\
        # A listing

        ```bash
        true
        echo "a # in quotes is no comment"   # but this is one
        # a line that is only a comment is not run
        sh -c 'echo broken >&2; exit 2'      # fails: broken
        ls no-such-file                      # fails: no-such-file
        echo one \\
            two
        ```
        """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines_of(result, "ok") == ["README.md:4", "README.md:5", "README.md:7",
                                      "README.md:8", "README.md:9"]
    assert "total:" in result.stdout


def test_a_failing_command_fails_the_check_and_the_rest_still_runs(tmp_path):
    result = check(tmp_path, """\
        ```bash
        echo before
        false
        echo after
        ```
        """)
    assert result.returncode == 1
    assert lines_of(result, "FAIL") == ["README.md:3"]
    assert lines_of(result, "ok") == ["README.md:2", "README.md:4"]
    assert "exit 1" in result.stdout


def test_fails_comment_needs_a_failure_and_its_text(tmp_path):
    result = check(tmp_path, """\
        ```bash
        true                                 # fails: anything
        echo "the real message" && false     # fails: another message
        echo "the real message" && false     # fails: real message
        ```
        """)
    assert result.returncode == 1
    assert lines_of(result, "FAIL") == ["README.md:2", "README.md:3"]
    assert "exit 0, but its comment says it fails" in result.stdout
    assert "the output lacks 'another message'" in result.stdout
    assert lines_of(result, "ok") == ["README.md:4"]


def test_not_run_marker_skips_a_block_and_needs_a_reason(tmp_path):
    marked = """\
        <!-- listing: not run (needs 2 GPUs) -->
        ```bash
        false
        ```

        <!-- output: illustrative (a text block never runs) -->
        ```text
        false
        ```
        """
    result = check(tmp_path, marked)
    assert result.returncode == 0, result.stdout
    assert "README.md:2  not run (needs 2 GPUs)" in result.stdout
    assert lines_of(result, "FAIL") == lines_of(result, "ok") == []

    without_reason = marked.replace(" (needs 2 GPUs)", "")
    result = check(tmp_path / "no_reason", without_reason)
    assert result.returncode == 1
    assert "README.md:1  ERROR" in result.stdout
    assert lines_of(result, "FAIL") == []  # the block is still not run


SHOWN = """\
    ```bash
    printf 'step 1: loss 0.75 (3.2 s)\\nstep 2: loss 0.50 (2.9 s)\\ndone\\n'   # three lines
    echo "difference: 0.0"
    echo "the last"
    ```

    <!-- output of `three lines`: exact lines -->
    ```text
    step 1: loss 0.75 (… s)
    ...
    done
    ```

    <!-- output of `echo`: exact lines -->
    ```text
    difference: 0.0
    ```

    <!-- output: exact lines -->
    ```text
    the last
    ```
    """


def test_shown_output_with_its_marks_for_what_varies_passes(tmp_path):
    result = check(tmp_path, SHOWN)
    assert result.returncode == 0, result.stdout
    assert lines_of(result, "ok") == ["README.md:2", "README.md:3", "README.md:4"]


def test_shown_output_that_differs_from_the_printed_fails(tmp_path):
    for n, (shown, wrong) in enumerate([("difference: 0.0", "difference: 0.1"),
                                        ("loss 0.75 (… s)", "loss 0.74 (… s)"),
                                        ("...\n    done", "done")]):
        result = check(tmp_path / str(n), SHOWN.replace(shown, wrong, 1))
        assert result.returncode == 1, result.stdout
        assert len(lines_of(result, "FAIL")) == 1, result.stdout
        assert "is not what it printed" in result.stdout
    result = check(tmp_path / "unmarked", SHOWN.replace("<!-- output: exact lines -->", ""))
    assert result.returncode == 1
    assert "README.md:20  ERROR  a ```text block has" in result.stdout


def test_state_carries_across_blocks_of_one_file(tmp_path):
    result = check(tmp_path, """\
        ```bash
        export GREETING=hello
        cd sub
        ```

        Some prose between the blocks.

        ```bash
        test "$GREETING" = hello
        test -f only_in_sub
        ```
        """, files={"sub/only_in_sub": ""})
    assert result.returncode == 0, result.stdout
    assert len(lines_of(result, "ok")) == 4


def test_runs_in_a_copy_without_runs_or_ignored_files(tmp_path):
    result = check(tmp_path, """\
        ```bash
        test -f tracked.txt && test ! -e runs && test ! -e ignored.txt
        echo written > written_by_the_listing.txt
        ```
        """, files={"tracked.txt": "", "runs/old/metrics.json": "{}", "ignored.txt": "",
                    ".gitignore": "ignored.txt\nruns/\n"})
    assert result.returncode == 0, result.stdout
    assert not (tmp_path / "repo" / "written_by_the_listing.txt").exists()


def test_background_commands_and_wait(tmp_path):
    result = check(tmp_path, """\
        ```bash
        (sleep 0.3; echo late) > late.txt &
        (sleep 0.2; exit 3) &
        wait
        grep late late.txt
        ```
        """)
    assert result.returncode == 1
    assert lines_of(result, "ok") == ["README.md:2", "README.md:4", "README.md:5"]
    assert lines_of(result, "FAIL") == ["README.md:3"]
    assert "exit 3" in result.stdout


def test_a_hung_command_is_stopped_and_the_rest_runs(tmp_path):
    result = check(tmp_path, """\
        ```bash
        sleep 60
        echo after
        ```
        """, "--timeout", "1")
    assert result.returncode == 1
    assert lines_of(result, "FAIL") == ["README.md:2"]
    assert "hung" in result.stdout
    assert lines_of(result, "ok") == ["README.md:3"]


# A lesson in SHARED_STARTS, faked: it notes which Python ran it, then says what it was asked.
FAKE_SHARED_LESSON = """\
import os, sys, time
import guard_rails  # the runner imports it first, as every lesson's train.py does
with open(os.environ["PIDS_FILE"], "a") as pids:
    print(os.getpid(), *sys.argv[1:], os.environ.get("SEEN", "-"), file=pids)
if "--hang" in sys.argv:
    time.sleep(60)
if "--bad" in sys.argv:
    sys.exit("error: --bad is refused")
print("test accuracy: 36/36 as asked:", *sys.argv[1:])
"""
FAKE_GUARD_RAILS = "def leave_quickly():\n    pass\n\n\ndef port_in_use(port):\n    return False\n"


def gone(pid):
    """Whether a process has ended (a zombie that its new parent has not reaped has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def test_plain_runs_of_a_lesson_share_one_python_per_file_and_end_with_it(tmp_path,
                                                                          monkeypatch):
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    markdown = """\
        ```bash
        python 02_multi_gpu_spawn/train.py --epochs 1
        python 02_multi_gpu_spawn/train.py --epochs 2 --out-dir runs/x
        python 02_multi_gpu_spawn/train.py --bad   # fails: error: --bad is refused
        python 02_multi_gpu_spawn/train.py --hang
        python 02_multi_gpu_spawn/train.py --epochs 3
        SEEN=prefix python 02_multi_gpu_spawn/train.py --epochs 4
        export SEEN=exported
        python 02_multi_gpu_spawn/train.py --epochs 5
        ```

        <!-- output: exact lines -->
        ```text
        test accuracy: 36/36 as asked: --epochs 5
        ```
        """
    files = {"02_multi_gpu_spawn/train.py": FAKE_SHARED_LESSON,
             "02_multi_gpu_spawn/guard_rails.py": FAKE_GUARD_RAILS}
    result = check(tmp_path, markdown, "--timeout", "3", files=files)
    assert lines_of(result, "FAIL") == ["README.md:5"], result.stdout  # --hang, stopped
    assert "hung" in result.stdout
    assert result.returncode == 1
    runs = [line.split() for line in pids_file.read_text().splitlines()]
    assert [run[1:] for run in runs] == [
        ["--epochs", "1", "-"], ["--epochs", "2", "--out-dir", "runs/x", "-"], ["--bad", "-"],
        ["--hang", "-"], ["--epochs", "3", "-"], ["--epochs", "4", "prefix"],
        ["--epochs", "5", "exported"]]
    pids = [run[0] for run in runs]
    # One Python for the first four; the hung run's ends with it, so a new one for --epochs 3;
    # a run with an environment of its own is a fresh Python, and a changed one a new runner.
    assert pids[0] == pids[1] == pids[2] == pids[3]
    assert len({pids[3], pids[4], pids[5], pids[6]}) == 4
    assert all(gone(pid) for pid in set(pids)), "a runner outlived its file"

    pids_file.unlink()
    result = check(tmp_path / "fresh", markdown, "--timeout", "3", "--fresh", files=files)
    assert lines_of(result, "FAIL") == ["README.md:5"], result.stdout
    assert len({line.split()[0] for line in pids_file.read_text().splitlines()}) == 7

    # In the lesson's own README, its first plain run is a fresh Python, as typed; the next
    # ones share one.
    pids_file.unlink()
    result = check(tmp_path / "own", markdown.replace("--hang", "--epochs 9"), files=files,
                   name="02_multi_gpu_spawn/README.md")
    assert result.returncode == 0, result.stdout
    pids = [line.split()[0] for line in pids_file.read_text().splitlines()]
    assert pids[0] != pids[1] == pids[2] == pids[3] == pids[4]


def test_a_lesson_run_that_trains_nothing_silently_is_flagged(tmp_path):
    result = check(tmp_path, """\
        ```bash
        python 09_fake/train.py
        python 09_fake/train.py "nothing left to train: epoch 20 of 20 is done"
        python 09_fake/train.py "test accuracy: 36/36"
        python 09_fake/train.py --help
        python not_a_lesson.py
        python 09_fake/train.py --nnodes 2 --node-rank 1
        python 09_fake/train.py --nnodes 2 --node-rank 0
        python not_a_lesson.py 02 09_fake/train.py
        ```
        """, files={"09_fake/train.py": FAKE_LESSON, "not_a_lesson.py": FAKE_LESSON})
    assert result.returncode == 1
    # Node 1 has no rank 0 to print the result; node 0 does, and says nothing here. A script
    # given a lesson's path (the exercises' checker) is not a lesson run.
    assert lines_of(result, "FAIL") == ["README.md:2", "README.md:8"]
    assert "a lesson run that exits 0 prints 'test accuracy'" in result.stdout
    assert lines_of(result, "ok") == ["README.md:3", "README.md:4", "README.md:5",
                                      "README.md:6", "README.md:7", "README.md:9"]


def test_a_command_that_names_another_machine_is_refused_unrun(tmp_path):
    # Its traffic would leave this machine: the block must be marked not run.
    result = check(tmp_path, """\
        ```bash
        echo --master-addr 127.0.0.1 localhost
        touch reached-1 # --master-addr 10.0.0.1
        touch reached-2 --rdzv-endpoint node0:29500
        ```
        """)
    assert result.returncode == 1
    assert lines_of(result, "ok") == ["README.md:2", "README.md:3"]
    assert "README.md:4  ERROR  this command reaches node0" in result.stdout


def test_the_course_files_keep_the_conventions():
    # Parsing only (--list runs nothing): every marker has its reason, every command is whole.
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_listings.py"),
                             "--list"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout


# Files side by side (--jobs, 2 by default). The files' commands meet in `shared`, a folder
# outside the copies of the repository that the check runs them in.

def side_by_side(tmp_path, readme, other, *args, files=None):
    """Run the check on README.md and other.md (in that order on the command line: other.md
    first), with each file's text given whole."""
    return check(tmp_path, readme, *args, "other.md", files={"other.md": other, **(files or {})})


def command_lines(result, name, status):
    """The name:N lines of the commands of file name reported with status (ok or FAIL)."""
    return [line.split()[0] for line in result.stdout.splitlines()
            if line.startswith(f"{name}:") and f" {status} " in f"{line} "]


def assert_whole_blocks(result, names):
    """Each file's lines come together, from its first `== name:` line to its last: no line
    of another file among them."""
    lines = result.stdout.splitlines()
    for name in names:
        mine = [i for i, line in enumerate(lines) if line.startswith(f"== {name}:")]
        for line in lines[mine[0]:mine[-1] + 1]:
            assert line.startswith((f"{name}:", f"== {name}:", "    ")) or not line, line


def test_two_files_run_at_the_same_time(tmp_path):
    # Each file marks that it has started, then waits up to 3 s for the other's mark: both pass
    # only if they run together.
    def meets(shared, mine, theirs):
        return (f"```bash\ntouch {shared}/{mine}\n"
                f"for _ in $(seq 60); do test -e {shared}/{theirs} && break; sleep 0.05; done; "
                f"test -e {shared}/{theirs}\n```\n")

    runs = {}
    for jobs in ("2", "1"):
        shared = tmp_path / jobs / "shared"
        shared.mkdir(parents=True)
        runs[jobs] = side_by_side(tmp_path / jobs, meets(shared, "README", "other"),
                                  meets(shared, "other", "README"), "--jobs", jobs)
    together = runs["2"]
    assert together.returncode == 0, together.stdout
    assert command_lines(together, "README.md", "ok") == ["README.md:2", "README.md:3"]
    assert command_lines(together, "other.md", "ok") == ["other.md:2", "other.md:3"]
    assert "-- started other.md\n-- started README.md\n" in together.stdout
    assert_whole_blocks(together, ["README.md", "other.md"])
    # The control, one at a time in the order given: other.md waits for README.md in vain.
    alone = runs["1"]
    assert alone.returncode == 1, alone.stdout
    assert command_lines(alone, "other.md", "FAIL") == ["other.md:3"]
    assert command_lines(alone, "README.md", "ok") == ["README.md:2", "README.md:3"]
    assert "-- started" not in alone.stdout


RECORD = """\
import sys, time
start = time.time()
time.sleep(1)
with open(sys.argv[1], "w") as out:
    print(start, time.time(), file=out)
"""


def ran_together(shared):
    """Whether the commands that RECORD timed, into shared/README and shared/other, overlapped."""
    (began, ended), (other_began, other_ended) = (
        map(float, (shared / name).read_text().split()) for name in ("README", "other"))
    return began < other_ended and other_began < ended


def test_files_that_use_the_same_fixed_port_never_run_at_once(tmp_path):
    # Each file's command records when it ran. The preflight takes 29500 without naming it.
    pairs = {  # README.md's command, other.md's, and whether they must run apart
        "named": ("python record.py {}/README --master-port 29599",
                  "python record.py {}/other --master-port=29599", True),
        "one named, one not": ("MASTER_PORT=29500 python record.py {}/README",
                               "python 00_preflight/preflight.py {}/other", True),
        "two ports": ("python record.py {}/README --master-port 29598",
                      "python record.py {}/other --master-port 29599", False),
    }
    for n, (case, (readme, other, apart)) in enumerate(pairs.items()):
        shared = tmp_path / str(n) / "shared"
        shared.mkdir(parents=True)
        result = side_by_side(tmp_path / str(n), f"```bash\n{readme.format(shared)}\n```\n",
                              f"```bash\n{other.format(shared)}\n```\n",
                              files={"record.py": RECORD, "00_preflight/preflight.py": RECORD})
        assert result.returncode == 0, result.stdout
        assert ran_together(shared) != apart, (case, result.stdout)
    assert "-- started other.md (fixed ports 29599)\n" in result.stdout


def test_a_file_marked_to_run_alone_runs_beside_no_other(tmp_path):
    # A file that times its commands says so; the control is the same two files unmarked.
    marker = "<!-- listings: run alone (it times a loop) -->\n\n"
    for n, (mark, apart) in enumerate([(marker, True), ("", False)]):
        shared = tmp_path / str(n) / "shared"
        shared.mkdir(parents=True)
        result = side_by_side(tmp_path / str(n),
                              f"{mark}```bash\npython record.py {shared}/README\n```\n",
                              f"```bash\npython record.py {shared}/other\n```\n",
                              files={"record.py": RECORD})
        assert result.returncode == 0, result.stdout
        assert ran_together(shared) != apart, (mark, result.stdout)


def test_a_failure_in_one_file_fails_the_check_and_the_other_file_still_runs(tmp_path):
    result = side_by_side(tmp_path, "```bash\necho before\nfalse\n```\n",
                          "```bash\nsleep 0.5\necho done\n```\n")
    assert result.returncode == 1, result.stdout
    assert command_lines(result, "README.md", "FAIL") == ["README.md:3"]
    assert "    exit 1\n    $ false\n    (no output)\n" in result.stdout
    assert command_lines(result, "other.md", "ok") == ["other.md:2", "other.md:3"]
    assert_whole_blocks(result, ["README.md", "other.md"])
    rows = {line.split()[0]: line.split()[1:3] for line in result.stdout.splitlines()
            if line.endswith(" s") and line.split()[0] in ("README.md", "other.md")}
    assert rows == {"other.md": ["2", "0"], "README.md": ["2", "1"]}  # commands, failed
    assert "total: " in result.stdout and ", 1 failed" in result.stdout


def test_sigterm_stops_every_running_file_and_removes_the_copies(tmp_path):
    shared, temporary = tmp_path / "shared", tmp_path / "tmp"
    shared.mkdir()
    temporary.mkdir()

    def sleeper(name):
        return f"```bash\nsh -c 'echo $$ > {shared}/{name}.pid; exec sleep 60'\n```\n"

    command = check_command(tmp_path, sleeper("README"), "other.md",
                            files={"other.md": sleeper("other")})
    command["env"]["TMPDIR"] = str(temporary)  # where the check makes its copies
    checking = subprocess.Popen(**command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    pid_files = [shared / "README.pid", shared / "other.pid"]
    deadline = time.monotonic() + 30
    while not all(path.exists() and path.read_text().strip() for path in pid_files):
        assert checking.poll() is None and time.monotonic() < deadline, checking.stdout.read()
        time.sleep(0.05)
    assert len(list(temporary.iterdir())) == 2  # both files run, each in its copy
    checking.send_signal(signal.SIGTERM)
    output, _ = checking.communicate(timeout=30)
    assert checking.returncode == 128 + signal.SIGTERM, output
    for path in pid_files:
        stat = subprocess.run(["ps", "-o", "stat=", "-p", path.read_text().strip()],
                              capture_output=True, text=True).stdout.strip()
        assert not stat or stat.startswith("Z"), f"{path.name}: still running ({stat})"
    assert list(temporary.iterdir()) == []



# A block marked `same as`: its commands run in the file it names, not here.

GUIDE = """\
```bash
touch made-by-the-guide
echo "shown twice"                    # a comment of its own
sh -c 'echo three; exit 3'            # fails: three
```
"""


def test_same_as_skips_a_block_that_another_file_runs(tmp_path):
    result = check(tmp_path, """\
        <!-- listing: same as INSTRUCTORS.md -->
        ```bash
        touch made-by-the-guide
        echo "shown twice"
        ```

        ```bash
        test ! -e made-by-the-guide
        ```
        """, "INSTRUCTORS.md", files={"INSTRUCTORS.md": GUIDE})
    assert result.returncode == 0, result.stdout
    assert "README.md:3  same as INSTRUCTORS.md:2" in result.stdout
    assert "README.md:4  same as INSTRUCTORS.md:3" in result.stdout
    # Not run in README.md's copy (it made no file there), and ok as their matches were.
    assert sorted(lines_of(result, "ok")) == ["README.md:3", "README.md:4", "README.md:8"]
    assert "ok    as INSTRUCTORS.md:2" in result.stdout

    # Checked alone, README.md cannot tell: its marked commands are reported not checked.
    alone = check(tmp_path / "alone", """\
        <!-- listing: same as INSTRUCTORS.md -->
        ```bash
        echo "shown twice"
        ```
        """, files={"INSTRUCTORS.md": GUIDE})
    assert alone.returncode == 0, alone.stdout
    assert "not checked (this run does not check INSTRUCTORS.md)" in alone.stdout


def test_same_as_fails_with_the_command_it_names(tmp_path):
    # The guide's command does not print what its comment says: it fails, and so does its copy.
    result = check(tmp_path, """\
        <!-- listing: same as INSTRUCTORS.md -->
        ```bash
        sh -c 'echo three; exit 3'   # fails: four
        ```
        """, "INSTRUCTORS.md", files={"INSTRUCTORS.md": GUIDE.replace("three\n", "four\n")})
    assert result.returncode == 1
    assert "the output lacks 'four'" in result.stdout
    assert lines_of(result, "FAIL") == ["README.md:3"]
    assert "FAIL  as INSTRUCTORS.md:4" in result.stdout


def test_same_as_needs_the_very_command_in_a_file_the_check_runs(tmp_path):
    for n, (block, error) in enumerate([
            ('echo "shown  twice"', '`echo "shown  twice"` is not a command of INSTRUCTORS.md; '
             "run it here or name the file that runs it"),
            ("sh -c 'echo three; exit 3'   # fails: 3", "is not a command of INSTRUCTORS.md"),
            ("touch made-by-the-guide &", "is not a command of INSTRUCTORS.md")]):
        result = check(tmp_path / str(n), f"""\
            <!-- listing: same as INSTRUCTORS.md -->
            ```bash
            {block}
            ```
            """, "--list", files={"INSTRUCTORS.md": GUIDE})
        assert result.returncode == 1, result.stdout
        assert "README.md:3  ERROR  " in result.stdout and error in result.stdout, result.stdout
    result = check(tmp_path / "unchecked", """\
        <!-- listing: same as notes.md -->
        ```bash
        touch made-by-the-guide
        ```
        """, "--list", files={"notes.md": GUIDE})
    assert result.returncode == 1
    assert "README.md:1  ERROR  same as notes.md: not one of the files this check runs" \
        in result.stdout


# A block marked `same as` a test file: the test that runs each command as it stands proves it.

DEMO_TESTS = """\
def run_demo(name):
    ...


def test_a():
    run_demo("a.py")


def test_b():
    assert run_demo("b.py")
"""


def test_same_as_a_test_file_passes_or_fails_with_the_test_that_runs_it(tmp_path):
    markdown = """\
        <!-- listing: same as tests/test_troubleshooting.py -->
        ```bash
        python troubleshooting/a.py      # 10:00 (the demos do not exist: run, they would fail)
        python troubleshooting/b.py
        ```
        """
    outcomes = tmp_path / "outcomes"
    outcomes.write_text("tests/test_troubleshooting.py::test_a passed\n"
                        "tests/test_troubleshooting.py::test_b passed\n")
    files = {"tests/test_troubleshooting.py": DEMO_TESTS}
    result = check(tmp_path / "passed", markdown, "--pytest-outcomes", outcomes, files=files)
    assert result.returncode == 0, result.stdout
    assert "README.md:3  same as tests/test_troubleshooting.py::test_a" in result.stdout
    assert "ok    as tests/test_troubleshooting.py::test_b" in result.stdout
    # A test that failed (in its teardown, here), or did not run, fails its command.
    outcomes.write_text("tests/test_troubleshooting.py::test_b passed\n"
                        "tests/test_troubleshooting.py::test_b failed\n")
    result = check(tmp_path / "failed", markdown, "--pytest-outcomes", outcomes, files=files)
    assert result.returncode == 1, result.stdout
    assert "FAIL  as tests/test_troubleshooting.py::test_a, which did not run" in result.stdout
    assert "FAIL  as tests/test_troubleshooting.py::test_b, which ended failed" in result.stdout
    # Without the outcomes of a pytest run, it cannot tell.
    result = check(tmp_path / "alone", markdown, files=files)
    assert result.returncode == 0, result.stdout
    assert "not checked (no pytest outcomes" in result.stdout
    # A command that no test runs as it stands is an error, not a pass.
    for n, block in enumerate(["python troubleshooting/c.py", "python troubleshooting/a.py &",
                               "python troubleshooting/a.py --fast"]):
        result = check(tmp_path / str(n), f"""\
            <!-- listing: same as tests/test_troubleshooting.py -->
            ```bash
            {block}
            ```
            """, "--list", files=files)
        assert result.returncode == 1, result.stdout
        assert ("README.md:3  ERROR  " in result.stdout and "is not a command that "
                "tests/test_troubleshooting.py runs as it stands" in result.stdout), result.stdout


def test_the_demo_tests_run_each_demo_as_the_guide_shows_it(monkeypatch):
    # check_listings.TEST_COMMANDS reads run_demo("hang.py") as `python troubleshooting/hang.py`,
    # run from the repository's root: so it must stay.
    import test_troubleshooting

    ran = []
    monkeypatch.setattr(test_troubleshooting.subprocess, "run", lambda command, **kwargs: (
        ran.append((command, kwargs["cwd"])) or subprocess.CompletedProcess(command, 0, "", "")))
    test_troubleshooting.run_demo("hang.py")
    assert ran == [([sys.executable, str(ROOT / "troubleshooting" / "hang.py")], ROOT)]


def test_the_pytest_step_writes_each_tests_outcome(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from conftest import pytest_runtest_logreport

    monkeypatch.setenv("PYTEST_OUTCOMES", str(tmp_path / "outcomes"))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    for when, outcome in [("setup", "passed"), ("call", "passed"), ("teardown", "failed"),
                          ("setup", "skipped")]:
        pytest_runtest_logreport(SimpleNamespace(nodeid="tests/t.py::test_x", when=when,
                                                 outcome=outcome))
    assert (tmp_path / "outcomes").read_text().splitlines() == [
        "tests/t.py::test_x passed", "tests/t.py::test_x failed", "tests/t.py::test_x skipped"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker leaves it to the controller
    pytest_runtest_logreport(SimpleNamespace(nodeid="tests/t.py::test_y", when="call",
                                             outcome="passed"))
    assert "test_y" not in (tmp_path / "outcomes").read_text()
