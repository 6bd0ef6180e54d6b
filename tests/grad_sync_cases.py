"""Lesson 08's gradient synchronisation on models unlike the wine MLP, each built here, every
home-made mode against DDP on the same ranks. tests/every_grad_sync.py calls run_cases() on
its ranks (2, gloo) for a group named "cases"; rank 0 writes OUT_DIR/cases.json:
{case: {mode: {"difference": the largest weight difference from DDP's, "all_reduces":
finish()'s count, "error": the line that stopped the mode, or null}, "ddp": {"finite": whether
DDP's weights are finite, "buckets": DDP's buckets after its rebuild}, "plan": the lesson's}}.

- dtypes: a float32 layer, then a bfloat16 one: buckets of one dtype each, as DDP's.
- unused: rank 0 skips layer a, rank 1 layer b, and no rank uses layer never; DDP with
  find_unused_parameters=True is the reference.
- fp16: every rank's gradient is 40,000; their sum, 80,000, is past fp16's largest number
  (65,504), their mean is not.
- twice: two backwards before finish(); DDP runs the first under no_sync.
"""

import contextlib
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HOME_MADE = ("after-backward", "flat", "overlap", "buckets")
SMALL = 1e-4  # --bucket-mb of 105 bytes: every 8 x 8 weight (256 bytes) closes a bucket


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4).to(torch.bfloat16)  # backward produces its gradients first

    def forward(self, x, rank):
        return self.fc2(F.relu(self.fc1(x)).to(torch.bfloat16)).float()


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.never, self.a, self.b, self.out = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, rank):
        skip = self.a if rank == 0 else self.b  # each rank misses a different layer
        for layer in (self.a, self.b):
            x = x if layer is skip else F.relu(layer(x))
        return self.out(x)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, dtype=torch.float16))

    def forward(self, x, rank):
        return (self.w * 40_000).float()  # the loss is its sum: 40,000 is w's gradient


# Each case's model and --bucket-mb. dtypes: 25 MiB, room for every gradient in one bucket,
# were it not for their two dtypes.
CASES = {"dtypes": (Mixed, 25), "unused": (Branches, SMALL), "fp16": (Scaled, 25),
         "twice": (Mixed, SMALL)}


def train(lesson, case, mode, rank):
    """Three SGD steps of the case's model with mode's synchronisation: (its weights, the
    all-reduces of the last step, the one line that stopped it or None, DDP's buckets)."""
    torch.manual_seed(0)
    make_model, bucket_mb = CASES[case]
    model = make_model()
    if mode == "ddp":
        model = DDP(model, bucket_cap_mb=bucket_mb, find_unused_parameters=case == "unused")
        finish = lambda: None  # noqa: E731
    else:
        model, finish = lesson.make_grad_sync(model, mode, bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6 if case == "fp16" else 0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batches
    all_reduces = None
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        batches = 2 if case == "twice" else 1
        for batch in range(batches):
            x = torch.randn(4, 8, generator=generator)
            first = batch < batches - 1  # DDP's no_sync covers the forward and the backward
            try:
                with model.no_sync() if mode == "ddp" and first else contextlib.nullcontext():
                    output = model(x, rank)
                    loss = (output.sum() if case == "fp16"
                            else F.cross_entropy(output, torch.arange(4)))
                    loss.backward()
            except SystemExit as stop:  # the lesson's one line, from inside backward
                dist.barrier()  # both ranks stopped here; their first all-reduces are done
                return None, None, str(stop.code), None
        all_reduces = finish()
        optimizer.step()
    plain = model.module if mode == "ddp" else model
    weights = {name: param.detach().float() for name, param in plain.named_parameters()}
    return weights, all_reduces, None, ddp_buckets(model) if mode == "ddp" else None


def ddp_buckets(model):
    """DDP's buckets after its rebuild, as parameter names, from the logging data DDP keeps
    (_get_ddp_logging_data, which DDP's docstring shows); None if it kept its first plan (it
    never rebuilds with find_unused_parameters=True, nor before a step that synchronised)."""
    data = model._get_ddp_logging_data()
    if "rebuilt_per_bucket_param_indices" not in data:
        return None
    names = [name for name, _ in model.module.named_parameters()]
    return [[names[int(i)] for i in bucket.split()]
            for bucket in data["rebuilt_per_bucket_param_indices"].split(",")]


def run_cases(lesson, rank, out_dir):
    results = {}
    for case in CASES:
        ddp, _, _, buckets = train(lesson, case, "ddp", rank)
        make_model, bucket_mb = CASES[case]
        results[case] = {
            "ddp": {"finite": all(w.isfinite().all().item() for w in ddp.values()),
                    "buckets": buckets},
            "plan": [[name for name, _ in bucket]
                     for bucket in lesson.plan_buckets(make_model(), bucket_mb)]}
        for mode in HOME_MADE:
            weights, all_reduces, error, _ = train(lesson, case, mode, rank)
            difference = None if weights is None else max(
                (weights[name] - ddp[name]).abs().max().item() for name in ddp)
            results[case][mode] = {"difference": difference, "all_reduces": all_reduces,
                                   "error": error}
    if rank == 0:
        (out_dir / "cases.json").write_text(json.dumps(results, indent=1))
