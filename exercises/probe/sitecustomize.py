"""The checker's recorder, loaded into every Python process of a checked run.

exercises/check.py starts the script under check with this folder on PYTHONPATH, so Python imports
this file at start-up (as it imports any `sitecustomize`), and with EXERCISE_PROBE_DIR set. Once the
script has imported torch, it records what the checker needs to name a mistake, and changes nothing
the script computes:
- the wines each training step read (the rows that reach the first layer, nn.Linear(13, ...)),
  and the wines each evaluation read;
- the weights before every optimizer step, after the last one, and each step's gradients;
- each linear layer as the first training step finds it (its weight's shape here, and how a
  DTensor weight is split: the mesh and its placements), and what it computed in that step;
- the rank and world size this process asked init_process_group for, and the ones it got;
- every torch.load and torch.save the script's own file made (the file, weights_only, map_location).
It writes them into EXERCISE_PROBE_DIR/<pid>.pt when the process ends, also by os._exit, as the
lessons' guard_rails.leave_process ends a rank. Each send and recv (a pipeline's) is written to
<pid>.p2p as it starts and when it ends, so that a run stopped in a deadlock still says which
ranks waited for which.
"""

import atexit
import importlib.abc
import importlib.util
import inspect
import json
import os
import sys

OUT = os.environ.get("EXERCISE_PROBE_DIR")
SCRIPT = os.path.realpath(os.environ.get("EXERCISE_SCRIPT", "-"))  # the file under check
FEATURES = 13  # a wine's measurements: the width of every lesson model's first layer


