"""Exercise 14's check (exercises/check.py calls it): your layout of Llama 3 70B on a cluster of 8
nodes of 8 GPUs, measured as lesson 14's planner measures it (14_planning/plan.py --layout: each
stage that differs built by its first rank in the fake process group, one step run), and, where
it does not fit, the budget it breaks and the part of the rank that breaks it.

Your layout is a JSON file: {"dp": ..., "pp": ..., "tp": ..., "cp": ..., "recompute": ...}
(cp 1 and recompute "none" when left out). In this order: the file, the GPUs it uses, TP inside
a node, then the planner's own refusals (a layout that does not split the model, its tokens or
its batch), then the measurement against the budget: 80 GB less the planner's 8 GB spare.
"""

import json
import os
import subprocess
import sys

from verdicts import Mistake, Unchecked, readme

LESSON = "14_planning"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--model", "llama3-70b", "--gpus", "64", "--gpus-per-node", "8", "--memory-gb", "80",
        "--seq-len", "8192", "--batch-size", "256"]
PAGE = "exercises/14_choose_a_layout.md"
GB = 1e9
# What each part of a rank that breaks the budget calls for: the most likely fix.
FIXES = {
    "activations": "the activations saved for backward, for each micro-batch in flight (pp - "
                   "stage of them under 1F1B: more stages do not shrink the first stage's): "
                   'recompute each block ("recompute": "full"), or split each sequence over cp '
                   "ranks",
    "gradients": "the gradients FSDP accumulates whole over the micro-batches: fewer blocks a "
                 "rank (more stages, or a larger tp)",
    "gathered": "the weights FSDP holds gathered from forward to backward under a pipeline: "
                "fewer blocks a rank (more stages, or a larger tp)",
    "weights": "the weights themselves: shard them over more ranks (dp, pp or tp)",
    "optimizer": "Adam's state: shard it over more ranks (dp, pp or tp)",
}


def read_layout(path):
    """Your layout: dp, pp, tp, cp, recompute, checked for form only."""
    try:
        with open(path) as f:
            given = json.load(f)
    except (OSError, ValueError) as error:
        raise Unchecked(f"{path} is not a JSON file of a layout: {error}") from None
    if not isinstance(given, dict) or not {"dp", "pp", "tp"} <= set(given) or set(given) - {
            "dp", "pp", "tp", "cp", "recompute"}:
        raise Unchecked(f"{path} must hold dp, pp and tp (and cp and recompute, if you wish), as "
                        f'{{"dp": 8, "pp": 1, "tp": 8}}; it holds {given!r}')
    layout = {"cp": 1, "recompute": "none", **given}
    if not all(isinstance(layout[k], int) and layout[k] >= 1 for k in ("dp", "pp", "tp", "cp")):
        raise Unchecked(f"dp, pp, tp and cp must be whole numbers of at least 1: {given!r}")
    if layout["recompute"] not in ("none", "selective", "full"):
        raise Unchecked(f'recompute must be "none", "selective" or "full", not '
                        f'{layout["recompute"]!r}')
    return layout


def check(script, folder, timeout):
    """Raise the first Mistake your layout makes, or Unchecked; return if it fits."""
    layout = read_layout(script)
    dp, pp, tp, cp = (layout[k] for k in ("dp", "pp", "tp", "cp"))
    if dp * pp * tp * cp != 64:
        raise Mistake(f"dp {dp} x pp {pp} x tp {tp} x cp {cp} is {dp * pp * tp * cp} GPUs, not "
                      "the cluster's 64", "every GPU takes one rank: dp x pp x tp x cp = 64",
                      PAGE)
    if tp > 8:
        raise Mistake(f"tp {tp} spans {tp // 8} nodes: every layer's all-gathers and "
                      "reduce-scatters, for every micro-batch, would cross the network",
                      "TP inside a node, at most its 8 GPUs (lesson 13's rule)",
                      readme("14_planning", "the-rule-and-what-it-tries"))
    out = os.path.join(folder, "plan")
    try:
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, LESSON, "plan.py"), *TASK, "--layout",
             f"{dp},{pp},{tp},{cp}", "--recompute", layout["recompute"], "--out-dir", out],
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unchecked(f"the planner took longer than --timeout {timeout:g} s") from None
    refused = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    if refused:
        raise Mistake(f"the planner refuses it: {refused[0].removeprefix('error: ')}",
                      "a layout must split the model's heads and blocks, its tokens and its "
                      "batch", readme("14_planning", "bad-input"))
    if done.returncode:
        raise Unchecked(f"the planner failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "plan.json")) as f:
        plan = json.load(f)
    worst = max(plan["rows"].values(), key=lambda row: row["total"])
    if worst["total"] > plan["budget"]:
        kinds = ("weights", "gradients", "optimizer", "gathered", "activations")
        most = max(kinds, key=lambda kind: worst[kind])
        raise Mistake(f"stage {worst['stage']}'s first rank holds {worst['total'] / GB:.1f} GB, "
                      f"{(worst['total'] - plan['budget']) / GB:.1f} GB over the budget of "
                      f"{plan['budget'] / GB:g} GB; {most} {worst[most] / GB:.1f} GB of it",
                      FIXES[most], readme("14_planning", "what-a-rank-holds"))
