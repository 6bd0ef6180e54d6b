"""Lesson 09, run as a learner runs it: python 09_tensor_parallel/train.py (mp.spawn, gloo/CPU),
and torchrun with a restart.

Tensor parallelism on 2 ranks takes the steps of one process (lesson 02 at one rank, the same
batch); 2-D, FSDP across 2 TP groups of 2, those of DDP on 2 ranks. The collectives of a step
are the ones the README counts; a TP group's ranks read the same wines; the sharded checkpoint
resumes bitwise and loads into another --tp. The GPU tier (NCCL) is at the end of this file.

Tolerance: the split changes only the order of float32 sums (a row-wise layer adds the ranks'
partial sums, about 1e-7 apart from one sum over all), and Adam's steps keep such differences
near that size: 20 epochs end 1.2e-7 apart (measured; 2.1e-7 with --layers 3 in 3 epochs), so
1e-6 leaves room and is still ten thousand times below what one wrong step moves (about the
learning rate, 1e-2)."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import (
    GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    evaluate_single_process,
    free_port,
    import_guard_rails,
    import_lesson,
    lesson02_run,
    load_weights,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "09_tensor_parallel"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
TOLERANCE = 1e-6
# Three pairs of layers: float32's rounding grows with depth and Adam's steps (6.9e-6 measured on
# a CPU with AVX-512, the README's proof), still a thousand times below one wrong step (lr, 1e-2).
DEEP_TOLERANCE = 1e-5
TP = ["--dp", 1, "--tp", 2, "--batch-size", 32]  # lesson 02's 1-rank run: batch 32
TWO_D = ["--dp", 2, "--tp", 2, "--batch-size", 16]  # lesson 02's 2-rank run: 2 x 16


def test_tensor_parallel_takes_the_steps_of_one_process(lesson_run):
    result, out_dir = lesson_run(LESSON, *CPU, *TP)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["dp"], metrics["tp"]) == (1, 2)
    assert max_weight_difference(out_dir, lesson02_run(lesson_run, 1)[1]) < TOLERANCE
    # final.pt is the whole model, put together from the slices: lesson 01's model agrees.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


def test_2d_takes_the_steps_of_ddp_on_the_dp_ranks(lesson_run):
    result, out_dir = lesson_run(LESSON, *CPU, *TWO_D)
    metrics = assert_good_run(result, out_dir, world_size=4, min_accuracy=0.95)
    assert max_weight_difference(out_dir, lesson02_run(lesson_run, 2)[1]) < TOLERANCE
    assert max_weight_difference(out_dir, lesson02_run(lesson_run, 1)[1]) < TOLERANCE
    assert metrics["test_total"] == 36  # each test wine counted once, not once per TP rank
    # Two warnings of torch's that concern nothing the lesson does are silenced (guard_rails.py;
    # tools/repro_tp_fsdp_warnings.py shows them): a learner sees no wall of text.
    assert "returned a view tensor" not in result.stderr
    assert "sequential all_gather" not in result.stderr


def test_a_tp_groups_ranks_read_the_same_wines_and_other_groups_other_ones(lesson_run):
    # Rank 0 prints each TP group's ranks, then the first 4 wines of each one's first batch.
    result, _ = lesson_run(LESSON, *CPU, *TWO_D)
    groups = re.findall(r"^TP group \d \(dp rank \d\): ranks (\[.*?\]) .* same wines "
                        r"(\[.*\]), (\[.*\])$", result.stdout, re.MULTILINE)
    assert [ranks for ranks, *_ in groups] == ["[0, 1]", "[2, 3]"], result.stdout
    (_, first, second), (_, third, fourth) = groups
    assert first == second and third == fourth  # within a TP group: the same wines
    assert not set(json.loads(first)) & set(json.loads(third))  # across dp: none in common


def collectives(result):
    """{"forward": "...", "backward": "..."} as rank 0 printed them."""
    line = next(line for line in result.stdout.splitlines() if line.startswith("collectives"))
    forward, backward = line.split("rank 0: forward ")[1].split(" | backward ")
    return {"forward": forward, "backward": backward}


def test_the_collectives_of_a_step_are_the_readmes(lesson_run):
    # TP alone: one all-reduce in forward (fc2's partial sums); none in backward, since fc1's
    # input, the data, needs no gradient. --layers 3 adds a pair: one more each way.
    assert collectives(lesson_run(LESSON, *CPU, *TP)[0]) == {"forward": "all-reduce 1",
                                                             "backward": "none"}
    deep, _ = lesson_run(LESSON, *CPU, *TP, "--layers", 3, "--epochs", 2)
    assert collectives(deep) == {"forward": "all-reduce 2", "backward": "all-reduce 1"}
    assert "predicts: forward all-reduce 2 (one per row-wise layer) | backward all-reduce 1" \
        in deep.stdout
    # 2-D adds FSDP's: each of fc1 and fc2 gathered in forward and again in backward, and its
    # gradients reduce-scattered; TP's all-reduce stays.
    two_d, _ = lesson_run(LESSON, *CPU, *TWO_D)
    assert collectives(two_d) == {"forward": "all-gather 2, all-reduce 1",
                                  "backward": "all-gather 2, reduce-scatter 2"}


def test_deeper_pairs_take_lesson_08s_steps(lesson_run):
    _, deep = lesson_run(LESSON, *CPU, *TP, "--layers", 3, "--epochs", 2)
    _, one = lesson_run("08_ddp_from_scratch", *CPU, "--world-size", 1, "--grad-sync", "ddp",
                        "--layers", 3, "--epochs", 2)
    assert sorted(load_weights(deep)) == sorted(load_weights(one))
    assert "hidden.1.weight" in load_weights(deep)
    assert max_weight_difference(deep, one) < DEEP_TOLERANCE


@pytest.mark.parametrize("run, held", [(TP, [2188, 2188]), (TWO_D, [1160, 1160, 1028, 1028])])
def test_each_rank_holds_its_slices(lesson_run, run, held):
    # Lesson 01's model holds 1,091 parameters, 4,364 bytes. TP 2: fc1's 32 rows and biases,
    # fc2's 32 input columns, fc2's bias whole: 416 + 32 + 96 + 3 = 547 parameters. 2-D: FSDP
    # cuts each of those along dim 0 again: fc1 16 rows each, fc2's 3 rows as 2 and 1.
    metrics = read_metrics(lesson_run(LESSON, *CPU, *run)[1])
    assert [row["parameters"] for row in metrics["memory"]] == held
    for row in metrics["memory"]:
        assert row["gradients"] == row["parameters"]  # one gradient per parameter held
        # Adam: two running averages per parameter, and one step count per tensor (4 bytes).
        assert row["optimizer_state"] == 2 * row["parameters"] + 4 * 4


# ---------------------------------------------------------------------------------------------
# The checkpoint: torchrun restarts a crashed job, which resumes; another --tp loads it
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """torchrun, 2 ranks, TP 2: a checkpoint every epoch, rank 1 raises in epoch 2, torchrun
    starts both again (--max-restarts 1), and they resume from epoch 1."""
    out_dir = tmp_path_factory.mktemp("lesson09_restart")
    result = run_torchrun(LESSON, *CPU, *TP, "--save-every", 1, "--out-dir", out_dir,
                          torchrun_args=["--max-restarts", 1], patch="raise-on-rank-1")
    return result, out_dir


def test_torchrun_restarts_and_the_resume_is_bitwise(lesson_run, restarted):
    result, out_dir = restarted
    assert result.returncode == 0, result.stdout + result.stderr
    assert "injected failure on rank 1" in result.stderr
    assert ("1 of 20 epochs done, written by --dp 1 --tp 2 on 2 ranks, "
            "loaded by --dp 1 --tp 2 on 2") in result.stdout
    metrics = read_metrics(out_dir)
    assert (metrics["launcher"], metrics["resumed_after_epoch"]) == ("torchrun", 1)
    _, uninterrupted = lesson_run(LESSON, *CPU, *TP)
    assert metrics["train_loss"] == read_metrics(uninterrupted)["train_loss"]
    ours, theirs = load_weights(out_dir), load_weights(uninterrupted)
    assert all((ours[name] == theirs[name]).all() for name in theirs)


def test_the_checkpoint_loads_into_another_tp_and_trains_on(lesson_run, restarted, tmp_path):
    # TP 2's slices, read by one process (--tp 1): one more epoch ends on lesson 02's 21st
    # at one rank, which needs the weights and Adam's state both put back together.
    _, out_dir = restarted
    shutil.copytree(out_dir / "checkpoint", tmp_path / "checkpoint")
    result = run_lesson(LESSON, *CPU, "--tp", 1, "--epochs", 21, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "written by --dp 1 --tp 2 on 2 ranks, loaded by --dp 1 --tp 1 on 1" in result.stdout
    _, lesson02 = lesson_run("02_multi_gpu_spawn", *CPU, "--world-size", 1, "--epochs", 21)
    assert max_weight_difference(tmp_path, lesson02) < TOLERANCE
    # A checkpoint of another shape: the check that stops the run in one line, before any rank
    # starts (the --tp 3 test below runs that path as a learner does).
    lesson = import_lesson(LESSON)
    checkpoint = lesson.latest_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(SystemExit) as stop:
        import_guard_rails(LESSON).check_checkpoint(
            checkpoint, lesson.parse_args(["--layers", "3", "--epochs", "21"]))
    assert "holds a model with --layers 1, not 3" in stop.value.code


# ---------------------------------------------------------------------------------------------
# A mesh that cannot split the model: one line, before any rank starts
# ---------------------------------------------------------------------------------------------
def test_a_tp_that_does_not_divide_the_model_gets_one_line(tmp_path):
    result = run_lesson(LESSON, *CPU, "--tp", 3, "--out-dir", tmp_path)
    assert_one_line_error(result, "--tp 3 does not divide --hidden 64")
    assert "starting" not in result.stdout
    lesson, guard_rails = import_lesson(LESSON), import_guard_rails(LESSON)
    with pytest.raises(SystemExit) as stop:
        guard_rails.check_tensor_parallel(lesson.parse_args(["--layers", "2"]))
    assert stop.value.code.startswith("error: --layers 2 makes 3 linear layers")
    assert "use an odd --layers" in stop.value.code


@pytest.mark.parametrize("lesson", [LESSON, "10_pipeline_parallel"])
def test_the_gloo_fallback_note_is_printed_once_not_once_per_rank(lesson, monkeypatch, capsys):
    # More ranks than GPUs: gloo on the CPU, said once. Under torchrun every process decides
    # for itself, so only RANK 0 prints; mp.spawn's parent (no RANK) decides once for all.
    choose_backend = import_lesson(lesson).choose_backend
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for rank, printed in (("0", 1), ("1", 0), ("3", 0), (None, 1)):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        assert choose_backend("auto", 4) == "gloo"
        assert capsys.readouterr().out.count("note: 4 ranks but 1 GPU(s)") == printed, rank


def test_under_torchrun_dp_is_its_ranks_over_tp_or_one_line(monkeypatch):
    lesson, guard_rails = import_lesson(LESSON), import_guard_rails(LESSON)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    args = lesson.parse_args(["--tp", "2"])
    args.world_size = 8  # torchrun's WORLD_SIZE
    guard_rails.check_tensor_parallel(args)
    assert args.dp == 4
    args = lesson.parse_args(["--tp", "2", "--dp", "3"])
    args.world_size = 8
    with pytest.raises(SystemExit) as stop:
        guard_rails.check_tensor_parallel(args)
    assert stop.value.code.startswith("error: --dp 3 x --tp 2 = 6 ranks, but torchrun started 8")


def test_a_tp_group_across_nodes_is_named_once_by_rank_0(monkeypatch, capsys):
    # torchrun numbers each node's ranks in turn; TP group d is ranks d*tp .. d*tp + tp - 1.
    lesson, guard_rails = import_lesson(LESSON), import_guard_rails(LESSON)
    for tp, dp, per_node, group in [(4, 3, 6, "[4, 5, 6, 7] spans nodes 0 to 1"),
                                    (2, 3, 3, "[2, 3] spans nodes 0 to 1"), (2, 4, 4, None)]:
        guard_rails.note_groups_across_nodes(tp, dp, per_node)
        printed = capsys.readouterr().out
        assert (f"TP group {group}" in printed) if group else printed == "", (tp, per_node)
    # Under torchrun, from check_tensor_parallel: rank 0 says it, the other ranks do not.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        args = lesson.parse_args(["--tp", "4", "--hidden", "64"])
        args.world_size = 12
        guard_rails.check_tensor_parallel(args)
        assert ("TP group [4, 5, 6, 7] spans nodes 0 to 1" in capsys.readouterr().out) == said


# Two "nodes" (forked processes) compare the backend each chose through a store that stands for
# torchrun's agent store: the same, both go on; different, both stop with one line. A second
# attempt (TORCHELASTIC_RESTART_COUNT) reads its own keys, not the first one's.
NODES_COMPARE = """
import multiprocessing, os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import guard_rails

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE="2",
                  GROUP_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")


