"""The listings check (tools/check_listings.py) on tiny markdown files in a scratch repository:
it must fail what breaks the conventions and pass what keeps them. No lesson runs here."""

import os
import subprocess
import sys
import textwrap

from helpers import ROOT

FAKE_LESSON = "import sys\nprint(sys.argv[1] if len(sys.argv) > 1 else 'trained, says nothing')\n"


def check(tmp_path, markdown, *args, files=None):
    """Make a git repository in tmp_path/repo with README.md (and files: {name: text}), run the
    check on it and return the finished process."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "README.md").write_text(textwrap.dedent(markdown))
    for name, text in (files or {}).items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    # `python` in a listing is this interpreter, as it is for a learner in the activated venv.
    env = {**os.environ,
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "check_listings.py"),
                           "--root", str(repo), *args, "README.md"],
                          capture_output=True, text=True, env=env, timeout=60)


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