class AfterTorch(importlib.abc.MetaPathFinder):
    """Installs the recorder as soon as torch has been imported, whoever imports it first: a
    process that never imports torch (multiprocessing's helpers) pays nothing for it."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_torch = spec.loader.exec_module

        def exec_module(module):
            exec_torch(module)
            record(module)

        spec.loader.exec_module = exec_module
        return spec


def part(name):
    """Where a record is written before done(name) renames it: a process killed while writing
    (a launcher stops its other ranks when one fails) leaves a .part file, never half a record."""
    return os.path.join(OUT, name + ".part")


def done(name):
    os.replace(part(name), os.path.join(OUT, name))


def record(torch):
    import torch.distributed as dist
    from torch import nn
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    log = {"pid": os.getpid(), "rank": None, "world_size": None, "steps": [], "eval_rows": [],
           "params": [], "last": None, "grads": [], "layers": set(), "loads": [], "saves": [],
           "linears": [], "outputs": []}
    rows = []  # the wines read since the last step
    # Ranks forked from a server that imported torch (lesson 02's start_ranks) inherit this
    # recorder from it: each keeps a record of its own, under its own pid.
    os.register_at_fork(after_in_child=lambda: log.update(pid=os.getpid()))

    def local(tensor):
        tensor = tensor.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP's shard
        return tensor.to("cpu", torch.float32).clone()

    seen = set()  # the linear layers described in log["linears"]

    def describe(layer):
        """A linear layer's sizes, its weight's shape on this rank, and, for a DTensor, over
        which ranks (the mesh) and how (a placement per mesh dim) it is split."""
        weight, mesh = layer.weight, getattr(layer.weight, "device_mesh", None)
        return {"in": layer.in_features, "out": layer.out_features,
                "local": list(local(weight).shape),
                "dims": list(mesh.mesh_dim_names or ()) if mesh is not None else [],
                "mesh": mesh.mesh.tolist() if mesh is not None else None,
                "placements": [str(p) for p in weight.placements] if mesh is not None else []}

    def on_forward(module, args):
        if module.training and torch.is_grad_enabled():
            log["layers"].add(type(module).__name__)  # FSDPLinear where fully_shard reached
            if isinstance(module, nn.Linear) and not log["steps"] and id(module) not in seen:
                seen.add(id(module))
                log["linears"].append(describe(module))
                # After the layer's own hooks (a row-wise layer's all-reduce is one of them):
                # its output as the next layer, or the loss, gets it. Already in this call.
                module.register_forward_hook(after_forward)
        if (isinstance(module, nn.Linear) and module.in_features == FEATURES and args
                and torch.is_tensor(args[0])):
            batch = local(args[0]).reshape(-1, FEATURES)
            (rows if module.training and torch.is_grad_enabled() else log["eval_rows"]).append(
                batch)

    def after_forward(module, args, output):
        # The first training step's outputs of each linear layer, in the order they ran.
        if module.training and torch.is_grad_enabled() and not log["steps"] and torch.is_tensor(
                output):
            log["outputs"].append({"in": module.in_features, "out": module.out_features,
                                   "value": local(output)})

    def before_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        log["grads"].append([None if p.grad is None else local(p.grad) for p in params])
        log["params"].append([local(p) for p in params])
        log["steps"].append(torch.cat(rows) if rows else torch.empty(0, FEATURES))
        rows.clear()

    def after_step(optimizer, args, kwargs):
        log["last"] = [local(p) for group in optimizer.param_groups for p in group["params"]]

    register_module_forward_pre_hook(on_forward)
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)

    def called_from_script():
        frame = sys._getframe(2)
        return os.path.realpath(frame.f_code.co_filename) == SCRIPT

    real_load, real_save = torch.load, torch.save

    def load(f, *args, **kwargs):
        if called_from_script():
            map_location = kwargs.get("map_location", args[0] if args else None)
            log["loads"].append({"file": str(getattr(f, "name", f)),
                                 "weights_only": kwargs.get("weights_only", "not given"),
                                 "map_location": repr(map_location)})
        return real_load(f, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        if called_from_script():  # not torch.distributed.checkpoint's shard files
            log["saves"].append(str(getattr(f, "name", f)))
        return real_save(obj, f, *args, **kwargs)

    torch.load, torch.save = load, save

    real_init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        # What this process asks to join as, written before it waits for the others: a process
        # that then waits forever, and is killed, still tells the checker who it meant to be.
        asked = {"rank": kwargs.get("rank", int(os.environ.get("RANK", -1))),
                 "world_size": kwargs.get("world_size", int(os.environ.get("WORLD_SIZE", -1)))}
        with open(part(f"{log['pid']}.json"), "w") as f:
            json.dump(asked, f)
        done(f"{log['pid']}.json")
        real_init(*args, **kwargs)
        log["rank"], log["world_size"] = dist.get_rank(), dist.get_world_size()

    dist.init_process_group = init_process_group

    def peer(function, args, kwargs):
        """The global rank a send goes to, or a recv comes from (given as dst or src, or as
        group_dst or group_src within group)."""
        given = inspect.signature(function).bind(*args, **kwargs).arguments
        for name in ("dst", "src"):
            if given.get(name) is not None:
                return given[name]
        within = given.get("group_dst", given.get("group_src"))
        group = given.get("group")
        return within if group is None or within is None else dist.get_global_rank(group, within)

    def recorded(function, op):
        """function (dist.send or dist.recv), each call written to <pid>.p2p when it starts,
        and again when it returns: a line each, written at once, so that a kill loses none."""
        def call(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            entry = {"op": op, "rank": log["rank"], "peer": peer(function, args, kwargs),
                     "shape": list(tensor.shape), "step": len(log["steps"])}
            note(entry)
            result = function(*args, **kwargs)
            note({"done": True, "rank": log["rank"]})
            return result
        return call

    def note(entry):
        fd = os.open(os.path.join(OUT, f"{log['pid']}.p2p"), os.O_WRONLY | os.O_APPEND |
                     os.O_CREAT)
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.close(fd)

    # The blocking ones, which a schedule written by hand calls (not isend and irecv: the
    # library's schedules pass those to P2POp, which checks which function it was given).
    for name in ("send", "recv"):
        setattr(dist, name, recorded(getattr(dist, name), name))

    def write():
        if not (log["steps"] or log["eval_rows"] or log["loads"] or log["saves"]
                or log["linears"]):
            return  # a launcher: it trained nothing
        log["layers"] = sorted(log["layers"])
        real_save(log, part(f"{log['pid']}.pt"))
        done(f"{log['pid']}.pt")

    atexit.register(write)
    real_exit = os._exit

    def exit_now(code):
        write()
        real_exit(code)

    os._exit = exit_now


if OUT:
    sys.meta_path.insert(0, AfterTorch())
