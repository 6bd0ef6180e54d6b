"""Exercise 09's own checks (tensor parallelism, FSDP across it), called by exercises/check.py.

The ranks of a TP group hold a slice of every layer and compute one forward together, so the
checker reads how each layer's weight was split (the probe records its DTensor placements on
the mesh), compares what the ranks of a group read and computed, and counts the test wines per
group. Then two runs of its own: your script with a --tp that does not divide --hidden, and
your transformer block's plan beside the whole block (exercises/block_probe.py).
"""

import dataclasses
import itertools
import os
import re
import signal
import subprocess
import sys

import torch

from verdicts import TOLERANCE, Mistake, readme

COLUMNS = readme("09_tensor_parallel", "column-wise-then-row-wise")
WHO_READS = readme("09_tensor_parallel", "who-reads-what")
BLOCK = readme("09_tensor_parallel", "a-transformer-block-heads-and-sequence-parallelism")
ERROR = re.compile(r"\w+(Error|Exception): ")  # a Python exception's line in a traceback
# How str() writes a weight's placement on one mesh dim: split by output rows (column-wise: the
# layer's output columns), by input columns (row-wise), or whole.
STYLES = {"S(0)": "column-wise", "S(1)": "row-wise", "R": "not split"}


def tp_dim(layer):
    """The mesh dim that splits the layer for TP: the one named "tp", else the last."""
    return layer["dims"].index("tp") if "tp" in layer["dims"] else len(layer["dims"]) - 1


def tp_groups(logs):
    """The TP groups, as lists of global ranks, from the mesh of a split weight; one group of
    every rank when no weight was split."""
    for log in logs:
        for layer in log["linears"]:
            if layer["mesh"] is not None:
                mesh = torch.tensor(layer["mesh"]).movedim(tp_dim(layer), -1)
                return mesh.reshape(-1, mesh.shape[-1]).tolist()
    return [sorted(log["rank"] for log in logs)]


def names(count):
    return ["fc1", *(f"hidden.{i}" for i in range(count - 2)), "fc2"]


def check_plan(yours):
    """Each linear layer split over the TP ranks as the plan says: column-wise, then row-wise,
    pair after pair. Known from the first forward, even in a run that then failed."""
    layers = next((log["linears"] for log in yours.ranks if log["linears"]), None)
    if layers is None:
        return  # no rank reached a forward: check_run says why
    styles = [layer["placements"][tp_dim(layer)] if layer["placements"] else "R"
              for layer in layers]
    wanted = ["S(0)" if i % 2 == 0 else "S(1)" for i in range(len(layers))]
    if styles == wanted:
        return
    if all(style == "R" for style in styles):
        raise Mistake("no linear layer's weight is split across the TP ranks",
                      "split them over the mesh's \"tp\" dim: parallelize_module(model, "
                      "mesh[\"tp\"], {\"fc1\": ColwiseParallel(), \"fc2\": RowwiseParallel()})",
                      COLUMNS)
    i = next(i for i, (got, want) in enumerate(zip(styles, wanted, strict=True)) if got != want)
    name, got = names(len(layers))[i], STYLES.get(styles[i], styles[i])
    if i and styles[i] == styles[i - 1] == "S(0)":
        raise Mistake(f"{name} is split column-wise, as {names(len(layers))[i - 1]} is: both "
                      "layers column-wise", f"split {name} row-wise (RowwiseParallel): it takes "
                      "the slice of the layer before's outputs that each rank holds, and its "
                      "partial sums are all-reduced; column-wise it would need that whole output",
                      COLUMNS)
    raise Mistake(f"{name} is split {got} over the TP ranks, not {STYLES[wanted[i]]}",
                  "fc1 column-wise, then fc2 row-wise (Megatron-LM's pair): the ReLU between "
                  "them works on each rank's own columns, and one all-reduce ends the pair",
                  COLUMNS)


def check_group_reads(trained, groups, wines):
    """The ranks of a TP group compute one forward together: they read the same wines."""
    logs = {log["rank"]: log for log in trained}
    for group in groups:
        read = {rank: [wines.ids(step, wines.train) for step in logs[rank]["steps"]]
                for rank in group}
        for rank in group[1:]:
            step = next((i for i, (a, b) in enumerate(itertools.zip_longest(
                read[rank], read[group[0]])) if a != b), None)
            if step is not None:
                raise Mistake(f"ranks {group[0]} and {rank}, one TP group, read different wines "
                              f"in step {step + 1}", "deal the batches to the TP groups, not to "
                              "the ranks: the sampler's num_replicas is the number of TP groups "
                              "(--dp), its rank the group's (the dp rank)", WHO_READS)


def check_group_outputs(trained, groups):
    """A row-wise layer's partial sums are all-reduced: the ranks of a TP group end the first
    step's forward with the same logits."""
    logs = {log["rank"]: log for log in trained}
    for group in groups:
        # The last linear layer's output: the logits.
        logits = [logs[rank]["outputs"][-1]["value"] for rank in group]
        for rank, other in zip(group[1:], logits[1:], strict=True):
            if other.shape != logits[0].shape or not torch.allclose(
                    other, logits[0], rtol=0, atol=TOLERANCE):
                raise Mistake(f"in the first step, ranks {group[0]} and {rank}, one TP group, "
                              "computed different logits for the same wines",
                              "each rank's row-wise output is a partial sum: it must be "
                              "all-reduced over the TP group (RowwiseParallel's default "
                              "output_layouts=Replicate() does it)", COLUMNS)


