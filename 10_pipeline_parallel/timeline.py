"""Lesson 10's instrument for the bubble: a fixed compute time per layer, when each micro-batch's
forward (F), input gradient (B) and weight gradient (W) ran, and what that timeline measures.

measure_bubble.py hooks SimulatedCompute and SimulatedWeight onto every stage of train.py's
pipeline; at the end, rank 0 turns every stage's events into the bubble, next to the formula,
and checks each rank's order of forwards and backwards against the one its schedule defines.
Nothing here trains: read it after train.py.
"""

import statistics
import time
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

# One forward (F), input gradient (B) or weight gradient (W) of a stage: which micro-batch, when.
Event = namedtuple("Event", "kind stage microbatch start end")
SPLIT = ("zb1p", "zbv", "dualpipev")  # the schedules that run W apart from B


class SimulatedCompute(torch.autograd.Function):
    """Sleeps as long as the stage's layers would compute, forward and (B) the input's gradient,
    and records when: a sleep takes no CPU, so 4 ranks on 2 cores keep a clean timeline."""

    @staticmethod
    def forward(ctx, x, seconds, backward_seconds, record):
        ctx.seconds, ctx.record = backward_seconds, record
        wait_for_device(x)
        record("F", seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait_for_device(grad)
        ctx.record("B", ctx.seconds)
        return grad, None, None, None


class SimulatedWeight(torch.autograd.Function):
    """Hands the stage's first weight on unchanged. Its backward runs only where autograd computes
    that weight's gradient (W: after B in one backward, or later, apart, in a zero-bubble
    schedule): it sleeps as long as the stage's weight gradients would take, and records when."""

    @staticmethod
    def forward(ctx, weight, seconds, record):
        ctx.seconds, ctx.record = seconds, record
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        wait_for_device(grad)
        ctx.record("W", ctx.seconds)
        return grad, None, None


def wait_for_device(tensor):
    """On a GPU, first let its stream run what was queued: with NCCL a recv holds the stream,
    not this thread, and the clock would start before the input came (a bubble near 0)."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


def simulate_compute(stage, stage_id, events, ms, backward_ms, weight_ms):
    """From now on, each forward of stage sleeps ms per layer, its B backward_ms and its W
    weight_ms, each recorded in events as an Event (the n-th F of a stage is micro-batch n)."""
    def record(kind, seconds):
        start = time.time()  # wall-clock time: the ranks' timestamps compare across processes
        time.sleep(seconds)
        done = sum(e.kind == kind and e.stage == stage_id for e in events)
        events.append(Event(kind, stage_id, done, start, time.time()))

    layers, first = len(stage.layers), stage.layers[0]
    stage.register_forward_hook(lambda module, args, out: SimulatedCompute.apply(
        out, ms / 1000 * layers, backward_ms / 1000 * layers, record))
    # The first layer's weight goes through SimulatedWeight on its way into the product.
    first.forward = lambda x: F.linear(x, SimulatedWeight.apply(
        first.weight, weight_ms / 1000 * layers, record), first.bias)


def defined_order(schedule, name, pp_rank, stages, microbatches):
    """This rank's forwards and backwards in the order its schedule defines, as "0F1" (stage
    0, forward, micro-batch 1), for comparison with the order they ran in."""
    s, m = pp_rank, microbatches
    if name in ("afab", "gpipe"):  # every forward, then every backward
        return [f"{s}F{i}" for i in range(m)] + [f"{s}B{i}" for i in range(m)]
    if name == "1f1b":  # p - s forwards fill the pipeline (torch's count), then B and F in turn
        warmup = min(m, stages - s)
        order = [f"{s}F{i}" for i in range(warmup)]
        for i in range(m):
            order += [f"{s}B{i}"] + ([f"{s}F{warmup + i}"] if warmup + i < m else [])
        return order
    # Interleaved: the library's own plan. (Its plan for 1F1B numbers the last stage's forwards
    # from 1 in torch 2.14, not from 0: tools/repro_1f1b_pipeline_order.py.)
    return [str(a) for a in schedule.pipeline_order[pp_rank]
            if a is not None and a.computation_type.value in ("F", "B")]


def predicted(args):
    """The bubble as a share of a rank's step, as the papers give it for stages of equal cost:
    GPipe's and 1F1B's (p - 1) / (m + p - 1), interleaved's (p - 1) / (v*m + p - 1); for the
    backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), ZB-H1's
    idle time (p - 1)(F + B - W) of a step's m (F + B + W) work (section 2.1; torch's zb1p), and
    ZB-V's none where F = B = W (section 6). None where no paper gives one (dualpipev)."""
    p, m, f, b, w = (args.stages, args.microbatches, args.simulate_ms, args.backward_ms,
                     args.weight_ms)
    v = 2 if args.schedule in ("interleaved", "zbv", "dualpipev") else 1
    if args.schedule == "zb1p":
        idle = (p - 1) * max(0, f + b - w)
        return idle / (m * (f + b + w) + idle)
    if args.schedule == "zbv":
        return 0.0 if f == b == w else None
    return None if args.schedule == "dualpipev" else (p - 1) / (v * m + p - 1)


