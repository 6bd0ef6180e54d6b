"""Lesson 13's proof: every layout of dp, pp and tp takes one process's steps, and three mistakes
do not.

It starts 8 ranks once (gloo, on the CPU, in float64). Every rank first trains the plain model
alone: 2 steps, each on a global batch of 16 of train.py's sequences, Adam, clipped to
the norm 0.25. Then the ranks run the layouts, several at once on different ranks, each with
train.py's own parallelize and Trainer.train_step, on parallelize.py's build_mesh: every
layout from 1 x 1 x 1 to 2 x 2 x 2, and 1 x 2 x 2 again with the 1F1B schedule. Each must end
within TOLERANCE of one process. On the layouts with dp 2 it also measures what FSDP holds: at
the start and the end of each block's forward, which of the stage's blocks hold more of their
weights than at rest (gathered); each block must be gathered alone, just before it runs, and
freed after. Then three controls, each one line of the lesson undone, must end far from it:

    norms of a rank's own tokens              their gradients not summed over the tp ranks
    no FSDP over dp                           each dp rank steps with its own sequences' gradients
    each stage clipped by its own norm        clip_grad_norm_, as on one process

A round in which anything goes wrong is the last one run, and the proof then exits 1.

    python 13_capstone/prove_layouts.py
"""

import contextlib
import datetime
import os
import sys
from argparse import Namespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

import parallelize as lesson
from guard_rails import find_free_port, spawn_guard, start_ranks
from train import TinyGPT, Trainer, load_data, parallelize

TIMEOUT = 120  # seconds any collective may wait, in the world group and every mesh's
TOLERANCE = 1e-12  # float64: the same sums in another order differ by ~1e-14 after 2 steps
CAUGHT = 1e-6  # a control must end at least this far from one process
# MAX_NORM: below the first steps' gradient norms (0.71, 0.52), so that every step clips
STEPS, BATCH, MAX_NORM, LR = 2, 16, 0.25, 1e-2
WORLD = 8

# Rounds of layouts, each on its own ranks: (name, (dp, pp, tp), first rank, mistake).
ROUNDS = [
    [("2 x 2 x 2", (2, 2, 2), 0, None)],
    [("2 x 2 x 1", (2, 2, 1), 0, None), ("2 x 1 x 2", (2, 1, 2), 4, None)],
    [("1 x 2 x 2", (1, 2, 2), 0, None), ("2 x 1 x 1", (2, 1, 1), 4, None),
     ("1 x 2 x 1", (1, 2, 1), 6, None)],
    [("1 x 1 x 2", (1, 1, 2), 0, None), ("1 x 1 x 1", (1, 1, 1), 2, None),
     ("1 x 2 x 2, 1F1B, 4 micro-batches", (1, 2, 2), 4, "1f1b")],
    [("norm gradients not summed over tp", (1, 1, 2), 0, "norms"),
     ("no FSDP over dp", (2, 1, 1), 2, "no fsdp"),
     ("each stage clipped by its own norm", (1, 2, 1), 4, "clip")],
]


class NormOfOwnTokens(ParallelStyle):
    """The first control's mistake, the sequence-parallel norm of a hand-made TP: its weights
    whole on every tp rank, run on the rank's own tokens, and the gradients of those weights
    (each rank's of its own tokens) never summed over tp. to_local() passes a gradient back
    as it is: a Replicate weight's gradient is taken to be whole already."""

    def _apply(self, module, device_mesh):
        for name, weight in list(module.named_parameters()):
            module.register_parameter(name, nn.Parameter(
                DTensor.from_local(weight.detach(), device_mesh, [Replicate()])))
        module.forward = lambda x: F.layer_norm(x, module.normalized_shape,
                                                module.weight.to_local(),
                                                module.bias.to_local(), module.eps)
        return module


