"""Lesson 08's idea: the gradient averaging that DDP does, written by hand, four ways.

After loss.backward() every rank holds the gradients of its own batch; before optimizer.step()
they must be the mean over the ranks, so that every rank takes the same step. make_grad_sync
returns the model to call and finish(), which completes that averaging for one step:
- after-backward (AfterBackward): an all-reduce per gradient, once backward is done;
- flat (Flat): one all-reduce of every gradient copied into one buffer;
- overlap and buckets (Buckets): gradients in buckets (plan_buckets), each all-reduced the moment
  its last gradient is ready, while backward goes on: what DDP's reducer does; overlap is a
  bucket per gradient;
- ddp: DDP itself, the reference every mode ends on; none: no averaging, the control.
Every mode but ddp first sends rank 0's weights to every rank (broadcast_from_rank_0).
"""

import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import guard_rails

GRAD_SYNC = ("after-backward", "flat", "overlap", "buckets", "ddp", "none")


def plan_buckets(model, bucket_mb):
    """(name, parameter) pairs in buckets, in the order backward produces the gradients in a
    model that uses its layers in the order it registers them: the reverse. As DDP's (c10d's
    compute_bucket_assignment_by_size), a bucket holds one dtype on one device and closes once
    it holds the cap or more, the parameter that crosses it included."""
    cap = bucket_mb * 1024 * 1024
    buckets, open_buckets = [], {}  # the bucket still filling, for each (dtype, device)
    for name, param in reversed(list(model.named_parameters())):
        if not param.requires_grad:
            continue
        key = (param.dtype, param.device)
        if key not in open_buckets:
            open_buckets[key] = []
            buckets.append(open_buckets[key])  # in the order of their first gradients
        open_buckets[key].append((name, param))
        if sum(p.numel() * p.element_size() for _, p in open_buckets[key]) >= cap:
            del open_buckets[key]
    return buckets


def broadcast_from_rank_0(model):
    """Rank 0's weights and buffers to every rank, as DDP's constructor does (_sync_module_states
    in torch/distributed/utils.py): the seed makes them equal only if every rank builds the
    model alike. As DDP's _broadcast_coalesced, one flat copy per dtype, not one per tensor."""
    states = list(model.state_dict().values())
    for dtype in dict.fromkeys(tensor.dtype for tensor in states):  # the same order everywhere
        tensors = [tensor for tensor in states if tensor.dtype == dtype]
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        dist.broadcast(flat, src=0)
        copy_back(flat, tensors)


def copy_back(flat, tensors):
    """Each slice of flat into its tensor: the inverse of torch.cat of their flattened copies."""
    pieces = flat.split([tensor.numel() for tensor in tensors])
    for tensor, piece in zip(tensors, pieces, strict=True):
        tensor.copy_(piece.view_as(tensor))


