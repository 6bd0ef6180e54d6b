"""Lesson 10, run as a learner runs it: python 10_pipeline_parallel/train.py (mp.spawn, gloo/CPU),
and torchrun.

Every schedule (afab by hand, GPipe, 1F1B, interleaved), at 1, 2 and 4 stages, takes the steps of
lesson 08 in one process on the whole batch, and so do the zero-bubble ones (zb1p, zbv, dualpipev),
whose backward split in two split_backward.py proves by hand; --dp 2 pipelines those of lesson 08
on 2 ranks;
the control, torch's default loss handling, fails that comparison where padding makes the
micro-batches unequal. Each rank runs its forwards and backwards in the order its schedule
defines, checked against orders written out here (measure_bubble.py, which also measures the
bubble beside the paper's). A resume ends bitwise on the run that never
stopped, from another --stages and --schedule too. The GPU tier (NCCL) is at the end of this file.

Some 30 runs would take 30 launches; instead tests/every_schedule.py starts 4 ranks once and
calls the lessons' own main() for every run (RUNS) on the ranks each needs, lesson 08's
references included (the suite launches none with these flags), and only the runs that the
selected tests read (READS): one test alone, as the mutation check runs it, makes 1 to 6 runs,
not 30. Lesson 02's run of one process is the suite's own (lesson02_run). The torchrun run and
the bad --layers are real launches.

Tolerance. A schedule changes the order in which micro-batches run, never the order in which a
weight's gradients add up (micro-batch 0 first, on every schedule and layout): every schedule and
layout ends bitwise on the same weights, and the tests say so. Against lesson 08 the sums differ
in float order: lesson 08 sums a batch's rows in one matrix product, the pipeline in
--microbatches products added together, with padding rows that add zeros. That is about 1e-7,
but Adam divides each step by the root of its running squared gradient, so a weight whose
gradient is near zero (the loss is below 1e-4 from epoch 13) takes visible steps on such
differences. Measured (gloo, on this course's 2-core machine): 1.0e-7 at 1 and 2 stages, 2.1e-7
for --dp 2 x --stages 2, 8.0e-8 for the padded batch 48 over 5 epochs (6.6e-7 over 20, so 5
epochs are run), 1.2e-7 for --layers 1 against lesson 02: TOLERANCE = 1e-6. The deeper model of
4 stages, --layers 7 (8 linear layers, which interleaved needs), amplifies them through its
depth: 9.3e-7 after 5 epochs, 1.0e-6 after 10, 2.2e-6 after 20, the same on all four schedules:
DEEP_TOLERANCE = 1e-5, for those runs only. Both are thousands of times below what one wrong
step moves (about the learning rate, 1e-2) and what the control moves (1.5e-2 in those 5
epochs)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import (
    GPUS,
    NO_GPUS,
    ROOT,
    assert_good_run,
    assert_one_line_error,
    check_ok,
    evaluate_single_process,
    import_lesson,
    lesson02_run,
    load_weights,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
)

LESSON = "10_pipeline_parallel"
CPU = ["--backend", "gloo"]  # the CPU tier stays on gloo even where GPUs exist
TOLERANCE = 1e-6
DEEP_TOLERANCE = 1e-5  # --layers 7 only: see the module's docstring
SCHEDULES = ["afab", "gpipe", "1f1b", "interleaved"]
# Lesson 08 at one rank takes each epoch in one step of all 142 wines; 2 micro-batches of 71.
TWO_STAGES = ["--stages", 2, "--layers", 3, "--batch-size", 142, "--microbatches", 2]
# 4 micro-batches need a batch that 4 divides: 144, so that the one batch of 142 is padded by 2.
FOUR_STAGES = ["--stages", 4, "--layers", 7, "--batch-size", 144, "--microbatches", 4]
ONE_STAGE = ["--stages", 1, "--layers", 3, "--batch-size", 142, "--microbatches", 2]
# Two pipelines of 2 stages, each its 72-row batch (71 wines and a padding row): lesson 08 on 2
# ranks with batch 71.
DP_PP = ["--dp", 2, "--stages", 2, "--batch-size", 72, "--microbatches", 2]
# Batches of 48, 48 and 46 wines: the last padded to 48, so its micro-batches hold 24 and 22.
PADDED = ["--stages", 2, "--layers", 3, "--batch-size", 48, "--microbatches", 2, "--epochs", 5]
# The order of forwards and backwards: 8 micro-batches over 4 stages, one epoch (5 steps of 32),
# measure_bubble.py's run with no time simulated.
ORDER = ["--measure", "--stages", 4, "--layers", 7, "--microbatches", 8, "--simulate-ms", 0,
         "--epochs", 1]
# The zero-bubble schedules, each against 1F1B, on 2 ranks: 4 micro-batches, dualpipev's least at
# 2 stages (2 x 2), of a batch of 144, so that the one batch of 142 is padded by 2.
ZERO_BUBBLE = ["zb1p", "zbv", "dualpipev"]
ZB = ["--stages", 2, "--layers", 3, "--batch-size", 144, "--microbatches", 4]
# The bubble measured: measure_bubble.py's 4 stages of 2 layers and 8 micro-batches, 40 ms a
# layer for each of F, B and W; 3 steps of 64, the first left out.
BUBBLE = ["--measure", "--batch-size", 64, "--simulate-ms", 40]
# Lesson 01's model (fc1 | fc2, one layer a stage), for final.pt in lesson 01 and torchrun.
LAYERS_1 = ["--stages", 2, "--layers", 1, "--microbatches", 2]
# Interleaved on 2 stages with micro-batch counts that are no multiple of them, which torch's
# ScheduleInterleaved1F1B takes (m in max(1, m // p) equal rounds): 1 of 142, 3 of 48 (144).
UNROUNDED = {1: ["--batch-size", 142, "--microbatches", 1],
             3: ["--batch-size", 144, "--microbatches", 3]}
LESSON_08 = ["--lesson", "08", "--world-size"]  # a run of lesson 08 (tests/every_schedule.py)
RUNS = [  # (name, flags), in the order tests/every_schedule.py runs them
    *((f"4_stages_{s}", [*FOUR_STAGES, "--schedule", s]) for s in SCHEDULES),
    ("dp_pp", DP_PP),
    *((f"order_{s}", [*ORDER, "--schedule", s]) for s in SCHEDULES),
    # Stopped after epoch 10 at 4 stages by hand (afab); resumed below at 2 by interleaved.
    ("relayout", ["--stages", 4, "--layers", 3, "--batch-size", 142, "--microbatches", 2,
                  "--schedule", "afab", "--epochs", 10]),
    *((f"2_stages_{s}", [*TWO_STAGES, "--schedule", s]) for s in SCHEDULES),
    *((f"interleaved_m{m}", ["--measure", "--stages", 2, "--layers", 3, "--schedule",
                             "interleaved", "--simulate-ms", 0, "--epochs", 20, *flags])
      for m, flags in UNROUNDED.items()),
    *((f"zb_{s}", [*ZB, "--schedule", s]) for s in ["1f1b", *ZERO_BUBBLE]),
    *((f"bubble_{s}", [*BUBBLE, "--schedule", s]) for s in ["1f1b", "zb1p", "zbv"]),
    ("padded", PADDED),
    ("padded_torch_loss", [*PADDED, "--patch", "torch-loss"]),
    ("layers_1", LAYERS_1),
    ("resume", [*TWO_STAGES, "--epochs", 10]),  # stopped after epoch 10 ...
    ("resume", TWO_STAGES),  # ... and the same command with --epochs 20 in the same --out-dir
    ("relayout", [*TWO_STAGES, "--schedule", "interleaved"]),
    ("08_dp_2", [*LESSON_08, 2, "--layers", 3, "--batch-size", 71]),
    *((f"1_stage_{s}", [*ONE_STAGE, "--schedule", s]) for s in SCHEDULES),
    ("08_layers_3", [*LESSON_08, 1, "--layers", 3, "--batch-size", 142]),
    ("08_layers_7", [*LESSON_08, 1, "--layers", 7, "--batch-size", 142]),
    ("08_padded", [*LESSON_08, 1, "--layers", 3, "--batch-size", 48, "--epochs", 5]),
]


def stages_name(stages):
    """The runs of every schedule at 1, 2 or 4 stages are named 1_stage_S, 2_stages_S, ..."""
    return f"{stages}_stage{'s' * (stages > 1)}"


def stages_runs(stages, schedules=SCHEDULES):
    return {f"{stages_name(stages)}_{s}" for s in schedules}


# What each test reads of RUNS, by name, from its parameters.
READS = {
    "test_every_schedule_takes_the_steps_of_one_process":
        lambda stages, reference, **_: {*stages_runs(stages), reference},
    "test_the_schedules_change_the_order_not_the_sums":
        lambda stages: stages_runs(stages) | (stages_runs(2, ["afab"]) if stages == 1 else set()),
    "test_dp_pipelines_take_the_steps_of_ddp": lambda: {"dp_pp", "08_dp_2"},
    "test_unequal_micro_batches_need_the_batchs_mean_not_torchs_default":
        lambda: {"padded", "padded_torch_loss", "08_padded"},
    "test_each_rank_runs_the_order_its_schedule_defines": lambda schedule: {f"order_{schedule}"},
    "test_interleaved_takes_every_micro_batch_count_torch_does":
        lambda microbatches: {f"interleaved_m{microbatches}", "08_layers_3"},
    "test_the_zero_bubble_schedules_take_the_steps_of_one_process":
        lambda: {f"zb_{s}" for s in ["1f1b", *ZERO_BUBBLE]} | {"08_layers_3"},
    "test_the_bubble_measured_is_the_papers_and_zero_bubble_holds_no_more":
        lambda: {f"bubble_{s}" for s in ["1f1b", "zb1p", "zbv"]},
    "test_a_resume_ends_bitwise_on_the_run_that_never_stopped":
        lambda: {"resume", "2_stages_1f1b"},
    "test_a_checkpoint_loads_into_another_stages_and_schedule":
        lambda: {"relayout", "2_stages_1f1b"},
    "test_final_pt_is_lesson_01s_model_and_its_accuracy": lambda: {"layers_1"},
    "test_torchrun_takes_the_steps_of_mp_spawn": lambda: {"layers_1"},
}


def runs_read(items):
    """The names of RUNS that these tests read (READS): under xdist, every test of this file that
    a worker collected, a superset of those it runs."""
    names = set()
    for item in items:
        if item.path == Path(__file__) and "every_run" in item.fixturenames:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            names |= READS[item.originalname](**params)  # a KeyError: add the test to READS
    assert names <= {name for name, _ in RUNS}, names - {name for name, _ in RUNS}
    return names


@pytest.fixture(scope="module")
def every_run(tmp_path_factory, request):
    """tests/every_schedule.py on the RUNS that this session's tests read, once for this file:
    (finished process, folder), each run in folder/<name>. The tests check its exit status, so
    that a lesson that fails or hangs makes them fail, not error."""
    out_dir = tmp_path_factory.mktemp("lesson10")
    command = [sys.executable, str(ROOT / "tests" / "every_schedule.py"), str(out_dir)]
    wanted = runs_read(request.session.items)
    for i, (name, flags) in enumerate((name, flags) for name, flags in RUNS if name in wanted):
        command += [*(["::"] if i else []), name, *CPU, *map(str, flags)]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **NO_GPUS})
    except subprocess.TimeoutExpired as late:  # a rank that hangs: the tests fail, and say so
        result = subprocess.CompletedProcess(command, "timed out after 280 s", late.stdout,
                                             late.stderr)
    return result, out_dir


def runs(every_run):
    """The folder of every run, once they all ended well."""
    result, out_dir = every_run
    check_ok(result)
    return out_dir


def read_bubble(out_dir):
    """What measure_bubble.py's rank 0 wrote: the bubble, each rank's order and what it held."""
    return json.loads((out_dir / "bubble.json").read_text())


def assert_pipeline_run(out_dir, world_size, learned=True, **expected):
    """A run of lesson 10 that wrote the whole model, says what it ran and, over more than one
    epoch (learned), learned."""
    metrics = read_metrics(out_dir)
    assert metrics["world_size"] == world_size
    assert {key: metrics[key] for key in expected} == expected
    assert (metrics["launcher"], metrics["test_total"]) == ("spawn", 36)
    losses = metrics["train_loss"]
    assert len(losses) == metrics["epochs"]
    if learned:
        assert losses[-1] < losses[0] and metrics["test_accuracy"] >= 0.9, metrics
    # final.pt: the whole model, every rank's layers, under the names of lesson 08's model.
    model = import_lesson(LESSON).WineMLP(layers=metrics["layers"])
    assert list(load_weights(out_dir)) == list(model.state_dict())
    return metrics


# ---------------------------------------------------------------------------------------------
# Every schedule takes the steps of one process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stages, reference, tolerance", [
    (2, "08_layers_3", TOLERANCE),
    (4, "08_layers_7", DEEP_TOLERANCE),
    (1, "08_layers_3", TOLERANCE),
])
def test_every_schedule_takes_the_steps_of_one_process(every_run, stages, reference, tolerance):
    # gloo, `stages` ranks (mp.spawn), against lesson 08 at 1 rank on the whole batch.
    folder = runs(every_run)
    name = stages_name(stages)
    for schedule in SCHEDULES:
        out_dir = folder / f"{name}_{schedule}"
        assert_pipeline_run(out_dir, stages, stages=stages, schedule=schedule, dp=1)
        assert max_weight_difference(out_dir, folder / reference) < tolerance, schedule


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_schedules_change_the_order_not_the_sums(every_run, stages):
    # gloo, `stages` ranks. afab, written by hand, runs GPipe's order: the same weights to the
    # last bit; and so do 1F1B and interleaved, which run the micro-batches in another order but
    # add each weight's gradients in the same one (micro-batch 0 first).
    folder = runs(every_run)
    name = stages_name(stages)
    for schedule in SCHEDULES[1:]:
        assert max_weight_difference(folder / f"{name}_afab", folder / f"{name}_{schedule}") == 0, \
            schedule
    # Where the cuts are changes nothing either: 1 stage and 2 stages, bitwise.
    if stages == 1:
        assert max_weight_difference(folder / "1_stage_afab", folder / "2_stages_afab") == 0


def test_dp_pipelines_take_the_steps_of_ddp(every_run):
    # gloo, 4 ranks: --dp 2 pipelines of --stages 2, against lesson 08 on 2 ranks (batch 71 each).
    folder = runs(every_run)
    assert_pipeline_run(folder / "dp_pp", 4, dp=2, stages=2, schedule="1f1b")
    assert max_weight_difference(folder / "dp_pp", folder / "08_dp_2") < TOLERANCE


def test_unequal_micro_batches_need_the_batchs_mean_not_torchs_default(every_run):
    # gloo, 2 ranks. The last batch, 46 wines padded to 48, makes micro-batches of 24 and 22
    # wines: the lesson divides each one's summed loss by the batch's 46 and passes.
    folder = runs(every_run)
    assert_pipeline_run(folder / "padded", 2, batch_size=48, microbatches=2)
    assert max_weight_difference(folder / "padded", folder / "08_padded") < TOLERANCE
    # The control: torch's default, each micro-batch's mean loss with scale_grads=True, weighs
    # the 22 like the 24. Right on full batches, it fails the same comparison.
    assert max_weight_difference(folder / "padded_torch_loss", folder / "08_padded") > 1e-3


# ---------------------------------------------------------------------------------------------
# The schedules' orders, recorded on each rank
# ---------------------------------------------------------------------------------------------
def all_forwards_then_all_backwards(stage, m):
    return [f"{stage}F{i}" for i in range(m)] + [f"{stage}B{i}" for i in range(m)]


def one_forward_one_backward(stage, p, m):
    """1F1B (torch's): p - stage forwards fill the pipeline, then each backward is followed by
    the next forward while one is left, then the backwards that remain."""
    warmup = min(m, p - stage)
    forwards = [f"{stage}F{i}" for i in range(m)]
    order = forwards[:warmup]
    for i in range(m):
        order += [f"{stage}B{i}", *forwards[warmup + i:warmup + i + 1]]
    return order


def test_the_orders_written_out_here_are_the_schedules():
    # 1F1B on rank 2 of 4 stages with 8 micro-batches, spelled out: 2 forwards, then B and F.
    assert " ".join(one_forward_one_backward(2, 4, 8)) == \
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7"
    assert all_forwards_then_all_backwards(0, 2) == ["0F0", "0F1", "0B0", "0B1"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_runs_the_order_its_schedule_defines(every_run, schedule):
    # gloo, 4 ranks, --simulate-ms 0: every forward and backward recorded, none slowed.
    folder = runs(every_run)
    assert_pipeline_run(folder / f"order_{schedule}", 4, learned=False, schedule=schedule)
    report = read_bubble(folder / f"order_{schedule}")
    p, m = 4, 8
    assert len(report["order"]) == len(report["held"]) == p
    for stage, order in enumerate(report["order"]):
        recorded = order["recorded"]
        assert recorded == order["defined"], (stage, recorded)  # what rank 0 prints as "yes"
        if schedule in ("afab", "gpipe"):
            assert recorded == all_forwards_then_all_backwards(stage, m)
        elif schedule == "1f1b":
            assert recorded == one_forward_one_backward(stage, p, m)
        else:  # rank r holds stages r and r + p: each micro-batch forward, then backward, once
            for s in (stage, stage + p):
                for i in range(m):
                    assert recorded.count(f"{s}F{i}") == recorded.count(f"{s}B{i}") == 1
                    assert recorded.index(f"{s}F{i}") < recorded.index(f"{s}B{i}")
            assert len(recorded) == 4 * m
    # Activations held at most: every micro-batch for afab and GPipe, p - s for 1F1B.
    if schedule in ("afab", "gpipe"):
        assert report["held"] == [m] * p
    elif schedule == "1f1b":
        assert report["held"] == [p - s for s in range(p)]
    else:  # interleaved counts chunk-micro-batches (2 chunks a rank): more than 1F1B's p - s,
        # fewer than the 2m of both chunks' every micro-batch, and fewer on each later rank
        held = report["held"]
        assert all(p - s < n < 2 * m for s, n in enumerate(held)) and held == sorted(held)[::-1]
    # The bubble is measured over the steps after the first (5 steps of 32 in the epoch).
    assert report["steps"] == 4 and report["formula"] == pytest.approx(
        (p - 1) / ((2 if schedule == "interleaved" else 1) * m + p - 1))
    assert f"as {schedule} defines: NO" not in every_run[0].stdout


@pytest.mark.parametrize("microbatches", sorted(UNROUNDED))
def test_interleaved_takes_every_micro_batch_count_torch_does(every_run, microbatches):
    # gloo, 2 ranks of 2 chunks each: fewer micro-batches than stages (1), or a count they do not
    # divide (3), in torch's own plan, which each rank follows, still one process's steps.
    folder = runs(every_run)
    out_dir = folder / f"interleaved_m{microbatches}"
    assert_pipeline_run(out_dir, 2, stages=2, schedule="interleaved", microbatches=microbatches)
    assert all(order["recorded"] == order["defined"] for order in read_bubble(out_dir)["order"])
    assert max_weight_difference(out_dir, folder / "08_layers_3") < TOLERANCE


def test_the_simulated_clock_starts_when_the_gpus_stream_has_the_input(monkeypatch):
    # With NCCL a recv holds the GPU's stream, not the host: each simulated forward and backward
    # first waits for the stream (wait_for_device), or the bubble would read near 0 on GPUs.
    # Without a GPU: the stream is recorded, for a tensor on "cuda" and one on the CPU.
    import_lesson(LESSON)
    import timeline  # measure_bubble.py's instrument, from the lesson's folder (now on sys.path)
    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        synchronize=lambda: synced.append(device)))
    timeline.wait_for_device(types.SimpleNamespace(device=torch.device("cuda", 1)))
    timeline.wait_for_device(torch.zeros(1))
    assert synced == [torch.device("cuda", 1)]
    # ... and the simulated compute waits, forward and backward, before it reads the clock.
    waited, events = [], []
    monkeypatch.setattr(timeline, "wait_for_device", lambda t: waited.append((t.shape, events[:])))
    stage = torch.nn.Linear(2, 2)
    stage.layers = [stage]
    timeline.simulate_compute(stage, 0, events, 0, 0, 0)
    stage(torch.ones(3, 2)).sum().backward()
    assert [(shape, [e.kind for e in before]) for shape, before in waited] == [
        ((3, 2), []), ((3, 2), ["F"]), ((2, 2), ["F", "B"])]  # F, B, then W: the weight's


# ---------------------------------------------------------------------------------------------
# Zero bubble: the backward split in two, B (the input's gradient) and W (the weights')
# ---------------------------------------------------------------------------------------------
def test_b_then_w_by_hand_add_up_to_one_backward_and_the_controls_do_not():
    # split_backward.py, as a learner runs it: float64, to the last bit; W left out and W run
    # twice each differ (exit 0 only if all three hold).
    result = subprocess.run([sys.executable, str(ROOT / LESSON / "split_backward.py")],
                            capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                              **NO_GPUS})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("B then W") and lines[0].endswith("largest difference 0")
    assert "largest difference inf" in lines[1] and "W left out" in lines[1]
    assert "W run twice" in lines[2] and not lines[2].endswith("largest difference 0")
    assert all("input gradient equal: yes" in line for line in lines[:3])


def test_the_zero_bubble_schedules_take_the_steps_of_one_process(every_run):
    # gloo, 2 ranks: torch's ScheduleInterleavedZeroBubble (zb1p, a stage a rank),
    # ScheduleZBVZeroBubble and ScheduleDualPipeV (2 stages a rank, in a V), their W apart from
    # B, against lesson 08 in one process; and bitwise 1F1B's steps: W adds each micro-batch's
    # weight gradient in the same order (micro-batch 0 first) that one backward does.
    folder = runs(every_run)
    for schedule in ["1f1b", *ZERO_BUBBLE]:
        out_dir = folder / f"zb_{schedule}"
        assert_pipeline_run(out_dir, 2, stages=2, schedule=schedule, microbatches=4)
        assert max_weight_difference(out_dir, folder / "08_layers_3") < TOLERANCE, schedule
        assert max_weight_difference(out_dir, folder / "zb_1f1b") == 0, schedule


def test_the_bubble_measured_is_the_papers_and_zero_bubble_holds_no_more(every_run):
    # gloo, 4 ranks, F = B = W = 40 ms a layer. The measured bubble is the paper's prediction
    # plus what sending and Python cost between the sleeps (more for ZB-V, with twice the
    # actions of half the length): never below it, and at most margin above it (1F1B
    # (p - 1) / (m + p - 1) = 0.273; ZB-H1 (p - 1) / (3m + p - 1) = 0.111; ZB-V 0). Each
    # zero-bubble schedule idles less than 1F1B, and holds no more activations at its peak:
    # ZB-H1 p micro-batches on its busiest rank, as 1F1B; ZB-V 2p of its half-deep stages, p
    # micro-batches' worth.
    folder = runs(every_run)
    report = {s: read_bubble(folder / f"bubble_{s}") for s in ["1f1b", "zb1p", "zbv"]}
    p, m, margin = 4, 8, 0.2
    assert report["1f1b"]["formula"] == pytest.approx((p - 1) / (m + p - 1))
    assert report["zb1p"]["formula"] == pytest.approx((p - 1) / (3 * m + p - 1))
    assert report["zbv"]["formula"] == 0
    for schedule, r in report.items():
        assert r["steps"] == 2 and r["formula"] - 0.02 < r["measured"] < r["formula"] + margin, (
            schedule, r["measured"], r["formula"])
    assert report["zb1p"]["measured"] < report["1f1b"]["measured"]
    assert report["zbv"]["measured"] < report["1f1b"]["measured"]
    assert report["1f1b"]["held"] == [p - s for s in range(p)]
    assert max(report["zb1p"]["held"]) == p and max(report["zbv"]["held"]) == 2 * p
    # The split ran: a zero-bubble rank does other work between a micro-batch's B and its W;
    # 1F1B's one backward runs W right after B, always.
    for schedule, r in report.items():
        deferred = False
        for events in r["timeline"]:  # each rank's, in the order they ran
            at = {(kind, stage, mb): i for i, (kind, stage, mb, *_) in enumerate(events)}
            gaps = [at[("W", stage, mb)] - at[("B", stage, mb)] for kind, stage, mb, *_ in events
                    if kind == "B"]
            assert min(gaps) >= 1, schedule  # W never before its B
            deferred |= max(gaps) > 1
        assert deferred == (schedule != "1f1b"), schedule


# ---------------------------------------------------------------------------------------------
# The checkpoint: a resume, from the same or another layout, and final.pt
# ---------------------------------------------------------------------------------------------
def test_a_resume_ends_bitwise_on_the_run_that_never_stopped(every_run):
    # gloo, 2 ranks: --epochs 10, then --epochs 20 in the same --out-dir, against 20 at once.
    folder = runs(every_run)
    metrics = assert_pipeline_run(folder / "resume", 2, resumed_after_epoch=10, epochs=20)
    assert metrics["train_loss"] == read_metrics(folder / "2_stages_1f1b")["train_loss"]
    assert max_weight_difference(folder / "resume", folder / "2_stages_1f1b") == 0


def test_a_checkpoint_loads_into_another_stages_and_schedule(every_run):
    # gloo: 4 ranks by hand (afab) for 10 epochs, then 2 ranks of interleaved for 10 more. Each
    # rank reads its layers by name, and Adam's state with them: bitwise the run of 20 at once.
    result, _ = every_run
    folder = runs(every_run)
    metrics = assert_pipeline_run(folder / "relayout", 2, stages=2, schedule="interleaved",
                                  resumed_after_epoch=10)
    assert f"{folder / 'relayout' / 'checkpoint' / 'epoch_0010'}: 10 of 20 epochs done, " \
        "written by --schedule afab --stages 4 --dp 1 on 4 ranks, loaded by --schedule " \
        "interleaved --stages 2 --dp 1 on 2" in result.stdout
    assert metrics["train_loss"] == read_metrics(folder / "2_stages_1f1b")["train_loss"]
    assert max_weight_difference(folder / "relayout", folder / "2_stages_1f1b") == 0


def test_final_pt_is_lesson_01s_model_and_its_accuracy(every_run, lesson_run):
    # gloo, 2 ranks, --layers 1: lesson 01's model, fc1 on rank 0 and fc2 on rank 1.
    folder = runs(every_run)
    metrics = assert_pipeline_run(folder / "layers_1", 2, layers=1)
    assert evaluate_single_process(folder / "layers_1") == (metrics["test_correct"], 36)
    # The same steps as lesson 02 in one process with batch 32 (the suite's run of it).
    assert max_weight_difference(folder / "layers_1", lesson02_run(lesson_run, 1)[1]) < TOLERANCE


def test_torchrun_takes_the_steps_of_mp_spawn(every_run, tmp_path):
    # gloo, 2 ranks started by torchrun, against the same flags under mp.spawn: bitwise.
    result = run_torchrun(LESSON, *CPU, *LAYERS_1, "--out-dir", tmp_path, env=NO_GPUS)
    metrics = assert_good_run(result, tmp_path, world_size=2)
    assert (metrics["launcher"], metrics["stages"], metrics["dp"]) == ("torchrun", 2, 1)
    assert "starting 2 ranks" not in result.stdout  # mp.spawn's line: torchrun started them
    spawned = runs(every_run) / "layers_1"
    assert metrics["train_loss"] == read_metrics(spawned)["train_loss"]
    assert max_weight_difference(tmp_path, spawned) == 0


# ---------------------------------------------------------------------------------------------
# Flags that cannot work: one line, before any rank starts
# ---------------------------------------------------------------------------------------------
def test_layers_that_do_not_split_over_the_stages_get_one_line(tmp_path):
    # The learner's path: no rank starts, exit 1, one line that names the numbers and a fix.
    result = run_lesson(LESSON, "--layers", 4, "--out-dir", tmp_path)
    assert result.returncode == 1
    assert_one_line_error(result, "--layers 4 makes 5 linear layers, which do not split evenly "
                          "over --stages 2 stages", "such as --layers 3")
    assert "starting" not in result.stdout and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("flags, line", [
    (["--layers", 4], "--layers 4 makes 5 linear layers, which do not split evenly over "
                      "--stages 2 stages; use a --layers one less than a multiple of 2, such as "
                      "--layers 3"),
    (["--layers", 5, "--schedule", "interleaved"],
     "--layers 5 makes 6 linear layers, which do not split evenly over --stages 2 x 2 chunks "
     "per rank (--schedule interleaved) = 4 stages; use a --layers one less than a multiple of "
     "4, such as --layers 3"),
    (["--microbatches", 3], "--microbatches 3 does not divide --batch-size 32"),
    (["--stages", 4, "--layers", 7, "--microbatches", 2],
     "--schedule 1f1b needs at least one micro-batch per stage (torch's Schedule1F1B refuses "
     "fewer): --microbatches 2 is fewer than --stages 4"),
    # torch's ScheduleInterleaved1F1B: m micro-batches in max(1, m // p) equal rounds.
    (["--schedule", "interleaved", "--microbatches", 5, "--batch-size", 30],
     "--schedule interleaved runs the micro-batches in 2 equal rounds (--microbatches // "
     "--stages): --microbatches 5 does not split into them; use a multiple of 2, such as 4"),
    # The zero-bubble schedules: zb1p's rounds are interleaved's; ZB-V and DualPipeV place two
    # stages a rank, in a V; DualPipeV wants a micro-batch per stage.
    (["--schedule", "zb1p", "--microbatches", 5, "--batch-size", 30],
     "--schedule zb1p runs the micro-batches in 2 equal rounds"),
    (["--schedule", "zbv", "--layers", 5],
     "over --stages 2 x 2 chunks per rank (--schedule zbv) = 4 stages; use a --layers one less "
     "than a multiple of 4, such as --layers 3"),
    (["--schedule", "dualpipev", "--microbatches", 2],
     "--schedule dualpipev needs at least one micro-batch per stage, 2 x --stages 2 = 4 (torch's "
     "ScheduleDualPipeV refuses fewer): use --microbatches 4 or more"),
    (["--measure", "--simulate-ms", -1], "--simulate-ms must be at least 0 (got -1)"),
    (["--measure", "--weight-ms", -2], "--weight-ms must be at least 0 (got -2)"),
])
def test_pipelines_that_cannot_work_get_one_line(flags, line):
    # In-process, as launch() checks them (parse_args, then guard_rails.check_pipeline);
    # measure_bubble.py's own flags as its parse_args checks them.
    lesson = import_lesson(LESSON)
    flags = list(map(str, flags))
    with pytest.raises(SystemExit) as stop:
        if flags[0] == "--measure":
            import measure_bubble  # from the lesson's folder, which import_lesson put first

            measure_bubble.parse_args(flags[1:])
        lesson.guard_rails.check_pipeline(lesson.parse_args(flags))
    assert stop.value.code.startswith("error: ") and "\n" not in stop.value.code
    assert line in stop.value.code


def test_a_pipeline_that_works_passes_the_checks():
    lesson = import_lesson(LESSON)
    for flags in (TWO_STAGES, FOUR_STAGES, [*FOUR_STAGES, "--schedule", "interleaved"], DP_PP):
        args = lesson.parse_args(list(map(str, flags)))
        lesson.guard_rails.check_pipeline(args)
        assert args.dp == (2 if flags is DP_PP else max(1, GPUS // args.stages))


# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# cuBLAS picks its own order of sums for each shape, and another on another GPU: looser than on
# the CPU, as lesson 09's GPU tier. Measured on one H100: 8.9e-8 at one stage, every schedule.
GPU_TOLERANCE = 1e-4


def gpu_reference(lesson_run):
    _, out_dir = lesson_run("08_ddp_from_scratch", "--backend", "nccl", "--world-size", 1,
                            "--layers", 3, "--batch-size", 142)
    return out_dir


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_one_stage_takes_the_steps_of_one_process(lesson_run, schedule):
    # nccl, 1 rank on 1 GPU: a pipeline of one stage, every schedule.
    result, out_dir = lesson_run(LESSON, "--backend", "nccl", *ONE_STAGE, "--dp", 1,
                                 "--schedule", schedule)
    check_ok(result)
    metrics = read_metrics(out_dir)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 1)
    assert max_weight_difference(out_dir, gpu_reference(lesson_run)) < GPU_TOLERANCE


@needs_two
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_two_stages_take_the_steps_of_one_process(lesson_run, schedule):
    # nccl, 2 ranks on 2 GPUs: activations and gradients go from GPU to GPU.
    result, out_dir = lesson_run(LESSON, "--backend", "nccl", *TWO_STAGES, "--dp", 1,
                                 "--schedule", schedule)
    check_ok(result)
    metrics = read_metrics(out_dir)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 2)
    assert max_weight_difference(out_dir, gpu_reference(lesson_run)) < GPU_TOLERANCE
    # guard_rails.py switches off NCCL's warning about unbatched sends (one per rank), and a
    # simulated bubble waits for each GPU's stream, so it is measured, not near 0.
    assert "unbatched P2P op" not in result.stdout + result.stderr


@needs_two
@pytest.mark.gpu
def test_gpu_nccl_warns_about_unbatched_sends_unless_switched_off():
    # What guard_rails.py relies on (tools/repro_nccl_p2p_warning.py): the warning by default,
    # none with TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false.
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "repro_nccl_p2p_warning.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_two
@pytest.mark.gpu
def test_gpu_the_simulated_bubble_is_measured_on_nccl(tmp_path):
    # Each layer sleeps 5 ms; without the wait for the stream, NCCL's recv would return at once
    # and every stage look busy all step: a bubble near 0. The formula here: 1/3.
    result = subprocess.run([sys.executable, str(ROOT / LESSON / "measure_bubble.py"), "--backend",
                             "nccl", *map(str, TWO_STAGES), "--simulate-ms", "5", "--epochs", "2",
                             "--out-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    check_ok(result)
    report = read_bubble(tmp_path)
    assert report["measured"] > 0.5 * report["formula"], report["measured"]
