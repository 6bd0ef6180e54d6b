"""The learning rate for the global batch (lesson 06): a rule that scales --lr to the batch one
optimizer step averages over, and a warm-up that reaches the scaled rate."""

import math


def scaled_lr(lr, global_batch, rule):
    """--lr was chosen for a batch of 32 (lesson 01's). For k times that batch, the linear rule
    takes k times the rate (Goyal et al., 2017, for SGD), the square-root rule sqrt(k) times
    (Malladi et al., 2022, for Adam); no rule keeps --lr."""
    k = global_batch / 32
    return {"linear": lr * k, "sqrt": lr * math.sqrt(k)}.get(rule, lr)


def lr_at_step(step, lr, peak_lr, warmup_steps):
    """Warm-up: from lr to peak_lr in a straight line over warmup_steps optimizer steps."""
    return peak_lr if step >= warmup_steps else lr + (peak_lr - lr) * step / warmup_steps
