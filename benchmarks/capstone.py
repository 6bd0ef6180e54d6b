"""What each layout of the capstone costs: lesson 13's tiny GPT on dp x pp x tp ranks, measured.

    python benchmarks/capstone.py            # 10 layouts: about 2 minutes on a busy 2-core machine
    python benchmarks/capstone.py --quick    # 6 of them, 2 timed rounds: under a minute

It starts 8 ranks once (gloo, on the CPU, a thread each) and runs every layout of 8 ranks or
fewer on the first dp x pp x tp of them (every rank builds every layout's mesh with the lesson's
build_mesh, in the same order: new_group is a collective of the whole world), with lesson 13's
own parallelize and Trainer.train_step (imported from its folder, not copied) and its default
model: dim 32, 4 heads, 4 blocks, sequences of 64 characters, a global batch of 16 in 2
micro-batches (GPipe), float32, Adam. Per rank, it measures:

- memory: the bytes of its weights, gradients and Adam's two averages (parallelize.py's bytes_held),
  and the activations: the bytes autograd saves for backward in one step's forward passes (every
  micro-batch's, which GPipe all holds before the first backward), each memory block once, counted
  by torch.autograd.graph.saved_tensors_hooks, in the blocks and in all; the weights, which
  autograd saves too, are not counted;
- communication: every collective of one training step, counted where it reaches PyTorch's
  dispatcher (a TorchDispatchMode): DTensor's functional collectives (TP), FSDP2's
  all_gather_single and reduce_scatter_single, the pipeline's sends, the clip's all-reduces; each
  by the mesh dimension of its group, with the bytes this rank sends in it as a ring sends them
  (all-gather: (n - 1) x its shard; reduce-scatter: (n - 1)/n of its input; all-reduce: twice
  that; send: the tensor). A group of one rank moves nothing and is not counted;
- time: tokens per second of the global batch (16 x 64 a step), the median of --rounds
  interleaved rounds with the spread, each round the slowest rank's.

Each count and byte total is printed beside its formula (formulas() below; benchmarks/README.md
derives them), and the run fails if one differs. So are FSDP's all-gathers a step with
torchtitan's setting under a pipeline, each block kept gathered from its forward to its backward
(KEPT_GATHERED). Then the same arithmetic for real clusters: how to split a model over your GPUs
(suggest). The table goes to --out-dir/capstone.json.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from argparse import Namespace
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

LESSON = Path(__file__).resolve().parent.parent / "13_capstone"
sys.path.insert(0, str(LESSON))
from guard_rails import find_free_port, start_ranks  # noqa: E402  (lesson 13's)
from model import VOCAB, Block, TinyGPT  # noqa: E402  (lesson 13's, as train.py imports it)
from parallelize import build_mesh, bytes_held  # noqa: E402
from train import Trainer, load_data, parallelize  # noqa: E402  (not a copy)

WORLD = 8
BATCH, SEQ_LEN, DIM, HEADS, LAYERS = 16, 64, 32, 4, 4  # train.py's defaults
E = torch.float32.itemsize  # bytes a number
# (dp, pp, tp, micro-batches): every layout of 8 ranks or fewer, and two with 4 micro-batches
LAYOUTS = [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 1, 2), (2, 1, 2, 2),
           (1, 2, 2, 2), (2, 2, 2, 2), (1, 1, 2, 4), (2, 2, 2, 4)]
QUICK = [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 2, 2), (1, 1, 2, 4)]
# torchtitan's FSDP setting under a pipeline, measured on these: fully_shard(block,
# reshard_after_forward=False), each block held gathered from its forward to its backward
KEPT_GATHERED = [(2, 2, 2, 2), (2, 2, 2, 4)]
TIMEOUT = 120  # seconds any collective may wait, in the world group and every mesh's


# ---------------------------------------------------------------------------------------------
# Measuring: collectives and saved activations
# ---------------------------------------------------------------------------------------------
# The collectives a step calls, as the dispatcher sees them: (kind, where the tensor is in the
# arguments, where the group is). A recv is its neighbour's send (counted there); wait_tensor
# and _wrap_tensor_autograd wait for, and wrap, the result of one already counted.
COLLECTIVES = {
    "_c10d_functional::all_gather_into_tensor": ("all-gather", 0, 2),  # DTensor (TP)
    "_c10d_functional::reduce_scatter_tensor": ("reduce-scatter", 0, 3),
    "_c10d_functional::all_reduce": ("all-reduce", 0, 2),
    "c10d::_allgather_base_": ("all-gather", 1, 2),  # FSDP2: dist.all_gather_single
    "c10d::_reduce_scatter_base_": ("reduce-scatter", 1, 2),  # dist.reduce_scatter_single
    "c10d::allreduce_": ("all-reduce", 0, 1),  # dist.all_reduce
    "c10d::send": ("send", 0, 1),  # the pipeline: dist.batch_isend_irecv
}
NOT_COUNTED = {"c10d::recv_", "_c10d_functional::wait_tensor",
               "_c10d_functional::_wrap_tensor_autograd"}


def bytes_sent(kind, tensor_bytes, n):
    """What a rank sends in one call on n ranks, as a ring sends it (NCCL's way on large messages;
    gloo's algorithms differ, the bytes a rank must send at the least do not)."""
    return {"all-gather": (n - 1) * tensor_bytes,  # its shard, to every other rank
            "reduce-scatter": (n - 1) * tensor_bytes // n,  # all of its input but its own part
            "all-reduce": 2 * (n - 1) * tensor_bytes // n,  # a reduce-scatter, then an all-gather
            "send": tensor_bytes}[kind]


class CountCollectives(TorchDispatchMode):
    """Every collective called while it is active: calls and bytes sent, by (dimension, kind)."""

    def __init__(self, dimension_of):
        super().__init__()
        self.dimension_of = dimension_of  # the group's ranks -> "dp", "pp" or "tp"
        self.counts = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen here
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name in COLLECTIVES:
            self.count(*COLLECTIVES[name], args)
        elif name.startswith(("c10d::", "_c10d_functional::")) and name not in NOT_COUNTED:
            raise RuntimeError(f"a collective this benchmark does not count: {name}")
        return out

    def count(self, kind, tensor_at, group_at, args):
        tensor, group = args[tensor_at], args[group_at]
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        if isinstance(group, str):  # the functional collectives get the group's name (private
            group = dist.distributed_c10d._resolve_process_group(group)  # API: funcol's own)
        else:  # c10d's ops get the group itself, boxed
            group = dist.ProcessGroup.unbox(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        n = len(ranks)
        if n > 1:  # a group of one rank moves nothing
            counted = self.counts[self.dimension_of[ranks], kind]
            counted[0] += 1
            counted[1] += bytes_sent(kind, tensor.numel() * tensor.element_size(), n)


def saved_activations(step, blocks):
    """Run step() and return the bytes of what autograd saves for backward meanwhile, in the
    transformer blocks and in all: each memory block once, but the weights (parameters, and views
    of them such as a Linear's w.t(): the weights' columns count those)."""
    seen, inside = {}, []  # data_ptr -> (bytes, saved in a block?); a block runs while inside

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, torch.nn.Parameter):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # its shard
            storage = local.untyped_storage()
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), bool(inside)))
        return tensor

    def enter(*_):
        inside.append(True)

    def leave(*_):
        inside.pop()  # (a hook that returns something replaces the block's output)

    hooks = [hook for block in blocks for hook in (block.register_forward_pre_hook(enter),
                                                   block.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    for hook in hooks:
        hook.remove()
    return (sum(n for n, in_block in seen.values() if in_block), sum(n for n, _ in seen.values()))


# ---------------------------------------------------------------------------------------------
# One layout on its ranks
# ---------------------------------------------------------------------------------------------
def keep_blocks_gathered(module, mesh):
    """fully_shard as torchtitan calls it when pp > 1: the blocks not resharded after forward
    (gathered once a step, not for every micro-batch); the root, FSDP's default."""
    kept = {"reshard_after_forward": False} if isinstance(module, Block) else {}
    return fully_shard(module, mesh=mesh, **kept)


def dp_gathers_kept(layout, mesh, batch):
    """FSDP's all-gathers over dp in one step (after a warm-up step), the blocks kept gathered."""
    with mock.patch("parallelize.fully_shard", keep_blocks_gathered):
        _, _, step = build_layout(layout, mesh, batch)
    step()
    counter = CountCollectives({tuple(dist.get_process_group_ranks(mesh[d].get_group())): d
                                for d in ("dp", "pp", "tp")})
    with counter:
        step()
    return counter.counts["dp", "all-gather"][0]


def build_layout(layout, mesh, batch):
    """Lesson 13's model on this rank's part of the layout, and a function that trains one step."""
    dp, pp, tp, microbatches = layout
    args = Namespace(dp=dp, pp=pp, tp=tp, batch_size=BATCH, seq_len=SEQ_LEN, max_norm=1.0,
                     schedule="gpipe", microbatches=microbatches, save_every=1, out_dir="")
    torch.manual_seed(0)
    model = TinyGPT(SEQ_LEN, DIM, HEADS, LAYERS)
    schedule = parallelize(model, mesh, torch.device("cpu"), args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = Trainer(model, None, None, optimizer, torch.device("cpu"), args.save_every,
                      args.out_dir, mesh, schedule, args)
    mine = [t[mesh["dp"].get_local_rank()::dp] for t in batch]  # this dp rank's sequences
    return model, optimizer, lambda: trainer.train_step(*mine)


def measure(layout, mesh, model, optimizer, step):
    """This rank's row: what it holds, what it saves for backward and what it sends in a step."""
    step()  # a warm-up step: the pipeline learns its shapes, FSDP sets itself up
    # By the group's ranks, not its name: DTensor may run TP on another mesh of the same ranks,
    # which it takes for equal (an earlier layout's; DeviceMesh.__eq__ compares ranks, not groups)
    dimension_of = {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d
                    for d in ("dp", "pp", "tp")}
    counter = CountCollectives(dimension_of)
    with counter:
        in_blocks, activations = saved_activations(step, model.blocks.values())
    stage, tp_rank = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    return {"rank": dist.get_rank(), "stage": stage, "tp_rank": tp_rank,
            **bytes_held(model, optimizer), "activations": activations,
            "activations_in_blocks": in_blocks, "in_blocks_formula": saved_in_blocks(layout),
            "collectives": {f"{d} {k}": v for (d, k), v in sorted(counter.counts.items())},
            "formulas": formulas(layout, stage, tp_rank)}


def run(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    batch = [t[:BATCH] for t in load_data(SEQ_LEN)[0].tensors]  # one global batch: 16 sequences
    rows, steps, kept = {}, {}, {}
    for layout in args.layouts:
        # Every rank makes every mesh, in the same order (new_group is a collective of all);
        # a rank outside the layout gets None.
        mesh = build_mesh("cpu", *layout[:3], TIMEOUT)
        if mesh is not None:
            model, optimizer, steps[layout] = build_layout(layout, mesh, batch)
            rows[layout] = measure(layout, mesh, model, optimizer, steps[layout])
        dist.barrier()  # the ranks outside the layout wait here
    for layout in KEPT_GATHERED:  # on all 8 ranks
        mesh = build_mesh("cpu", *layout[:3], TIMEOUT)
        kept[layout] = dp_gathers_kept(layout, mesh, batch)
    seconds = torch.zeros(len(args.layouts), args.rounds, dtype=torch.float64)
    for r in range(args.rounds):  # interleaved: every layout once per round, alone
        for i, layout in enumerate(args.layouts):
            if layout in steps:
                started = time.perf_counter()
                steps[layout]()
                seconds[i, r] = time.perf_counter() - started
            dist.barrier()
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each round: the layout's slowest rank
    every = [None] * WORLD
    dist.all_gather_object(every, (rows, kept))
    dist.destroy_process_group()
    if rank == 0:
        table = [make_row(layout, [r[layout] for r, _ in every if layout in r],
                          seconds[i].tolist()) for i, layout in enumerate(args.layouts)]
        kept = [{"dp": dp, "pp": pp, "tp": tp, "microbatches": m,
                 "dp_all_gathers": [k[dp, pp, tp, m] for _, k in every],
                 "formula": LAYERS // pp + 1} for dp, pp, tp, m in KEPT_GATHERED]
        if not report(table, kept, args):
            sys.exit(1)


# ---------------------------------------------------------------------------------------------
# The formulas
# ---------------------------------------------------------------------------------------------
def params_and_replicated(layers=LAYERS, dim=DIM, seq_len=SEQ_LEN):
    """(P, R): the model's parameters, and those that TP leaves whole on every tp rank: the
    norms, and the biases of out and fc2 (added after their reduce-scatter)."""
    vocab = len(VOCAB)
    block = 12 * dim * dim + 10 * dim  # q k v out, fc1 fc2 (4 dim wide); their biases, 2 norms
    ends = (vocab + seq_len) * dim + 2 * dim + vocab * (dim + 1)  # embeddings; norm, head
    return layers * block + ends, (6 * layers + 2) * dim


def held_by_all(dp, pp, tp):
    """Bytes of weights the layout's ranks hold together: every weight once (FSDP and PP split
    them, with no copy), and the ones TP leaves whole tp times."""
    params, replicated = params_and_replicated()
    return E * (params + (tp - 1) * replicated)


def saved_in_blocks(layout):
    """Bytes the stage's blocks save for backward in a step, every micro-batch's. Per token and
    block, split over tp: 14 d (the block's input, q, k, v, attention's output, which the reshape
    for out views, the residual sum, fc1's output and gelu's), the norms' 2 means and 2
    reciprocal deviations, a log-sum-exp per head; and 2 d kept whole on every tp rank: the inputs
    of q, k, v and of fc1 as TP gathers them (at tp = 1 the norms' outputs, the same tensors)."""
    dp, pp, tp, m = layout
    per_token = (14 * DIM + 4 + HEADS) // tp + 2 * DIM
    return BATCH // dp * SEQ_LEN * LAYERS // pp * per_token * E


def rows_of(rows, parts, part):
    """Rows part `part` of `parts` holds when torch.chunk splits `rows` (the last ones fewer)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - part * size))


def fsdp_shards(stage, pp, tp_rank, tp, dp):
    """Numbers in this rank's shard of a block, and of the stage's other FSDP unit (embeddings,
    or norm and head): FSDP pads each weight's rows, as TP left them, to a multiple of dp."""
    shard = lambda rows: -(-rows // dp)  # noqa: E731  a shard's rows
    d, vocab = DIM, rows_of(len(VOCAB), tp, tp_rank)  # the characters this tp rank holds
    block = (12 * d * d + 4 * d) // tp // dp + 6 * d // dp  # split by TP; the rest whole
    first = (shard(vocab) + shard(SEQ_LEN // tp)) * d if stage == 0 else 0
    last = 2 * shard(d) + shard(vocab) * (d + 1) if stage == pp - 1 else 0
    return block, first + last


def formulas(layout, stage, tp_rank):
    """[calls, bytes sent] in a step, by "dimension kind", of the rank at stage and tp_rank."""
    dp, pp, tp, m = layout
    k, first, last = LAYERS // pp, int(stage == 0), int(stage == pp - 1)  # k: the stage's blocks
    tensors = 13 * k + 2 * first + 4 * last  # the stage's parameter tensors
    acts = BATCH // dp // m * SEQ_LEN * DIM * E  # a micro-batch's activation, all its tokens
    out = {}
    if tp > 1:  # per block and micro-batch: 2 all-gathers and 2 reduce-scatters, each way
        share = (tp - 1) * acts // tp  # each sends 1/tp of the activation to every other rank
        positions = first * (tp - 1) * SEQ_LEN * DIM * E // tp  # their sum, their gradient
        scores = last * (tp - 1) * acts // DIM * -(-len(VOCAB) // tp)  # all tokens' scores
        out["tp all-gather"] = [m * (4 * k + 2 * first + 2 * last),
                                m * ((4 * k + first + last) * share + positions + scores)]
        out["tp reduce-scatter"] = [m * (4 * k + 2 * first + last),
                                    m * ((4 * k + first + last) * share + positions)]
        whole = 4 * k + 2 * last  # the norms' weights and biases: their gradients' sums
        out["tp all-reduce"] = [whole + 1,  # ... and the clip's norms of every tensor, once
                                2 * (tp - 1) * (whole * DIM + tensors) * E // tp]
    if dp > 1:  # FSDP: each block gathered for every micro-batch's forward, once for backward
        block, ends = fsdp_shards(stage, pp, tp_rank, tp, dp)
        out["dp all-gather"] = [k * (m + 1) + 1, (dp - 1) * (k * (m + 1) * block + ends) * E]
        out["dp reduce-scatter"] = [k + 1, (dp - 1) * (k * block + ends) * E]
        out["dp all-reduce"] = [1, 2 * (dp - 1) * tensors * E // dp]  # the clip's norms
    if pp > 1:  # each micro-batch: its activation to the next stage, its gradient back
        neighbours = 2 - first - last
        out["pp send"] = [m * neighbours, m * neighbours * acts // tp]  # tp: 1/tp of the tokens
        out["pp all-reduce"] = [1, 2 * (pp - 1) * E // pp]  # the clip's squared norm
    return out


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def make_row(layout, ranks, seconds):
    """One layout's row: every rank's measurements, the checks against the formulas, tokens/s."""
    dp, pp, tp, m = layout
    tokens = [BATCH * SEQ_LEN / s for s in seconds]  # the global batch's tokens per step
    weights = [r["weights"] for r in ranks]
    equal = (sum(weights) == held_by_all(dp, pp, tp)
             and all(r["gradients"] == r["weights"] and r["optimizer"] == 2 * r["weights"]
                     and r["activations_in_blocks"] == r["in_blocks_formula"]
                     and r["collectives"] == r["formulas"] for r in ranks))
    return {"dp": dp, "pp": pp, "tp": tp, "microbatches": m, "ranks": ranks,
            "weights_all_ranks": sum(weights), "weights_all_ranks_formula": held_by_all(dp, pp, tp),
            "equal": equal, "seconds": seconds, "tokens_per_s": statistics.median(tokens),
            "tokens_per_s_range": [min(tokens), max(tokens)]}


def most(ranks, key, dim):
    """The most calls and bytes of a dimension, of any rank (measured or formula)."""
    totals = [[sum(v[i] for k, v in r[key].items() if k.startswith(dim)) for i in (0, 1)]
              for r in ranks]
    return max(totals, key=lambda t: t[1])


def print_memory(table):
    params, replicated = params_and_replicated()
    print(f"\nbytes per rank: the mean over the layout's ranks (weights: beside its formula "
          f"e (P + (tp - 1) R) / (dp pp tp), with P = {params:,} parameters, R = {replicated:,} "
          f"that TP keeps whole, e = {E} bytes), and the most any rank holds; activations: what "
          "autograd saves in one step's forward passes, in the blocks beside their formula")
    print(f"{'dp x pp x tp':12} {'m':>2} | {'weights: mean':>13} {'formula':>9} {'most':>9} | "
          f"{'gradients':>9} {'Adam':>9} | {'activations: blocks':>19} {'formula':>9} "
          f"{'all':>9} {'most':>9}")
    for row in table:
        ranks, n = row["ranks"], len(row["ranks"])
        mean = {k: statistics.mean(r[k] for r in ranks) for k in (
            "weights", "gradients", "optimizer", "activations", "activations_in_blocks",
            "in_blocks_formula")}
        print(f"{row['dp']} x {row['pp']} x {row['tp']:<4} {row['microbatches']:2} | "
              f"{mean['weights']:13,.0f} {row['weights_all_ranks_formula'] / n:9,.0f} "
              f"{max(r['weights'] for r in ranks):9,} | {mean['gradients']:9,.0f} "
              f"{mean['optimizer']:9,.0f} | {mean['activations_in_blocks']:19,.0f} "
              f"{mean['in_blocks_formula']:9,.0f} {mean['activations']:9,.0f} "
              f"{max(r['activations'] for r in ranks):9,}")


def print_collectives(table):
    print("\ncollectives per training step, by mesh dimension: calls and kB a rank sends, the "
          "most of any rank of the layout, measured [formula]")
    print(f"{'dp x pp x tp':12} {'m':>2} | " + " | ".join(f"{d + ': calls':>14} {'kB':>14}"
                                                          for d in ("dp", "pp", "tp")))
    for row in table:
        cells = []
        for dim in ("dp", "pp", "tp"):
            (calls, sent), (f_calls, f_sent) = (most(row["ranks"], key, dim)
                                                for key in ("collectives", "formulas"))
            cells.append(f"{calls:5} [{f_calls:5}] {sent / 1000:5.1f} [{f_sent / 1000:5.1f}]")
        print(f"{row['dp']} x {row['pp']} x {row['tp']:<4} {row['microbatches']:2} | "
              + " | ".join(cells))
    print("""formulas, per rank and step: k = layers / pp blocks on its stage, m micro-batches of
b = batch / (dp m) sequences of T tokens, d = dim, first/last = 1 on the first/last stage
  tp: all-gathers m (4k + 2 first + 2 last), reduce-scatters m (4k + 2 first + last), most of
      them (tp - 1)/tp of an activation, b T d e; all-reduces 4k + 2 last + 1 (the norms'
      gradients, the clip's norms)
  dp: all-gathers k (m + 1) + 1, reduce-scatters k + 1, each (dp - 1) shards of a block (or of
      the embeddings, or the norm and head) padded to dp rows; 1 all-reduce (the clip's norms)
  pp: sends m (2 - first - last), each b T d e / tp (the activation, or its gradient); 1
      all-reduce (the clip's norm)""")


def print_speed(table, args, cores):
    one = table[0]["tokens_per_s"]
    print(f"\ntokens/s of the global batch ({BATCH} x {SEQ_LEN}), median (min-max) of "
          f"{args.rounds} interleaved rounds; {WORLD} ranks of 1 thread on {cores} cores: a layout "
          f"of more than {cores} ranks shares them")
    for row in table:
        low, high = row["tokens_per_s_range"]
        print(f"{row['dp']} x {row['pp']} x {row['tp']:<4} {row['microbatches']:2} | "
              f"{row['tokens_per_s']:9,.0f} ({low:,.0f}-{high:,.0f}) | "
              f"{row['tokens_per_s'] / one:4.2f} x 1 x 1 x 1")


def print_kept_gathered(kept):
    print("\nFSDP with torchtitan's setting under a pipeline, fully_shard(block, "
          "reshard_after_forward=False): dp all-gathers a step of each rank, measured [formula "
          "k + 1: each block once, the root once]")
    for row in kept:
        print(f"{row['dp']} x {row['pp']} x {row['tp']:<4} {row['microbatches']:2} | "
              f"{' '.join(map(str, row['dp_all_gathers']))} [{row['formula']}]")


def report(table, kept, args):
    """Print the tables and write the JSON; True if every measured count equals its formula."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"lesson 13's tiny GPT (dim {DIM}, 4 heads, {LAYERS} blocks, T = {SEQ_LEN}), a global "
          f"batch of {BATCH} sequences in m micro-batches (GPipe), {torch.get_default_dtype()}, "
          "Adam, gloo on the CPU")
    print_memory(table)
    print_collectives(table)
    print_kept_gathered(kept)
    equal = all(row["equal"] for row in table) and all(
        set(row["dp_all_gathers"]) == {row["formula"]} for row in kept)
    print(f"measured equal the formulas: {equal}")
    print_speed(table, args, cores)
    rule = print_rule()
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "capstone.json"), "w") as f:
        json.dump({"rows": table, "kept_gathered": kept, "rule": rule, "cores": cores,
                   "torch": torch.__version__, "rounds": args.rounds, "equal": equal}, f,
                  indent=1)
    return equal


# ---------------------------------------------------------------------------------------------
# The rule, for a real cluster
# ---------------------------------------------------------------------------------------------
# Llama 2's 7B and 70B: blocks, heads, dim, parameters
MODELS = {"7B": (32, 32, 4096, 7e9), "70B": (80, 64, 8192, 70e9)}
GPU_BYTES = 80e9  # an H100's


def suggest(gpus, gpus_per_node, layers, heads, params, gpu_bytes=GPU_BYTES, per_param=16):
    """(dp, pp, tp) for a model on `gpus` GPUs: TP within a node, at most its GPUs and the heads;
    PP across nodes, the fewest stages whose share of the training state (per_param bytes a
    parameter: bf16 weights and gradients, fp32 master weights and Adam's two averages) fits in
    half a GPU (the rest for activations); DP over the GPUs that remain."""
    tp = min(gpus_per_node, gpus, heads)
    pp = 1
    while (per_param * params / (tp * pp) > gpu_bytes / 2 and layers % (2 * pp) == 0
           and gpus % (tp * pp * 2) == 0):
        pp *= 2
    return gpus // (tp * pp), pp, tp


def sends_per_step(layers, dim, params, dp, pp, tp, tokens=4096, m=8, e=2):
    """Bytes a GPU sends in a step of m micro-batches of one sequence (bf16), by the formulas
    above, their blocks' terms: TP 8 (tp - 1)/tp activations per block and micro-batch, PP an
    activation and a gradient per micro-batch (1/tp of each), DP (dp - 1)/dp of the stage's
    weights m + 2 times: FSDP as the lesson runs it, with GPipe, gathers each block for every
    micro-batch's forward and once for backward, and reduce-scatters its gradients once. It
    counts every weight as a block's (the root's, the embeddings and head, are gathered once
    a step; the blocks hold nearly all of a large model's)."""
    activation = tokens * dim * e
    return {"tp": m * 8 * layers // pp * (tp - 1) * activation / tp,
            "pp": m * 2 * activation / tp if pp > 1 else 0,
            "dp": (m + 2) * (dp - 1) / dp * params * e / (pp * tp)}


def print_rule():
    """The rule, for real clusters: suggest() and what each dimension would send."""
    print("""
the rule, for your own GPUs (the Ultra-Scale Playbook's), by the formulas above:
  tp = the GPUs of a node (at most the heads): TP sends the most, 8 (tp - 1)/tp activations per
       block and micro-batch, and waits for them at every block: keep it on the node's links
  pp = the fewest stages whose share of the training state fits: PP sends the least, 2
       activations / tp per micro-batch, to the next stage: it can cross nodes
  dp = the rest; FSDP shards the state once more, and sends each stage's weights m + 2 times a
       step here: m + 1 gathers, 1 reduce-scatter (with torchtitan's setting when pp > 1,
       measured above: 1 gather, 1 reduce-scatter)
for Llama 2 7B and 70B on GPUs of 80 GB, 8 a node; what a GPU sends in a step of 8
micro-batches of one 4,096-token sequence, in bf16:""")
    rule = []
    for name, (layers, heads, dim, params) in MODELS.items():
        for gpus in (8, 16, 64, 512):
            dp, pp, tp = suggest(gpus, 8, layers, heads, params)
            state = 16 * params / (tp * pp)
            sent = sends_per_step(layers, dim, params, dp, pp, tp)
            rule.append({"model": name, "gpus": gpus, "dp": dp, "pp": pp, "tp": tp,
                         "state_bytes": state, "state_bytes_fsdp": state / dp, "sends": sent})
            print(f"  {name:>3} on {gpus:3} GPUs: dp x pp x tp = {dp:2} x {pp} x {tp} | state "
                  f"{state / 1e9:3.0f} GB a GPU, {state / dp / 1e9:4.1f} with FSDP"
                  + (" (too big)" if state / dp > GPU_BYTES / 2 else "")
                  + f" | sends: tp {sent['tp'] / 1e9:3.0f} GB, pp {sent['pp'] / 1e6:3.0f} MB, "
                  f"dp {sent['dp'] / 1e9:2.0f} GB")
    return rule


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true",
                        help="--rounds 2, and 6 layouts of the 10: 1 x 1 x 1 to 2 x 2 x 2")
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    args.layouts = QUICK if args.quick else LAYOUTS
    if args.quick:
        args.rounds = 2
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    start_ranks(run, (args, find_free_port()), WORLD)


if __name__ == "__main__":
    main()
