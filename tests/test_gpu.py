"""The GPU tier: the lessons on CUDA with NCCL. Skipped, with the reason, where there are no GPUs.

First every lesson as a learner first runs it, with no arguments: what its defaults must give
for this machine's GPU count (the preflight's GPU run is
test_00_preflight.py::test_gpu_commands). Then every lesson that torchrun may start, started by
it. Then the NCCL paths with flags: one GPU, and with two or more GPUs, world size 2 as well.
The rest of the tier sits beside each lesson's CPU tests under the same `gpu` marker (lesson 06's
precisions and torch.compile, lesson 07's strategies, lesson 08's gradient synchronisations, the
benchmark): `python -m pytest -m gpu -rA` runs all of it and lists what ran and what was skipped,
with the reason."""

import sys

import pytest
import torch

from helpers import (
    GPUS,
    ROOT,
    assert_final_pt_holds_cpu_tensors,
    assert_good_run,
    assert_one_line_error,
    check_ok,
    evaluate_single_process,
    free_port,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_nodes,
    run_torchrun,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible on this machine"),
]
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
NCCL_WORLD = min(GPUS, 2)


# --- every lesson with no arguments ----------------------------------------------------------
def test_lesson01_default_trains_on_the_gpu(lesson_run):
    result, out_dir = lesson_run("01_single_gpu")
    metrics = assert_good_run(result, out_dir, world_size=1, min_accuracy=0.95)
    assert metrics["device"] == "cuda"
    assert_final_pt_holds_cpu_tensors(out_dir)


# The bar for any number of ranks is the CPU tier's for world sizes other than 2: 90%. (On the
# CPU, gloo runs of lesson 02 with 1 to 8 ranks all score 35 of the 36 test wines.) Lesson 07's
# default is FSDP. Lesson 08's default run is checked in test_08_ddp_from_scratch.py.
@pytest.mark.parametrize("lesson", ["02_multi_gpu_spawn", "04_checkpointing",
                                    "06_ddp_in_practice", "07_sharding"])
def test_default_is_one_nccl_rank_per_gpu(lesson_run, lesson):
    result, out_dir = lesson_run(lesson)
    metrics = assert_good_run(result, out_dir, world_size=GPUS)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert f"starting {GPUS} ranks (nccl)" in result.stdout
    assert "note:" not in result.stdout  # nothing fell back to the CPU
    # The weights every rank trained on its own GPU are the ones rank 0 saved.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert_final_pt_holds_cpu_tensors(out_dir)


def test_lesson03_default_is_one_node_of_one_nccl_process_per_gpu(lesson_run):
    result, out_dir = lesson_run("03_multi_node")
    metrics = assert_good_run(result, out_dir, world_size=GPUS)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "spawn")
    assert (metrics["nnodes"], metrics["nproc_per_node"]) == (1, GPUS)
    assert [r["local_rank"] for r in metrics["ranks"]] == list(range(GPUS))
    assert_final_pt_holds_cpu_tensors(out_dir)


def test_lesson04_default_snapshot_is_written_from_rank_0s_gpu(lesson_run):
    _, out_dir = lesson_run("04_checkpointing")
    # Loaded without map_location, the tensors go back where they were saved from: rank 0's
    # GPU. Resuming maps them to each rank's own (test_lesson04_resumes_on_the_gpu_bitwise).
    saved = torch.load(out_dir / "snapshot.pt", weights_only=True)
    assert (saved["epochs_completed"], saved["world_size"]) == (20, GPUS)
    assert saved["model"]["fc1.weight"].device == torch.device("cuda", 0)


def test_lesson05_default_follows_the_plan_for_this_gpu_count(lesson_run):
    # The plan, written out: one GPU holds both stages of one rank; otherwise a rank per pair
    # of GPUs, rank r on cuda:2r and cuda:2r+1, and an odd GPU left idle.
    world_size = 1 if GPUS == 1 else GPUS // 2
    first_pair = ["cuda:0", "cuda:0"] if GPUS == 1 else ["cuda:0", "cuda:1"]
    result, out_dir = lesson_run("05_model_parallel_ddp")
    metrics = assert_good_run(result, out_dir, world_size=world_size)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert metrics["stage_devices"] == first_pair
    if GPUS == 1:
        assert "both stages of the model share cuda:0" in result.stdout
    elif GPUS % 2:
        assert f"cuda:{GPUS - 1} stays idle" in result.stdout
    else:
        assert "note:" not in result.stdout
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert_final_pt_holds_cpu_tensors(out_dir)


