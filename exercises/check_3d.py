"""Exercise 13's checks (exercises/check.py calls them): your copy of lesson 13's 3-D step, run on
five layouts, each compared with one process in float64, where a correct step differs from it
only by rounding. The step is your copy's: model.py's TinyGPT, train.py's parallelize (its loss)
and Trainer.train_step, and parallelize.py's build_mesh, keep_stage, tensor_parallel,
shard_data_parallel, pipeline_schedule and clip_whole_model.

It starts 8 ranks once. They run 1 x 1 x 1, 2 x 1 x 1, 1 x 2 x 1 and 1 x 1 x 2 (dp x pp x tp: one
dimension at a time) at once, each layout on its own ranks, then 2 x 2 x 2 on all 8, on your
build_mesh's mesh, as lesson 13's prove_layouts.py runs its layouts (every rank makes every
mesh, in the same order). Each layout takes 2 steps of Adam, clipped. Rank 7, free in the first
round, trains your model alone: the reference. Which layouts differ from it, or raise, names the
dimension; what differs names the mistake: the first step's gradients before clipping, the
factor that clipping scaled them by, each stage's blocks, the error a layout raised.

    python exercises/check_3d.py a/train.py b/train.py   # several copies, the ranks started once

(the tests' way: each copy's verdict, as exercises/check.py prints it).
"""

import datetime
import importlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from argparse import Namespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from verdicts import Mistake, Unchecked, free_port, read

CLOSE = 1e-12  # float64: the same sums in another order differ by ~1e-14 after 2 steps
# 2 steps of 8 sequences of 16 characters: dp 2 gives each rank 4, 2 micro-batches of 2; tp 2
# gives each 8 tokens. Adam; MAX_NORM below both steps' gradient norms (0.99, 0.79), so that
# both steps clip, as prove_layouts.py's do.
SEQ_LEN, BATCH, STEPS, LR, MICROBATCHES, MAX_NORM = 16, 8, 2, 1e-2, 2, 0.25
WORLD = 8
COPY_MODULES = ("train", "model", "data", "parallelize", "sharding", "guard_rails")  # a copy's own
DIMENSIONS = ("dp", "pp", "tp")
# Rounds of layouts, each on its own ranks: (name, (dp, pp, tp), first rank). The first changes
# one dimension at a time; the second is the 3-D layout, on your build_mesh's mesh.
ONE, DP, PP, TP, ALL = "1 x 1 x 1", "2 x 1 x 1", "1 x 2 x 1", "1 x 1 x 2", "2 x 2 x 2"
ROUNDS = [[(ONE, (1, 1, 1), 0), (DP, (2, 1, 1), 1), (PP, (1, 2, 1), 3), (TP, (1, 1, 2), 5)],
          [(ALL, (2, 2, 2), 0)]]
REFERENCE_RANK = 7  # free in the first round: it trains your model alone, the reference
LAYOUTS = {name: shape for layouts in ROUNDS for name, shape, _ in layouts}
SKIPPED = "not run: a layout of the first round failed"
# What a copy's train.py imports, imported once before the ranks fork (8 imports saved).
PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel", "torch.utils.data.distributed")


