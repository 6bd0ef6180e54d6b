"""Lesson 04, run as a learner runs it: snapshots, a crash, and a resume that loses nothing.

"Bitwise equal" means torch.equal on every tensor of final.pt, and the same float for every
epoch's loss: a resumed run must be the run that never crashed, not merely close to it."""

import errno
import os
import pickle
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    NO_GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    error_lines,
    evaluate_single_process,
    free_port,
    import_lesson,
    load_weights,
    read_metrics,
    run_lesson,
    run_nodes,
    run_torchrun,
    small_disk,
)

LESSON = "04_checkpointing"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
# Six epochs, a snapshot every two, one rank dies at the start of epoch 3: the snapshot of
# epoch 2 is the one to resume from.
SHORT = ["--epochs", "6", "--save-every", "2"]
CRASH = ["--crash-at-epoch", "3"]


def assert_bitwise_equal(out_dir, reference_dir):
    weights, reference = load_weights(out_dir), load_weights(reference_dir)
    assert weights.keys() == reference.keys()
    for name in weights:
        assert torch.equal(weights[name], reference[name]), name
    assert read_metrics(out_dir)["train_loss"] == read_metrics(reference_dir)["train_loss"]


def snapshot(out_dir):
    return torch.load(os.path.join(out_dir, "snapshot.pt"), weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(lesson_run):
    """The reference run for a world size: the same flags, no crash. It runs under the
    log-writes patch, which only prints each save (test_only_global_rank_0_writes_each_snapshot
    reads those lines), so one run serves both."""
    def run(world_size):
        result, out_dir = uninterrupted_run(lesson_run, world_size)
        assert result.returncode == 0, result.stderr
        return out_dir
    return run


def uninterrupted_run(lesson_run, world_size):
    return lesson_run(LESSON, *CPU, *SHORT, "--world-size", world_size, patch="log-writes")


@pytest.fixture(scope="module")
def crashed(lesson_run):
    """A run that died at the start of epoch 3; each test resumes its own copy of its folder."""
    def run(world_size, copy_to):
        result, out_dir = lesson_run(LESSON, *CPU, *SHORT, *CRASH, "--world-size", world_size)
        shutil.copytree(out_dir, copy_to)
        return result, copy_to
    return run


def test_default_run_writes_a_snapshot_and_a_final_model(lesson_run):
    # No flags, GPUs hidden: a CPU machine's default, 2 gloo ranks, on any machine (test_gpu.py
    # runs it with the GPUs visible).
    result, out_dir = lesson_run(LESSON, env=NO_GPUS)
    metrics = assert_good_run(result, out_dir, world_size=2, min_accuracy=0.95)
    assert (metrics["backend"], metrics["device"]) == ("gloo", "cpu")
    assert (metrics["resumed_after_epoch"], metrics["launcher"]) == (0, "spawn")
    saved = snapshot(out_dir)
    assert sorted(saved) == ["epochs_completed", "model", "optimizer", "settings", "train_loss",
                             "world_size"]
    assert (saved["epochs_completed"], saved["world_size"]) == (20, 2)
    assert saved["train_loss"] == metrics["train_loss"]
    assert list(saved["model"]) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert saved["optimizer"]["state"], "the optimizer's state was not saved"
    # final.pt is lesson 01's model, for inference anywhere.
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)
    assert not list(out_dir.glob("*.tmp"))


# The same command again: with 2 ranks word for word, --crash-at-epoch still given (the crash
# must not happen a second time); with 1 rank without it.
@pytest.mark.parametrize("world_size, again", [(1, []), (2, CRASH)])
def test_crash_then_resume_equals_the_run_that_never_crashed(crashed, uninterrupted, tmp_path,
                                                            world_size, again):
    result, out_dir = crashed(world_size, tmp_path / "run")
    assert result.returncode != 0
    assert f"simulated crash of rank {world_size - 1} at the start of epoch 3" in result.stderr
    assert "Run the same command again to resume" in result.stderr
    assert snapshot(out_dir)["epochs_completed"] == 2
    assert not (out_dir / "final.pt").exists()

    # The resume runs under the log-loads patch, which only prints each rank's torch.load.
    resumed = run_lesson(LESSON, *CPU, *SHORT, *again, "--world-size", world_size, "--out-dir",
                         out_dir, patch="log-loads")
    metrics = assert_good_run_resumed(resumed, out_dir, world_size)
    assert metrics["resumed_after_epoch"] == 2
    # Each rank loads the snapshot once, onto its own device: map_location=self.device, which
    # setup_process_group makes cuda:<local rank> on GPUs and the CPU here. Without it, torch
    # puts the tensors where they were saved from (rank 0's cuda:0 on GPUs), and this says None.
    # Found anywhere in a line: rank 0 may be amid a print of its own (print writes its text,
    # then "\n") when rank 1 writes its line, which then ends rank 0's.
    loads = sorted(re.findall(r"load by rank \d+ onto \S+", resumed.stdout))
    assert loads == [f"load by rank {rank} onto cpu" for rank in range(world_size)], loads
    assert metrics["lr"] == snapshot(out_dir)["optimizer"]["param_groups"][0]["lr"] == 0.01
    assert_bitwise_equal(out_dir, uninterrupted(world_size))


