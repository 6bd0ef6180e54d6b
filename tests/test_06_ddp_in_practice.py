"""Lesson 06, run as a learner runs it: mixed precision, accumulation, clipping, compile, scale-lr.

The CPU tier runs 2 gloo ranks (and 1 for the single-process reference). Most tests look at the
same few runs from different sides (the lesson_run cache launches each once). The GPU tier, at
the end, is skipped with the reason where no CUDA GPU is visible."""

import contextlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from helpers import (
    GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    evaluate_single_process,
    import_lesson,
    max_weight_difference,
    read_metrics,
    run_lesson,
)

LESSON = "06_ddp_in_practice"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
# Clipping at 0.5 is active in the first steps only (the gradient norm starts near 1.1 and falls
# to about 0.01): a step size that depends on the gradient's scale, which Adam alone would hide.
CLIP = ["--clip-grad-norm", 0.5]
ACCUMULATED = [*CPU, *CLIP, "--world-size", 2, "--batch-size", 8, "--accumulate", 2]
TWO_RANKS = [*CPU, *CLIP, "--world-size", 2, "--batch-size", 16]
ONE_RANK = [*CPU, *CLIP, "--world-size", 1, "--batch-size", 32]
EPOCHS = 20


def grad_norms(out_dir, rank=0):
    return read_metrics(out_dir)["ranks"][rank]["grad_norms"]


def same_trajectory(a, b, tolerance=1e-5):
    """The gradient norm at every step (relative) and the final weights agree."""
    norms_a, norms_b = grad_norms(a), grad_norms(b)
    if len(norms_a) != len(norms_b):
        return False
    worst = max(abs(x - y) / y for x, y in zip(norms_a, norms_b, strict=True))
    return worst < tolerance and max_weight_difference(a, b) < tolerance


def all_reduce_counts(result):
    """{rank: (all-reduces, optimizer steps)} from the count-all-reduces patch's lines."""
    found = re.findall(r"rank (\d+): (\d+) gradient all-reduces in (\d+) optimizer steps",
                       result.stdout)
    return {int(rank): (int(count), int(steps)) for rank, count, steps in found}


@pytest.fixture(scope="module")
def accumulated(lesson_run):
    # The DDP comm hook that counts is DDP's own allreduce_hook (sum, divided by world size).
    return lesson_run(LESSON, *ACCUMULATED, patch="count-all-reduces")


def test_two_ranks_learn_and_measure_every_phase(lesson_run):
    result, out_dir = lesson_run(LESSON, *TWO_RANKS)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert (metrics["global_batch"], metrics["optimizer_steps"]) == (32, EPOCHS * 5)
    # Rank 0 gathered every rank's phase times and peak memory into metrics.json and the log.
    ranks = metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        phases = [r[f"{name}_seconds"] for name in ("data", "forward", "backward", "optimizer")]
        assert all(seconds > 0 for seconds in phases), r
        assert sum(phases) <= metrics["train_seconds"]
        assert r["peak_memory_mib"] > 50  # a process that has imported torch, at the least
    assert metrics["samples_per_second"] > 0
    assert "backward+all-reduce s" in result.stdout
    assert "samples/s over all ranks, 100 optimizer steps" in result.stdout


def test_accumulation_equals_the_big_batch(lesson_run, accumulated):
    # 2 ranks x 8 x 2 micro-batches, 2 ranks x 16, 1 rank x 32: the same steps on the same
    # 32 wines, so the same gradient norm at every step and the same final weights.
    result, accumulated_dir = accumulated
    assert_good_run(result, accumulated_dir, world_size=2, min_accuracy=0.95)
    _, two_ranks = lesson_run(LESSON, *TWO_RANKS)
    _, one_rank = lesson_run(LESSON, *ONE_RANK)
    assert read_metrics(accumulated_dir)["optimizer_steps"] == EPOCHS * 5
    assert same_trajectory(accumulated_dir, two_ranks)
    assert same_trajectory(accumulated_dir, one_rank)


