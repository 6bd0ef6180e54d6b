"""Lesson 10's instrument for the bubble: a fixed compute time per layer, when each micro-batch's
forward and backward ran, and what that timeline measures.

train.py --simulate-ms T hooks SimulatedCompute onto every stage; at the end, rank 0 turns every
stage's events into the bubble, next to the formula, and checks each rank's order of forwards
and backwards against the one its schedule defines. Nothing here trains: read it after train.py.
"""

import statistics
import time
from collections import namedtuple

import torch
import torch.distributed as dist

# One forward (F) or backward (B) of a stage: which micro-batch, and when it ran.
Event = namedtuple("Event", "kind stage microbatch start end")


class SimulatedCompute(torch.autograd.Function):
    """Sleeps as long as the stage's layers would compute, forward and (twice that) backward,
    and records when: a sleep takes no CPU, so 4 ranks on 2 cores keep a clean timeline."""

    @staticmethod
    def forward(ctx, x, seconds, record):
        ctx.seconds, ctx.record = seconds, record
        wait_for_device(x)
        record("F", seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait_for_device(grad)
        ctx.record("B", 2 * ctx.seconds)  # backward: two products per layer, forward's one
        return grad, None, None


def wait_for_device(tensor):
    """On a GPU, first let its stream run what was queued: with NCCL a recv holds the stream,
    not this thread, and the clock would start before the input came (a bubble near 0)."""
    if tensor.device.type == "cuda":
        torch.cuda.current_stream(tensor.device).synchronize()


def simulate_compute(stage, stage_id, ms, events):
    """From now on, each forward and backward of stage sleeps ms per layer and is recorded in
    events as an Event (the n-th F of a stage is micro-batch n)."""
    def record(kind, seconds):
        start = time.time()  # wall-clock time: the ranks' timestamps compare across processes
        time.sleep(seconds)
        done = sum(e.kind == kind and e.stage == stage_id for e in events)
        events.append(Event(kind, stage_id, done, start, time.time()))

    seconds = ms / 1000 * len(stage.layers)
    stage.register_forward_hook(lambda module, args, out: SimulatedCompute.apply(out, seconds,
                                                                                 record))


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


def bubble_report(timelines, args):
    """From every stage's events: the bubble per step, its median, and what each rank ran."""
    p, v, m = args.stages, 2 if args.schedule == "interleaved" else 1, args.microbatches
    bubbles = []
    for step in range(1, len(timelines[0])):  # step 0 also sets the pipeline up: left out
        events = [e for rank in timelines for e in rank[step]]
        wall = max(e.end for e in events) - min(e.start for e in events)
        busy = sum(e.end - e.start for e in events)
        bubbles.append(1 - busy / (p * wall))  # idle share of p ranks over the step
    last = [rank[-1] for rank in timelines]
    t0 = min(e.start for events in last for e in events)
    held = []
    for events in last:  # micro-batches whose activations a rank holds: F done, B not yet
        now = top = 0
        for e in sorted(events, key=lambda e: e.start):
            now += 1 if e.kind == "F" else -1
            top = max(top, now)
        held.append(top)
    return {
        "measured": statistics.median(bubbles) if bubbles else None,
        "spread": [min(bubbles), max(bubbles)] if bubbles else None,
        "steps": len(bubbles),
        "formula": (p - 1) / (v * m + p - 1),
        "held": held,
        "timeline": [[[e.kind, e.stage, e.microbatch, e.start - t0, e.end - t0] for e in events]
                     for events in last],
    }


def print_schedule_report(report, args):
    v = 2 if args.schedule == "interleaved" else 1
    if report["steps"]:
        low, high = report["spread"]
        measured = (f"{report['measured']:.3f} (median of {report['steps']} steps, {low:.3f} "
                    f"to {high:.3f})")
    else:  # the first step also sets the pipeline up, and is left out: none was left
        measured = "n/a (one step only; the first is left out: train more steps)"
    print(f"bubble, --schedule {args.schedule}: p {args.stages} stages x v {v}, m "
          f"{args.microbatches} micro-batches: measured {measured} | (p - 1) / (v*m + p - 1) = "
          f"{report['formula']:.3f}", flush=True)
    for r, (order, held) in enumerate(zip(report["order"], report["held"], strict=True)):
        same = "yes" if order["recorded"] == order["defined"] else "NO"
        print(f"rank {r}: {' '.join(order['recorded'])} | as {args.schedule} defines: {same} "
              f"| activations held: at most {held} micro-batches", flush=True)


def schedule_report(trainer, pp_rank):
    """On rank 0: the bubble of the first pipeline and each of its ranks' order, recorded
    (the last step's) and defined; None on the other ranks, which send theirs."""
    args = trainer.args
    order = {"recorded": [f"{e.stage}{e.kind}{e.microbatch}" for e in trainer.timeline[-1]],
             "defined": defined_order(trainer.schedule, args.schedule, pp_rank, args.stages,
                                      args.microbatches)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trainer.timeline, order))  # every rank takes part
    if not trainer.is_main_process:
        return None
    pipeline = everyone[:args.stages]  # ranks 0 .. stages - 1: the first pipeline
    report = bubble_report([timeline for timeline, _ in pipeline], args)
    report["order"] = [order for _, order in pipeline]
    return report
