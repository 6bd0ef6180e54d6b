"""Lesson 06, run as a learner runs it: mixed precision, accumulation, clipping, compile, scale-lr,
torchrun.

The CPU tier runs 2 gloo ranks (and 1 for the single-process reference). Most tests look at the
same few runs from different sides (the lesson_run cache launches each once). The GPU tier, at
the end, is skipped with the reason where no CUDA GPU is visible."""

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import (
    GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    evaluate_single_process,
    import_lesson,
    load_weights,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
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
# Each rank's 71 wines (142 over 2 ranks) make 5 steps of 16 per epoch: 16, 16, 16, 16 and 7,
# that is 2, 2, 2, 2 and 1 micro-batches of 8.
STEPS = EPOCHS * 5
MICRO_BATCHES = EPOCHS * 9
# A batch of 64, twice lesson 01's 32, so --scale-lr linear doubles --lr 0.01 to 0.02, reached in
# 4 warm-up steps; 142 wines make 3 steps an epoch, 6 in 2 epochs. One rank: the rate is the
# optimizer's, the same on every rank, and one process starts faster than two.
SCALED = [*CPU, "--world-size", 1, "--batch-size", 64, "--scale-lr", "linear", "--warmup-steps",
          4, "--epochs", 2]
SCALED_RATES = [0.01, 0.0125, 0.015, 0.0175, 0.02, 0.02]


def grad_norms(out_dir, rank=0):
    return read_metrics(out_dir)["grad_norms"][rank]


def same_trajectory(a, b, tolerance=1e-5):
    """The gradient norm at every step (relative) and the final weights agree."""
    norms_a, norms_b = grad_norms(a), grad_norms(b)
    if len(norms_a) != len(norms_b):
        return False
    worst = max(abs(x - y) / y for x, y in zip(norms_a, norms_b, strict=True))
    return worst < tolerance and max_weight_difference(a, b) < tolerance


def all_reduce_counts(result):
    """{rank: (all-reduces, optimizer steps)} from the count-all-reduces patches' lines."""
    found = re.findall(r"rank (\d+): (\d+) gradient all-reduces in (\d+) optimizer steps",
                       result.stdout)
    return {int(rank): (int(count), int(steps)) for rank, count, steps in found}


@pytest.fixture(scope="module")
def accumulated(lesson_run):
    # The DDP comm hook that counts is DDP's own allreduce_hook (sum, divided by world size).
    return lesson_run(LESSON, *ACCUMULATED, patch="count-all-reduces")


def test_two_ranks_learn_and_report_their_throughput(lesson_run):
    result, out_dir = lesson_run(LESSON, *TWO_RANKS)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert (metrics["global_batch"], metrics["optimizer_steps"]) == (32, STEPS)
    assert metrics["samples_per_second"] > 0
    assert "samples/s over all ranks, 100 optimizer steps" in result.stdout
    # Every rank's gradient norms, one per step, gathered by rank 0.
    assert [len(norms) for norms in metrics["grad_norms"]] == [STEPS, STEPS]
    # No --scale-lr: the optimizer used --lr at every step.
    assert metrics["lr_per_step"] == [0.01] * STEPS


def test_the_warm_up_and_the_scaled_rate_reach_the_optimizer(lesson_run):
    # lr_per_step is the rate in the optimizer's param_groups when each step was taken: the one
    # Adam used, not the one the schedule computed.
    result, out_dir = lesson_run(LESSON, *SCALED)
    assert result.returncode == 0, result.stderr
    assert "lr 0.02" in result.stdout
    assert read_metrics(out_dir)["lr_per_step"] == pytest.approx(SCALED_RATES, rel=1e-12)


def test_torchrun_takes_the_steps_of_mp_spawn(lesson_run, tmp_path):
    # The same flags, the ranks started by torchrun instead of mp.spawn: the same run, bitwise.
    result = run_torchrun(LESSON, *TWO_RANKS, "--out-dir", tmp_path)
    metrics = assert_good_run(result, tmp_path, world_size=2, min_accuracy=0.95)
    assert "starting 2 ranks" not in result.stdout  # mp.spawn's line: torchrun started them
    spawned = lesson_run(LESSON, *TWO_RANKS)[1]
    assert metrics["train_loss"] == read_metrics(spawned)["train_loss"]
    assert max_weight_difference(tmp_path, spawned) == 0


def test_accumulation_equals_the_big_batch(lesson_run, accumulated):
    # 2 ranks x 8 x 2 micro-batches, 2 ranks x 16, 1 rank x 32: the same steps on the same
    # 32 wines, so the same gradient norm at every step and the same final weights.
    result, accumulated_dir = accumulated
    assert_good_run(result, accumulated_dir, world_size=2, min_accuracy=0.95)
    _, two_ranks = lesson_run(LESSON, *TWO_RANKS)
    _, one_rank = lesson_run(LESSON, *ONE_RANK)
    assert read_metrics(accumulated_dir)["optimizer_steps"] == STEPS
    assert same_trajectory(accumulated_dir, two_ranks)
    assert same_trajectory(accumulated_dir, one_rank)


def test_a_loss_not_divided_by_k_fails_the_same_comparison(lesson_run):
    # The control: each micro-batch's loss not divided by K, the rest unchanged.
    result, wrong = lesson_run(LESSON, *ACCUMULATED, patch="loss-not-divided")
    assert result.returncode == 0, result.stderr
    _, two_ranks = lesson_run(LESSON, *TWO_RANKS)
    assert not same_trajectory(wrong, two_ranks)
    # The norms double, and the weights end elsewhere too (clipping sees the gradient's scale).
    assert grad_norms(wrong)[0] == pytest.approx(2 * grad_norms(two_ranks)[0], rel=1e-5)
    assert max_weight_difference(wrong, two_ranks) > 1e-3


def test_no_sync_saves_all_reduces_not_math(lesson_run, accumulated):
    # On 2 ranks, where an all-reduce does combine gradients: one all-reduce per optimizer step
    # with no_sync, one per micro-batch without it (DDP's no_sync made to do nothing) ...
    with_no_sync, with_dir = accumulated
    without_no_sync, without_dir = lesson_run(LESSON, *ACCUMULATED,
                                              patch="count-all-reduces-without-no-sync")
    assert all_reduce_counts(with_no_sync) == {0: (STEPS, STEPS), 1: (STEPS, STEPS)}
    assert all_reduce_counts(without_no_sync) == {0: (MICRO_BATCHES, STEPS),
                                                  1: (MICRO_BATCHES, STEPS)}
    # ... and the same steps, up to float rounding: averaging the first micro-batch's gradient
    # early, then the sum, gives the average of the sum.
    assert same_trajectory(without_dir, with_dir)


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
    _, fp32_dir = lesson_run(LESSON, *TWO_RANKS)
    fp32 = read_metrics(fp32_dir)
    # Autocast casts a bf16 copy of each weight for its product; the weights themselves, and so
    # final.pt, stay float32.
    assert {tensor.dtype for tensor in load_weights(bf16).values()} == {torch.float32}
    # bf16 keeps 8 significant bits: each number rounded to it is off by up to 2^-8 (0.4%) of
    # itself, and so is each epoch's loss, computed from such products. Every epoch's loss
    # within 2^-6 (1.6%) of fp32's leaves room for the drift of 100 steps (measured: 0.54% at
    # most, 0.07% at the end), and at most one test wine more or less ...
    assert metrics["train_loss"] == pytest.approx(fp32["train_loss"], rel=2**-6, abs=0)
    assert abs(metrics["test_correct"] - fp32["test_correct"]) <= 1
    # ... and they do differ: autocast really ran the matrix products in bf16.
    assert max_weight_difference(bf16, fp32_dir) > 1e-4


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


@pytest.mark.parametrize("world_size, batch_size, accumulate, linear", [
    (1, 32, 1, 0.01),   # the reference: one process, batch 32
    (2, 32, 1, 0.02),   # the lesson's default on a CPU: global batch 64
    (4, 16, 2, 0.04),   # global batch 128
    (8, 64, 1, 0.16),   # global batch 512
    (2, 8, 1, 0.005),   # smaller than the reference: a smaller lr
])
def test_scale_lr_gives_the_documented_rates(world_size, batch_size, accumulate, linear):
    lesson = import_lesson(LESSON)
    global_batch = world_size * batch_size * accumulate
    assert lesson.scaled_lr(0.01, global_batch, "linear") == pytest.approx(linear)
    sqrt = 0.01 * math.sqrt(global_batch / 32)
    assert lesson.scaled_lr(0.01, global_batch, "sqrt") == pytest.approx(sqrt)
    assert lesson.scaled_lr(0.01, global_batch, None) == 0.01  # no --scale-lr: --lr as given


def test_warm_up_rises_in_a_straight_line():
    lesson = import_lesson(LESSON)
    rates = [lesson.lr_at_step(step, 0.01, 0.04, 10) for step in (0, 5, 10, 50)]
    assert rates == pytest.approx([0.01, 0.025, 0.04, 0.04])
    assert lesson.lr_at_step(0, 0.01, 0.04, 0) == 0.04  # no warm-up


def test_bad_input_gets_one_clear_line_before_any_rank_starts(tmp_path):
    result = run_lesson(LESSON, "--accumulate", "0", "--out-dir", tmp_path)
    assert_one_line_error(result, "--accumulate must be at least 1")
    assert "starting" not in result.stdout


@pytest.mark.parametrize("args, env, fragments", [
    ([*CPU, "--precision", "fp16"], {}, ["--precision fp16 needs CUDA GPUs",
                                        "--precision bf16"]),
    ([*CPU, "--compile"], {"CXX": "no-such-compiler"},
     ["--compile needs a C++ compiler", "no-such-compiler", "leave out --compile"]),
    # On GPUs the compiler is Triton's C compiler, not Inductor's C++ one. Shown here without a
    # GPU: --backend nccl is checked with the flags, before any rank needs a GPU.
    pytest.param(["--backend", "nccl", "--compile"], {"CC": "no-such-c-compiler"},
                 ["--compile needs a C compiler", "no-such-c-compiler", "set CC"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                          reason="triton is not installed: the GPU check "
                                                 "stops at its absence first")),
], ids=["fp16 on the CPU", "compile without a compiler", "compile on GPUs without a C compiler"])
def test_what_the_device_cannot_do_is_refused_with_the_flags(args, env, fragments, monkeypatch):
    # Checked with the flags (parse_args), the same checks as the refusal above: in this process.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        import_lesson(LESSON).parse_args(list(map(str, args)))
    assert str(stop.value).startswith("error: ")
    for fragment in fragments:
        assert fragment in str(stop.value)


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


def fp16_step_on_overflow(device, backend, store):
    """One fp16 train_step of the lesson's Trainer, in this process, on wines whose features
    (1e5) overflow fp16 (largest 65504) to inf: (the weights changed, the scale before, after)."""
    lesson = import_lesson(LESSON)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = lesson.DDP(lesson.WineMLP().to(device))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = lesson.Trainer(model, None, None, optimizer, device, 1, None, 32, "fp16", 0.0,
                                 lambda step: 0.01)
        before = [p.detach().clone() for p in model.parameters()]
        scale = trainer.scaler.get_scale()
        features = torch.full((32, 13), 1e5, device=device)
        trainer.train_step(features, torch.zeros(32, dtype=torch.long, device=device))
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                             strict=True))
        return changed, scale, trainer.scaler.get_scale()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device, backend", [
    ("cpu", "gloo"),
    pytest.param("cuda", "nccl", marks=[pytest.mark.gpu, needs_gpu]),
])
def test_fp16_skips_the_step_whose_gradient_overflowed(tmp_path, device, backend):
    # The GradScaler finds the inf in the gradients, skips optimizer.step and halves its scale;
    # a step taken without it (optimizer.step() in place of scaler.step) writes nan into every
    # weight. One rank is enough: the check is within a rank. The CPU case runs the Trainer in
    # this process (torch's CPU autocast does fp16; the lesson's flags keep fp16 for GPUs).
    device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    changed, before, after = fp16_step_on_overflow(device, backend, tmp_path / "store")
    assert not changed
    assert after == before / 2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")),
                    reason="torch.compile on GPUs needs a C compiler for Triton ($CC, gcc or "
                           "clang)")
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
