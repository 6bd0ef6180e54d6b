"""Lesson 07, run as a learner runs it: python 07_sharding/train.py (mp.spawn, gloo/CPU), and
torchrun on two nodes.

The same training as DDP, with less held per rank: ZeRO-1 and FSDP end with lesson 02's weights,
each rank holds the bytes the arithmetic says, and the sharded checkpoint resumes exactly, also
under another strategy and world size, and across nodes after a torchrun restart. The GPU tier
(NCCL) is at the end of this file."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import (
    GPUS,
    NO_GPUS,
    ROOT,
    assert_final_pt_holds_cpu_tensors,
    assert_good_run,
    assert_one_line_error,
    error_lines,
    evaluate_single_process,
    free_port,
    fsdp_rows,
    import_guard_rails,
    import_lesson,
    lesson02_run,
    load_weights,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_nodes,
    small_disk,
)

LESSON = "07_sharding"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
SHARDED = ["zero1", "fsdp"]
# The wine MLP's tensors (hidden 64) as (rows, elements per row): FSDP cuts each along its rows.
SHAPES = {"fc1.weight": (64, 13), "fc1.bias": (64, 1), "fc2.weight": (3, 64), "fc2.bias": (3, 1)}
FLOAT = 4  # bytes of a float32
ADAM_STEP = 4  # bytes of Adam's step count, one float32 scalar per parameter tensor


def two_ranks(lesson_run, strategy, *args, patch=None):
    """2 ranks x batch 16 = the global batch 32 of the comparisons below."""
    return lesson_run(LESSON, *CPU, "--strategy", strategy, "--world-size", 2,
                      "--batch-size", 16, *args, patch=patch)


def memory(out_dir):
    """Per rank: {"parameters", "gradients", "optimizer_state", "peak"} in bytes."""
    return read_metrics(out_dir)["memory"]


def assert_same_weights(out_dir, reference_dir):
    """final.pt of both runs: the same tensor names (so no comparison below is over nothing),
    each equal to the last bit."""
    ours, reference = load_weights(out_dir), load_weights(reference_dir)
    assert sorted(ours) == sorted(reference) == sorted(SHAPES)
    assert all(torch.equal(ours[name], reference[name]) for name in SHAPES)


@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_every_strategy_learns_and_writes_lesson_01s_weights(lesson_run, strategy):
    result, out_dir = two_ranks(lesson_run, strategy)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["strategy"], metrics["backend"], metrics["hidden"]) == (strategy, "gloo", 64)
    # final.pt is the full model, gathered from the shards: lesson 01's model evaluates it to
    # the count the ranks made together.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert f"memory per rank ({strategy}, 2 ranks, hidden 64)" in result.stdout
    assert metrics["peak_memory_measure"] == "max_rss"
    assert len(metrics["memory"]) == 2 and all(row["peak"] > 0 for row in metrics["memory"])


def test_ddp_strategy_is_lesson_02_to_the_last_bit(lesson_run):
    _, ours = two_ranks(lesson_run, "ddp")
    assert max_weight_difference(ours, lesson02_run(lesson_run, 2)[1]) == 0.0


@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_training_takes_the_steps_of_ddp_and_of_one_process(lesson_run, strategy):
    _, sharded = two_ranks(lesson_run, strategy)
    assert max_weight_difference(sharded, lesson02_run(lesson_run, 2)[1]) < 1e-5
    assert max_weight_difference(sharded, lesson02_run(lesson_run, 1)[1]) < 1e-5


@pytest.mark.parametrize("strategy", SHARDED)
def test_control_without_gradient_reduction_gives_other_weights(lesson_run, strategy):
    # The same run with the gradients never combined across ranks (tests/patched_lesson.py):
    # the comparison above must fail, or it could not tell a sharded step from a local one.
    result, alone = two_ranks(lesson_run, strategy, patch="no-gradient-sync")
    assert result.returncode == 0, result.stderr
    assert max_weight_difference(alone, lesson02_run(lesson_run, 1)[1]) > 1e-2


def ddp_bytes():
    """What DDP holds on every rank: all of it."""
    params = sum(rows * width for rows, width in SHAPES.values()) * FLOAT
    return {"parameters": params, "gradients": params,
            "optimizer_state": 2 * params + ADAM_STEP * len(SHAPES)}  # exp_avg, exp_avg_sq


def memory_run(lesson_run, request, strategy, world_size):
    if world_size == 2:
        return memory(two_ranks(lesson_run, strategy)[1])  # the runs above
    if (strategy, world_size) == ("zero1", 1):  # the resume from fsdp below trains 19 epochs
        return memory(request.getfixturevalue("zero1_resumed_from_fsdp")[1])
    result, out_dir = lesson_run(LESSON, *CPU, "--strategy", strategy, "--world-size",
                                 world_size, "--epochs", 2)
    assert result.returncode == 0, result.stderr
    return memory(out_dir)


def test_ddp_holds_everything_on_every_rank(lesson_run):
    rows = memory(two_ranks(lesson_run, "ddp")[1])
    assert [{k: v for k, v in row.items() if k != "peak"} for row in rows] == [ddp_bytes()] * 2


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fsdp_holds_one_nth_of_everything(lesson_run, request, world_size):
    full = ddp_bytes()
    rows = memory_run(lesson_run, request, "fsdp", world_size)
    assert len(rows) == world_size
    for rank, row in enumerate(rows):
        # Exactly this rank's rows of each tensor; 1/N of DDP's up to the one row per tensor
        # by which the uneven ones (fc2's 3 rows over 2 or 4 ranks) differ between ranks.
        params = sum(fsdp_rows(rows_, rank, world_size) * width
                     for rows_, width in SHAPES.values()) * FLOAT
        assert row["parameters"] == row["gradients"] == params
        assert row["optimizer_state"] == 2 * params + ADAM_STEP * len(SHAPES)
        padding = sum(width for _, width in SHAPES.values()) * FLOAT
        for key in ("parameters", "gradients", "optimizer_state"):
            assert abs(row[key] - full[key] / world_size) <= 2 * padding, (key, row)
    # Every element is held by exactly one rank.
    assert sum(row["parameters"] for row in rows) == full["parameters"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero1_holds_one_nth_of_the_optimizer_state_by_whole_tensors(lesson_run, request,
                                                                    world_size):
    full = ddp_bytes()
    rows = memory_run(lesson_run, request, "zero1", world_size)
    assert len(rows) == world_size
    # Parameters and gradients stay whole on every rank, as under DDP.
    assert all(row["parameters"] == row["gradients"] == full["parameters"] for row in rows)
    # Adam's state of each tensor is held by exactly one rank, none twice ...
    assert sum(row["optimizer_state"] for row in rows) == full["optimizer_state"]
    # ... and ZeroRedundancyOptimizer deals whole tensors, largest first, to the rank with
    # the fewest elements so far: a rank's share is 1/N up to one tensor, the largest
    # (fc1.weight, 13 x 64), so no rank holds more than that tensor's state or 1/N plus it.
    largest = 2 * 64 * 13 * FLOAT + ADAM_STEP
    for row in rows:
        assert row["optimizer_state"] <= max(largest, full["optimizer_state"] / world_size
                                             + largest)
        assert row["optimizer_state"] > 0 or world_size > len(SHAPES)
    if world_size > 1:
        assert max(row["optimizer_state"] for row in rows) < full["optimizer_state"]


# Two training steps of the lesson's wrap_model (sharding.py) under fsdp on 2 gloo ranks (the
# second forked from the first, so torch is imported once), counting FSDP's all-gathers
# (dist.all_gather_single, which FSDP2's DefaultAllGather calls:
# torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) and noting which layers are whole (a
# plain tensor in place of a DTensor shard) at each all-gather and as each layer computes.
COUNT_ALL_GATHERS = """
import json, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[1])
import train


