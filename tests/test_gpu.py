"""The GPU tier: the lessons on CUDA with NCCL. Skipped, with the reason, where there are no GPUs.

One GPU: every NCCL run uses world size 1. Two or more: world size 2 as well."""

import pytest

from helpers import (
    GPUS,
    assert_good_run,
    assert_one_line_error,
    evaluate_single_process,
    max_weight_difference,
    read_metrics,
    run_lesson,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible on this machine"),
]
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
NCCL_WORLD = min(GPUS, 2)


def test_lesson01_trains_on_the_gpu(lesson_run):
    result, out_dir = lesson_run("01_single_gpu", "--device", "cuda")
    metrics = assert_good_run(result, out_dir, world_size=1, min_accuracy=0.95)
    assert metrics["device"] == "cuda"


def test_lesson01_device_flag_overrides_the_gpu(lesson_run):
    result, out_dir = lesson_run("01_single_gpu", "--device", "cpu", "--epochs", 2)
    assert result.returncode == 0, result.stderr
    assert read_metrics(out_dir)["device"] == "cpu"


def test_lesson02_auto_picks_nccl_with_one_rank_per_gpu(lesson_run):
    result, out_dir = lesson_run("02_multi_gpu_spawn", "--world-size", NCCL_WORLD)
    metrics = assert_good_run(result, out_dir, world_size=NCCL_WORLD, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


@needs_two
def test_lesson02_nccl_math_matches_one_process(lesson_run):
    _, one = lesson_run("02_multi_gpu_spawn", "--backend", "nccl", "--world-size", 1,
                        "--batch-size", 32)
    _, two = lesson_run("02_multi_gpu_spawn", "--backend", "nccl", "--world-size", 2,
                        "--batch-size", 16)
    assert max_weight_difference(one, two) < 1e-4


def test_lesson02_nccl_with_more_ranks_than_gpus_is_refused(tmp_path):
    result = run_lesson("02_multi_gpu_spawn", "--backend", "nccl", "--world-size", GPUS + 1,
                        "--out-dir", tmp_path)
    assert_one_line_error(result, f"needs {GPUS + 1} GPUs", "--backend gloo")
