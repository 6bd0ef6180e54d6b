"""Lesson 14: plan a real run on a laptop. For a model and a cluster, the layouts of dp x pp x tp
x cp that fit, ranked by lesson 13's rule, each of their ranks built as it would build itself and
one training step of it measured: what it holds, by kind, and what it sends, by mesh dimension.

Lesson 13's program, its ranks now built at real sizes and never allocated: in PyTorch's fake
process group and under fake tensors, any rank of any layout of Llama 3 405B is built on this
laptop with lesson 13's parallelize.py, and one step of it runs (fake_ranks.py, read it first).
The stages that differ are measured (the first, a middle one, the last), each by its first rank.

Run it (no GPU needed; each writes plan.json to --out-dir):
    python 14_planning/plan.py --model llama3-405b --gpus 16384 --gpus-per-node 8 --memory-gb 80
    python 14_planning/plan.py --model llama3-8b --gpus 64 --memory-gb 40 --seq-len 8192
    python 14_planning/plan.py --model tiny --layout 2,2,2 --batch-size 16 --microbatches 2 --fp32
"""

import argparse
import dataclasses
import json
import os

import torch
from fake_ranks import Layout, as_rank, make_groups, run

from guard_rails import check_args, fail, start
from model import CONFIGS, GPT

GB = 1e9  # bytes: the "80 GB" of a GPU's memory
# The order the rule tries: no recomputation before some; fewer cp ranks; fewer stages.
RECOMPUTE = ["none", "selective", "full"]
KINDS = ["weights", "gradients", "optimizer", "gathered", "activations"]


