"""Lesson 11, run as a learner runs it: python 11_context_parallel/train.py (mp.spawn, gloo/CPU)
and its proof, python 11_context_parallel/prove_ring.py.

Ring attention and the all-gather way give full attention's output and gradients at 4 ranks,
balanced and not, and the balanced layout gives every rank the same work; training with --cp 2,
--cp 4 and --dp 2 --cp 2 ends on the weights of --cp 1, one process; torchrun restarts a crashed
run, which resumes bitwise, and a checkpoint loads into another layout; a --seq-len that 2 x
--cp chunks cannot split stops in one line; what attention keeps for backward and sends, per
rank, measured by benchmarks/context_parallel.py, equals the README's formulas.

Tolerance. In float64 (--float64), the layouts differ only in the order of their sums: each CP
rank adds its tokens' loss and gradient shares, the ring adds each query's blocks in its own
order, and all-reduce adds the ranks' gradients. Measured after 2 epochs (50 Adam steps), on
this course's 2-core machine: 1.1e-14 between --cp 2 and --cp 1, 1.6e-14 for --cp 4 (with 8
threads per rank, or ATEN_CPU_CAPABILITY=default, within 2e-14): TOLERANCE = 1e-12. (With a
bias on the keys, whose gradient is only rounding, one CI machine measured 1.8e-7: the model has
none.) In float32 the same runs end about 5e-7 apart, as Adam divides each
step by its gradient's running size and so turns rounding into steps of about lr, which is why
the proof runs in float64."""

import json
import shutil
import subprocess
import sys

import pytest