def check_evaluation(yours, metrics, wines, groups):
    """Each TP group evaluates its own test wines, all its ranks the same ones, and each test
    wine is counted once; True when that holds, so that the counts need no other check."""
    evaluated = {log["rank"]: wines.ids(torch.cat(log["eval_rows"]) if log["eval_rows"]
                                        else torch.empty(0, 13), wines.test)
                 for log in yours.ranks if log["rank"] is not None}
    for group in groups:
        for rank in group[1:]:
            if evaluated.get(rank) != evaluated.get(group[0]):
                raise Mistake(f"ranks {group[0]} and {rank}, one TP group, evaluated different "
                              "test wines", "every rank of a TP group calls the model on the "
                              "same wines (they compute one forward together): give each TP "
                              "group, by its dp rank, a stride of the test set", WHO_READS)
    total, tp = metrics["test_total"], len(groups[0])
    if tp > 1 and total == tp * wines.test_size:
        raise Mistake(f"metrics.json counts {total} test wines; there are {wines.test_size}, and "
                      f"each was counted by each of the {tp} ranks of its TP group",
                      "sum the counts over the dp group only (one rank of each TP group): the "
                      "ranks of a TP group computed the same predictions", WHO_READS)
    return total == wines.test_size


def check_refusal(script, exercise, folder, timeout, run):
    """A --tp that does not divide --hidden (64): refused before any rank starts, or trained."""
    flags = list(exercise.flags)
    flags[flags.index("--dp") + 1], flags[flags.index("--tp") + 1] = "1", "3"
    os.makedirs(folder)
    result = run(script, dataclasses.replace(exercise, flags=flags), folder, timeout)
    if result.code == 0 or (result.code is not None and not result.joined):
        return
    ended = ("did not finish within the time bound" if result.code is None
             else f"stopped with exit status {result.code}")
    errors = [line.strip() for line in result.output.splitlines() if ERROR.match(line.strip())]
    raise Mistake(f"with --dp 1 --tp 3, which does not divide --hidden 64, your ranks started and "
                  f"{ended}: {(errors or [result.last_line()])[-1]}",
                  "refuse a --tp that does not divide --hidden before any rank starts, in one "
                  "line: each rank of a TP group holds hidden / tp of every layer's units",
                  readme("09_tensor_parallel", "pitfalls"))


def check_block(script, folder, timeout):
    """Your transformer_block.py's plan beside the whole block: the output, then each gradient
    as the optimizer would use it."""
    path = os.path.join(os.path.dirname(script), "transformer_block.py")
    page = "exercises/09_tensor_parallel.md#the-transformer-block"
    if not os.path.isfile(path):
        raise Mistake("there is no transformer_block.py beside your train.py",
                      "copy lesson 09's, and write its tp_plan with sequence parallelism", page)
    out = os.path.join(folder, "block.pt")
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "block_probe.py")
    # Its own session: at the time bound, the probe and both its ranks are killed.
    process = subprocess.Popen([sys.executable, probe, path, out], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise Mistake("your transformer block did not finish one forward and backward within "
                      "the time bound", "a rank waits in a collective the other never makes: "
                      "compare your tp_plan with the lesson's", BLOCK) from None
    if process.returncode != 0:
        last = (stderr.strip().splitlines() or ["(it printed nothing)"])[-1]
        raise Mistake(f"your transformer block failed in one forward and backward; its last "
                      f"line: {last}", "compare your tp_plan with the lesson's", BLOCK)
    measured = torch.load(out, weights_only=True)
    ranks = measured["ranks"]
    split_out = torch.cat([rank["out"] for rank in ranks], dim=1)
    if split_out.shape != measured["out"].shape or not torch.allclose(
            split_out, measured["out"], rtol=0, atol=TOLERANCE):
        raise Mistake("your split block's output, its ranks' slices of the sequence put "
                      "together, is not the whole block's", "attn and mlp take the whole "
                      "sequence (PrepareModuleInput from Shard(1) to Replicate()), q, k, v and w1 "
                      "column-wise, o and w2 row-wise back to Shard(1)", BLOCK)
    for name, whole in measured["grads"].items():
        params = [rank["params"][name] for rank in ranks]
        if all(p["used"] is not None and torch.allclose(p["used"], whole, rtol=0, atol=TOLERANCE)
               for p in params):
            continue
        parts = [p["grad"] for p in params]
        if (not params[0]["split"] and all(g is not None for g in parts)
                and torch.allclose(sum(parts), whole, rtol=0, atol=TOLERANCE)):
            raise Mistake(f"{name}'s gradient on each rank is that of its own slice of the "
                          f"sequence: summed over the {len(ranks)} TP ranks, it is the whole "
                          "block's, but nothing sums it", "the norms' gradients not reduced "
                          "across the TP group under sequence parallelism (Megatron-LM's and "
                          "gpt-neox's bug): give norm1 and norm2 SequenceParallel(): their "
                          "gradients are then partial sums (a DTensor's Partial placement), "
                          "added up over the TP group when the optimizer uses them", BLOCK)
        raise Mistake(f"{name}'s gradient differs from the whole block's",
                      "compare your tp_plan with the lesson's", BLOCK)
