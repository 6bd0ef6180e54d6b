"""Lesson 13, run as a learner runs it: python 13_capstone/train.py (8 ranks: --dp 2 --pp 2
--tp 2) and its proof, python 13_capstone/prove_layouts.py.

Every layout, from one process to the 3-D one, takes one process's steps, and three mistakes do
not, and FSDP gathers each block alone for each of its forwards and frees it after
(prove_layouts.py); train.py's 3-D run ends on one process's weights and writes the same text;
a rank killed with SIGKILL stops the run in one line, and run again it resumes bitwise; the 3-D
checkpoint loads into one process and into another layout; two torchrun nodes keep each TP
group on one node; a layout that does not fit the model, or the ranks torchrun started, stops
in one line. In this process, no ranks started: the mesh's groups on 2 nodes of 4 (fake process
group) and their timeout (a 1-rank gloo world), the blocks each stage keeps, and the default
--dp for every GPU count from 1 to 16. The GPU tier runs the lesson with no flags too.

Tolerance. In float64 the layouts differ only in the order of their sums (each micro-batch's
loss, each TP rank's partial sums, FSDP's reduce-scatter): prove_layouts.py measures at most
2.2e-14 after 2 steps; train.py's runs here (2 epochs of 6 steps, --batch-size 64) end within
TOLERANCE = 1e-12 of one process, measured below 1e-13 on this course's 2-core machine. The
controls end 1.5e-3 to 4.0e-2 away. --batch-size 64 keeps the runs short (6 steps an epoch);
what is proven does not depend on it."""

import contextlib
import datetime
import importlib
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import (
    GPUS,
    ROOT,
    assert_final_pt_holds_cpu_tensors,
    assert_one_line_error,
    assert_prints_what_the_readme_shows,
    check_ok,
    import_guard_rails,
    import_lesson,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
    run_torchrun_nodes,
)