from helpers import (
    GPUS,
    ROOT,
    assert_final_pt_holds_cpu_tensors,
    assert_one_line_error,
    check_ok,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "11_context_parallel"
TOLERANCE = 1e-12
CPU = ["--backend", "gloo", "--dp", "1"]  # the CPU tier stays on gloo even where GPUs exist
SMALL = ["--float64", "--epochs", "2", "--save-every", "1"]
LAYOUTS = {"cp1": ["--cp", "1"], "cp2": ["--cp", "2"], "cp4": ["--cp", "4"],
           "dp2cp2": ["--dp", "2", "--cp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run of 2 epochs in float64, made once: {name: out_dir}."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            check_ok(run_lesson(LESSON, *CPU, *LAYOUTS[name], *SMALL, "--out-dir", out))
            made[name] = out
        return made[name]

    return run


def test_ring_and_all_gather_attention_equal_full_attention():
    done = subprocess.run([sys.executable, str(ROOT / LESSON / "prove_ring.py"), "--cp", "4"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal within 1e-12: True" in done.stdout, done.stdout
    assert done.stdout.count("largest difference") == 4  # ring and all-gather, both layouts
    # Balanced, every rank attends to as many blocks; unbalanced, the last rank to 5 times
    # as many as the first (chunks 6 and 7 see 7 and 8 of the 8; chunks 0 and 1, 1 and 2).
    assert "blocks per rank, balanced  : 9, 9, 9, 9" in done.stdout, done.stdout
    assert "blocks per rank, unbalanced: 3, 7, 11, 15" in done.stdout, done.stdout


@pytest.mark.parametrize("layout", ["cp2", "cp4", "dp2cp2"])
def test_every_layout_takes_the_steps_of_one_process(runs, layout):
    assert max_weight_difference(runs(layout), runs("cp1")) < TOLERANCE
    ours, one = read_metrics(runs(layout)), read_metrics(runs("cp1"))
    for a, b in zip(ours["train_loss"], one["train_loss"], strict=True):
        assert abs(a - b) < TOLERANCE
    assert abs(ours["val_loss"] - one["val_loss"]) < TOLERANCE
    assert ours["train_loss"][-1] < ours["train_loss"][0]


def test_torchrun_restarts_a_crashed_run_which_resumes_bitwise(runs, tmp_path):
    # torchrun, --cp 2: rank 1 raises in epoch 2, torchrun starts both again (--max-restarts 1),
    # they resume from epoch 1's checkpoint and end bitwise on a run of 3 epochs that never
    # stopped. Then the 2-epoch --cp 4 run's checkpoint, resumed by --cp 2: within TOLERANCE.
    three = ["--cp", "2", "--float64", "--epochs", "3", "--backend", "gloo"]
    straight = tmp_path / "straight"
    check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", straight))
    restarted = tmp_path / "restarted"
    result = run_torchrun(LESSON, *three, "--save-every", 1, "--out-dir", restarted,
                          torchrun_args=["--max-restarts", 1], patch="raise-on-rank-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "injected failure on rank 1" in result.stderr
    assert "1 of 3 epochs done, written by --dp 1 --cp 2, loaded by --dp 1 --cp 2" in result.stdout
    assert read_metrics(restarted)["launcher"] == "torchrun"
    assert max_weight_difference(straight, restarted) == 0
    other = tmp_path / "from_cp4"
    shutil.copytree(runs("cp4") / "checkpoint", other / "checkpoint")
    result = check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", other))
    assert "2 of 3 epochs done, written by --dp 1 --cp 4, loaded by --dp 1 --cp 2" in result.stdout
    assert read_metrics(other)["resumed_after_epoch"] == 2
    assert max_weight_difference(straight, other) < TOLERANCE


def test_torchs_context_parallel_stops_on_a_cpu_mesh():
    # What the README says of torch 2.14's own CP (tools/repro_context_parallel_cpu.py).
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "repro_context_parallel_cpu.py")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "_scaled_dot_product_flash_attention_for_cpu" in done.stdout
    assert "does not have a sharding strategy registered" in done.stdout


def test_a_seq_len_that_the_chunks_do_not_split_stops_in_one_line(tmp_path):
    result = run_lesson(LESSON, "--cp", "3", "--out-dir", tmp_path)
    assert_one_line_error(result, "--seq-len 64 does not split into 2 x --cp = 6 equal chunks")
    assert "starting" not in result.stdout



def test_what_it_costs_is_measured_beside_its_formula(tmp_path):
    # benchmarks/context_parallel.py --quick: T = 64 and 128, attention plain and by the ring at
    # N = 1, 2, 4. The bytes attention keeps for backward (counted by saved_tensors_hooks) and
    # sends (counted at batch_isend_irecv) equal the README's formulas: plain attention keeps the
    # T x T scores; the ring keeps 1/N of what it keeps at N = 1, and sends (3N - 2) blocks.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"),
                           "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured bytes equal the formulas: True" in done.stdout, done.stdout
    rows = {(r["seq_len"], r["attention"], r["cp"]): r
            for r in json.loads((tmp_path / "context_parallel.json").read_text())["rows"]}
    assert len(rows) == 8
    for length in (64, 128):
        ring = {n: rows[length, "ring", n] for n in (1, 2, 4)}
        for n in (2, 4):
            assert ring[n]["saved_bytes"] * n == ring[1]["saved_bytes"]
            blocks = 2 * 4 * (length // n) * 8 * 4  # keys and values: heads x tokens x dim x 4 B
            assert ring[n]["sent_bytes"] == (3 * n - 2) * blocks
        assert rows[length, "plain", 1]["saved_bytes"] > 2 * 4 * length ** 2 * 4  # the scores
        assert all(len(r["seconds"]) == 2 and r["tokens_per_s"] > 0 for r in rows.values())

# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# float64 on a GPU adds in cuBLAS's order, not the CPU's: about 1e-15 a step, which Adam carries
# through 2 epochs; far below what one wrong block moves (1e-2 and more).
GPU_TOLERANCE = 1e-8


@needs_gpu
@pytest.mark.gpu
def test_gpu_one_rank_takes_the_cpus_steps(runs, tmp_path):
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["cp1"], "--dp", 1, *SMALL,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, runs("cp1")) < GPU_TOLERANCE
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_two
@pytest.mark.gpu
def test_gpu_the_ring_on_nccl_takes_one_processs_steps(runs, tmp_path):
    # batch_isend_irecv between two GPUs: each rank's keys and values go from GPU to GPU.
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["cp2"], "--dp", 1, *SMALL,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 2)
    assert max_weight_difference(tmp_path, runs("cp1")) < GPU_TOLERANCE


@needs_gpu
@pytest.mark.gpu
def test_gpu_torchrun_starts_one_nccl_rank_per_gpu(tmp_path):
    nproc = min(GPUS, 2)  # one CP group of them all
    result = run_torchrun(LESSON, "--cp", nproc, "--epochs", 2, "--out-dir", tmp_path,
                          nproc=nproc)
    check_ok(result)
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "torchrun")
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)