# ---------------------------------------------------------------------------------------------
# The lesson: each rank that differs, measured; the rule, and the layouts it tries
# ---------------------------------------------------------------------------------------------
def stage_blocks(layers, pp):
    """The blocks of each stage: an even split, or, where there is none (126 on 16 stages),
    Llama 3's: one block fewer on the first and the last stage, which hold the embeddings and
    the head. None if neither splits them."""
    if layers % pp == 0:
        return [layers // pp] * pp
    per = (layers + 2) // pp
    return [per - 1] + [per] * (pp - 2) + [per - 1] if pp > 2 and per * pp == layers + 2 else None


def measure(config, layout, stage, blocks, mesh, cp_group):
    """What the first rank of a stage of `blocks` blocks holds and sends in a step: its stage
    built with one block and with two, each stepped with min(m, 3) micro-batches; the rest by
    linearity, as every block of a stage is the same, and every middle micro-batch (the tests
    build whole stages, and all m micro-batches, and find the same bytes)."""
    m = layout.microbatches
    short = dataclasses.replace(layout, microbatches=min(m, 3))
    runs = [run(config, short, stage, n, mesh, cp_group) for n in range(1, min(blocks, 2) + 1)]

    def scaled(value):  # value(run) of one block, and the second block's share k - 1 times more
        one = value(runs[0])
        return one if len(runs) == 1 else one + (blocks - 1) * (value(runs[-1]) - one)

    held = {k: scaled(lambda r, k=k: r[0][k]) for k in runs[0][0] if k != "block"}
    per = [scaled(lambda r, j=j: r[1][j]) for j in range(short.microbatches)]  # saved, by mb
    times = {"F1": 1, "F2": m - 1, "B1": 1, "B2": m - 2, "B3": 1, "step": 1} if m > 3 else {}
    collectives = {}
    for phase, dim, kind in runs[0][2].calls:
        if not times or phase in times:
            key = (phase, dim, kind)
            calls = scaled(lambda r, key=key: r[2].calls[key])
            sent = scaled(lambda r, key=key: r[2].bytes[key])
            total = collectives.setdefault(dim, {}).setdefault(kind, [0, 0])
            total[0] += times.get(phase, 1) * calls
            total[1] += times.get(phase, 1) * sent
    in_flight = m if layout.schedule == "gpipe" else min(m, layout.pp - stage)
    kinds = {"weights": held["weights"], "optimizer": held["optimizer"],
             # the larger: the gradients accumulated, whole, or their shards after the step
             "gradients": max(held["gradients"], held["accumulated"] if m > 1 else 0),
             "gathered": held["gathered"] + runs[0][0].get("block", 0),
             "activations": per[0] + (in_flight - 1) * per[-1]}
    at_rest = {"weights": held["weights"], "gradients": held["gradients"],
               "optimizer": held["optimizer"]}  # as lesson 13's bytes_held counts them
    per_block = {k: 0 if len(runs) == 1 else runs[1][0][k] - runs[0][0][k]
                 for k in ("accumulated", "weights")}
    per_block["activations"] = 0 if len(runs) == 1 else runs[1][1][-1] - runs[0][1][-1]
    return {"stage": stage, "blocks": blocks, **kinds, "total": sum(kinds.values()),
            "in_flight": in_flight, "micro_batch": per[-1], "at_rest": at_rest,
            "per_block": per_block, "collectives": collectives}


def measure_layout(config, layout, stages=None):
    """{stage: what its first rank holds and sends} for each stage that differs (or `stages`):
    the first, the first of the middle ones (the most in flight under 1F1B), the last. One fake
    world: rank 0 plays each stage's first rank in turn (fake_ranks.train_step says why)."""
    blocks = stage_blocks(config.layers, layout.pp)
    with as_rank(0, layout.world):
        mesh, cp_group = make_groups(layout)
        return {s: measure(config, layout, s, blocks[s], mesh, cp_group)
                for s in stages or sorted({0, min(1, layout.pp - 1), layout.pp - 1})}


def tp_degree(config, gpus, per_node):
    """Lesson 13's rule: TP inside a node, up to its GPUs: TP's collectives run at every layer,
    on every micro-batch, and need the node's links. At most the key/value heads, each rank
    holding whole heads."""
    return max(t for t in range(1, per_node + 1) if per_node % t == 0 and gpus % t == 0 and
               config.heads % t == 0 and (config.kv_heads or config.heads) % t == 0)


def candidates(config, args, tp):
    """Every layout the cluster and the batch allow, in the rule's order: no recomputation
    before some, then the fewest cp ranks (CP only where a sequence needs splitting), then the
    fewest pipeline stages (each adds to the bubble, (pp - 1) / m of the step)."""
    found = []
    for pp in range(1, config.layers + 1):
        for cp in [1] + ([2 ** i for i in range(1, 7)] if not config.seq_len else []):
            dp, left = divmod(args.gpus, tp * pp * cp)
            m = args.microbatches or (args.batch_size // dp if dp else 0)
            if (left or not stage_blocks(config.layers, pp) or not m
                    or args.batch_size % (dp * m) or args.seq_len % (2 * cp * tp)):
                continue
            for recompute in RECOMPUTE if config.explicit else ["none", "full"]:
                found.append(Layout(dp, pp, tp, cp, m, args.batch_size // (dp * m),
                                    args.seq_len, fsdp_mode(args, pp), recompute,
                                    args.schedule, not args.fp32))
    return sorted(found, key=lambda x: (RECOMPUTE.index(x.recompute), x.cp, x.pp))


def fsdp_mode(args, pp):
    """torchtitan's choice, unless --data says: under a pipeline, each block kept gathered from
    its forward to its backward (gathered once a step, not for each of m micro-batches)."""
    return args.data if args.data != "auto" else ("kept" if pp > 1 else "fsdp")


def at_least(config, layout, probes):
    """A lower bound on a layout's largest rank: its stages' blocks alone, each block's
    activations per micro-batch (for every one in flight) and gradients accumulated, as one
    stage of one rank's blocks measured them (a probe per recomputation and cp)."""
    key = (layout.recompute, layout.cp)
    if key not in probes:
        probe = dataclasses.replace(layout, dp=1, pp=1, microbatches=2, batch=1)
        probes[key] = measure_layout(dataclasses.replace(config, layers=2), probe)[0]["per_block"]
    block = probes[key]
    in_flight = [layout.microbatches if layout.schedule == "gpipe" else
                 min(layout.microbatches, layout.pp - s) for s in range(layout.pp)]
    return max(k * (layout.batch * block["activations"] * n +
                    (block["accumulated"] if layout.microbatches > 1 else 0))
               for k, n in zip(stage_blocks(config.layers, layout.pp), in_flight, strict=True))


def plan(config, args, budget):
    """The first --top layouts that fit, in the rule's order; and those tried before, with what
    their largest rank holds (or at least holds, its blocks' share alone)."""
    tp = tp_degree(config, args.gpus, args.gpus_per_node)
    fits, tried, probes = [], [], {}
    for layout in candidates(config, args, tp):
        low = at_least(config, layout, probes)
        if low > budget:
            tried.append((layout, low, None))
            continue
        rows = measure_layout(config, layout)
        worst = max(row["total"] for row in rows.values())
        (fits if worst <= budget else tried).append((layout, worst, rows))
        if len(fits) == args.top:
            break
    return tp, fits, tried


# ---------------------------------------------------------------------------------------------
# What it prints
# ---------------------------------------------------------------------------------------------
def name(layout):
    return (f"dp {layout.dp} x pp {layout.pp} x tp {layout.tp} x cp {layout.cp}, "
            f"recompute {layout.recompute}")


def crosses_nodes(dim, layout, per_node):
    """Whether rank 0's group along `dim` spans nodes: lesson 13's mesh numbers ranks (pp, dp x
    cp, tp), tp innermost, so a group of `dim` holds ranks `stride` apart."""
    stride, size = {"tp": (1, layout.tp), "cp": (layout.tp, layout.cp),
                    "dp": (layout.tp, layout.dp * layout.cp),
                    "pp": (layout.tp * layout.dp * layout.cp, layout.pp)}[dim]
    return len({r * stride // per_node for r in range(size)}) > 1


def unit(largest):
    return next((size, word) for size, word in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                if largest >= size or size == 1)


def report(layout, rows, args):
    """The layout's bytes per rank by kind, for each stage that differs, and its traffic."""
    print(f"  {name(layout)}: {layout.microbatches} micro-batches of {layout.batch} "
          f"sequence{'s' if layout.batch > 1 else ''}, {layout.schedule.upper()}, "
          f"FSDP {layout.data}")
    size, word = unit(max(row["total"] for row in rows.values()))
    print(f"    {word + ' a rank':20}" + "".join(f"{k:>12}" for k in [*KINDS, "total"]))
    for row in rows.values():
        stage = f"stage {row['stage']} ({row['blocks']} blocks)"
        print(f"    {stage:20}"
              + "".join(f"{row[k] / size:12.2f}" for k in [*KINDS, "total"]))
    worst = max(rows.values(), key=lambda row: row["total"])
    sent = sum(b for kinds in worst["collectives"].values() for _, b in kinds.values())
    size, word = unit(sent)
    print(f"    sent in a step by stage {worst['stage']}'s first rank, {word} (calls):")
    for dim, kinds in sorted(worst["collectives"].items()):
        where = "across nodes" if crosses_nodes(dim, layout, args.gpus_per_node) else "in a node"
        print(f"      {dim:2} {where:12}  " + ", ".join(
            f"{kind} {b / size:.3g} ({calls})" for kind, (calls, b) in kinds.items()))
    return worst


def main(args):
    config = model_config(args)
    budget = (args.memory_gb - args.spare_gb) * GB
    print(f"{args.model}: {parameters(config):,} parameters in {config.layers} blocks; "
          f"{args.gpus:,} GPUs of {args.memory_gb:g} GB ({args.spare_gb:g} kept spare), "
          f"{args.gpus_per_node} to a node; a step: {args.batch_size:,} sequences of "
          f"{args.seq_len:,} tokens, {'float32' if args.fp32 else 'bf16 compute'}, Adam")
    if args.layout:
        layout = given_layout(config, args)
        rows = measure_layout(config, layout)
        worst = report(layout, rows, args)
        most = max(KINDS, key=lambda kind: worst[kind])
        size, word = unit(worst["total"])
        print(f"{'fits' if worst['total'] <= budget else 'does not fit'}: stage "
              f"{worst['stage']}'s first rank holds {worst['total'] / size:.2f} {word} of the "
              f"{budget / GB:g} GB budget, the most of it {most} ({worst[most] / size:.2f} {word})")
        return write(args, {"layout": vars(layout), "rows": rows, "budget": budget})
    tp, fits, tried = plan(config, args, budget)
    print(f"the rule: tp {tp}, inside a node; then no recomputation before some, the fewest cp "
          f"ranks, the fewest stages (GB = 1e9 bytes). Tried, in that order:")
    for layout, low, rows in tried:
        print(f"  {name(layout)}: " + (f"its blocks alone hold {low / GB:.1f} GB" if rows is None
                                       else f"{low / GB:.1f} GB") + ", does not fit")
    if not fits:
        fail(f"no layout of {args.model} on {args.gpus} GPUs of {args.memory_gb:g} GB fits (with "
             f"{args.spare_gb:g} GB spare): use more GPUs, or a shorter --seq-len")
    print("the first layout that fits:" if len(fits) == 1 else f"the first {len(fits)} that fit:")
    for layout, total, rows in fits:
        report(layout, rows, args)
        print(f"    the largest rank: {total / GB:.2f} GB, {(budget - total) / GB:.2f} GB under "
              f"the {budget / GB:g} GB budget")
    write(args, {"tp": tp, "budget": budget,
                 "fits": [{"layout": vars(x), "rows": rows} for x, _, rows in fits],
                 "tried": [{"layout": vars(x), "bytes": low} for x, low, _ in tried]})


def write(args, results):
    with open(os.path.join(args.out_dir, "plan.json"), "w") as f:
        json.dump(results, f, indent=1)


# ---------------------------------------------------------------------------------------------
# Plumbing: the model and the layout from the flags, refused in one line where they cannot be
# ---------------------------------------------------------------------------------------------
SIZES = ("dim", "heads", "kv_heads", "layers", "hidden", "vocab")


def model_config(args):
    if args.model not in CONFIGS:
        fail(f"no model {args.model!r}; the models are {', '.join(CONFIGS)} (or one of them with "
             f"other sizes: --dim, --heads, --kv-heads, --layers, --hidden, --vocab)")
    config = dataclasses.replace(CONFIGS[args.model], **{
        k: getattr(args, k) for k in SIZES if getattr(args, k) is not None})
    if config.dim % config.heads or config.heads % (config.kv_heads or config.heads):
        fail(f"--heads {config.heads} must divide --dim {config.dim}, and --kv-heads "
             f"{config.kv_heads} the heads")
    args.seq_len = args.seq_len or config.seq_len or 8192
    if config.seq_len and args.seq_len > config.seq_len:
        fail(f"--seq-len {args.seq_len} is longer than {args.model}'s {config.seq_len} learned "
             "positions; use at most that, or a model with rotary positions (Llama 3)")
    args.batch_size = args.batch_size or max(1, 2 ** 24 // args.seq_len)  # 16 M tokens: Llama 3's
    return config


def parameters(config):
    with torch.device("meta"):  # shapes only
        return sum(p.numel() for p in GPT(config).parameters())


def given_layout(config, args):
    dp, pp, tp, cp = (list(map(int, args.layout.split(","))) + [1])[:4]
    if dp * pp * tp * cp != args.gpus:
        fail(f"--layout {args.layout} is {dp * pp * tp * cp} ranks, not --gpus {args.gpus}: "
             "dp x pp x tp x cp must be the GPUs")
    if config.heads % tp or (config.kv_heads or config.heads) % tp:
        fail(f"--layout's tp {tp} must divide the {config.heads} heads and the "
             f"{config.kv_heads or config.heads} key/value heads: each rank holds whole heads")
    if not stage_blocks(config.layers, pp):
        fail(f"--layout's pp {pp} cannot split {config.layers} blocks into stages: choose pp that "
             f"divides {config.layers} (or {config.layers + 2}, one block fewer at each end)")
    if cp > 1 and config.seq_len:
        fail(f"--layout's cp {cp}: context parallelism needs rotary positions (the Llama models)")
    m = args.microbatches or args.batch_size // dp
    if args.seq_len % (2 * cp * tp) or not m or args.batch_size % (dp * m):
        fail(f"--batch-size {args.batch_size} sequences of --seq-len {args.seq_len} do not split "
             f"over dp {dp} x --microbatches {m}, or the tokens over 2 x cp x tp = {2 * cp * tp}")
    return Layout(dp, pp, tp, cp, m, args.batch_size // (dp * m), args.seq_len,
                  fsdp_mode(args, pp), args.recompute, args.schedule, not args.fp32)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 14: the layouts of a model on a cluster that fit, each rank measured.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help=f"one of {', '.join(CONFIGS)}")
    for size in SIZES:
        parser.add_argument(f"--{size.replace('_', '-')}", type=int,
                            help=f"the model's {size}, instead of the named model's")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node")
    parser.add_argument("--memory-gb", type=float, default=80.0, help="memory a GPU, in 1e9 bytes")
    parser.add_argument("--spare-gb", type=float, default=8.0,
                        help="memory a GPU keeps for what the plan does not count (the "
                        "allocator's caches, NCCL's buffers, copies made in passing): a choice")
    parser.add_argument("--seq-len", type=int, help="tokens a sequence (default: the model's "
                        "learned positions, or 8192)")
    parser.add_argument("--batch-size", type=int, help="sequences a step, in all (default: "
                        "16 M tokens, Llama 3's)")
    parser.add_argument("--microbatches", type=int,
                        help="micro-batches a step, each dp rank (default: 1 sequence each)")
    parser.add_argument("--layout", help="measure only this layout: dp,pp,tp[,cp]")
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE,
                        help="with --layout: recompute nothing, attention proper, or each block")
    parser.add_argument("--data", default="auto", choices=["auto", "fsdp", "kept", "ddp"],
                        help="FSDP as lesson 13's (each block gathered for each forward), kept "
                        "gathered from forward to backward, or DDP; auto: kept when --pp > 1")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"],
                        help="the pipeline's order; 1F1B holds pp - stage micro-batches")
    parser.add_argument("--fp32", action="store_true", help="compute in float32 (lesson 13's)")
    parser.add_argument("--top", type=int, default=1, help="how many layouts that fit to show")
    parser.add_argument("--out-dir", default="runs/14_planning", help="folder for plan.json")
    args = check_args(parser.parse_args(argv))
    for flag in ("gpus", "gpus_per_node", "batch_size", "top", *SIZES):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    if not 0 <= args.spare_gb < args.memory_gb:
        fail(f"--spare-gb {args.spare_gb:g} must be at least 0 and less than --memory-gb "
             f"{args.memory_gb:g}")
    return args


if __name__ == "__main__":
    start(main, parse_args, torchrun_ok=False)