@pytest.mark.parametrize("mistake", ["loss-not-divided", "step-every-micro-batch"])
def test_accumulation_mistakes_fail_the_same_comparison(lesson_run, mistake):
    result, wrong = lesson_run(LESSON, *ACCUMULATED, patch=mistake)
    assert result.returncode == 0, result.stderr
    _, two_ranks = lesson_run(LESSON, *TWO_RANKS)
    assert not same_trajectory(wrong, two_ranks)
    # Not only the norms: the weights end elsewhere too (clipping sees the gradient's scale).
    assert max_weight_difference(wrong, two_ranks) > 1e-3


def test_one_all_reduce_per_optimizer_step_with_no_sync(accumulated):
    result, _ = accumulated
    steps = EPOCHS * 5
    assert all_reduce_counts(result) == {0: (steps, steps), 1: (steps, steps)}


def test_without_no_sync_every_micro_batch_all_reduces(tmp_path, monkeypatch):
    # In this process, with a group of one rank, the lesson's own train_step with 4
    # micro-batches: one all-reduce per step, and 4 once no_sync does nothing.
    lesson = import_lesson(LESSON)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        train_set, test_set = lesson.load_data()
        torch.manual_seed(0)
        model = lesson.DDP(lesson.WineMLP())
        all_reduces = []

        def counting_hook(state, bucket):
            all_reduces.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, counting_hook)
        trainer = lesson.Trainer(model, None, test_set, torch.optim.Adam(model.parameters()),
                                 torch.device("cpu"), 100, str(tmp_path), 0, 1, accumulate=4)
        micro_batches = [(train_set.features[i:i + 8], train_set.labels[i:i + 8])
                         for i in range(0, 32, 8)]
        trainer.train_step(micro_batches)
        with_no_sync = len(all_reduces)
        monkeypatch.setattr(lesson.DDP, "no_sync", lambda self: contextlib.nullcontext())
        trainer.train_step(micro_batches)
        assert (with_no_sync, len(all_reduces) - with_no_sync) == (1, 4)
    finally:
        dist.destroy_process_group()


def test_clipping_after_the_all_reduce(lesson_run, accumulated):
    _, two_ranks = lesson_run(LESSON, *TWO_RANKS)
    _, one_rank = lesson_run(LESSON, *ONE_RANK)
    for out_dir in (two_ranks, accumulated[1]):
        # Every rank measured the norm of the same, synchronised gradient.
        assert grad_norms(out_dir, rank=0) == grad_norms(out_dir, rank=1)
    norms = grad_norms(one_rank)
    # The threshold bit in some steps and not in others, so clipping shaped the run ...
    assert any(n > 0.5 for n in norms) and any(n < 0.5 for n in norms)
    # ... and 2 ranks clipping after the all-reduce took the steps of one process clipping the
    # gradient of the whole batch of 32.
    assert max_weight_difference(two_ranks, one_rank) < 1e-5