# Lessons 09 and 10 make groups of 2 ranks by default (a TP group, a pipeline of 2 stages), as
# many as the GPUs hold (--dp = GPUs // 2); with one GPU, one group of 2 ranks on the CPU, and a
# note. Lesson 08's default is tested beside its CPU tests, 11 to 13's beside theirs.
@pytest.mark.parametrize("lesson", ["09_tensor_parallel", "10_pipeline_parallel"])
def test_default_groups_of_two_fill_the_gpus(lesson_run, lesson):
    result, out_dir = lesson_run(lesson)
    world_size = 2 * max(1, GPUS // 2)
    check_ok(result)
    metrics = read_metrics(out_dir)
    assert (metrics["world_size"], metrics["test_total"]) == (world_size, 36)
    assert metrics["test_accuracy"] >= 0.9, metrics
    if GPUS == 1:
        assert "note: 2 ranks but 1 GPU(s)" in result.stdout
        assert (metrics["backend"], metrics["device"]) == ("gloo", "cpu")
    else:
        assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
        assert f"starting {world_size} ranks (nccl)" in result.stdout
    assert_final_pt_holds_cpu_tensors(out_dir)


def test_more_ranks_than_gpus_fall_back_to_gloo_and_say_so(lesson_run):
    result, out_dir = lesson_run("02_multi_gpu_spawn", "--world-size", GPUS + 1, "--epochs", 2)
    assert result.returncode == 0, result.stderr
    assert f"note: {GPUS + 1} ranks but {GPUS} GPU(s)" in result.stdout
    metrics = read_metrics(out_dir)
    assert (metrics["world_size"], metrics["backend"], metrics["device"]) == (
        GPUS + 1, "gloo", "cpu")


# --- torchrun, which starts the ranks itself --------------------------------------------------
# Every lesson whose start() accepts torchrun: one process per GPU, two at most. Lesson 05 needs a
# pair of GPUs per rank, or one GPU for its one rank: 1 process below 4 GPUs, then 2.
@pytest.mark.parametrize("lesson", ["03_multi_node", "04_checkpointing", "05_model_parallel_ddp",
                                    "06_ddp_in_practice", "07_sharding", "08_ddp_from_scratch",
                                    "09_tensor_parallel", "10_pipeline_parallel"])
def test_torchrun_starts_one_nccl_rank_per_gpu(lesson, tmp_path):
    nproc = max(1, min(GPUS // 2, 2)) if lesson == "05_model_parallel_ddp" else NCCL_WORLD
    tp = ["--tp", nproc] if lesson == "09_tensor_parallel" else []  # one TP group of them all
    tp += ["--stages", nproc] if lesson == "10_pipeline_parallel" else []  # one pipeline
    result = run_torchrun(lesson, *tp, "--out-dir", tmp_path, nproc=nproc)
    metrics = assert_good_run(result, tmp_path, world_size=nproc)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert "rank 0 listens on" not in result.stdout  # mp.spawn's line: torchrun started them
    if "launcher" in metrics:
        assert metrics["launcher"] == "torchrun"
    if lesson == "05_model_parallel_ddp":  # rank 0's stages, planned from its local rank
        assert metrics["stage_devices"] == (["cuda:0", "cuda:0"] if GPUS == 1
                                            else ["cuda:0", "cuda:1"])
    assert evaluate_single_process(tmp_path) == (metrics["test_correct"], 36)
    assert_final_pt_holds_cpu_tensors(tmp_path)


# --- the NCCL paths, with flags --------------------------------------------------------------
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


def test_lesson05_one_gpu_holds_both_stages(lesson_run):
    # One visible GPU, whatever the node has: the plan puts both stages on cuda:0, one rank.
    result, out_dir = lesson_run("05_model_parallel_ddp", env={"CUDA_VISIBLE_DEVICES": "0"})
    metrics = assert_good_run(result, out_dir, world_size=1, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert metrics["stage_devices"] == ["cuda:0", "cuda:0"]
    assert "both stages of the model share cuda:0" in result.stdout


@needs_two
def test_lesson05_splits_the_model_across_two_gpus(lesson_run):
    result, out_dir = lesson_run("05_model_parallel_ddp", "--world-size", 1)
    metrics = assert_good_run(result, out_dir, world_size=1, min_accuracy=0.95)
    assert metrics["backend"] == "nccl"
    assert metrics["stage_devices"] == ["cuda:0", "cuda:1"]
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


@pytest.mark.skipif(GPUS < 4, reason=f"needs 4+ GPUs; this machine has {GPUS}")
def test_lesson05_four_gpus_make_two_ranks_of_two(lesson_run):
    result, out_dir = lesson_run("05_model_parallel_ddp", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert metrics["stage_devices"] == ["cuda:0", "cuda:1"]  # rank 0's pair; rank 1 has 2 and 3


def test_lesson05_more_ranks_than_gpu_pairs_is_refused(tmp_path):
    # One GPU makes one rank (both stages on it), so ask for at least 2.
    too_many = max(2, GPUS // 2 + 1)
    result = run_lesson("05_model_parallel_ddp", "--world-size", too_many, "--out-dir", tmp_path)
    assert_one_line_error(result, "GPUs (2 per rank)", "--backend gloo")


def test_lesson03_one_node_nccl_one_process_per_gpu(lesson_run):
    result, out_dir = lesson_run("03_multi_node", "--nproc-per-node", NCCL_WORLD)
    metrics = assert_good_run(result, out_dir, world_size=NCCL_WORLD, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert [r["local_rank"] for r in metrics["ranks"]] == list(range(NCCL_WORLD))


@needs_two
def test_lesson03_two_nodes_of_one_gpu_each(tmp_path):
    # Each "node" sees one GPU, so on both the local rank 0 picks cuda:0, which is a different
    # physical GPU: what two single-GPU machines do.
    port = str(free_port())
    out_dirs = [tmp_path / "node0", tmp_path / "node1"]
    commands = [
        ([sys.executable, str(ROOT / "03_multi_node" / "train.py"), "--backend", "nccl",
          "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--master-port", port,
          "--out-dir", str(out_dirs[n])], {"CUDA_VISIBLE_DEVICES": str(n)})
        for n in (0, 1)
    ]
    results = run_nodes(commands)
    assert results[1].returncode == 0, results[1].stderr
    metrics = assert_good_run(results[0], out_dirs[0], world_size=2, min_accuracy=0.95)
    assert metrics["backend"] == "nccl"
    assert [r["node_rank"] for r in metrics["ranks"]] == [0, 1]


def test_lesson03_nccl_with_more_processes_than_gpus_is_refused(tmp_path):
    result = run_lesson("03_multi_node", "--backend", "nccl", "--nproc-per-node", GPUS + 1,
                        "--out-dir", tmp_path)
    assert_one_line_error(result, f"--nproc-per-node {GPUS + 1} with NCCL needs {GPUS + 1} GPUs",
                          "--backend gloo")


def test_lesson04_resumes_on_the_gpu_bitwise(lesson_run, tmp_path):
    # The snapshot is written from cuda:0 and loaded with map_location onto each rank's GPU.
    flags = ["--backend", "nccl", "--world-size", NCCL_WORLD, "--epochs", 6, "--save-every", 2]
    _, reference = lesson_run("04_checkpointing", *flags)
    crashed = run_lesson("04_checkpointing", *flags, "--crash-at-epoch", 3, "--out-dir", tmp_path)
    assert crashed.returncode != 0
    resumed = run_lesson("04_checkpointing", *flags, "--out-dir", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "2 of 6 epochs done, continuing at epoch 3" in resumed.stdout
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, reference) == 0
    assert metrics["train_loss"] == read_metrics(reference)["train_loss"]
