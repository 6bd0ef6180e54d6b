"""Where every rank holds a weight whole (no DDP, no FSDP), its gradients from different tokens
are summed by hand (lessons 11 and 12, byte for byte; lesson 13's FSDP reduce-scatters them)."""

import torch
import torch.distributed as dist


def sum_gradients(params, group):
    """Sum every rank's gradients, in place, in one all-reduce of all of them: one message, not
    one per tensor (each a round trip); of params only, over group's ranks (None: all ranks)."""
    grads = [param.grad for param in params]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(summed.view_as(grad))
