"""What expert parallelism costs: lesson 12's mixture-of-experts layer, measured.

    python benchmarks/expert_parallel.py            # under a minute on a 2-core laptop
    python benchmarks/expert_parallel.py --quick    # seconds: short sequences, 2 rounds

It starts 4 ranks once (gloo, on the CPU, a thread each), and for each routing (top-1, top-2,
and top-1 with a capacity factor of 1, which drops choices), each sequence length T of
--seq-lens and each EP group size N of 1, 2 and 4 (ranks [0], [0, 1], [0, 1, 2, 3]) it runs one
MoE layer (lesson 12's experts.MoE, float32, dim 32, 8 experts) forward and backward. Every rank
keeps the same work, --batch sequences of T tokens of its own (EP ranks read different
sequences), so N ranks move N times the tokens of one. It measures:

- communication: what each all_to_all_single of a step sends to the other ranks of the group,
  counted where it leaves (the input and its splits), beside the formula. A rank sends its rows
  to its experts' ranks and their outputs back (two exchanges), and backward sends the gradients
  of both the other way (two more); each row is dim numbers. Routing depends on the data, so the
  formula takes the router's counts of the step (rows[i][j]: rows rank i sends to rank j's
  experts): rank r sends 2 x (rows it sends out + rows it gets) rows, plus, once in forward, its
  counts for the other ranks' experts (E/N int64 each). The share of the rows that cross ranks is
  printed beside the (N - 1)/N of even routing;
- time: tokens per second of the N ranks together (N x batch x T tokens a step), the median of
  --rounds interleaved rounds with the spread, each round's time that of the group's slowest rank;
  per core it can use (min(N, cores)) against N = 1; and the share of the step spent in
  all_to_all_single (sending, receiving, waiting for the other ranks), the most of any rank.

The run fails if a count differs from its formula. The table goes to the screen and to
--out-dir/expert_parallel.json.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

LESSON = Path(__file__).resolve().parent.parent / "12_expert_parallel"
sys.path.insert(0, str(LESSON))
import guard_rails  # noqa: E402  (lesson 12's own: start_ranks, find_free_port)
from experts import MoE  # noqa: E402  (lesson 12's idea, not a copy)

SIZES = (1, 2, 4)  # EP group sizes; the run starts max(SIZES) ranks
ROUTINGS = [(1, 0), (2, 0), (1, 1.0)]  # (top_k, capacity factor; 0: no limit)
DIM, EXPERTS = 32, 8
COUNT_BYTES = torch.int64.itemsize  # the counts are torch.bincount's int64


def count_sends(step):
    """Run step() and return, for every all_to_all_single it calls, (dtype, the bytes it sends
    to the other ranks of its group): the input rows of every split but this rank's own."""
    sent = []
    all_to_all = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        me, ranks = dist.get_rank(group), dist.get_world_size(group)
        splits = input_split_sizes or [input.shape[0] // ranks] * ranks  # none: even parts
        row = input.numel() // max(input.shape[0], 1) * input.element_size()
        sent.append((input.dtype, sum(n for i, n in enumerate(splits) if i != me) * row))
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group,
                          async_op=async_op)

    dist.all_to_all_single = counted  # experts.py calls it through torch.distributed
    try:
        step()
    finally:
        dist.all_to_all_single = all_to_all
    return sent


def time_step(step):
    """Run step() and return its seconds, and how many of them it spent in all_to_all_single:
    sending, receiving, and waiting there for the other ranks."""
    spent = 0.0
    all_to_all = dist.all_to_all_single

    def timed(*args, **kwargs):
        nonlocal spent
        started = time.perf_counter()
        done = all_to_all(*args, **kwargs)
        spent += time.perf_counter() - started
        return done

    dist.all_to_all_single = timed  # two clock reads a call: microseconds in a step of ms
    try:
        started = time.perf_counter()
        step()
        return time.perf_counter() - started, spent
    finally:
        dist.all_to_all_single = all_to_all


def formula(rows, rank, element):
    """(bytes rank sends in the four exchanges of rows, bytes of its counts' exchange), from
    rows[i][j], the rows rank i sends to rank j's experts."""
    n = len(rows)
    out = sum(rows[rank]) - rows[rank][rank]  # its tokens, to other ranks' experts
    into = sum(line[rank] for line in rows) - rows[rank][rank]  # other ranks' tokens, to its
    return 2 * (out + into) * DIM * element, EXPERTS // n * (n - 1) * COUNT_BYTES


