"""Lesson 10: one stage's backward split in two by hand, B then W, as the zero-bubble schedules
run it (zb1p, zbv, dualpipev).

B, the gradient of the stage's input, is what the stage before waits for: torch.autograd.grad
on the stage's input, which also keeps the gradient at each layer's output. W, the gradient of
the weights, waits for nothing: each layer's, from its input and the gradient at its output,
any time later. In float64, B and W together give the gradients of one ordinary backward to the
last bit; two controls, W left out and W run twice, do not. Exit status 0 when all three hold.

Run it:
    python 10_pipeline_parallel/split_backward.py
"""

import torch
import torch.nn.functional as F

from model import WineMLP
from pipeline import Stage, layers_per_stage


def middle_stage():
    """Stage 1 of 3 of lesson 10's model in float64 (hidden.1 and hidden.2, each with its
    ReLU), an input from the stage before, and the gradient of its output from the one after."""
    torch.manual_seed(0)
    model = WineMLP(layers=5).double()  # 6 linear layers: 3 stages of 2
    stage = Stage([model.get_submodule(n) for n in layers_per_stage(model, 3)[1]], 1, 3)
    x = torch.randn(16, stage.layers[0].in_features, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(16, stage.layers[-1].out_features, dtype=torch.float64)
    return stage, x, grad


def forward_keeping(stage, x):
    """stage(x), and each layer's input and output (before its ReLU): what W needs later."""
    inputs, outputs = [], []
    for i, layer in enumerate(stage.layers):
        inputs.append(x)
        outputs.append(layer(x))
        x = outputs[-1] if stage.last and i == len(stage.layers) - 1 else F.relu(outputs[-1])
    return x, inputs, outputs


def backward_input(out, grad, x, outputs):
    """B: the gradient of the stage's input, handed back to the stage before, and those at each
    layer's output, kept for W. No weight's gradient is computed: none is asked for."""
    dx, *douts = torch.autograd.grad(out, [x, *outputs], grad)
    return dx, douts


def backward_weight(stage, inputs, douts):
    """W: each layer's weight gradient from its input a and the gradient dz at its output,
    dW = dz^T a (the product autograd's linear computes, to the bit) and db = the sum of dz's
    rows, added to .grad as backward adds them."""
    for layer, a, dz in zip(stage.layers, inputs, douts, strict=True):
        for param, g in ((layer.weight, dz.T @ a), (layer.bias, dz.sum(0))):
            param.grad = g if param.grad is None else param.grad + g


def split_step(stage, x, grad, weights=1):
    """Forward, B, then W (weights times): the input's gradient and every parameter's."""
    out, inputs, outputs = forward_keeping(stage, x)
    dx, douts = backward_input(out, grad, x, outputs)
    for _ in range(weights):
        backward_weight(stage, inputs, douts)
    return dx, [p.grad for p in stage.parameters()]


def ordinary_step(stage, x, grad):
    """One ordinary backward: the input's gradient and every parameter's, at once."""
    stage(x).backward(grad)
    return x.grad, [p.grad for p in stage.parameters()]


def difference(a, b):
    """The largest difference between two lists of gradients (inf where one is missing)."""
    return max(float("inf") if s is None or t is None else (s - t).abs().max().item()
               for s, t in zip(a, b, strict=True))


def main():
    stage, x, grad = middle_stage()
    dx, weights = ordinary_step(stage, x, grad)
    results = {}
    for name, times in (("B then W", 1), ("control, W left out", 0), ("control, W run twice", 2)):
        stage.zero_grad(set_to_none=True)
        results[name] = split_step(stage, x.detach().requires_grad_(), grad, times)
    ok = True
    for name, (split_dx, split_weights) in results.items():
        same_dx, gap = torch.equal(split_dx, dx), difference(split_weights, weights)
        print(f"{name:21} vs one backward, float64: input gradient equal: "
              f"{'yes' if same_dx else 'no'} | {len(weights)} weight and bias gradients, largest "
              f"difference {gap:.3g}", flush=True)
        ok &= same_dx and (gap == 0) == (name == "B then W")
    print("B and W add up to one backward; the controls do not" if ok else
          "error: the split does not add up to one backward, or a control does", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