def bubble_report(timelines, args):
    """From every stage's events: the bubble per step, its median, and what each rank ran."""
    p = args.stages
    bubbles = []
    for step in range(1, len(timelines[0])):  # step 0 also sets the pipeline up: left out
        events = [e for rank in timelines for e in rank[step]]
        wall = max(e.end for e in events) - min(e.start for e in events)
        busy = sum(e.end - e.start for e in events)
        bubbles.append(1 - busy / (p * wall))  # idle share of p ranks over the step
    last = [rank[-1] for rank in timelines]
    t0 = min(e.start for events in last for e in events)
    held = []
    for events in last:  # micro-batches whose activations a rank holds: F done, W not yet
        now = top = 0
        for e in sorted(events, key=lambda e: e.start):
            now += {"F": 1, "B": 0, "W": -1}[e.kind]
            top = max(top, now)
        held.append(top)
    return {
        "measured": statistics.median(bubbles) if bubbles else None,
        "spread": [min(bubbles), max(bubbles)] if bubbles else None,
        "steps": len(bubbles),
        "formula": predicted(args),
        "held": held,
        "timeline": [[[e.kind, e.stage, e.microbatch, e.start - t0, e.end - t0] for e in events]
                     for events in last],
    }


def print_schedule_report(report, args):
    if report["steps"]:
        low, high = report["spread"]
        measured = (f"{report['measured']:.3f} (median of {report['steps']} steps, {low:.3f} "
                    f"to {high:.3f})")
    else:  # the first step also sets the pipeline up, and is left out: none was left
        measured = "n/a (one step only; the first is left out: train more steps)"
    formula = "n/a" if report["formula"] is None else f"{report['formula']:.3f}"
    print(f"bubble, --schedule {args.schedule}: p {args.stages} stages, m {args.microbatches} "
          f"micro-batches, F {args.simulate_ms:g} B {args.backward_ms:g} W {args.weight_ms:g} "
          f"ms a layer: measured {measured} | predicted {formula}", flush=True)
    for r, (order, held) in enumerate(zip(report["order"], report["held"], strict=True)):
        same = "yes" if order["recorded"] == order["defined"] else "NO"
        same = "" if order["defined"] is None else f" | as {args.schedule} defines: {same}"
        print(f"rank {r}: {' '.join(order['recorded'])}{same} | activations held: at most "
              f"{held} micro-batches", flush=True)


def schedule_report(trainer, pp_rank):
    """On rank 0: the bubble of the first pipeline and each of its ranks' order, recorded
    (the last step's) and defined; None on the other ranks, which send theirs."""
    args = trainer.args
    split = args.schedule in SPLIT  # W apart from B: the whole order; else W follows each B
    order = {"recorded": [f"{e.stage}{e.kind}{e.microbatch}" for e in trainer.timeline[-1]
                          if split or e.kind != "W"],
             "defined": None if split else defined_order(trainer.schedule, args.schedule,
                                                         pp_rank, args.stages, args.microbatches)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trainer.timeline, order))  # every rank takes part
    if not trainer.is_main_process:
        return None
    pipeline = everyone[:args.stages]  # ranks 0 .. stages - 1: the first pipeline
    report = bubble_report([timeline for timeline, _ in pipeline], args)
    report["order"] = [order for _, order in pipeline]
    return report