def assert_good_run_resumed(result, out_dir, world_size):
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 of 6 epochs done, continuing at epoch 3" in result.stdout
    # No epoch repeated, none skipped: this run printed epochs 3 to 6, once each.
    printed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("epoch")]
    assert printed == ["3/6", "4/6", "5/6", "6/6"], result.stdout
    metrics = read_metrics(out_dir)
    assert (metrics["world_size"], len(metrics["train_loss"])) == (world_size, 6)
    return metrics


def test_torchrun_restarts_the_job_and_it_resumes(uninterrupted, tmp_path):
    result = run_torchrun(LESSON, *CPU, *SHORT, *CRASH, "--out-dir", tmp_path,
                          torchrun_args=["--max-restarts", 1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "simulated crash of rank 1 at the start of epoch 3" in result.stderr
    assert "2 of 6 epochs done, continuing at epoch 3" in result.stdout
    metrics = read_metrics(tmp_path)
    assert (metrics["launcher"], metrics["resumed_after_epoch"]) == ("torchrun", 2)
    assert_bitwise_equal(tmp_path, uninterrupted(2))


def test_a_crash_while_writing_leaves_the_previous_snapshot(uninterrupted, tmp_path):
    # The second snapshot (after epoch 4) is cut off halfway and rank 0 is killed.
    died = run_lesson(LESSON, *CPU, *SHORT, "--world-size", 2, "--out-dir", tmp_path,
                      patch="die-while-saving")
    assert died.returncode != 0
    assert "was killed (SIGKILL)" in died.stderr
    assert (tmp_path / "snapshot.pt.tmp").exists(), "the half-written file should be the tmp"
    assert snapshot(tmp_path)["epochs_completed"] == 2  # the previous one, intact
    resumed = run_lesson(LESSON, *CPU, *SHORT, "--world-size", 2, "--out-dir", tmp_path)
    assert_good_run_resumed(resumed, tmp_path, 2)
    assert_bitwise_equal(tmp_path, uninterrupted(2))


# Snapshots after epochs 2, 4 and 6, each written once, by rank 0; then the results.
WRITES = ["write snapshot.pt by rank 0"] * 3 + ["write final.pt by rank 0",
                                                 "write metrics.json by rank 0"]


def writes(result):
    """Each rank's writes, in order; found anywhere in a line, as the loads are."""
    return re.findall(r"write \S+ by rank \d+", result.stdout)


def test_only_global_rank_0_writes_each_snapshot(lesson_run):
    result, _ = uninterrupted_run(lesson_run, 2)
    assert result.returncode == 0, result.stderr
    assert writes(result) == WRITES, result.stdout


def test_only_global_rank_0_writes_when_two_nodes_share_the_out_dir(tmp_path):
    # Two torchrun "nodes" on this machine, one process each, sharing one --out-dir as nodes
    # share a network filesystem: each process is local rank 0 on its node, and only one of
    # them, global rank 0, may write. Deciding by the local rank, both would.
    port = free_port()
    results = run_nodes([
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
          "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
          str(ROOT / "tests" / "patched_lesson.py"), str(ROOT / LESSON / "train.py"),
          "log-writes", *CPU, *SHORT, "--out-dir", str(tmp_path)], {}) for node_rank in (0, 1)],
        timeout=180)
    for result in results:
        assert result.returncode == 0, result.stdout + result.stderr
    assert (writes(results[0]), writes(results[1])) == (WRITES, []), [r.stdout for r in results]


def test_a_snapshot_resumes_with_another_world_size(crashed, uninterrupted, tmp_path):
    before, after = 2, 1
    _, out_dir = crashed(before, tmp_path / "run")
    result = run_lesson(LESSON, *CPU, *SHORT, "--world-size", after, "--out-dir", out_dir)
    metrics = assert_good_run_resumed(result, out_dir, after)
    assert f"written by {before} ranks and {after} resume it" in result.stdout
    assert f"the global batch goes from {32 * before} to {32 * after}" in result.stdout
    # The epochs before the crash are the old world size's, to the last bit.
    losses = metrics["train_loss"]
    assert losses[:2] == read_metrics(uninterrupted(before))["train_loss"][:2]
    # The first epoch after the resume goes on from the snapshot's weights: below the last loss
    # the snapshot holds. A run that started afresh would be back near an untrained model's
    # first epoch, which is the highest of all.
    assert losses[2] < losses[1] < losses[0]
    assert losses[-1] < losses[0]
    assert metrics["test_accuracy"] >= 0.9
    assert evaluate_single_process(out_dir) == (metrics["test_correct"], 36)