LESSON = "13_capstone"
TOLERANCE = 1e-12
SMALL = ["--float64", "--batch-size", "64", "--epochs", "2", "--save-every", "1",
         "--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
LAYOUTS = {"one": ["--dp", "1", "--pp", "1", "--tp", "1"],
           "3d": ["--dp", "2", "--pp", "2", "--tp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run of 2 epochs in float64, made once: {name: out_dir}."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            check_ok(run_lesson(LESSON, *LAYOUTS[name], *SMALL, "--out-dir", out))
            made[name] = out
        return made[name]

    return run


@pytest.fixture(scope="module")
def one_process_three_epochs(tmp_path_factory):
    out = tmp_path_factory.mktemp("one3")
    check_ok(run_lesson(LESSON, *LAYOUTS["one"], *SMALL, "--epochs", "3", "--out-dir", out))
    return out


def test_every_layout_takes_one_processs_steps_and_each_mistake_does_not():
    # The README's command as it stands, from the repository's root: its listing is this run
    # (tools/check_listings.py, TEST_COMMANDS), so the output it shows is checked here.
    done = subprocess.run([sys.executable, str(ROOT / LESSON / "prove_layouts.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_prints_what_the_readme_shows(done.stdout, LESSON, f"python {LESSON}/prove_layouts.py")
    assert "every layout equal within 1e-12: True" in done.stdout, done.stdout
    assert "every control farther than 1e-06: True" in done.stdout, done.stdout
    assert done.stdout.count("dp x pp x tp = ") == 9, done.stdout  # 1x1x1 to 2x2x2, and 1F1B
    assert done.stdout.count(" caught") == 3, done.stdout
    assert "compared" not in done.stdout  # every layout compared every weight of the model
    # What FSDP holds, measured in the same runs: each block gathered just before each of its
    # forwards, alone, and freed after it (2 x 2 x 2, 2 x 2 x 1, 2 x 1 x 2, 2 x 1 x 1).
    assert ("FSDP gathered each block alone for each forward and freed it after, on all 4 "
            "layouts with dp 2: True") in done.stdout, done.stdout


def test_the_proof_fails_on_a_round_that_went_wrong_and_on_the_rounds_it_then_skipped(capsys):
    # The proof's verdict, in this process: what its ranks gathered, made by hand. A run whose
    # first round had a layout off stops there, and rank 0 exits 1 on report's False.
    import_lesson(LESSON)
    proof = importlib.import_module("prove_layouts")
    names = ["w"]
    right = [("2 x 2 x 2", False, names, 1e-14)]
    off = [("2 x 2 x 2", False, names, 1e-3)]
    every_row = [(name, kind is not None, names, 1e-14 if kind is None else 1e-2)
                 for layouts in proof.ROUNDS for name, _, _, kind in layouts]
    assert proof.report([every_row], names)  # every layout equal, every control caught
    assert not proof.report([right], names)  # the rounds after the first were not run
    assert "not run: the 11 layouts and controls after the first round" in capsys.readouterr().out
    assert not proof.report([off], names)
    assert "every layout equal within 1e-12: False" in capsys.readouterr().out
    missed = [row if not row[1] else (*row[:3], 1e-9) for row in every_row]
    assert not proof.report([missed], names)  # a control too close to one process
    assert not proof.report_fsdp([[("2 x 2 x 2", 0, 4, 3)]])  # one forward not gathered alone
    assert not proof.report_fsdp([[]])  # no layout with dp 2 ran


# ---------------------------------------------------------------------------------------------
# The mesh, the stages and the default --dp, in this process: no ranks started
# ---------------------------------------------------------------------------------------------
def idea():
    """13_capstone/parallelize.py, as train.py imports it."""
    import_lesson(LESSON)  # puts the lesson's folder on sys.path, as running train.py does
    return importlib.import_module("parallelize")


@contextlib.contextmanager
def as_rank(backend, rank, world_size):
    """This process as rank `rank` of world_size: "fake" (PyTorch's fake process group: every
    group is made as that rank makes it, no collective moves data) or a 1-rank gloo world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_on_two_nodes_of_4_each_stage_is_a_node_and_only_the_pipeline_crosses():
    # dp 2 x pp 2 x tp 2 on 8 ranks, as torchrun numbers 2 nodes of 4: node n has ranks 4n to
    # 4n + 3. Each rank's groups, as build_mesh makes them, against the definition: rank r sits
    # at (r // (dp tp), r // tp % dp, r % tp) of the (pp, dp, tp) grid, and its group along a
    # dimension is the ranks that share its other two coordinates.
    parallelize = idea()
    dp, pp, tp, per_node = 2, 2, 2, 4

    def at(r):
        return {"pp": r // (dp * tp), "dp": r // tp % dp, "tp": r % tp}

    found = {name: set() for name in parallelize.DIMENSIONS}
    for rank in range(dp * pp * tp):
        with as_rank("fake", rank, dp * pp * tp):
            mesh = parallelize.build_mesh("cpu", dp, pp, tp, timeout=60)
            assert dict(zip(parallelize.DIMENSIONS, mesh.get_coordinate(), strict=True)) == (
                at(rank))
            for name in parallelize.DIMENSIONS:
                group = dist.get_process_group_ranks(mesh[name].get_group())
                others = [d for d in parallelize.DIMENSIONS if d != name]
                assert group == [r for r in range(dp * pp * tp)
                                 if all(at(r)[d] == at(rank)[d] for d in others)], (rank, name)
                assert mesh[name].get_local_rank() == at(rank)[name]
                found[name].add(tuple(group))
    nodes = {name: {tuple(sorted({r // per_node for r in g})) for g in groups}
             for name, groups in found.items()}
    assert nodes == {"tp": {(0,), (1,)}, "dp": {(0,), (1,)}, "pp": {(0, 1)}}, found
    assert sorted(found["pp"]) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_every_group_of_the_mesh_waits_the_timeout_it_is_given():
    # --timeout bounds a wait in any of the mesh's groups, not only in the world group: gloo's
    # default for a group made without it is 30 minutes (NCCL's 10).
    parallelize = idea()
    with as_rank("gloo", 0, 1):
        mesh = parallelize.build_mesh("cpu", 1, 1, 1, timeout=7)
        for name in parallelize.DIMENSIONS:
            group = mesh[name].get_group()
            assert group is not dist.group.WORLD
            assert group._get_backend(torch.device("cpu")).options._timeout == (
                datetime.timedelta(seconds=7)), name


def test_each_stage_keeps_consecutive_blocks_in_the_models_order():
    lesson, parallelize = import_lesson(LESSON), idea()
    for layers in (4, 8):
        for stages in (1, 2, 4):
            kept = [parallelize.keep_stage(lesson.TinyGPT(16, layers=layers), stage, stages)
                    for stage in range(stages)]
            # the stages' blocks, one after another, are the model's, each block once, in order
            assert [name for stage in kept for name in stage.blocks] == [
                str(i) for i in range(layers)]
            assert {len(stage.blocks) for stage in kept} == {layers // stages}
            assert [stage.tokens is not None for stage in kept] == [True] + [False] * (
                stages - 1)
            assert [stage.head is not None for stage in kept] == [False] * (stages - 1) + [True]


@pytest.mark.parametrize("batch_size", [16, 12])
def test_without_dp_the_gpus_hold_the_most_pipelines_the_batch_splits_over(monkeypatch, capsys,
                                                                          batch_size):
    # For every GPU count from 1 to 16: --dp by default is the largest d <= GPUs // (pp x tp)
    # for which d x micro-batches divides --batch-size, with one note when GPUs stay idle; too
    # few GPUs for one pipeline, 2 pipelines on the CPU.
    lesson, guard_rails = import_lesson(LESSON), import_guard_rails(LESSON)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for gpus in range(1, 17):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        args = lesson.parse_args(["--batch-size", str(batch_size)])
        guard_rails.check_layout(args)  # a layout it refuses raises SystemExit
        per_pipeline, m = args.pp * args.tp, args.microbatches
        fits = [d for d in range(1, gpus // per_pipeline + 1) if batch_size % (d * m) == 0]
        assert args.dp == (max(fits) if gpus >= per_pipeline else 2), gpus
        printed = capsys.readouterr().out
        idle = gpus - args.dp * per_pipeline if gpus >= per_pipeline else 0
        assert (printed.count("note:"), f"{idle} stay" in printed) == (
            (1, True) if idle else (0, False)), (gpus, printed)


def test_the_3d_run_ends_on_one_processs_weights_and_writes_the_same_text(runs):
    three, one = read_metrics(runs("3d")), read_metrics(runs("one"))
    assert max_weight_difference(runs("3d"), runs("one")) < TOLERANCE
    for a, b in zip(three["train_loss"], one["train_loss"], strict=True):
        assert abs(a - b) < TOLERANCE
    assert abs(three["val_loss"] - one["val_loss"]) < TOLERANCE
    assert three["train_loss"][-1] < three["train_loss"][0]
    assert three["samples"] == one["samples"]
    # What each rank holds: one process, the whole model once in each of weights, gradients
    # and Adam's two averages; 8 ranks, each about an 8th of it (a stage's half of the blocks,
    # split 4 ways by tp and dp; the embeddings and the head are not evenly halved).
    whole = one["bytes_per_rank"][0]
    assert whole["gradients"] == whole["weights"] and whole["optimizer"] == 2 * whole["weights"]
    assert len(three["bytes_per_rank"]) == 8
    for held in three["bytes_per_rank"]:
        assert whole["weights"] / 12 < held["weights"] < whole["weights"] / 5, held
        assert held["optimizer"] == 2 * held["weights"]


def test_a_rank_killed_by_sigkill_stops_the_run_in_one_line_and_it_resumes_bitwise(runs,
                                                                                   tmp_path):
    # 8 ranks: rank 1 kills itself with SIGKILL (kill -9) at the start of epoch 2. The run stops
    # with one line; run again, it resumes from epoch 1's checkpoint and ends bitwise on the
    # run that never stopped.
    flags = [*LAYOUTS["3d"], *SMALL, "--out-dir", tmp_path]
    result = run_lesson(LESSON, *flags, patch="kill-rank-1")
    assert_one_line_error(result, "rank 1 was killed (SIGKILL)", "Run it again to resume")
    result = check_ok(run_lesson(LESSON, *flags))
    assert ("1 of 2 epochs done, written by --dp 2 --pp 2 --tp 2 on 8 ranks, loaded by --dp 2 "
            "--pp 2 --tp 2 on 8") in result.stdout
    assert read_metrics(tmp_path)["resumed_after_epoch"] == 1
    assert max_weight_difference(tmp_path, runs("3d")) == 0


@pytest.mark.parametrize("layout", [["--dp", "1", "--pp", "1", "--tp", "1"],
                                    ["--dp", "1", "--pp", "2", "--tp", "2"]],
                         ids=["one_process", "1x2x2"])
def test_the_3d_checkpoint_loads_into_one_process_and_another_layout(
        runs, one_process_three_epochs, layout, tmp_path):
    # The 3-D run's checkpoint of epoch 2, resumed for a third epoch on another layout, ends
    # where one process's 3 epochs end.
    three = [*SMALL, "--epochs", "3"]
    resumed = tmp_path / "resumed"
    shutil.copytree(runs("3d") / "checkpoint", resumed / "checkpoint")
    result = check_ok(run_lesson(LESSON, *layout, *three, "--out-dir", resumed))
    loaded_by = f"{' '.join(layout)} on {math.prod(map(int, layout[1::2]))}"
    assert (f"2 of 3 epochs done, written by --dp 2 --pp 2 --tp 2 on 8 ranks, "
            f"loaded by {loaded_by}") in result.stdout
    assert read_metrics(resumed)["resumed_after_epoch"] == 2
    assert max_weight_difference(resumed, one_process_three_epochs) < TOLERANCE


def test_two_torchrun_nodes_keep_each_tp_group_on_one_node(runs, tmp_path):
    # Two torchrun "nodes" on this machine, 2 ranks each, --pp 2 --tp 2: ranks 0 and 1 (node 0)
    # are stage 0's TP group, ranks 2 and 3 (node 1) stage 1's; only the pipeline's sends
    # cross between the nodes. The run ends on one process's weights.
    for node in run_torchrun_nodes(LESSON, "--pp", "2", "--tp", "2", *SMALL,
                                   "--out-dir", tmp_path, nproc=2):
        check_ok(node)
        assert "spans nodes" not in node.stdout
    metrics = read_metrics(tmp_path)
    assert (metrics["launcher"], metrics["world_size"], metrics["dp"]) == ("torchrun", 4, 1)
    assert max_weight_difference(tmp_path, runs("one")) < TOLERANCE


@pytest.mark.parametrize(("flags", "says"), [
    (["--tp", "3"], "--tp 3 does not divide --heads 4"),
    (["--pp", "3"], "--layers 4 do not split evenly over --pp 3 stages"),
    (["--seq-len", "63"], "--seq-len 63 does not split over --tp 2"),
    (["--dim", "30"], "--heads 4 does not divide --dim 30"),
    (["--dp", "2", "--batch-size", "6"], "--batch-size 6, the global batch, does not split "
                                         "over --dp 2 x --microbatches 2"),
    (["--schedule", "1f1b", "--microbatches", "1"], "--schedule 1f1b needs at least one "
                                                    "micro-batch per stage")])
def test_a_layout_that_does_not_fit_the_model_stops_in_one_line(flags, says, tmp_path):
    result = run_lesson(LESSON, *flags, "--out-dir", tmp_path)
    assert_one_line_error(result, says)
    assert "starting" not in result.stdout


def test_under_torchrun_dp_is_its_ranks_over_pp_x_tp_or_one_line(monkeypatch):
    lesson, guard_rails = import_lesson(LESSON), import_guard_rails(LESSON)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    args = lesson.parse_args([])
    args.world_size = 16  # torchrun's WORLD_SIZE
    guard_rails.check_layout(args)
    assert args.dp == 4
    args = lesson.parse_args(["--dp", "2"])
    args.world_size = 2
    with pytest.raises(SystemExit) as stop:
        guard_rails.check_layout(args)
    assert stop.value.code.startswith("error: --dp 2 x --pp 2 x --tp 2 = 8 ranks, but torchrun "
                                      "started 2")


def test_a_checkpoint_of_another_model_stops_in_one_line(runs, tmp_path):
    shutil.copytree(runs("3d") / "checkpoint", tmp_path / "checkpoint")
    result = run_lesson(LESSON, "--layers", "2", "--out-dir", tmp_path)
    assert_one_line_error(result, "holds a model with --layers 4, not 2")

# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# float64 on a GPU adds in cuBLAS's order, not the CPU's: about 1e-15 a step, which Adam carries
# through 2 epochs; far below what one wrong shard moves (1e-3 and more).
GPU_TOLERANCE = 1e-8


@needs_gpu
@pytest.mark.gpu
def test_gpu_default_run_takes_the_pipelines_the_gpus_hold(lesson_run):
    # No flags, as a learner first runs it (--pp 2 --tp 2, --batch-size 16 in 2 micro-batches):
    # fewer than 4 GPUs hold no pipeline, so 2 of them, 8 ranks, train on the CPU with gloo;
    # else one NCCL rank a GPU, --dp the most pipelines whose dp x 2 divides 16, a note naming
    # the GPUs left idle.
    result, out_dir = lesson_run(LESSON)
    check_ok(result)
    metrics = read_metrics(out_dir)
    if GPUS < 4:
        assert f"note: 8 ranks but {GPUS} GPU(s)" in result.stdout
        expected = (2, 8, "gloo", "cpu")
    else:
        dp = max(d for d in range(1, GPUS // 4 + 1) if 16 % (2 * d) == 0)
        idle = GPUS - 4 * dp
        assert (f"{idle} stay" in result.stdout) == (idle > 0), result.stdout
        expected = (dp, 4 * dp, "nccl", "cuda")
    assert (metrics["dp"], metrics["world_size"], metrics["backend"], metrics["device"]) == (
        expected)
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(out_dir)


@needs_gpu
@pytest.mark.gpu
def test_gpu_one_rank_takes_the_cpus_steps(runs, tmp_path):
    check_ok(run_lesson(LESSON, *LAYOUTS["one"], *SMALL, "--backend", "nccl",
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, runs("one")) < GPU_TOLERANCE
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_two
@pytest.mark.gpu
def test_gpu_tp_and_pp_on_nccl_take_one_processs_steps(runs, tmp_path):
    for layout in (["--dp", 1, "--pp", 1, "--tp", 2], ["--dp", 1, "--pp", 2, "--tp", 1]):
        check_ok(run_lesson(LESSON, *layout, *SMALL, "--backend", "nccl", "--out-dir", tmp_path))
        metrics = read_metrics(tmp_path)
        assert (metrics["backend"], metrics["device"], metrics["world_size"]) == (
            "nccl", "cuda", 2)
        assert max_weight_difference(tmp_path, runs("one")) < GPU_TOLERANCE
        shutil.rmtree(tmp_path / "checkpoint")


@needs_gpu
@pytest.mark.gpu
def test_gpu_torchrun_starts_one_nccl_rank_per_gpu(tmp_path):
    nproc = min(GPUS, 2)  # one TP group of them all
    result = run_torchrun(LESSON, "--pp", 1, "--tp", nproc, "--epochs", 1, "--out-dir", tmp_path,
                          nproc=nproc)
    check_ok(result)
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "torchrun")
    assert_final_pt_holds_cpu_tensors(tmp_path)
