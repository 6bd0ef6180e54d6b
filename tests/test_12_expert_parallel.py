"""Lesson 12, run as a learner runs it: python 12_expert_parallel/train.py (mp.spawn, gloo/CPU)
and its proof, python 12_expert_parallel/prove_experts.py.

The MoE layer by hand (sorted by expert, exchanged, combined) equals every expert run on every
token, on one process and on 4 ranks, with and without a capacity limit; training with --ep 2,
--ep 4 and --dp 2 --ep 2 ends on the weights of --ep 1, one process, routes the same rows to each
expert every step, and with a capacity limit drops the same ones; torchrun restarts a crashed
run, which resumes bitwise, a checkpoint loads into another --ep, and two torchrun nodes share
one EP group; the balance loss reaches the router; a layout that cannot share out the experts
stops in one line.

Tolerance. In float64 (--float64), the layouts differ only in the order of their sums: each rank
adds its own sequences' gradients, an expert adds the rows it received from every rank in its
own order, and all-reduce adds the ranks' shares. Measured on this course's 2-core machine:
after 1 epoch (25 Adam steps) 1.7e-14 between --ep 4 and --ep 1; after 2 epochs (50 steps)
3.8e-13 (--ep 2), 8.9e-13 (--ep 4), 3.4e-13 (--dp 2 --ep 2): Adam, which divides each step by
its gradient's running size, makes rounding grow about 17% a step here. TOLERANCE = 1e-10,
a hundred times that; one wrong line of the dispatch moves the weights by 1e-3 and more."""

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
    run_torchrun_nodes,
)

