"""Lesson 07's idea: the training state split across the ranks instead of copied to each
(wrap_model, under --strategy fsdp: FSDP2, ZeRO stage 3; build_optimizer, under zero1: ZeRO
stage 1), and saved that way
(save_sharded, load_sharded: torch.distributed.checkpoint writes every rank's shards at once,
and gives each rank the pieces it needs, whatever strategy and world size wrote them)."""

import glob
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import guard_rails


def shard_model(model, device):
    """The model, each of its layers and then the whole, sharded over every rank by FSDP2."""
    # The mesh: the ranks that share the model, on this device type, over our process group.
    # Not fully_shard's default, on the accelerator whenever one exists, where a gloo run's CPU
    # model would move (pytorch/pytorch#132471); nor init_device_mesh, which for a gloo group on
    # a machine with CUDA makes a new group with the 30-minute default timeout, not --timeout.
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    # Each call makes one unit: its parameters are cut along dim 0, one slice (a DTensor) per
    # rank. In forward and backward a unit is all-gathered whole, used and freed, and its
    # gradients reduce-scattered: a layer at a time, and in backward the next one fetched ahead.
    # FSDP does not broadcast rank 0's weights as DDP does: each rank cuts its slice from its own.
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def wrap_model(model, strategy, device):
    """The model as --strategy trains it: sharded by FSDP (fsdp), or whole in DDP (ddp, zero1)."""
    if strategy == "fsdp":
        return shard_model(model, device)
    # DDP copies rank 0's weights to every rank; device_ids: this rank's GPU (none on a CPU).
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def build_optimizer(model, strategy, lr):
    """Adam; under zero1, inside ZeroRedundancyOptimizer, which shards its state."""
    if strategy == "zero1":
        # ZeRO stage 1: every rank still holds all parameters and, after DDP's all-reduce, all
        # gradients, but Adam's state only for its share: whole tensors, dealt largest first.
        # Each rank steps its share, then broadcasts it to the others.
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=lr)
    return torch.optim.Adam(model.parameters(), lr=lr)


def training_state(model, optimizer):
    """{"model": ..., "optimizer": ...}: tensors by parameter name, each rank's own shards."""
    # The same names under every strategy ("fc1.weight", no "module." prefix) let one
    # strategy's checkpoint load into another. zero1: Adam's state of this rank's share.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state["state"]}


def save_sharded(checkpoint_dir, model, optimizer, progress):
    """Every rank's shards, and progress (a dict) in progress.json, into a folder of
    checkpoint_dir named for progress["epochs_completed"]; then the older folders go."""
    path = os.path.join(checkpoint_dir, f"epoch_{progress['epochs_completed']:04d}")
    with guard_rails.sharded_save_or_fail(dist.get_rank(), path) as barrier:  # a failure: a line
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)  # a save of this epoch that was cut short
            os.makedirs(path)
            with open(os.path.join(path, "progress.json"), "w") as f:
                json.dump(progress, f)
        barrier()  # the folder exists before any rank writes into it
        # Every rank writes what it holds to its own file, all at once (a tensor held whole
        # by several, once); rank 0 then writes .metadata: which file holds which chunk of what.
        dcp.save(training_state(model, optimizer), checkpoint_id=path)
    if dist.get_rank() == 0:  # this save is complete: older ones can go
        for old in glob.glob(os.path.join(checkpoint_dir, "epoch_*")):
            if old != path:
                shutil.rmtree(old)


def load_sharded(path, model, optimizer):
    """The checkpoint in the folder path, into the model and the optimizer; its progress."""
    # Each rank reads, from whichever files hold them, exactly the pieces of each tensor it
    # needs now: the checkpoint loads whatever strategy and number of ranks wrote it.
    state = training_state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    _, optimizer_state = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={**optimizer_state, "state": state["optimizer"]})
    with open(os.path.join(path, "progress.json")) as f:
        return json.load(f)


def latest_checkpoint(checkpoint_dir):
    """The newest finished checkpoint folder, or None: a save writes checksums.json last of all,
    after dcp.save's .metadata (guard_rails.py, record_checksums)."""
    finished = sorted(glob.glob(os.path.join(checkpoint_dir, "epoch_*", "checksums.json")))
    return os.path.dirname(finished[-1]) if finished else None