# ---------------------------------------------------------------------------------------------
# Your copy, imported by name, as its train.py imports parallelize and guard_rails
# ---------------------------------------------------------------------------------------------
def folder_of(script):
    folder = os.path.dirname(os.path.abspath(script))
    for name in ("train.py", "parallelize.py", "guard_rails.py", "model.py", "data.py",
                 "sharding.py"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise Unchecked(f"there is no {name} beside {script}: the copy is the whole of "
                            "13_capstone's Python files")
    return folder


def import_copy(folder):
    """The copy's train module (any other copy's train, parallelize, guard_rails forgotten)."""
    for name in COPY_MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("train")
    except Exception as error:  # noqa: BLE001 (any error of the learner's file is one line)
        raise Unchecked(f"your train.py failed to import: {error!r}") from None
    finally:
        sys.path.remove(folder)


def describe(error, folder):
    """'tensor_parallel raised RuntimeError (in torch from_local): ...': the function of your
    copy that was running (the deepest of its frames), and torch's public one the error came
    from, if any."""
    yours, deepest, tb = None, None, error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if os.path.dirname(os.path.abspath(code.co_filename)) == folder:
            yours = getattr(code, "co_qualname", code.co_name)  # Python 3.11 on
            deepest = None
        else:
            deepest = code.co_name
        tb = tb.tb_next
    said = " ".join(str(error).split())[:240]
    inner = yours and deepest and not deepest.startswith("_")  # from_local, not __call__
    return (f"{yours or deepest} raised {type(error).__name__}"
            f"{f' (in torch {deepest})' if inner else ''}{': ' + said if said else ''}")


def show(folder, file, function):
    """'my_13/parallelize.py, tensor_parallel', the copy's path as the learner gave it."""
    path = os.path.relpath(os.path.join(folder, file))
    return f"{os.path.join(folder, file) if path.startswith('..') else path}, {function}"


def batches_of(train):
    """The steps' global batches: seeded, the same in every process."""
    train_set, _ = train.load_data(SEQ_LEN)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0))
    return [[t[order[s * BATCH:(s + 1) * BATCH]] for t in train_set.tensors]
            for s in range(STEPS)]