def node(n, backend):
    os.environ.update(GROUP_RANK=str(n), RANK=str(n))
    guard_rails.check_backends_agree(backend, 20)
    print(f"node {n} goes on", flush=True)


for attempt, backends in enumerate([("gloo", "gloo"), ("nccl", "gloo")]):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    nodes = [multiprocessing.get_context("fork").Process(target=node, args=(n, backend))
             for n, backend in enumerate(backends)]
    for process in nodes:
        process.start()
    for process in nodes:
        process.join(60)
    print(f"attempt {attempt}: exit codes", [process.exitcode for process in nodes], flush=True)
"""


def test_nodes_that_chose_different_backends_stop_in_one_line():
    result = subprocess.run([sys.executable, "-c", NODES_COMPARE, str(ROOT / LESSON)],
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert "attempt 0: exit codes [0, 0]" in result.stdout, output
    assert result.stdout.count("goes on") == 2, output
    assert "attempt 1: exit codes [1, 1]" in result.stdout, output
    assert result.stderr.count("error: the nodes chose different backends (node 0 nccl, node 1 "
                               "gloo)") == 2, output


# Three gloo ranks forked from one process build a 1 x 2 mesh: ranks 0 and 1 are its TP group,
# rank 2 makes every group too (new_group's rule) and gets None, as the benchmark's ranks beyond
# a smaller case's mesh do (benchmarks/bench/ranks.py calls build_mesh, mesh.py's).
BEYOND_THE_MESH = """
import datetime, multiprocessing, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from mesh import build_mesh


