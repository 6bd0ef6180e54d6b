"""Lesson 01, run as a learner runs it: python 01_single_gpu/train.py."""

import pytest
import torch

from helpers import (
    GPUS,
    NO_GPUS,
    assert_good_run,
    assert_one_line_error,
    error_lines,
    evaluate_single_process,
    read_metrics,
    run_lesson,
    run_torchrun,
    small_disk,
)

LESSON = "01_single_gpu"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    # No arguments at all, from a fresh folder: the defaults must work and write to runs/.
    cwd = tmp_path_factory.mktemp("lesson01_default")
    return run_lesson(LESSON, cwd=cwd), cwd / "runs" / LESSON


def test_default_run_learns_the_wine_data(default_run):
    result, out_dir = default_run
    metrics = assert_good_run(result, out_dir, world_size=1, min_accuracy=0.95)
    assert metrics["device"] == ("cuda" if GPUS else "cpu")
    assert metrics["epochs"] == 20 and metrics["batch_size"] == 32


def test_final_weights_give_the_reported_accuracy(default_run):
    _, out_dir = default_run
    metrics = read_metrics(out_dir)
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], metrics["test_total"])


def test_checkpoint_is_written_every_save_every_epochs(lesson_run):
    result, out_dir = lesson_run(LESSON, "--epochs", 5, "--save-every", 2)
    assert result.returncode == 0, result.stderr
    checkpoint = torch.load(out_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["epochs_completed"] == 4  # saved after epochs 2 and 4, not after 5
    assert checkpoint["model"].keys() == torch.load(out_dir / "final.pt", weights_only=True).keys()
    assert not list(out_dir.glob("*.tmp")), "a temporary file was left behind"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--epochs", "-1"], "--epochs must be at least 1"),
        (["--lr", "0"], "--lr must be positive"),
        (["--device", "banana"], "use auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_input_gets_one_clear_line(args, fragment, tmp_path):
    assert_one_line_error(run_lesson(LESSON, *args, "--out-dir", tmp_path), fragment)


def test_cuda_without_a_gpu_is_refused(tmp_path):
    # The GPUs, if any, hidden: what a machine without one sees.
    result = run_lesson(LESSON, "--device", "cuda", "--out-dir", tmp_path, env=NO_GPUS)
    assert_one_line_error(result, "none is visible", "--device cpu")


def test_out_dir_that_is_a_file_gets_one_clear_line(tmp_path):
    path = tmp_path / "results"
    path.write_text("a file where the results folder should go\n")
    assert_one_line_error(run_lesson(LESSON, "--out-dir", path), f"--out-dir {path} is a file",
                          "choose another --out-dir")


def test_out_dir_on_a_read_only_filesystem_is_named_as_such(tmp_path):
    # Not "not writable by this user": no user can write there, and the fix is another folder.
    disk = tmp_path / "disk"
    with small_disk(disk) as make_read_only:
        make_read_only()
        result = run_lesson(LESSON, "--out-dir", disk)
    assert_one_line_error(result, f"--out-dir {disk} is on a read-only filesystem",
                          "choose another --out-dir")


def test_torchrun_is_named_as_the_wrong_launcher_once(tmp_path):
    # torchrun starts 2 copies of a one-process lesson: one line says how to start it instead.
    result = run_torchrun(LESSON, "--out-dir", tmp_path, nproc=2)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert "is not written for torchrun" in errors[0]
    assert "start it with: python " in errors[0] and "01_single_gpu/train.py" in errors[0]
    assert not (tmp_path / "metrics.json").exists()