def test_bf16_learns_and_stays_close_to_fp32(lesson_run):
    result, bf16 = lesson_run(LESSON, *TWO_RANKS, "--precision", "bf16")
    metrics = assert_good_run(result, bf16, world_size=2, min_accuracy=0.95)
    assert metrics["precision"] == "bf16"
    fp32 = read_metrics(lesson_run(LESSON, *TWO_RANKS)[1])
    # The tolerance: at most one test wine more or less than fp32, and a final training loss
    # within 0.01 of it. bf16 keeps 8 bits of mantissa, so the runs differ, but not by much ...
    assert abs(metrics["test_correct"] - fp32["test_correct"]) <= 1
    assert abs(metrics["train_loss"][-1] - fp32["train_loss"][-1]) < 0.01
    # ... and they do differ: autocast really ran the forward pass in bf16.
    assert max_weight_difference(bf16, lesson_run(LESSON, *TWO_RANKS)[1]) > 1e-4


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="torch.compile on the CPU needs a C++ compiler (g++ or $CXX)")
def test_compile_matches_eager(lesson_run, tmp_path_factory):
    # One compiled run, with accumulation, so no_sync is exercised under compile too. Inductor
    # writes the code it generates into its cache: finding some there shows it compiled.
    cache = tmp_path_factory.mktemp("inductor_cache")
    result, compiled = lesson_run(LESSON, *ACCUMULATED, "--compile",
                                  env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    metrics = assert_good_run(result, compiled, world_size=2, min_accuracy=0.95)
    assert metrics["compile"] is True
    assert list(cache.rglob("*.py")), "no generated code in Inductor's cache"
    _, eager = lesson_run(LESSON, *TWO_RANKS)
    # Inductor fuses operations and may round differently: within 1e-4 of eager, not bitwise.
    assert max_weight_difference(compiled, eager) < 1e-4


@pytest.mark.parametrize("world_size, batch_size, accumulate, expected", [
    (1, 32, 1, 0.01),   # the reference: one process, batch 32
    (2, 32, 1, 0.02),   # the lesson's default on a CPU: global batch 64
    (4, 16, 2, 0.04),   # global batch 128
    (8, 64, 1, 0.16),   # global batch 512
    (2, 8, 1, 0.005),   # smaller than the reference: a smaller lr
])
def test_scale_lr_gives_the_documented_rate(world_size, batch_size, accumulate, expected):
    lesson = import_lesson(LESSON)
    assert lesson.scaled_lr(0.01, world_size * batch_size * accumulate) == pytest.approx(expected)


def test_warm_up_rises_in_a_straight_line():
    lesson = import_lesson(LESSON)
    rates = [lesson.lr_at_step(step, 0.01, 0.04, 10) for step in (0, 5, 10, 50)]
    assert rates == pytest.approx([0.01, 0.025, 0.04, 0.04])
    assert lesson.lr_at_step(0, 0.01, 0.04, 0) == 0.04  # no warm-up


@pytest.mark.parametrize("args, env, fragments", [
    (["--accumulate", "0"], {}, ["--accumulate must be at least 1"]),
    ([*CPU, "--precision", "fp16"], {}, ["--precision fp16 needs CUDA GPUs",
                                        "--precision bf16"]),
    ([*CPU, "--compile"], {"CXX": "no-such-compiler"},
     ["--compile needs a C++ compiler", "no-such-compiler", "leave out --compile"]),
], ids=["accumulate 0", "fp16 on the CPU", "compile without a compiler"])
def test_bad_input_gets_one_clear_line(args, env, fragments, tmp_path):
    result = run_lesson(LESSON, *args, "--out-dir", tmp_path, env=env)
    assert_one_line_error(result, *fragments)
    assert "starting" not in result.stdout  # refused before any rank was started


# ---------------------------------------------------------------------------------------------
# The GPU tier: CUDA with NCCL, world size 1 with one GPU, 2 with two or more
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible here")
NCCL_WORLD = min(GPUS, 2)
GPU = ["--backend", "nccl", "--world-size", NCCL_WORLD]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_mixed_precision(lesson_run, precision):
    result, out_dir = lesson_run(LESSON, *GPU, *CLIP, "--precision", precision)
    metrics = assert_good_run(result, out_dir, world_size=NCCL_WORLD, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"], metrics["precision"]) == (
        "nccl", "cuda", precision)
    # fp16 runs with the GradScaler (its scale starts at 65536 and halves on an overflow); bf16
    # needs none, and its disabled scaler reports 1.
    if precision == "fp16":
        assert metrics["grad_scale"] > 1
    else:
        assert metrics["grad_scale"] == 1
    peak = [r["peak_memory_mib"] for r in metrics["ranks"]]
    assert all(0 < mib < 1024 for mib in peak), peak  # torch.cuda.max_memory_allocated


@pytest.mark.gpu
@needs_gpu
def test_gpu_compile_matches_eager(lesson_run):
    result, compiled = lesson_run(LESSON, *GPU, *CLIP, "--compile")
    assert_good_run(result, compiled, world_size=NCCL_WORLD, min_accuracy=0.95)
    _, eager = lesson_run(LESSON, *GPU, *CLIP)
    assert max_weight_difference(compiled, eager) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"SyncBatchNorm needs 2+ GPUs; this machine has {GPUS}")
def test_gpu_sync_batchnorm_gives_the_global_statistics():
    result = subprocess.run([sys.executable, str(ROOT / "troubleshooting" / "batchnorm_stats.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 ranks over nccl" in result.stdout
    assert ("fix: SyncBatchNorm gives every rank the statistics of the global batch: True"
            in result.stdout)