def rank_main(rank, store):
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model = train.wrap_model(train.WineMLP(), "fsdp", torch.device("cpu"))
    events = []

    def whole():
        return sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters()
                       if not isinstance(p, DTensor)})

    all_gather_single = dist.all_gather_single

    def counted(output, *args, **kwargs):
        events.append(["all-gather", output.numel(), whole()])
        return all_gather_single(output, *args, **kwargs)

    dist.all_gather_single = counted
    for name in ("fc1", "fc2"):
        getattr(model, name).register_forward_pre_hook(
            lambda *_, name=name: events.append(["forward", name, whole()]))
    for _ in range(2):
        events.append(["step"])
        F.cross_entropy(model(torch.randn(8, 13)), torch.randint(0, 3, (8,))).backward()
    if rank == 0:
        print(json.dumps(events))
    dist.destroy_process_group()


mp.start_processes(rank_main, args=(sys.argv[2],), nprocs=2, start_method="fork")
"""


def test_fsdp_gathers_one_layer_at_a_time_never_the_model(tmp_path):
    result = subprocess.run([sys.executable, "-c", COUNT_ALL_GATHERS, str(ROOT / LESSON),
                             str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = json.loads(result.stdout.splitlines()[-1])
    # Each layer's all-gather: its rows padded to a multiple of the 2 ranks, never the model's.
    size = {layer: sum(-(-rows // 2) * 2 * width for name, (rows, width) in SHAPES.items()
                       if name.startswith(layer)) for layer in ("fc1", "fc2")}
    one_step = [
        ["all-gather", size["fc1"], []], ["forward", "fc1", ["fc1"]],  # forward: one layer whole
        ["all-gather", size["fc2"], []], ["forward", "fc2", ["fc2"]],  # fc1 freed first
        # backward: each layer gathered again (both are resharded after forward), fc2 first,
        # and fc1 fetched ahead while fc2 is still whole: two layers at once, as the README says
        ["all-gather", size["fc2"], []], ["all-gather", size["fc1"], ["fc2"]],
    ]
    assert events == [["step"], *one_step] * 2, events


@pytest.fixture(scope="module")
def crashed_and_resumed(lesson_run, tmp_path_factory):
    """fsdp, 2 ranks: checkpoint after every epoch, rank 1 raises at the start of epoch 2;
    a copy of the checkpoint is kept; the same command runs again and resumes."""
    out_dir = tmp_path_factory.mktemp("lesson07_crash")
    args = [*CPU, "--strategy", "fsdp", "--world-size", 2, "--batch-size", 16,
            "--save-every", 1, "--out-dir", out_dir]
    crashed = run_lesson(LESSON, *args, patch="raise-on-rank-1")
    saved = out_dir / "checkpoint" / "epoch_0001"
    kept = tmp_path_factory.mktemp("lesson07_kept") / "checkpoint" / "epoch_0001"
    shutil.copytree(saved, kept)
    # A save of epoch 2 that was cut short: its files and DCP's .metadata, not the checksums.json
    # that a save writes last. It must not be loaded.
    shutil.copytree(saved, out_dir / "checkpoint" / "epoch_0002")
    (out_dir / "checkpoint" / "epoch_0002" / "checksums.json").unlink()
    resumed = run_lesson(LESSON, *args)
    return crashed, resumed, out_dir, kept.parent.parent


def test_a_crash_and_a_resume_end_bitwise_equal_to_a_run_that_never_crashed(
        lesson_run, crashed_and_resumed):
    crashed, resumed, out_dir, _ = crashed_and_resumed
    assert crashed.returncode != 0
    assert "injected failure on rank 1" in crashed.stderr
    assert crashed.stderr.strip().splitlines()[-1].startswith("error: rank 1 failed")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "epoch_0001: 1 of 20 epochs done, written by fsdp on 2 ranks" in resumed.stdout
    printed = [line.split()[1] for line in resumed.stdout.splitlines() if line.startswith("epoch")]
    assert printed == [f"{epoch}/20" for epoch in range(2, 21)], resumed.stdout
    _, uninterrupted = two_ranks(lesson_run, "fsdp")
    assert read_metrics(out_dir)["train_loss"] == read_metrics(uninterrupted)["train_loss"]
    assert_same_weights(out_dir, uninterrupted)
    # Only the last finished checkpoint is left; the unfinished one was replaced.
    assert [p.name for p in (out_dir / "checkpoint").iterdir()] == ["epoch_0020"]


@pytest.fixture(scope="module")
def zero1_resumed_from_fsdp(crashed_and_resumed):
    """The fsdp checkpoint of 2 ranks after epoch 1, resumed by zero1 on 1 rank x batch 32."""
    *_, kept = crashed_and_resumed
    out_dir = kept / "zero1_from_fsdp"
    shutil.copytree(kept / "checkpoint", out_dir / "checkpoint")
    result = run_lesson(LESSON, *CPU, "--strategy", "zero1", "--world-size", 1,
                        "--out-dir", out_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, out_dir


def test_a_checkpoint_loads_into_another_strategy_and_world_size(lesson_run,
                                                                 zero1_resumed_from_fsdp):
    # The same global batch, so the model and Adam's state, loaded correctly, make the run end
    # with the weights of the fsdp run that never stopped. (Without Adam's state it would not.)
    result, out_dir = zero1_resumed_from_fsdp
    assert "written by fsdp on 2 ranks, loaded by zero1 on 1" in result.stdout
    _, uninterrupted = two_ranks(lesson_run, "fsdp")
    assert max_weight_difference(out_dir, uninterrupted) < 1e-5


def test_zero1s_checkpoint_loads_into_ddp_on_one_rank_and_trains_on(lesson_run, tmp_path):
    # Each zero1 rank wrote Adam's state of its own tensors only; DDP needs all of it. Loaded
    # with nothing left to train, the weights come back to the last bit:
    _, zero1 = two_ranks(lesson_run, "zero1")
    shutil.copytree(zero1 / "checkpoint", tmp_path / "checkpoint")
    ddp = [*CPU, "--strategy", "ddp", "--world-size", 1, "--batch-size", 32, "--out-dir", tmp_path]
    result = run_lesson(LESSON, *ddp)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "20 of 20 epochs done, written by zero1 on 2 ranks, loaded by ddp on 1" in result.stdout
    # Nothing trained here: one line says so, and no table shows 0 bytes of gradients.
    assert "epoch_0020 already holds all 20 epochs: nothing left to train" in result.stdout
    assert "memory per rank" not in result.stdout
    assert_same_weights(tmp_path, zero1)
    # One more epoch, with the same global batch, ends within 1e-5 of a zero1 run of 21 epochs
    # that never stopped: Adam's state came back too. (Adam started afresh moves each weight by
    # about the learning rate, 1e-2, a step: 0.04 apart after the epoch, measured with
    # tools/mutants.py's 07-adam-state-not-loaded.)
    result = run_lesson(LESSON, *ddp, "--epochs", 21)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_metrics(tmp_path)["resumed_after_epoch"] == 20
    _, never_stopped = two_ranks(lesson_run, "zero1", "--epochs", 21)
    assert max_weight_difference(tmp_path, never_stopped) < 1e-5


def test_a_checkpoint_of_another_width_is_refused_in_one_line(lesson_run, tmp_path):
    _, zero1 = two_ranks(lesson_run, "zero1")
    shutil.copytree(zero1 / "checkpoint", tmp_path / "checkpoint")
    result = run_lesson(LESSON, *CPU, "--hidden", 128, "--out-dir", tmp_path)
    assert_one_line_error(result, "holds a model with --hidden 64, not 128",
                          "resume with --hidden 64")
    result = run_lesson(LESSON, *CPU, "--epochs", 5, "--out-dir", tmp_path)
    assert_one_line_error(result, "has 20 epochs done, more than --epochs 5")
    metadata = tmp_path / "checkpoint" / "epoch_0020" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])  # damaged
    result = run_lesson(LESSON, *CPU, "--out-dir", tmp_path)
    assert_one_line_error(result, "is damaged: its file .metadata is cut short (100 of its ",
                          "delete")
    assert not (tmp_path / "final.pt").exists()  # nothing trained from scratch in its place


# ---------------------------------------------------------------------------------------------
# Two nodes, started with torchrun: each on half of this machine's cores
# ---------------------------------------------------------------------------------------------
def torchrun_node(node_rank, port, out_dir, *args, torchrun_args=(), patch=None):
    """One node's command: torchrun with the static rendezvous (--node-rank, rank 0's address),
    one process, FSDP with batch 16, so two nodes are two_ranks("fsdp") above. taskset gives
    each node half of this machine's cores, as on two machines of that size: its one rank then
    runs as many threads as each of the two spawned ranks does here, and the runs compute
    alike, to the bit."""
    script = [str(ROOT / LESSON / "train.py")]
    if patch:
        script = [str(ROOT / "tests" / "patched_lesson.py"), script[0], patch]
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    mine = cores[node_rank * half:(node_rank + 1) * half] or cores[:half]
    return ["taskset", "-c", ",".join(map(str, mine)), sys.executable, "-m",
            "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
            str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *map(str, torchrun_args), *script, *CPU, "--strategy", "fsdp", "--batch-size", "16",
            "--out-dir", str(out_dir), *map(str, args)]


needs_taskset = pytest.mark.skipif(shutil.which("taskset") is None,
                                   reason="needs taskset (util-linux) to give each node its cores")


@needs_taskset
def test_two_nodes_crash_restart_and_end_bitwise_equal_to_one_machine(lesson_run, tmp_path):
    # Rank 1, the only rank of node 1, raises at the start of epoch 2 (not in the restart);
    # torchrun restarts both nodes' ranks, and they resume from the checkpoint both wrote.
    port = free_port()
    node0, node1 = run_nodes([
        (torchrun_node(n, port, tmp_path, "--save-every", 1, torchrun_args=["--max-restarts", 1],
                       patch="raise-on-rank-1"), {}) for n in (0, 1)])
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr + node1.stderr
    assert "injected failure on rank 1" in node1.stderr
    assert "epoch_0001: 1 of 20 epochs done, written by fsdp on 2 ranks" in node0.stdout
    assert "test accuracy" not in node1.stdout  # global rank 0, on node 0, alone prints
    # Restarts on two nodes with torchrun's one store: rank 0 names the switch that c10d needs.
    assert node0.stdout.count("set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == 1, node0.stdout
    # The rank that raised left with its traceback and exit code 1, not gloo's teardown abort
    # (rank_guard and leave_process; tools/repro_teardown.py --crash).
    assert "terminate called" not in node0.stderr + node1.stderr
    _, one_machine = two_ranks(lesson_run, "fsdp")
    metrics = read_metrics(tmp_path)
    assert (metrics["launcher"], metrics["world_size"], metrics["resumed_after_epoch"]) == (
        "torchrun", 2, 1)
    assert metrics["train_loss"] == read_metrics(one_machine)["train_loss"]
    assert_same_weights(tmp_path, one_machine)
    # One checkpoint, with a file from the rank on each node.
    assert sorted(p.name for p in (tmp_path / "checkpoint" / "epoch_0020").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "progress.json"]


@needs_taskset
def test_nodes_without_a_shared_out_dir_stop_before_training(tmp_path):
    # Two --out-dir folders stand for two nodes' own disks: node 1 cannot see what rank 0 writes.
    port = free_port()
    out_dirs = [tmp_path / "node0", tmp_path / "node1"]
    node0, node1 = run_nodes([(torchrun_node(n, port, out_dirs[n]), {}) for n in (0, 1)])
    assert node0.returncode != 0 and node1.returncode != 0
    errors = error_lines(node0.stderr)
    assert len(errors) == 1, node0.stderr
    for fragment in ("rank 1 (host", "cannot see", "on a filesystem they all share"):
        assert fragment in errors[0], errors[0]
    assert not error_lines(node1.stderr), node1.stderr  # rank 0 speaks for every rank
    assert "epoch" not in node0.stdout  # stopped before the first step
    assert not list((out_dirs[0] / "checkpoint").iterdir())


def test_a_checkpoint_with_a_shard_missing_or_cut_short_is_refused_in_one_line(lesson_run,
                                                                             tmp_path):
    # Decided before any rank starts, from what .metadata says each file holds: not every
    # rank's CheckpointException from dcp.load. One rank's file deleted, as a learner meets it:
    _, zero1 = two_ranks(lesson_run, "zero1")
    shutil.copytree(zero1 / "checkpoint", tmp_path / "checkpoint")
    folder = tmp_path / "checkpoint" / "epoch_0020"
    (folder / "__1_0.distcp").unlink()
    result = run_lesson(LESSON, *CPU, "--out-dir", tmp_path, env=NO_GPUS)
    assert_one_line_error(result, f"{folder} is damaged: its file __1_0.distcp is missing",
                          f"delete {folder} to start afresh")
    assert not (tmp_path / "final.pt").exists()
    # A file cut short, checked by the same function in this process; with an older finished
    # checkpoint beside it, the line says to resume from that one.
    shutil.copy(zero1 / "checkpoint" / "epoch_0020" / "__1_0.distcp", folder)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    shutil.copytree(zero1 / "checkpoint" / "epoch_0020", tmp_path / "checkpoint" / "epoch_0010")
    args = import_lesson(LESSON).parse_args(["--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        import_guard_rails(LESSON).check_checkpoint(str(folder), args)
    assert str(stop.value.code).startswith(
        f"error: {folder} is damaged: its file __0_0.distcp is cut short (1000 of its ")
    assert f"delete {folder} to resume from {tmp_path / 'checkpoint' / 'epoch_0010'}" in str(
        stop.value.code)


def test_a_shard_with_other_bytes_of_its_size_is_refused_by_its_checksum(lesson_run, tmp_path):
    # DCP checks no checksum: one bit of a weight flipped in a shard loads without a word
    # (tools/repro_dcp_no_checksum.py shows it). The save's checksums.json, the folder's last
    # file, names every file's size and SHA-256, and the check before any rank starts uses it.
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "repro_dcp_no_checksum.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "read the changed shard without an error" in done.stdout
    _, zero1 = two_ranks(lesson_run, "zero1")
    shutil.copytree(zero1 / "checkpoint", tmp_path / "checkpoint")
    folder = tmp_path / "checkpoint" / "epoch_0020"
    sums = json.loads((folder / "checksums.json").read_text())
    assert sorted(sums) == sorted(p.name for p in folder.iterdir() if p.name != "checksums.json")
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # the same size, one bit other
    shard.write_bytes(data)
    args = import_lesson(LESSON).parse_args(["--out-dir", str(tmp_path)])
    guard_rails = import_guard_rails(LESSON)
    with pytest.raises(SystemExit) as stop:
        guard_rails.check_checkpoint(str(folder), args)
    assert stop.value.code == (
        f"error: {folder} is damaged: its file __1_0.distcp holds other bytes than its save "
        f"wrote (its SHA-256 is not checksums.json's); delete {folder} to start afresh, or "
        "choose another --out-dir")
    # A save cut short after DCP's .metadata, before its checksums: refused, not loaded.
    (folder / "checksums.json").unlink()
    with pytest.raises(SystemExit) as stop:
        guard_rails.check_checkpoint(str(folder), args)
    assert "it has no checksums.json, which its save writes last" in stop.value.code


def test_a_read_only_checkpoint_folder_stops_the_job_in_one_line(lesson_run, tmp_path):
    # The checkpoint folder on a filesystem mounted read-only (root ignores file modes, not a
    # read-only mount): rank 0 cannot write there, says so, and every rank stops at once.
    _, zero1 = two_ranks(lesson_run, "zero1")
    folder = tmp_path / "checkpoint"
    with small_disk(folder) as make_read_only:
        shutil.copytree(zero1 / "checkpoint", folder, dirs_exist_ok=True)
        make_read_only()
        result = run_lesson(LESSON, *CPU, "--epochs", 21, "--out-dir", tmp_path, env=NO_GPUS)
    assert_one_line_error(result, f"cannot write {folder} (Read-only file system)",
                          "the checkpoint epoch_0020 in it is intact", "make that filesystem")
    assert "lost contact" not in result.stderr
    assert "epoch " not in result.stdout  # stopped before training


def test_bad_input_gets_one_clear_line(tmp_path):
    result = run_lesson(LESSON, *CPU, "--hidden", 0, "--out-dir", tmp_path)
    assert_one_line_error(result, "--hidden must be at least 1")


# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL, with torch.cuda.max_memory_allocated per rank
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; none is visible here")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")


@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
@pytest.mark.gpu
@needs_gpu
def test_gpu_every_strategy_learns_and_measures_cuda_memory(lesson_run, strategy):
    world_size = min(GPUS, 2)
    result, out_dir = lesson_run(LESSON, "--backend", "nccl", "--strategy", strategy,
                                 "--world-size", world_size)
    metrics = assert_good_run(result, out_dir, world_size=world_size, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert metrics["peak_memory_measure"] == "cuda_max_allocated"
    full = ddp_bytes()
    assert len(metrics["memory"]) == world_size
    for row in metrics["memory"]:
        # Tensors only: at least what the rank still holds, and far below one cuBLAS workspace
        # (8 MiB by default, 32 MiB on recent GPUs), which memory_baseline made beforehand and
        # subtracts.
        held = row["parameters"] + row["gradients"] + row["optimizer_state"]
        assert held <= row["peak"] < 4 << 20, row
        if strategy == "fsdp":
            assert row["parameters"] <= full["parameters"] / world_size + 64 * FLOAT * 2
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert_final_pt_holds_cpu_tensors(out_dir)


@needs_two
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", SHARDED)
def test_gpu_sharded_math_matches_one_process(lesson_run, strategy):
    _, sharded = lesson_run(LESSON, "--backend", "nccl", "--strategy", strategy,
                            "--world-size", 2, "--batch-size", 16)
    _, one = lesson_run("02_multi_gpu_spawn", "--backend", "nccl", "--world-size", 1,
                        "--batch-size", 32)
    assert max_weight_difference(sharded, one) < 1e-4


@pytest.mark.gpu
@needs_gpu
def test_gpu_checkpoint_resumes_bitwise(lesson_run, tmp_path):
    world_size = min(GPUS, 2)
    args = ["--backend", "nccl", "--strategy", "fsdp", "--world-size", world_size, "--epochs", 4]
    _, uninterrupted = lesson_run(LESSON, *args)
    first = run_lesson(LESSON, *args[:-1], 2, "--out-dir", tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = run_lesson(LESSON, *args, "--out-dir", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "2 of 4 epochs done" in resumed.stdout
    assert_same_weights(tmp_path, uninterrupted)
    assert json.loads((tmp_path / "metrics.json").read_text())["resumed_after_epoch"] == 2


# The mesh FSDP shards over, on a machine with CUDA and a gloo group. Shown on the CPU by making
# torch believe that CUDA exists: init_device_mesh would then make a second group, with the
# 30-minute default timeout (torch/distributed/device_mesh.py); the lesson's mesh is its own
# group, with --timeout.
MESH_TIMEOUTS = """
import datetime, sys
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

sys.path.insert(0, sys.argv[1])
import train

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=7))
torch.cuda.is_available = lambda: True
train.wrap_model(train.WineMLP(), "fsdp", torch.device("cpu"))
for group in distributed_c10d._world.pg_map:
    print("group timeout:", group._get_backend(torch.device("cpu")).options._timeout)
"""


def test_the_fsdp_mesh_keeps_the_timeout_where_cuda_exists(tmp_path):
    result = subprocess.run([sys.executable, "-c", MESH_TIMEOUTS, str(ROOT / LESSON),
                             str(tmp_path / "store")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    timeouts = [line for line in result.stdout.splitlines() if line.startswith("group timeout")]
    assert timeouts == ["group timeout: 0:00:07"], result.stdout