def rank(r, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=r, world_size=3, timeout=datetime.timedelta(seconds=60))
    mesh = build_mesh(torch.device("cpu"), 60, dp=1, tp=2)
    # One write per line: print writes its parts apart, and the ranks share one pipe.
    os.write(1, f"{r} {None if mesh is None else mesh['tp'].mesh.tolist()}\\n".encode())
    dist.barrier()
    dist.destroy_process_group()


port = sys.argv[2]
ranks = [multiprocessing.get_context("fork").Process(target=rank, args=(r, port))
         for r in range(3)]
for process in ranks:
    process.start()
for process in ranks:
    process.join(60)
print("exit codes", [process.exitcode for process in ranks], flush=True)
"""


def test_a_rank_beyond_the_mesh_makes_its_groups_and_gets_none():
    result = subprocess.run([sys.executable, "-c", BEYOND_THE_MESH, str(ROOT / LESSON),
                             str(free_port())], capture_output=True, text=True, timeout=120)
    assert "exit codes [0, 0, 0]" in result.stdout, result.stdout + result.stderr
    assert sorted(result.stdout.splitlines()[:3]) == ["0 [0, 1]", "1 [0, 1]", "2 None"]


# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")


@needs_two
@pytest.mark.gpu
def test_gpu_tensor_parallel_matches_one_process(lesson_run):
    result, out_dir = lesson_run(LESSON, "--backend", "nccl", *TP)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    _, one = lesson_run("02_multi_gpu_spawn", "--backend", "nccl", "--world-size", 1)
    # cuBLAS picks its own order of sums for each shape: looser than on the CPU.
    assert max_weight_difference(out_dir, one) < 1e-4


@pytest.mark.skipif(GPUS != 1, reason="needs exactly 1 GPU: shows the gloo fallback note")
@pytest.mark.gpu
def test_gpu_one_gpu_and_two_ranks_fall_back_to_gloo(lesson_run):
    result, out_dir = lesson_run(LESSON, *TP)
    assert "note: 2 ranks but 1 GPU(s)" in result.stdout
    assert read_metrics(out_dir)["backend"] == "gloo"