def mistake(kind):
    """The lesson's code with one line undone, for the controls; nothing for the layouts."""
    if kind == "norms":
        return mock.patch.object(lesson, "SequenceParallel", NormOfOwnTokens)
    if kind == "no fsdp":
        return mock.patch("parallelize.fully_shard", lambda module, **_: module)
    if kind == "clip":  # train.py imported clip_whole_model by name: patch its copy
        return mock.patch("train.clip_whole_model", lambda params, max_norm, group:
                          torch.nn.utils.clip_grad_norm_(list(params), max_norm))
    return contextlib.nullcontext()


def one_process(batches, seq_len):
    """The reference: the whole model on one process, each step on the whole global batch."""
    torch.manual_seed(0)
    model = TinyGPT(seq_len)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for inputs, targets in batches:
        optimizer.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def local_numbers(module):
    """The numbers of module's weights this rank holds now (of a DTensor, its shard)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for p in module.parameters())


def watch_fsdp(model):
    """Record, at the start and the end of each block's forward, which of the stage's blocks hold
    more of their weights than at rest: the blocks FSDP has gathered. The hooks run after FSDP's
    own (which gathers before the block's forward and frees after it). Returns the list it fills:
    [block, gathered at its start, gathered at its end] per forward."""
    rest = {name: local_numbers(block) for name, block in model.blocks.items()}
    calls = []

    def gathered():
        return [name for name, block in model.blocks.items() if local_numbers(block) > rest[name]]

    for name, block in model.blocks.items():
        block.register_forward_pre_hook(lambda *_, name=name: calls.append([name, gathered()]))
        block.register_forward_hook(lambda *_: calls[-1].append(gathered()))
    return calls


def run_layout(mesh, batches, seq_len, kind):
    """train.py's steps on this layout: this rank's stage's weights, whole, and what FSDP held
    (watch_fsdp) in every forward of every block."""
    dp, pp, tp = (mesh[name].size() for name in ("dp", "pp", "tp"))
    args = Namespace(dp=dp, pp=pp, tp=tp, batch_size=BATCH, seq_len=seq_len, max_norm=MAX_NORM,
                     schedule="1f1b" if kind == "1f1b" else "gpipe",
                     microbatches=4 if kind == "1f1b" else 2, save_every=STEPS, out_dir="")
    torch.manual_seed(0)
    model = TinyGPT(seq_len)
    with mistake(kind):
        schedule = parallelize(model, mesh, torch.device("cpu"), args)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        trainer = Trainer(model, None, None, optimizer, torch.device("cpu"), args.save_every,
                          args.out_dir, mesh, schedule, args)
        fsdp_calls = watch_fsdp(model)
        dp_rank = mesh["dp"].get_local_rank()
        for inputs, targets in batches:  # this dp rank's sequences: every dp-th one
            trainer.train_step(inputs[dp_rank::dp], targets[dp_rank::dp])
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()}, fsdp_calls


def each_rank(rank, port, seq_len):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    torch.set_default_dtype(torch.float64)
    train_set, _ = load_data(seq_len)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0))
    batches = [[t[order[s * BATCH:(s + 1) * BATCH]] for t in train_set.tensors]
               for s in range(STEPS)]
    reference = one_process(batches, seq_len)
    found = []  # (layout, caught by a control?, parameter names this rank compared, difference)
    fsdp = []  # on the layouts with dp 2: (layout, rank, forwards, forwards FSDP got right)
    for layouts in ROUNDS:
        before = len(found), len(fsdp)
        for name, (dp, pp, tp), first, kind in layouts:
            # Every rank makes every mesh, in the same order: new_group, which build_mesh calls
            # for each group, is a collective of the whole world (a rank outside gets None).
            mesh = lesson.build_mesh("cpu", dp, pp, tp, TIMEOUT, first=first)
            if mesh is not None:
                weights, calls = run_layout(mesh, batches, seq_len, kind)
                worst = max((weights[n] - reference[n]).abs().max().item() for n in weights)
                found.append((name, kind not in (None, "1f1b"), sorted(weights), worst))
                if dp > 1 and kind is None:
                    right = [c for c in calls if c[1:] == [[c[0]], []]]
                    fsdp.append((name, rank, len(calls), len(right)))
        # The first round in which any rank saw a layout go wrong is the last: what it found is
        # the proof's answer, and the rounds after it would only take time.
        wrong = torch.tensor(float(any(not passed(control, worst)
                                       for _, control, _, worst in found[before[0]:])
                                   or any(not gathered_alone(calls, good)
                                          for *_, calls, good in fsdp[before[1]:])))
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
        if wrong:
            break
    every = [None] * WORLD
    dist.all_gather_object(every, (found, fsdp))
    proven = True
    if rank == 0:
        proven = report([f for f, _ in every], sorted(reference))
        proven &= report_fsdp([f for _, f in every])
    dist.destroy_process_group()
    if not proven:
        sys.exit(1)  # rank 0's lines above say what differed; the launcher exits 1 too


def passed(control, worst):
    """A layout ends within TOLERANCE of one process; a control, farther than CAUGHT."""
    return worst > CAUGHT if control else worst < TOLERANCE


def gathered_alone(calls, good):
    """FSDP ran forwards, and in each of them gathered its block alone and freed it after."""
    return calls > 0 and good == calls


def report(every, names):
    """Rank 0: each layout's largest difference over its ranks, and whether it covered every
    parameter of the model (the stages' names together)."""
    order = [name for layouts in ROUNDS for name, *_ in layouts]
    layouts = dict.fromkeys(order)
    for found in every:
        for name, control, compared, worst in found:
            seen = layouts[name] = layouts[name] or [control, set(), 0.0]
            seen[1].update(compared)
            seen[2] = max(seen[2], worst)
    print(f"one process: {STEPS} Adam steps of {BATCH} sequences, float64, clipped to norm "
          f"{MAX_NORM:g}; largest difference from it of every weight:")
    equal = caught = True
    for name, (control, compared, worst) in [(n, seen) for n, seen in layouts.items() if seen]:
        if sorted(compared) != names:
            print(f"{name}: compared {len(compared)} of the model's {len(names)} weights")
            equal = False
        if control:
            caught &= passed(control, worst)
            print(f"  control, {name:40s} {worst:.1e}  "
                  f"{'caught' if passed(control, worst) else 'MISSED'}")
        else:
            equal &= passed(control, worst)
            print(f"  dp x pp x tp = {name:34s} {worst:.1e}")
    skipped = [name for name, seen in layouts.items() if seen is None]
    if skipped:  # the rounds after the one that went wrong
        print(f"  not run: the {len(skipped)} layouts and controls after the first round in "
              "which one went wrong")
        equal = caught = False
    print(f"every layout equal within {TOLERANCE:g}: {equal}")
    print(f"every control farther than {CAUGHT:g}: {caught}", flush=True)
    return equal and caught


def report_fsdp(every):
    """Rank 0: whether FSDP gathered each block alone for each of its forwards, and freed it."""
    rows = sorted(row for found in every for row in found)
    right = bool(rows) and all(gathered_alone(calls, good) for _, _, calls, good in rows)
    for name, rank, calls, good in [row for row in rows if row[3] != row[2]][:1]:
        print(f"  FSDP at {name}, rank {rank}: in {calls - good} of {calls} forwards another "
              "block was gathered, or this one was not, or was not freed after")
    layouts = sorted({name for name, *_ in rows})
    print(f"FSDP gathered each block alone for each forward and freed it after, on all "
          f"{len(layouts)} layouts with dp 2: {right}", flush=True)
    return right


def main():
    seq_len = 64
    port = find_free_port()
    with spawn_guard("rank"):
        start_ranks(each_rank, args=(port, seq_len), nprocs=WORLD)


if __name__ == "__main__":
    sys.exit(main())