LESSON = "12_expert_parallel"
TOLERANCE = 1e-10
CPU = ["--backend", "gloo", "--dp", "1"]  # the CPU tier stays on gloo even where GPUs exist
SMALL = ["--float64", "--epochs", "2", "--save-every", "1"]
CAPACITY = ["--top-k", "1", "--capacity-factor", "1", "--epochs", "1"]  # drops some choices
LAYOUTS = {"ep1": ["--ep", "1", *SMALL], "ep2": ["--ep", "2", *SMALL],
           "ep4": ["--ep", "4", *SMALL], "dp2ep2": ["--dp", "2", "--ep", "2", *SMALL],
           "capacity_ep1": ["--ep", "1", *SMALL, *CAPACITY],
           "capacity_ep2": ["--ep", "2", *SMALL, *CAPACITY]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run in float64, made once: {name: out_dir}."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            check_ok(run_lesson(LESSON, *CPU, *LAYOUTS[name], "--out-dir", out))
            made[name] = out
        return made[name]

    return run


def test_the_moe_by_hand_equals_every_expert_on_every_token():
    done = subprocess.run([sys.executable, str(ROOT / LESSON / "prove_experts.py"), "--ep", "4"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal within 1e-12: True" in done.stdout, done.stdout
    assert done.stdout.count("largest difference") == 4  # one process, 4 ranks; twice
    # 8 experts on 4 ranks, 4 sequences of 16 tokens: top-2 keeps every choice (128 rows);
    # top-1 with a capacity of 16 x 1 / 8 = 2 per expert and sequence drops some.
    kept = [line for line in done.stdout.splitlines() if "of the choices" in line]
    assert len(kept) == 2 and "kept 100%" in kept[0] and "kept 100%" not in kept[1], kept
    sends = [line for line in done.stdout.splitlines() if "sends rows to ranks 0..3" in line]
    assert len(sends) == 8, done.stdout
    rows = [sum(map(int, line.split(": ")[1].split(", "))) for line in sends]
    assert rows[:4] == [32] * 4  # top-2: each rank sends 2 rows for each of its 16 tokens


@pytest.mark.parametrize("layout", ["ep2", "ep4", "dp2ep2"])
def test_every_layout_takes_the_steps_of_one_process(runs, layout):
    assert max_weight_difference(runs(layout), runs("ep1")) < TOLERANCE
    ours, one = read_metrics(runs(layout)), read_metrics(runs("ep1"))
    for a, b in zip(ours["train_loss"], one["train_loss"], strict=True):
        assert abs(a - b) < TOLERANCE
    assert abs(ours["val_loss"] - one["val_loss"]) < TOLERANCE
    assert ours["train_loss"][-1] < ours["train_loss"][0]
    # Every step, every expert of every block got the rows it gets in one process; 2 epochs
    # of 25 steps, each 16 sequences x 64 tokens x top-2 choices, none dropped.
    assert ours["expert_load"] == one["expert_load"]
    assert len(one["expert_load"]) == 50
    assert all(sum(block) == 16 * 64 * 2 for step in one["expert_load"] for block in step)


def test_a_capacity_limit_drops_the_same_choices_on_every_layout(runs):
    ep1, ep2 = read_metrics(runs("capacity_ep1")), read_metrics(runs("capacity_ep2"))
    assert ep2["expert_load"] == ep1["expert_load"]
    # top-1, capacity 64 x 1 / 4 = 16 per expert and sequence: at most 16 x 16 rows per step.
    assert max(n for step in ep1["expert_load"] for block in step for n in block) <= 16 * 16
    assert sum(sum(block) for step in ep1["expert_load"] for block in step) < 25 * 2 * 16 * 64
    assert max_weight_difference(runs("capacity_ep2"), runs("capacity_ep1")) < TOLERANCE


def test_the_balance_loss_reaches_the_router(runs, tmp_path):
    # The --ep 2 run again with --balance-loss 0 ends elsewhere: the loss moved the weights.
    check_ok(run_lesson(LESSON, *CPU, *LAYOUTS["ep2"], "--balance-loss", "0",
                        "--out-dir", tmp_path))
    assert max_weight_difference(tmp_path, runs("ep2")) > 1e-6
    assert read_metrics(tmp_path)["balance_loss"] == 0


def test_torchrun_restarts_a_crashed_run_which_resumes_bitwise(runs, tmp_path):
    # torchrun, --ep 2: rank 1 raises in epoch 2, torchrun starts both again (--max-restarts 1),
    # they resume from epoch 1's checkpoint and end bitwise on a run of 3 epochs that never
    # stopped. Then the 2-epoch --ep 4 run's checkpoint, resumed by --ep 2: within TOLERANCE.
    three = ["--ep", "2", "--float64", "--epochs", "3", "--backend", "gloo"]
    straight = tmp_path / "straight"
    check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", straight))
    restarted = tmp_path / "restarted"
    result = run_torchrun(LESSON, *three, "--save-every", 1, "--out-dir", restarted,
                          torchrun_args=["--max-restarts", 1], patch="raise-on-rank-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "injected failure on rank 1" in result.stderr
    assert "1 of 3 epochs done, written by --dp 1 --ep 2, loaded by --dp 1 --ep 2" in result.stdout
    metrics = read_metrics(restarted)
    assert metrics["launcher"] == "torchrun" and metrics["backend"] == "gloo"
    assert max_weight_difference(straight, restarted) == 0
    assert metrics["expert_load"] == read_metrics(straight)["expert_load"]  # all 3 epochs'
    other = tmp_path / "from_ep4"
    shutil.copytree(runs("ep4") / "checkpoint", other / "checkpoint")
    result = check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", other))
    assert "2 of 3 epochs done, written by --dp 1 --ep 4, loaded by --dp 1 --ep 2" in result.stdout
    assert read_metrics(other)["resumed_after_epoch"] == 2
    assert max_weight_difference(straight, other) < TOLERANCE


def test_two_torchrun_nodes_share_one_ep_group(runs, tmp_path):
    # Two torchrun "nodes" on this machine, one rank each: the EP group spans them, every
    # all-to-all crosses between the nodes. The run ends on --ep 2's weights. Both write their
    # shards of the checkpoint to the one --out-dir, as on a filesystem the nodes share.
    for node in run_torchrun_nodes(LESSON, *LAYOUTS["ep2"], "--backend", "gloo",
                                   "--out-dir", tmp_path):
        check_ok(node)
    metrics = read_metrics(tmp_path)
    assert (metrics["launcher"], metrics["world_size"], metrics["ep"]) == ("torchrun", 2, 2)
    assert max_weight_difference(tmp_path, runs("ep2")) < TOLERANCE


@pytest.mark.parametrize(("flags", "says"), [
    (["--ep", "3"], "--experts 4 does not share out over --ep 3"),
    (["--ep", "2", "--top-k", "5"], "--top-k 5 must be from 1 to --experts 4"),
    (["--ep", "4", "--batch-size", "6"], "--batch-size 6, the global batch, does not split over "
                                         "--dp x --ep = 4 ranks")])
def test_a_layout_that_cannot_share_out_the_experts_stops_in_one_line(flags, says, tmp_path):
    result = run_lesson(LESSON, *CPU, *flags, "--out-dir", tmp_path)
    assert_one_line_error(result, says)
    assert "starting" not in result.stdout


def test_a_checkpoint_of_other_experts_stops_in_one_line(runs, tmp_path):
    shutil.copytree(runs("ep2") / "checkpoint", tmp_path / "checkpoint")
    result = run_lesson(LESSON, *CPU, "--ep", "2", "--experts", "8", "--out-dir", tmp_path)
    assert_one_line_error(result, "holds a model with --experts 4, not 8")

# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# float64 on a GPU adds in cuBLAS's order, not the CPU's: about 1e-15 a step, which Adam grows
# as it grows the CPU layouts' differences (see the module's docstring); a wrong row moves 1e-3.
GPU_TOLERANCE = 1e-8


@needs_gpu
@pytest.mark.gpu
def test_gpu_one_rank_takes_the_cpus_steps(runs, tmp_path):
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["ep1"], "--dp", 1,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, runs("ep1")) < GPU_TOLERANCE
    assert metrics["expert_load"] == read_metrics(runs("ep1"))["expert_load"]
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_two
@pytest.mark.gpu
def test_gpu_the_all_to_alls_on_nccl_take_one_processs_steps(runs, tmp_path):
    # all_to_all_single between two GPUs: the counts, then the rows, from GPU to GPU.
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["ep2"], "--dp", 1,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 2)
    assert max_weight_difference(tmp_path, runs("ep1")) < GPU_TOLERANCE


@needs_gpu
@pytest.mark.gpu
def test_gpu_torchrun_starts_one_nccl_rank_per_gpu(tmp_path):
    nproc = min(GPUS, 2)  # one EP group of them all
    result = run_torchrun(LESSON, "--ep", nproc, "--epochs", 2, "--out-dir", tmp_path,
                          nproc=nproc)
    check_ok(result)
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "torchrun")
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)
    assert json.loads((tmp_path / "metrics.json").read_text())["ep"] == nproc
