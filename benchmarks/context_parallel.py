"""What context parallelism buys and costs: lesson 11's ring attention, measured.

    python benchmarks/context_parallel.py            # about 1 minute on a 2-core laptop
    python benchmarks/context_parallel.py --quick    # seconds: short sequences, 2 rounds

It starts 4 ranks once (gloo, on the CPU, a thread each), and for each sequence length T of
--seq-lens and each CP group size N of 1, 2 and 4 (ranks [0], [0, 1], [0, 1, 2, 3]) it measures,
on rank 0:

- memory: the bytes attention keeps for backward, per rank (every tensor autograd saves, counted
  by torch.autograd.graph.saved_tensors_hooks), for the lesson's plain attention on one process
  (autograd keeps the T x T scores and probabilities) and for the ring at N ranks (it keeps q, k,
  v, its output and the log-sum-exp of its T/N tokens, and recomputes the scores in backward);
- communication: the bytes a rank sends in attention's forward and backward, counted where they
  leave (dist.batch_isend_irecv);
- time: tokens per second of the tiny GPT's forward and backward on one sequence of T tokens
  (lesson 11's TinyGPT, 2 blocks), the median of --rounds interleaved rounds, with the spread.

Each measured byte count is printed beside its formula, and the run fails if they differ. The
table goes to the screen and to --out-dir/context_parallel.json.
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
import torch.nn.functional as F

LESSON = Path(__file__).resolve().parent.parent / "11_context_parallel"
sys.path.insert(0, str(LESSON))
import guard_rails  # noqa: E402  (lesson 11's own: start_ranks, find_free_port)
import ring_attention  # noqa: E402  (lesson 11's idea, not a copy)
from data import VOCAB  # noqa: E402
from model import TinyGPT  # noqa: E402

SIZES = (1, 2, 4)  # CP group sizes; the run starts max(SIZES) ranks
CASES = [("plain", 1), ("ring", 1), ("ring", 2), ("ring", 4)]  # attention, ranks sharing it
HEADS, HEAD_DIM, LAYERS = 4, 8, 2  # lesson 11's defaults: --dim 32, --heads 4, --layers 2


def saved_bytes(fn):
    """Run fn() and return the bytes of the tensors autograd saves for backward meanwhile, each
    memory block once (a tensor saved by two operations, or as two views, is held once)."""
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(seen.values())


def formula(way, length, cp, element):
    """(attention's saved bytes per rank, bytes a rank sends), as the README derives them."""
    rows = HEADS * length // cp  # (head, token) pairs of this rank, batch 1
    if way == "plain":  # q, k, v and lse; the T x T scores and probabilities; the causal mask
        return ((3 * HEAD_DIM + 1) * rows * element + 2 * HEADS * length ** 2 * element
                + length ** 2, 0)
    kv = 2 * rows * HEAD_DIM * element  # this rank's keys and values
    return (4 * HEAD_DIM + 1) * rows * element, (3 * cp - 2) * kv if cp > 1 else 0


def attention_costs(way, length, cp, group):
    """(saved bytes, sent bytes) of one attention's forward and backward on this rank."""
    shape = (1, HEADS, length // cp, HEAD_DIM)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    sent = [0]
    send_and_receive = dist.batch_isend_irecv

    def counted(ops):
        sent[0] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return send_and_receive(ops)

    dist.batch_isend_irecv = counted  # ring_attention calls it through torch.distributed
    try:
        if way == "plain":
            out, saved = saved_bytes(lambda: ring_attention.attend_block(q, k, v, 0, 0)[0])
        else:
            out, saved = saved_bytes(lambda: ring_attention.ring_attention(q, k, v, group))
        out.sum().backward()
    finally:
        dist.batch_isend_irecv = send_and_receive
    return saved, sent[0]


def make_step(way, length, cp, group, rank):
    """A function that runs one forward and backward of the tiny GPT on this rank's tokens."""
    model = TinyGPT(length, HEADS * HEAD_DIM, HEADS, LAYERS)
    if way == "ring":
        model.use_cp_group(group)  # a group of 1 too: the ring's Function, with no passes
    generator = torch.Generator().manual_seed(0)  # the same sequence on every rank
    ids = torch.randint(len(VOCAB), (1, length + 1), generator=generator)
    inputs, targets = (ring_attention.local_part(t, rank, cp) for t in (ids[:, :-1], ids[:, 1:]))
    positions = ring_attention.local_part(torch.arange(length), rank, cp, dim=0)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(inputs, positions)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    return step


def run(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=max(SIZES),
                            timeout=datetime.timedelta(seconds=120))
    groups = {cp: dist.new_group(list(range(cp))) for cp in SIZES}  # every rank creates each
    cases = [(length, way, cp) for length in args.seq_lens for way, cp in CASES]
    rows, steps = {}, {}
    for case in cases:  # measure the bytes, and build each case's step
        length, way, cp = case
        if rank < cp:
            saved, sent = attention_costs(way, length, cp, groups[cp])
            steps[case] = make_step(way, length, cp, groups[cp], rank)
            steps[case]()  # a warm-up step, not timed
            saved_formula, sent_formula = formula(way, length, cp,
                                                  torch.get_default_dtype().itemsize)
            rows[case] = {"seq_len": length, "attention": way, "cp": cp, "saved_bytes": saved,
                          "saved_formula": saved_formula, "sent_bytes": sent,
                          "sent_formula": sent_formula, "seconds": []}
        dist.barrier()  # the ranks outside the group wait here
    for _ in range(args.rounds):  # interleaved: every case once per round
        for case in cases:
            if case in steps:
                started = time.perf_counter()
                steps[case]()
                rows[case]["seconds"].append(time.perf_counter() - started)
            dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        if not report(list(rows.values()), args):
            sys.exit(1)


def report(rows, args):
    """Print the table and write the JSON; True if every measured count equals its formula."""
    print(f"one sequence of T tokens (batch 1, {HEADS} heads of {HEAD_DIM}, "
          f"{torch.get_default_dtype()}); N ranks share it; bytes per rank, per attention layer")
    print(f"{'T':>5} {'attention':9} {'N':>2} | {'keeps for backward':>18} {'formula':>11} | "
          f"{'sends':>9} {'formula':>9} | tokens/s: median (min-max)")
    for row in rows:
        tokens = [row["seq_len"] / seconds for seconds in row["seconds"]]
        row["tokens_per_s"], row["tokens_per_s_range"] = statistics.median(tokens), [
            min(tokens), max(tokens)]
        print(f"{row['seq_len']:5} {row['attention']:9} {row['cp']:2} | {row['saved_bytes']:18,} "
              f"{row['saved_formula']:11,} | {row['sent_bytes']:9,} {row['sent_formula']:9,} | "
              f"{row['tokens_per_s']:,.0f} ({min(tokens):,.0f}-{max(tokens):,.0f})")
    equal = all((r["saved_bytes"], r["sent_bytes"]) == (r["saved_formula"], r["sent_formula"])
                for r in rows)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"measured bytes equal the formulas: {equal}")
    print(f"tokens/s: forward and backward of the tiny GPT ({LAYERS} blocks), {args.rounds} "
          f"interleaved rounds; {max(SIZES)} ranks of 1 thread on {cores} cores"
          + (": the larger groups share cores" if cores < max(SIZES) else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "context_parallel.json"), "w") as f:
        json.dump({"rows": rows, "cores": cores, "torch": torch.__version__,
                   "rounds": args.rounds, "equal": equal}, f, indent=1)
    return equal


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--quick", action="store_true", help="--seq-lens 64 128 --rounds 2")
    parser.add_argument("--out-dir", default="runs/benchmarks")
    args = parser.parse_args()
    if args.quick:
        args.seq_lens, args.rounds = [64, 128], 2
    for length in args.seq_lens:
        if length % (2 * max(SIZES)):
            parser.error(f"--seq-lens: {length} does not split into 2 x {max(SIZES)} chunks")
    guard_rails.start_ranks(run, (args, guard_rails.find_free_port()), max(SIZES))


if __name__ == "__main__":
    main()