def test_a_finished_snapshot_leaves_nothing_to_train(uninterrupted, tmp_path):
    # A finished 1-rank run, resumed by 2 ranks: nothing to train, one line that says what to do,
    # and final.pt and metrics.json written again from the snapshot's weights.
    reference = uninterrupted(1)
    shutil.copy(reference / "snapshot.pt", tmp_path / "snapshot.pt")
    result = run_lesson(LESSON, *CPU, *SHORT, "--world-size", 2, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    notes = [line for line in result.stdout.splitlines() if "nothing left to train" in line]
    assert notes == [f"note: {tmp_path / 'snapshot.pt'} already holds all 6 epochs: nothing left "
                     "to train; raise --epochs to go on, or another --out-dir starts afresh"]
    # No epoch trained, and no figure that would say otherwise.
    for absent in ("epoch ", "training on", "global batch", "resuming"):
        assert absent not in result.stdout, result.stdout
    assert result.stdout.count("test accuracy:") == 1
    metrics = read_metrics(tmp_path)
    assert (metrics["world_size"], metrics["resumed_after_epoch"]) == (2, 6)
    assert metrics["test_correct"] == read_metrics(reference)["test_correct"]
    assert_bitwise_equal(tmp_path, reference)


def write_bad_snapshot(kind, out_dir, good_dir):
    good = (good_dir / "snapshot.pt").read_bytes()
    path = out_dir / "snapshot.pt"
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "garbage":
        path.write_bytes(b"not a snapshot at all\n" * 20)
    elif kind == "not-a-snapshot":  # lesson 01's final.pt: weights only, no optimizer
        torch.save(load_weights(good_dir), path)
    elif kind == "other-model":
        saved = torch.load(good_dir / "snapshot.pt", weights_only=True)
        saved["model"]["fc1.weight"] = torch.zeros(32, 13)
        torch.save(saved, path)
    elif kind == "unsafe-pickle":  # an object weights_only=True must refuse to build
        torch.save({"model": {}, "note": shutil.which}, path)
    return path


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("truncated", "cannot be loaded"),
        ("garbage", "cannot be loaded"),
        ("unsafe-pickle", "cannot be loaded"),
        ("not-a-snapshot", "is not a snapshot of this lesson (no model, optimizer"),
        ("other-model", "holds a different model (size mismatch for fc1.weight"),
    ],
)
def test_a_bad_snapshot_is_refused_not_silently_replaced(uninterrupted, tmp_path, kind,
                                                         fragment):
    path = write_bad_snapshot(kind, tmp_path, uninterrupted(2))
    before = path.read_bytes()
    result = run_lesson(LESSON, *CPU, *SHORT, "--out-dir", tmp_path)
    line = assert_one_line_error(result, str(path), fragment)
    assert "delete it" in line
    assert path.read_bytes() == before  # not overwritten, not removed
    assert not (tmp_path / "final.pt").exists()  # no silent training from scratch