def grad_or_zeros(param):
    """param.grad, or zeros if this rank's backward gave it none (a layer it did not use): a rank
    that skipped it would pair its later all-reduces with other tensors (a hang, or a wrong
    sum). The zeros count in the mean, as with DDP's find_unused_parameters=True."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


class AfterBackward:
    """An all-reduce per gradient, once backward has produced them all."""

    def __init__(self, model):
        self.params = [param for param in model.parameters() if param.requires_grad]

    def finish(self):
        for param in self.params:
            grad = grad_or_zeros(param)
            # The mean: times 1/N before the sum, as DDP (mark_variable_ready_dense), so that the
            # sum cannot pass fp16's 65,504 where the mean does not; gloo's ReduceOp.AVG sums first.
            grad *= 1 / dist.get_world_size()
            dist.all_reduce(grad)  # the sum over the ranks, in place
        return len(self.params)


class Flat:
    """One all-reduce of every gradient copied into one buffer (one per dtype and device)."""

    def __init__(self, model):
        self.groups = plan_buckets(model, bucket_mb=math.inf)

    def finish(self):
        for group in self.groups:
            # One all-reduce, not one per gradient: each pays a fixed cost (a round of messages).
            grads = [grad_or_zeros(param) for _, param in group]
            flat = torch.cat([grad.reshape(-1) for grad in grads]) * (1 / dist.get_world_size())
            dist.all_reduce(flat)
            copy_back(flat, grads)
        return len(self.groups)


class Buckets:
    """Gradients in buckets, each all-reduced the moment its last gradient is ready, strictly
    in order: what DDP's reducer does. bucket_mb=0, a bucket per gradient, is overlap."""

    def __init__(self, model, bucket_mb):
        self.buckets, self.flats, self.slots = plan_buckets(model, bucket_mb), [], {}
        for bucket in self.buckets:  # a flat buffer per bucket; each parameter's slice of it
            sizes = [param.numel() for _, param in bucket]
            flat = torch.empty(sum(sizes), dtype=bucket[0][1].dtype, device=bucket[0][1].device)
            for (name, param), piece in zip(bucket, flat.split(sizes), strict=True):
                self.slots[param] = (name, piece.view_as(param))
                param.register_post_accumulate_grad_hook(self.hook)  # once .grad is complete
            self.flats.append(flat)
        self.ready, self.works = set(), []  # works: the all-reduces started, each a handle

    def hook(self, param):
        name, slot = self.slots[param]
        if param in self.ready:  # a second backward would add to a gradient already sent
            guard_rails.fail(f"{name}'s gradient hook fired twice before finish(): call "
                             "finish() after every backward, or accumulate with --grad-sync "
                             "after-backward or flat")
        self.ready.add(param)
        # Times 1/N while it is copied in, as DDP does: one pass, and before the sum.
        torch.mul(param.grad, 1 / dist.get_world_size(), out=slot)
        # Strictly in order, as DDP's: a bucket waiting for a gradient, late or missing on
        # this rank, holds back the later ones, so every rank starts them in the same order.
        while (len(self.works) < len(self.buckets)
               and all(p in self.ready for _, p in self.buckets[len(self.works)])):
            self.start_next()  # the bucket's last gradient: send it while backward goes on

    def start_next(self):
        """Start the all-reduce of the next bucket in the plan."""
        for _, param in self.buckets[len(self.works)]:
            if param not in self.ready:  # no gradient on this rank: zeros (grad_or_zeros)
                self.slots[param][1].zero_()
        # async_op=True returns at once with a handle; backward goes on with the layers below.
        self.works.append(dist.all_reduce(self.flats[len(self.works)], async_op=True))

    def finish(self):
        while len(self.works) < len(self.buckets):  # held back by a gradient this rank lacks
            self.start_next()
        # Bucket by bucket, as DDP's finalize_backward: the first's copies run as later travel.
        for work, bucket in zip(self.works, self.buckets, strict=True):
            work.wait()  # gloo: until it is done; NCCL: the current stream waits for it (README)
            for _, param in bucket:  # the mean, where the optimizer reads it
                grad_or_zeros(param).copy_(self.slots[param][1])
        count, self.ready, self.works = len(self.works), set(), []
        return count


def make_grad_sync(model, mode, bucket_mb):
    """(the model to call, finish): finish() completes the gradient synchronisation of a step,
    after loss.backward() and before optimizer.step(), and returns the all-reduces it took."""
    if mode == "ddp":
        # DDP itself, every bucket capped at bucket_mb (with bucket_cap_mb left unset, DDP would
        # make its first bucket 1 MiB); it all-reduces inside loss.backward().
        device = next(model.parameters()).device
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=bucket_mb)
        return model, lambda: None
    broadcast_from_rank_0(model)
    if mode == "none":
        return model, lambda: 0  # the control: every rank steps with its own gradients
    if mode in ("after-backward", "flat"):
        return model, (AfterBackward if mode == "after-backward" else Flat)(model).finish
    return model, Buckets(model, bucket_mb=0 if mode == "overlap" else bucket_mb).finish
