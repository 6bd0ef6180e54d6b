"""Exercise 13's start: a copy of lesson 13 with one mistake in its 3-D step.

    python exercises/break_3d.py my_13            # one of the mistakes below, at random
    python exercises/break_3d.py my_13 --seed 3   # the same one every time for seed 3

It copies 13_capstone's Python files into the folder and makes one of the mistakes below in
them, without saying which: exercises/check.py 13 my_13/train.py then runs the copy on five
layouts, and names the dimension whose layouts differ from one process, and the mistake.
Reading this list first spoils the exercise.
"""

import argparse
import os
import random
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = os.path.join(ROOT, "13_capstone")


@dataclass(frozen=True)
class Broken:
    id: str  # "13-tp-norm-left-out": the dimension, then the mistake in a few words
    changes: tuple  # (file, find, replace): each find once in that file of 13_capstone
    dimension: str  # how the checker's "most likely" line begins: the dimension it names
    says: str  # and a fragment of the rest of that line: the mistake


TP, DP, PP = (f"the {d} dimension (only layouts with {d} 2 fail)" for d in ("tp", "dp", "pp"))
POSITIONS = ('        # positions.weight is [tokens, dim]: its token dimension is 0, not 1\n'
             '        ends["positions"] = RowwiseParallel(input_layouts=Replicate(), '
             'output_layouts=Shard(0))\n')
ORDER = ('    if args.tp > 1:\n        tensor_parallel(model, mesh["tp"])\n'
         '    shard_data_parallel(model, mesh["dp"])\n')
MISTAKES = [
    # TP: a norm left out of sequence parallelism: its weights stay on the dp mesh alone.
    Broken("13-tp-norm-left-out",
           (("parallelize.py", '            "norm2": SequenceParallel(),\n', ""),),
           TP, "a layer left out of TP's plan"),
    # TP: the position embedding's output split as the token embedding's is, by dimension 1;
    # its weight is [tokens, dim], so that splits its features.
    Broken("13-tp-positions-split-by-feature",
           (("parallelize.py", POSITIONS,
             '        ends["positions"] = RowwiseParallel(input_layouts=Replicate(), '
             'output_layouts=sequence)\n'),),
           TP, "The position embedding's token dimension is 0"),
    # TP: the heads counted as the whole model's, the head size derived: each tp rank holds the
    # columns of heads / tp heads, which view() cuts into heads half as wide.
    Broken("13-tp-heads-counted-whole",
           (("model.py", "        self.head_dim = dim // heads\n",
             "        self.heads, self.head_dim = heads, dim // heads\n"),
            ("model.py", "        # -1 heads: the ones this rank holds, all of them on one "
             "process, heads / tp under TP\n        q, k, v = (f(x).view(batch, tokens, -1, "
             "self.head_dim)", "        q, k, v = (f(x).view(batch, tokens, self.heads, -1)")),
           TP, "the first step's gradients differ"),
    # DP: the loss divided by the global batch's tokens, and FSDP averages over dp as well.
    Broken("13-dp-loss-divided-twice",
           (("train.py", "    tokens = args.batch_size // args.dp * args.seq_len  # this dp "
             "rank's, in each step\n", "    tokens = args.batch_size * args.seq_len  # the "
             "global batch's, in each step\n"),),
           DP, "the first step's gradients are 0.5 x one process's, 1 / dp"),
    # DP and TP: FSDP first, then TP. FSDP runs on every layout; it breaks where TP runs too.
    Broken("13-fsdp-before-tp",
           (("train.py", ORDER, '    shard_data_parallel(model, mesh["dp"])\n'
             '    if args.tp > 1:\n        tensor_parallel(model, mesh["tp"])\n'),),
           TP, "fully_shard ran before tensor_parallel"),
    # DP and TP: TP on the dp mesh. Alone, each dimension is right (TP over a mesh of 1 rank is
    # no TP); together, FSDP and TP claim the same ranks.
    Broken("13-tp-on-the-dp-mesh",
           (("train.py", 'tensor_parallel(model, mesh["tp"])',
             'tensor_parallel(model, mesh["dp"])'),),
           "the dimensions together", "TP and FSDP on the same ranks"),
    # PP: each stage clipped by its own gradients' norm.
    Broken("13-pp-clip-per-stage",
           (("parallelize.py", "    dist.all_reduce(squared, group=pp_group)\n", ""),),
           PP, "each stage clipped by its own norm"),
    # PP: the stages' norms added, not their squares.
    Broken("13-pp-norms-added",
           (("parallelize.py", "    squared = norm ** 2\n    dist.all_reduce(squared, "
             "group=pp_group)\n    norm = squared.sqrt()\n",
             "    dist.all_reduce(norm, group=pp_group)\n"),),
           PP, "the stages' norms added, not their squares"),
    # PP: the blocks dealt to the stages in turn (0, 2 to the first, 1, 3 to the second): the
    # pipeline runs them out of order.
    Broken("13-pp-blocks-dealt-in-turn",
           (("parallelize.py", "        if int(name) // per_stage != stage:",
             "        if int(name) % stages != stage:"),),
           PP, "the stages run the blocks in the order [0, 2, 1, 3]"),
    # The schedule's default, scale_grads=True, divides the gradients by the micro-batches,
    # which loss_fn's division by the dp rank's tokens already counts: on every layout, for the
    # schedule runs on one stage too.
    Broken("13-schedule-scales-the-gradients",
           (("parallelize.py", "return kind(stage, n_microbatches=microbatches, loss_fn=loss_fn, "
             "scale_grads=False)", "return kind(stage, n_microbatches=microbatches, "
             "loss_fn=loss_fn)"),),
           "not a dimension: 1 x 1 x 1 differs too, the step itself",
           "the first step's gradients are 0.5 x"),
]


def make(folder, mistake):
    """The lesson's Python files in folder, with mistake made (ValueError: the lesson has
    changed, and the mistake's text is no longer once in it)."""
    sources = {}
    for name in sorted(os.listdir(LESSON)):
        if name.endswith(".py"):
            with open(os.path.join(LESSON, name)) as f:
                sources[name] = f.read()
    for file, find, replace in mistake.changes:
        if sources[file].count(find) != 1:
            raise ValueError(f"{mistake.id}: its text is not once in 13_capstone/{file}")
        sources[file] = sources[file].replace(find, replace)
    os.makedirs(folder, exist_ok=True)
    for name, source in sources.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(source)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where the broken copy goes (a new folder)")
    parser.add_argument("--seed", type=int, help="pick the mistake by this seed, not at random")
    args = parser.parse_args(argv)
    if os.path.exists(args.folder) and os.listdir(args.folder):
        parser.error(f"{args.folder} is not empty: give a new folder (or remove it first)")
    mistake = random.Random(args.seed).choice(MISTAKES)
    try:
        make(args.folder, mistake)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(f"{args.folder}: lesson 13 with one mistake in its 3-D step; find it with "
          f"python exercises/check.py 13 {os.path.join(args.folder, 'train.py')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