class RunsCodeWhenLoaded:
    """Unpickling it calls open(path, "w"): what a file that runs code as it loads can do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_the_lessons_own_loader_refuses_a_file_that_runs_code(tmp_path):
    # The run above stops such a file in the guard rails' check, before the lesson's own
    # torch.load sees it; here that load gets it, in this process. weights_only=True refuses it
    # before any code runs; weights_only=False would create the file.
    lesson = import_lesson(LESSON)
    ran = tmp_path / "code_ran"
    path = tmp_path / "snapshot.pt"
    torch.save({"model": RunsCodeWhenLoaded(ran), "optimizer": {}, "epochs_completed": 1,
                "train_loss": [1.0]}, path)
    model = lesson.WineMLP()
    trainer = SimpleNamespace(device=torch.device("cpu"), model=SimpleNamespace(module=model),
                              optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        lesson.Trainer.load_snapshot(trainer, path)
    assert not ran.exists()


def test_more_epochs_done_than_asked_for_is_refused(uninterrupted, tmp_path):
    shutil.copy(uninterrupted(2) / "snapshot.pt", tmp_path / "snapshot.pt")
    result = run_lesson(LESSON, *CPU, "--epochs", 3, "--out-dir", tmp_path)
    assert_one_line_error(result, "has 6 epochs done, more than --epochs 3",
                          "ask for at least 6")


def test_crash_at_epoch_zero_gets_one_clear_line(tmp_path):
    result = run_lesson(LESSON, *CPU, "--crash-at-epoch", 0, "--out-dir", tmp_path)
    assert_one_line_error(result, "--crash-at-epoch must be at least 1")


@pytest.mark.parametrize("flag, value, saved", [("--lr", "0.5", "0.01"), ("--seed", "7", "0"),
                                                ("--batch-size", "8", "32")])
def test_a_resume_with_other_settings_is_refused(uninterrupted, tmp_path, flag, value, saved):
    # The snapshot of a run with --lr 0.01 --seed 0 --batch-size 32 would continue as another
    # run: Adam's restored state puts the old rate back, the seed reorders the samples, the
    # batch size changes the steps. One line says which flag, both values and the way out.
    shutil.copy(uninterrupted(2) / "snapshot.pt", tmp_path / "snapshot.pt")
    result = run_lesson(LESSON, *CPU, *SHORT, flag, value, "--out-dir", tmp_path)
    assert_one_line_error(result, f"{flag} {value} differs", f"used {flag} {saved}",
                          f"resume it with {flag} {saved}", "another --out-dir")
    assert not (tmp_path / "metrics.json").exists()


def test_torchrun_ranks_wait_for_a_stalled_rank_only_as_long_as_the_timeout(tmp_path):
    # Under torchrun, as under mp.spawn, --timeout bounds every collective (not gloo's
    # 30-minute default): rank 1 sleeps for 5 minutes, rank 0 gives up after 5 s, and gloo's
    # message names the 5000 ms it waited. No clock is read: a run that waited for the sleeper
    # would pass run_torchrun's 240 s limit and fail the test.
    result = run_torchrun(LESSON, *CPU, *SHORT, "--timeout", 5, "--out-dir", tmp_path,
                          patch="stall-rank-1")
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert "rank 0 lost contact with the other ranks" in errors[0]
    assert "Timed out waiting 5000ms" in errors[0], errors[0]


def test_a_node_that_cannot_see_the_snapshot_stops_the_job(uninterrupted, tmp_path):
    # Two torchrun "nodes" on this machine, each with its own --out-dir, as on two machines
    # without a shared filesystem: node 0's folder holds a snapshot, node 1's is empty. Rank 0
    # decides to resume; rank 1 cannot see that file, and the job stops with one line.
    out_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for out_dir in out_dirs:
        out_dir.mkdir()
    shutil.copy(uninterrupted(2) / "snapshot.pt", out_dirs[0] / "snapshot.pt")
    port = free_port()
    results = run_nodes([
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
          "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
          str(ROOT / LESSON / "train.py"), *CPU, *SHORT, "--out-dir", str(out_dirs[node_rank])],
         {}) for node_rank in (0, 1)], timeout=180)
    for result in results:
        assert result.returncode != 0
    errors = error_lines(results[0].stderr)
    assert len(errors) == 1, results[0].stderr
    assert "rank 1" in errors[0] and "cannot read" in errors[0]
    assert "filesystem shared by all nodes" in errors[0]
    assert not error_lines(results[1].stderr), results[1].stderr
    assert not (out_dirs[0] / "final.pt").exists() and not any(out_dirs[1].iterdir())


def fill(folder):
    """A file in folder that takes every byte left on its filesystem."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    return filler


def test_a_full_disk_is_one_line_and_the_same_command_resumes(uninterrupted, tmp_path):
    # The snapshot of 6 epochs, on a disk then filled to the last byte: the run trains epoch 7,
    # cannot write its snapshot, and says so in one line; every rank stops. Once there is room
    # again, the same command resumes from the snapshot kept.
    disk = tmp_path / "disk"
    with small_disk(disk):
        out_dir = disk / "run"
        out_dir.mkdir()
        shutil.copy(uninterrupted(2) / "snapshot.pt", out_dir / "snapshot.pt")
        kept = (out_dir / "snapshot.pt").read_bytes()
        filler = fill(disk)
        command = [*CPU, "--epochs", 7, "--save-every", 2, "--world-size", 2, "--out-dir", out_dir]
        full = run_lesson(LESSON, *command, env=NO_GPUS)
        assert "epoch   7/7" in full.stdout, full.stdout + full.stderr
        assert_one_line_error(full, f"cannot write {out_dir / 'snapshot.pt'} (No space left",
                              "the previous snapshot.pt is intact", "run the same command again")
        assert "lost contact" not in full.stderr
        assert (out_dir / "snapshot.pt").read_bytes() == kept
        assert [p.name for p in out_dir.iterdir()] == ["snapshot.pt"]  # no .tmp left behind
        filler.unlink()
        resumed = run_lesson(LESSON, *command, env=NO_GPUS)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "6 of 7 epochs done, continuing at epoch 7" in resumed.stdout
        assert read_metrics(out_dir)["resumed_after_epoch"] == 6
        assert torch.load(out_dir / "snapshot.pt", weights_only=True)["epochs_completed"] == 7