def reference(train):
    """Your model alone on one process: the first step's gradients and clipping factor, and the
    weights after the steps."""
    torch.manual_seed(0)
    model = train.TinyGPT(SEQ_LEN)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    found = {}
    for step, (inputs, targets) in enumerate(batches_of(train)):
        optimizer.zero_grad()
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if step == 0:
            found["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
            found["norm"], found["factor"] = float(norm), factor(float(norm))
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, norm)
        optimizer.step()
    found["weights"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return found


def factor(norm):
    """What clipping to MAX_NORM multiplies gradients of this norm by (clip_grads_with_norm_)."""
    return min(1.0, MAX_NORM / (norm + 1e-6))


# ---------------------------------------------------------------------------------------------
# The ranks: each runs your step on the layouts it is part of, round by round
# ---------------------------------------------------------------------------------------------
def whole(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def local(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().flatten()


def run_layout(train, mesh, shape, batches):
    """Your step on this layout; what this rank's stage shows of it."""
    dp, pp, tp = shape
    args = Namespace(dp=dp, pp=pp, tp=tp, batch_size=BATCH, seq_len=SEQ_LEN, max_norm=MAX_NORM,
                     schedule="gpipe", microbatches=MICROBATCHES, save_every=STEPS, out_dir="",
                     lr=LR, epochs=1, seed=0, dim=32, heads=4, layers=4)
    torch.manual_seed(0)
    model = train.TinyGPT(SEQ_LEN)
    device = torch.device("cpu")
    schedule = train.parallelize(model, mesh, device, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    trainer = train.Trainer(model, None, None, optimizer, device, args.save_every, args.out_dir,
                            mesh, schedule, args)
    found = {"stage": mesh["pp"].get_local_rank(),
             "names": sorted(name for name, _ in model.named_parameters())}
    step, before = schedule.step, []

    def step_and_record(*args, **kwargs):  # the first step's gradients, before clipping
        out = step(*args, **kwargs)
        if "grads" not in found:
            found["grads"] = {name: whole(p.grad) for name, p in model.named_parameters()
                              if p.grad is not None}
            before.extend(local(p.grad).clone() for p in model.parameters()
                          if p.grad is not None)
        return out

    def record_clipping(optimizer, args, kwargs):  # what clipping multiplied them by
        if "factor" not in found and before:
            was = torch.cat(before)
            now = torch.cat([local(p.grad) for p in model.parameters() if p.grad is not None])
            found["local norm"] = float(was.norm())
            found["factor"] = float(now @ was / (was @ was)) if was.any() else 1.0

    schedule.step = step_and_record
    optimizer.register_step_pre_hook(record_clipping)
    dp_rank = mesh["dp"].get_local_rank()
    for inputs, targets in batches:  # this dp rank's sequences: every dp-th one
        trainer.train_step(inputs[dp_rank::dp], targets[dp_rank::dp])
    found["weights"] = {name: whole(p) for name, p in model.named_parameters()}
    return found


def run_copy(rank, folder, label, rounds, out, wait):
    """Every layout of one copy, on this rank's share; {layout: what it found}."""
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_default_dtype(torch.float32)  # as a fresh process imports the copy
    train = import_copy(folder)
    torch.set_default_dtype(torch.float64)
    batches = batches_of(train)
    results, found = {}, False
    if rank == REFERENCE_RANK:
        try:
            results["reference"] = reference(train)
        except Exception as error:  # noqa: BLE001
            results["unchecked"] = f"your model alone, on one process: {describe(error, folder)}"
    for layouts in ROUNDS:
        for name, shape, first in layouts:
            ranks = list(range(first, first + shape[0] * shape[1] * shape[2]))
            with open(os.path.join(out, f"rank{rank}.at"), "w") as at:
                at.write(f"dp x pp x tp = {name}{label}")
            if name == ALL and found:  # the table names the dimension already; a 3-D layout
                results[name] = {"skipped": SKIPPED}  # can raise on one stage while one waits
                continue
            try:
                dp, pp, tp = shape
                if name == ALL:  # your build_mesh, which every rank calls
                    mesh = train.build_mesh("cpu", dp, pp, tp, wait)
                else:  # every rank makes every mesh, in the same order, the lesson's
                    mesh = DeviceMesh("cpu", torch.tensor(ranks).view(pp, dp, tp),
                                      mesh_dim_names=("pp", "dp", "tp"))
                if rank in ranks:
                    results[name] = run_layout(train, mesh, shape, batches)
            except Exception as error:  # noqa: BLE001 (one line: what raised, and where)
                results[name] = {"error": describe(error, folder)}
        if layouts is ROUNDS[0]:  # the layouts that raised or differ from one process
            shared = [results.get("reference", {}).get("weights")]
            dist.broadcast_object_list(shared, src=REFERENCE_RANK, group=rounds)
            failing = [n for n in LAYOUTS if n in results and ("error" in results[n]
                       or differs(results[n], shared[0]))]
            every = [None] * WORLD  # the round's barrier too
            dist.all_gather_object(every, failing, group=rounds)
            found = any(every)
    return results


def differs(found, reference):
    return reference is not None and any(
        n not in reference or t.shape != reference[n].shape
        or (t - reference[n]).abs().max() > CLOSE for n, t in found["weights"].items())


def rank_main(rank, folders, out, port, wait):
    # Its output in a file of its own: a rank that dies in gloo says why there.
    with open(os.path.join(out, f"rank{rank}.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank whose partner raised waits `wait` seconds in a collective, then raises too: the
    # layouts' groups time out so, the checker's (DeviceMesh gives them new_group's default
    # timeout) and your build_mesh's (given `wait`).
    dist.distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=wait)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=wait))
    # Each round ends when its slowest layout does, or its ranks have timed out.
    rounds = dist.new_group(timeout=datetime.timedelta(seconds=6 * wait))
    for index, folder in enumerate(folders):
        label = f" of {os.path.basename(folder)}" if len(folders) > 1 else ""
        try:
            results = run_copy(rank, folder, label, rounds, out, wait)
        except Unchecked as error:  # its train.py failed to import: on every rank
            results = {"unchecked": str(error)}
        torch.save(results, os.path.join(out, f"rank{rank}-{index}.pt"))
    dist.destroy_process_group()


def start_ranks(folders, out, timeout):
    """8 ranks: on Linux forked from this process, which has imported torch and what the lesson
    imports, and computed nothing (no thread pool to copy half-made); else spawned."""
    os.makedirs(out)
    # spawn logs "Terminating process N via signal SIGTERM" for each rank it stops after one
    # failed: the verdict line says which one failed, and why.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    method = "spawn"  # macOS and Windows
    if sys.platform == "linux":
        for name in PRELOAD:
            importlib.import_module(name)
        method = "fork"  # a fork server would import torch again: 3 s more on a 2-core machine
    wait = max(5.0, min(20.0, timeout / 6))  # for a partner that raised
    return mp.start_processes(rank_main, args=(folders, out, free_port(), wait), nprocs=WORLD,
                              join=False, start_method=method)


def join_ranks(context, count, out, deadline):
    """Each rank's results for each copy, or Unchecked saying why the ranks stopped."""
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                at = read(os.path.join(out, "rank0.at"))
                raise Unchecked(f"the {WORLD} ranks did not finish in time"
                                f"{', rank 0 at ' + at if at else ''}")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
        rank = error.error_index
        at = read(os.path.join(out, f"rank{rank}.at"))
        lines = [line.strip() for line in read(os.path.join(out, f"rank{rank}.log")).splitlines()
                 if line.strip()]
        how = f"died of {error.signal_name}" if getattr(error, "signal_name", None) else \
            f"stopped with exit status {getattr(error, 'exit_code', '?')}"
        raise Unchecked(f"{'at ' + at + ', ' if at else ''}rank {rank} {how}; its last line: "
                        f"{(lines or ['(nothing)'])[-1][:300]}") from None
    finally:  # also on Ctrl-C: no rank is left running
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [[torch.load(os.path.join(out, f"rank{rank}-{index}.pt"), weights_only=True)
             for rank in range(WORLD)] for index in range(count)]


# ---------------------------------------------------------------------------------------------
# The judgement: the table of layouts names the dimension; what differs, the mistake
# ---------------------------------------------------------------------------------------------
def dims(name):
    return [d for d, n in zip(DIMENSIONS, LAYOUTS[name], strict=True) if n > 1]


def the_table(per_rank, ref):
    """{layout: {"error": ...} or {"skipped": ...} or {"ranks": [...], "difference": ...}}."""
    table = {}
    for name in LAYOUTS:
        found = [results[name] for results in per_rank if name in results]
        # A rank's own error first; then a partner's that waited for it and timed out.
        errors = sorted((f["error"] for f in found if "error" in f), key=waited)
        if errors or any("skipped" in f for f in found):
            table[name] = {"error": errors[0]} if errors else found[0]
            continue
        worst = 0.0
        for f in found:
            for n, t in f["weights"].items():
                want = ref["weights"].get(n)
                worst = max(worst, float("inf") if want is None or t.shape != want.shape
                            else (t - want).abs().max().item())
        table[name] = {"ranks": found, "difference": worst}
    return table


def waited(error):
    return bool(re.search(r"[Tt]imed out|timeout|Connection (closed|reset)", error))


def failed(entry):
    return "error" in entry or entry.get("difference", 0.0) > CLOSE


def table_line(table):
    """'dp x pp x tp = 1 x 1 x 2 differs from one process by 4.0e-02, 2 x 2 x 2 by 4.0e-02;
    1 x 1 x 1, 2 x 1 x 1 and 1 x 2 x 1 equal it'"""
    wrong, right, skipped = [], [], []
    for name, entry in table.items():
        if "error" in entry:
            wrong.append(f"{name} raised")
        elif "skipped" in entry:
            skipped.append(name)
        elif failed(entry):
            said = any("by" in w for w in wrong)
            wrong.append(f"{name} {'' if said else 'differs from one process '}by "
                         f"{entry['difference']:.1e}")
        else:
            right.append(name)
    line = "dp x pp x tp = " + ", ".join(wrong)
    if right:
        line += (f"; {both(right)} equal{'s' if len(right) == 1 else ''} "
                 f"{'it' if any('by' in w for w in wrong) else 'one process'}")
    if skipped:
        line += f"; {both(skipped)} not run"
    return line


def both(names):
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def dimension_of(table):
    """What the table says: the dimension whose layouts fail."""
    if failed(table[ONE]):
        return "not a dimension: 1 x 1 x 1 differs too, the step itself"
    single = [dims(name)[0] for name in (DP, PP, TP) if failed(table[name])]
    if not single:
        return ("the dimensions together: each alone is right, 2 x 2 x 2 is not (where two "
                "meet: TP's mesh and FSDP's, or the mesh itself)")
    if len(single) == 1:
        return f"the {single[0]} dimension (only layouts with {single[0]} 2 fail)"
    return f"the {' and '.join(single)} dimensions (layouts with {' or '.join(single)} 2 fail)"


# What each dimension's code is, for a mistake the evidence does not name: (function, what).
CODE = {
    "tp": (("tensor_parallel", "Attention.forward"), "TP's plan, each layer split as lesson 09 "
           "splits it, the sequence split over tp between the pairs, and what the model's forward "
           "makes of a rank's shards (its heads: heads / tp of them, each whole)"),
    "dp": (("shard_data_parallel", "parallelize"), "FSDP over the dp mesh, after TP, and each dp "
           "rank's loss over its own sequences"),
    "pp": (("keep_stage", "pipeline_schedule"), "the stages: their blocks, the ends each keeps, "
           "the schedule"),
    "": (("parallelize",), "the step"),
}
# An error's text (a regular expression), what it most likely means, and where to look.
ERRORS = [
    (r"only accepts torch\.Tensor but got .*DTensor",
     "fully_shard ran before tensor_parallel: TP found weights that FSDP had already made "
     "DTensors on the dp mesh. TP first, then FSDP over the dp mesh, which shards TP's shards",
     "parallelize"),
    (r"must have the same mesh.*DeviceMesh\(\(dp=\d+\)",
     "a layer left out of TP's plan: its weights are on the dp mesh alone, the others on dp x "
     "tp. Every layer of a stage is in the plan: the norms (norm1, norm2 of each block, the last "
     "norm) as SequenceParallel", "tensor_parallel"),
    (r"^TinyGPT\.forward raised .*size of tensor a \(\d+\) must match .* dimension 2",
     "the two embeddings' outputs split differently before they are added: the token "
     "embedding's [batch, tokens, dim] by token (its dimension 1), the position embedding's "
     "[tokens, dim] by its features. The position embedding's token dimension is 0: Shard(0)",
     "tensor_parallel"),
    (r"^Block\.forward raised .*size of tensor a \(\d+\) must match .* dimension 1",
     "a layer's output whole where the residual stream is split by token: attn.out and fc2 "
     "give their sums split by token (RowwiseParallel(output_layouts=Shard(1)))",
     "tensor_parallel"),
    (r"^(parallelize\.<locals>\.loss_fn|loss_sum) raised IndexError.*out of bounds",
     "the head's scores split by character over tp: the loss needs every character's score on "
     "every rank, so the head gathers them (ColwiseParallel(output_layouts=Replicate()))",
     "tensor_parallel"),
    (r"Cannot concatenate overlapping meshes",
     "TP and FSDP on the same ranks: tensor_parallel on the tp mesh, shard_data_parallel on the "
     "dp mesh (mesh[\"tp\"], mesh[\"dp\"]); with one of them 1 it cannot show", "parallelize"),
    (r"ascending order",
     "the mesh's dimensions named in another order than they are laid out: build_mesh's shape "
     "is (pp, dp, tp) and so are its names", "build_mesh"),
]


def explain_error(name, error, folder, dimension):
    for pattern, mistake, function in ERRORS:
        if re.search(pattern, error):
            return f"{dimension}: {mistake}", show(folder, file_of(folder, function), function)
    functions, what = CODE[dims(name)[0] if len(dims(name)) == 1 else ""]
    return f"{dimension}: {what}", places(folder, functions)


def places(folder, functions):
    return "; ".join(show(folder, file_of(folder, f), f) for f in functions)


def file_of(folder, function):
    """The file of the copy that defines function ("Attention.forward": its class)."""
    for name in ("parallelize.py", "model.py"):
        with open(os.path.join(folder, name)) as f:
            if re.search(rf"^(def|class) {function.split('.')[0]}\b", f.read(), re.M):
                return name
    return "train.py"


def explain(name, entry, ref, folder, dimension):
    """(the mistake, where to look) from what the first failing layout measured."""
    if "error" in entry:
        return explain_error(name, entry["error"], folder, dimension)
    dp, pp, tp = LAYOUTS[name]

    def at(*functions):
        return places(folder, functions)

    by_stage = {}
    for found in entry["ranks"]:
        by_stage.setdefault(found["stage"], set()).update(found["names"])
    blocks = {s: sorted({int(n.split(".")[1]) for n in held if n.startswith("blocks.")})
              for s, held in sorted(by_stage.items())}
    stages = ", ".join(f"stage {s} {b}" for s, b in blocks.items())
    held = [n for s in sorted(by_stage) for n in sorted(by_stage[s])]
    names = sorted(ref["grads"])
    if sorted(held) != names:
        twice = sorted({n for n in held if held.count(n) > 1})
        missing = sorted(set(names) - set(held))
        what = (f"{twice[0]} is on {held.count(twice[0])} stages" if twice else
                f"{missing[0]} is on no stage" if missing else "weights not the model's")
        return (f"{dimension}: {what} (their blocks: {stages}): keep_stage keeps its share of the "
                "blocks, the embeddings on the first stage, the last norm and the head on the "
                "last, and deletes the rest", at("keep_stage"))
    order = [b for s in blocks for b in blocks[s]]
    if order != sorted(order):
        return (f"{dimension}: the stages run the blocks in the order {order} ({stages}): "
                "stage s keeps blocks s * per_stage to (s + 1) * per_stage - 1, so that the "
                "pipeline runs the model's blocks in its order", at("keep_stage"))
    grads = {}
    for found in entry["ranks"]:
        for n, g in found.get("grads", {}).items():  # none: the schedule did not step
            grads.setdefault(n, g)
    wrong = [n for n in names if n not in grads or grads[n].shape != ref["grads"][n].shape
             or not torch.allclose(grads[n], ref["grads"][n], rtol=0, atol=10 * CLOSE)]
    if wrong:
        if all(n in grads and grads[n].shape == ref["grads"][n].shape for n in names):
            got = torch.cat([grads[n].flatten() for n in names])
            want = torch.cat([ref["grads"][n].flatten() for n in names])
            ratio = float(got @ want / (want @ want))
            if torch.allclose(got, ratio * want, rtol=0, atol=10 * CLOSE):
                seen = f"the first step's gradients are {ratio:g} x one process's"
                if dp > 1 and abs(ratio - 1 / dp) < 1e-9:
                    return (f"{dimension}: {seen}, 1 / dp: the loss was divided by the global "
                            "batch's tokens, and FSDP averages over dp as well. A dp rank's "
                            "loss is the mean over its own sequences' tokens (batch_size // dp "
                            "of them); FSDP's average makes it the global batch's. Adam and "
                            "clipping hide a gradient's scale, but not all of it",
                            at("parallelize"))
                return (f"{dimension}: {seen}: the loss's scale. loss_fn divides each "
                        "micro-batch's summed loss by the dp rank's tokens in a step, and the "
                        "schedule adds the micro-batches' gradients as they are "
                        "(scale_grads=False)", at("parallelize", "pipeline_schedule"))
        functions, what = CODE[dims(name)[0] if len(dims(name)) == 1 else ""]
        return (f"{dimension}: the first step's gradients differ ({len(wrong)} of "
                f"{len(names)}: {', '.join(wrong[:2])}{', ...' if len(wrong) > 2 else ''}): "
                f"{what}", places(folder, functions))
    if any("factor" not in found for found in entry["ranks"]):
        return (f"{dimension}: the first step's gradients are right, but the optimizer did not "
                "step after them: Trainer.train_step runs the schedule, clips, then steps",
                at("Trainer.train_step"))
    factors = sorted({found["factor"] for found in entry["ranks"]})
    if any(abs(f - ref["factor"]) > 1e-9 for f in factors):
        shown = [factors[0], factors[-1]] if len(factors) > 1 else factors
        seen = (f"the gradients are right, but clipping multiplied them by "
                f"{' and '.join(f'{f:.4f}' for f in shown)}, one process's by "
                f"{ref['factor']:.4f} (its norm {ref['norm']:.4f}, max_norm {MAX_NORM:g})")
        own = {s: torch.cat([ref["grads"][n].flatten() for n in by_stage[s]]).norm().item()
               for s in by_stage}
        ranks = [(found["stage"], found["factor"], found["local norm"])
                 for found in entry["ranks"]]
        if pp > 1 and all(abs(f - factor(own[s])) < 1e-9 for s, f, _ in ranks):
            return (f"{dimension}: {seen}: each stage clipped by its own norm. The step is the "
                    "whole model's: the stages' squared norms summed over pp, then the root",
                    at("clip_whole_model"))
        if pp > 1 and all(abs(f - factor(sum(own.values()))) < 1e-9 for _, f, _ in ranks):
            return (f"{dimension}: {seen}: the stages' norms added, not their squares. The "
                    "whole model's norm is the root of the sum of the stages' squared norms",
                    at("clip_whole_model"))
        if all(abs(f - factor(n)) < 1e-9 for _, f, n in ranks):
            return (f"{dimension}: {seen}: each rank clipped by the norm of its own shards: "
                    "the norm is the whole stage's, over every dp and tp shard",
                    at("clip_whole_model"))
        return (f"{dimension}: {seen}: the step clips by the whole model's norm, over every dp "
                "and tp shard and every stage (squares summed over pp)", at("clip_whole_model"))
    return (f"{dimension}: the first step's gradients and their clipping are right, the "
            "weights after the steps are not: what the step does after clipping",
            at("Trainer.train_step"))


def judge(per_rank, folder):
    """Raise the Mistake (or Unchecked) that fits one copy's results."""
    unchecked = [r["unchecked"] for r in per_rank if "unchecked" in r]
    if unchecked:
        raise Unchecked(unchecked[0])
    ref = per_rank[REFERENCE_RANK]["reference"]
    table = the_table(per_rank, ref)
    first = next((name for name in LAYOUTS if failed(table[name])), None)
    if first is None:
        return
    if all("error" in table[name] or "skipped" in table[name] for name in LAYOUTS):
        raise Unchecked(f"every layout raised, 1 x 1 x 1 too: {table[ONE]['error']}")
    dimension = dimension_of(table)
    seen = table_line(table)
    if "error" in table[first]:
        seen += f"; {first}: {table[first]['error']}"
    mistake, where = explain(first, table[first], ref, folder, dimension)
    raise Mistake(seen, mistake, where)


# ---------------------------------------------------------------------------------------------
# exercises/check.py's entry, and several copies at once (the tests')
# ---------------------------------------------------------------------------------------------
def check_many(scripts, folder, timeout):
    """Each copy's verdict: None (it passes), or its Mistake or Unchecked. The ranks start once,
    and have timeout seconds for the first copy and half that for each one after."""
    verdicts, folders = [None] * len(scripts), []
    for i, script in enumerate(scripts):
        try:
            folders.append(folder_of(script))
        except Unchecked as error:
            verdicts[i] = error
    todo = list(dict.fromkeys(folders))  # each folder once, in the order given
    if not todo:
        return verdicts
    deadline = time.monotonic() + timeout * (1 + (len(todo) - 1) / 2)
    out = os.path.join(folder, "ranks")
    context = start_ranks(todo, out, timeout)
    results = dict(zip(todo, join_ranks(context, len(todo), out, deadline), strict=True))
    for i, script in enumerate(scripts):
        if verdicts[i] is None:
            try:
                judge(results[folder_of(script)], folder_of(script))
            except (Mistake, Unchecked) as error:
                verdicts[i] = error
            except Exception as error:  # noqa: BLE001 (what the ranks found, not foreseen here)
                verdicts[i] = Unchecked(f"the checker could not judge what your copy's ranks "
                                        f"found: {error!r}")
    return verdicts


def check(script, folder, timeout):
    """exercises/check.py's: raise the verdict, unless the copy passes."""
    verdict = check_many([script], folder, timeout)[0]
    if verdict is not None:
        raise verdict


TITLE = "exercise 13 (which dimension is wrong)"
PASSES = "every layout of your 3-D step equals one process, on every check"


def main(scripts):
    folder = tempfile.mkdtemp(prefix="exercise-check-")
    os.environ["TMPDIR"] = tempfile.tempdir = os.path.join(folder, "tmp")
    os.mkdir(tempfile.tempdir)
    try:
        verdicts = check_many([os.path.abspath(s) for s in scripts], folder, 120)
    except Unchecked as error:  # the ranks stopped: every copy's check with them
        verdicts = [error] * len(scripts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for script, verdict in zip(scripts, verdicts, strict=True):
        print(f"== {script}")
        if isinstance(verdict, Unchecked):
            print(f"CANNOT CHECK {TITLE}: {verdict}")
        elif isinstance(verdict, Mistake):
            print(f"NOT YET {TITLE}: {verdict.seen}")
            print(f"  most likely: {verdict.mistake}")
            print(f"  where to look: {verdict.where}")
        else:
            print(f"PASS {TITLE}: {PASSES}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