def make_step(top_k, capacity_factor, length, batch, group, rank):
    """The layer, this rank's tokens, and a function that runs one forward and backward."""
    torch.manual_seed(0)  # the same layer on every rank, as in the lesson
    moe = MoE(DIM, EXPERTS, top_k, capacity_factor)
    moe.hold_experts(group)  # a group of 1 too: one rank with every expert, as --ep 1 trains
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own sequences
    x = torch.randn(batch, length, DIM, generator=generator).requires_grad_()
    grad_out = torch.randn(batch, length, DIM, generator=generator)

    def step():
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe(x).backward(grad_out)

    return moe, step


def measure_bytes(moe, step, group, rank):
    """One counted step: what this rank sent, what the formula says, and the group's rows."""
    sent = count_sends(step)
    exchanges = [nbytes for dtype, nbytes in sent if dtype.is_floating_point]
    counts = [nbytes for dtype, nbytes in sent if not dtype.is_floating_point]
    n = dist.get_world_size(group)
    mine = moe.load.view(n, -1).sum(dim=1)  # rows this rank's tokens send to each rank
    rows = [torch.zeros_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    rows = torch.stack(rows).tolist()
    sent_formula, count_formula = formula(rows, dist.get_rank(group),
                                          torch.get_default_dtype().itemsize)
    return {"rank": rank, "exchanges": len(exchanges), "sent_bytes": sum(exchanges),
            "sent_formula": sent_formula, "count_exchanges": len(counts),
            "count_bytes": sum(counts), "count_formula": count_formula,
            "kept_rows": sum(rows[dist.get_rank(group)]), "rows_to_ranks": rows}


def run(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=max(SIZES),
                            timeout=datetime.timedelta(seconds=120))
    groups = {ep: dist.new_group(list(range(ep))) for ep in SIZES}  # every rank creates each
    cases = [(top_k, capacity, length, ep) for top_k, capacity in ROUTINGS
             for length in args.seq_lens for ep in SIZES]
    measured, steps = {}, {}
    for case in cases:  # count the bytes, and build each case's step
        top_k, capacity, length, ep = case
        if rank < ep:
            moe, steps[case] = make_step(top_k, capacity, length, args.batch, groups[ep], rank)
            measured[case] = measure_bytes(moe, steps[case], groups[ep], rank)
            steps[case]()  # a warm-up step, not timed
        dist.barrier()  # the ranks outside the group wait here
    seconds = torch.zeros(len(cases), args.rounds, 2, dtype=torch.float64)  # step, exchanges
    for r in range(args.rounds):  # interleaved: every case once per round
        for c, case in enumerate(cases):
            if case in steps:
                seconds[c, r] = torch.tensor(time_step(steps[case]))
            dist.barrier()
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each round: the group's slowest rank
    every = [None] * max(SIZES)
    dist.all_gather_object(every, measured)
    dist.destroy_process_group()
    if rank == 0:
        rows = [make_row(case, [m[case] for m in every if case in m], seconds[c].tolist(), args)
                for c, case in enumerate(cases)]
        if not report(rows, args):
            sys.exit(1)


def make_row(case, ranks, seconds, args):
    """One case's row: its settings, every rank's counts, the shares and the tokens/s.
    seconds: [round] of (the step, in all_to_all_single), each the most of the group's ranks."""
    top_k, capacity, length, ep = case
    seconds, exchanges = zip(*seconds, strict=True)
    rows = ranks[0]["rows_to_ranks"]
    kept = sum(map(sum, rows))
    crossing = kept - sum(rows[i][i] for i in range(ep))
    tokens = [ep * args.batch * length / s for s in seconds]  # the group's tokens per step
    return {"top_k": top_k, "capacity_factor": capacity, "seq_len": length, "batch": args.batch,
            "tokens_per_rank": args.batch * length, "ep": ep, "dim": DIM, "experts": EXPERTS,
            "rows_to_ranks": rows, "share_to_others": crossing / kept,
            "share_expected": (ep - 1) / ep,
            "ranks": [{k: v for k, v in r.items() if k != "rows_to_ranks"} for r in ranks],
            "seconds": seconds, "exchange_seconds": exchanges,
            "exchange_share": statistics.median(e / s for e, s in zip(exchanges, seconds,
                                                                       strict=True)),
            "tokens_per_s": statistics.median(tokens),
            "tokens_per_s_range": [min(tokens), max(tokens)]}


def compare_with_one_rank(rows, cores):
    """Each row's tokens/s per core it can use, min(N, cores), over the same case's at N = 1:
    1.0 when each core moves as many tokens as one rank alone; below it, what the exchanges
    (and the ranks' waits for each other) cost."""
    one = {(r["top_k"], r["capacity_factor"], r["seq_len"]): r["tokens_per_s"]
           for r in rows if r["ep"] == 1}
    for row in rows:
        row["per_core_vs_one"] = row["tokens_per_s"] / min(row["ep"], cores) / one[
            row["top_k"], row["capacity_factor"], row["seq_len"]]


def print_row(row, element):
    """One line of the table: the bytes are the mean over the group's ranks."""
    ranks, ep = row["ranks"], row["ep"]
    mean = {key: statistics.mean(r[key] for r in ranks) for key in ranks[0] if key != "rank"}
    routing = f"top-{row['top_k']}" + (f", cap {row['capacity_factor']:g}"
                                       if row["capacity_factor"] else "")
    if_even = 4 * mean["kept_rows"] * (ep - 1) / ep * DIM * element  # (N - 1)/N of them cross
    low, high = row["tokens_per_s_range"]
    print(f"{routing:13} {row['seq_len']:5} {ep:2} | {mean['kept_rows']:9,.0f} "
          f"{row['share_to_others']:5.2f} {row['share_expected']:5.2f} | "
          f"{mean['sent_bytes']:10,.0f} {mean['sent_formula']:10,.0f} {if_even:10,.0f} | "
          f"{mean['count_bytes']:6,.0f} {mean['count_formula']:7,.0f} | "
          f"{row['tokens_per_s']:,.0f} ({low:,.0f}-{high:,.0f}) | {row['per_core_vs_one']:15.2f} | "
          f"{row['exchange_share']:.0%}")


def report(rows, args):
    """Print the table and write the JSON; True if every measured count equals its formula."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    compare_with_one_rank(rows, cores)
    print(f"one MoE layer (dim {DIM}, {EXPERTS} experts, {torch.get_default_dtype()}), forward "
          f"and backward; each of N ranks has {args.batch} sequences of T tokens; bytes a rank "
          "sends per step, the mean over the ranks")
    print(f"{'routing':13} {'T':>5} {'N':>2} | {'rows/rank':>9} {'cross':>5} {'even':>5} | "
          f"{'sends':>10} {'formula':>10} {'if even':>10} | {'counts':>6} {'formula':>7} | "
          "tokens/s: median (min-max) | per core vs N=1 | in all-to-all")
    for row in rows:
        print_row(row, torch.get_default_dtype().itemsize)
    equal = all((r["exchanges"], r["sent_bytes"], r["count_exchanges"], r["count_bytes"])
                == (4, r["sent_formula"], 1, r["count_formula"])
                for row in rows for r in row["ranks"])
    print(f"measured bytes equal the formulas: {equal}")
    print(f"tokens/s: the N ranks' tokens, forward and backward, {args.rounds} interleaved "
          f"rounds; {max(SIZES)} ranks of 1 thread on {cores} cores"
          + (": the larger groups share cores" if cores < max(SIZES) else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "expert_parallel.json"), "w") as f:
        json.dump({"rows": rows, "cores": cores, "torch": torch.__version__,
                   "rounds": args.rounds, "equal": equal}, f, indent=1)
    return equal


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true", help="--seq-lens 16 64 --rounds 2")
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    if args.quick:
        args.seq_lens, args.rounds = [16, 64], 2
    if min(args.seq_lens) < 1 or args.batch < 1:
        parser.error("--seq-lens and --batch: at least 1")
    guard_rails.start_ranks(run, (args, guard_rails.find_free_port()), max(SIZES))


if __name__ == "__main__":
    main()
