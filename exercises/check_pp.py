"""Exercise 10's own checks (a pipeline scheduled by hand), called by exercises/check.py.

Each rank of a pipeline holds some of the model's layers, so no rank's record is the model's:
the checker puts the stages' weights and gradients back together, in rank order, into the
whole model, and compares each step's gradients with the ones the whole model gets from the
batch's mean loss over its real rows. A run that stopped in a deadlock is read from the sends and
recvs each rank began (the probe writes each as it starts, and again when it ends).
"""

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

from verdicts import Mistake, call, load_beside, readme

BY_HAND = readme("10_pipeline_parallel", "by-hand-all-forwards-then-all-backwards")
VERB = {"send": "send", "recv": "receive"}
THE_LOSS = readme("10_pipeline_parallel", "a-short-last-batch-and-the-loss-of-a-micro-batch")


def read_p2p(lines, p2p):
    """One process's <pid>.p2p lines into p2p: {rank: [{"op", "peer", "shape", "step",
    "done"}, ...]}, each send or recv in the order it began; done: it returned."""
    for line in lines:
        entry = json.loads(line)
        ops = p2p.setdefault(entry["rank"], [])
        if entry.get("done"):
            ops[-1]["done"] = True
        else:
            ops.append({**entry, "done": False})


def flag(flags, name):
    return int(flags[flags.index(name) + 1])


def check_deadlock(yours, exercise):
    """A run that did not end well, with a rank still waiting in a recv: name who waited for
    what, and the schedule's mistake that leads there."""
    if yours.code == 0:
        return
    waiting = {rank: ops[-1] for rank, ops in yours.p2p.items() if ops and not ops[-1]["done"]}
    if not waiting:
        return
    m = flag(exercise.flags, "--microbatches")
    # The first stage that waits for a gradient (a recv from a later stage), else any.
    rank = min(waiting, key=lambda r: (not (waiting[r]["op"] == "recv"
                                            and waiting[r]["peer"] > r), r))
    op = waiting[rank]
    peer, step = op["peer"], op["step"]
    if peer in waiting:
        other = waiting[peer]
        what = "a gradient" if other["peer"] > peer else "an activation"
        there = (f"while rank {peer} waits to {VERB[other['op']]} {what} "
                 f"{'from' if other['op'] == 'recv' else 'to'} rank {other['peer']}")
    else:
        there = f"while rank {peer} had stopped"
    if op["op"] != "recv" or peer < rank:
        raise Mistake(f"the run stopped in a deadlock: rank {rank} waited to {VERB[op['op']]} "
                      f"{'from' if op['op'] == 'recv' else 'to'} rank {peer} in step {step + 1}, "
                      f"{there}", "each send has its recv on the neighbour, in the same order: "
                      "compare your sends and recvs with afab_step's", BY_HAND)
    sent = sum(1 for o in yours.p2p[rank] if o["op"] == "send" and o["peer"] == peer
               and o["step"] == step)
    back = sum(1 for o in yours.p2p.get(peer, []) if o["op"] == "send" and o["peer"] == rank)
    seen = (f"the run stopped in a deadlock in step {step + 1}: rank {rank} waited for a gradient "
            f"from rank {peer} after sending it {sent} of the {m} micro-batches' activations, "
            f"{there}")
    if sent < m:
        raise Mistake(seen, "backwards in the wrong order: a stage that waits for a gradient "
                      "before it has sent every activation waits for a stage that still waits for "
                      "them; in afab every stage runs all its forwards, then all its backwards, in "
                      "the same order", BY_HAND)
    if back == 0:
        raise Mistake(seen + f"; rank {peer} never sent rank {rank} a gradient",
                      "a stage that never sends its gradient back: after each micro-batch's "
                      "backward, every stage but the first sends its input's gradient (x.grad) "
                      "to the stage before", BY_HAND)
    raise Mistake(seen, "each send has its recv on the neighbour, in the same order: compare "
                  "your sends and recvs with afab_step's", BY_HAND)


def padding(rows):
    """Which rows of a batch are padding (a row of zeros: no wine measures 0 on every scaled
    feature)."""
    return (rows == 0).all(dim=1)


def without_padding(logs):
    """Copies of the ranks' records with the padding rows taken out of each step."""
    return [{**log, "steps": [step[~padding(step)] for step in log["steps"]]} for log in logs]


def whole(logs, key, step):
    """The stages' tensors of one step (params or grads), in rank order: the whole model's."""
    return [t for log in logs for t in log[key][step]]


def candidates(model, rows, labels, m):
    """{what: the gradients it gives}: the batch's mean loss over its real rows (the right one),
    and the mistakes that give other gradients on some batch. rows: the batch as the first
    stage got it (padding included), cut into m micro-batches as torch.chunk cuts it; labels:
    each real row's, -100 for padding."""
    real = int((labels != -100).sum())
    pieces = list(zip(rows.chunk(m), labels.chunk(m), strict=True))

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    def summed(x, y, pad_label=None):
        y = y if pad_label is None else torch.where(y == -100, pad_label, y)
        return F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")

    def mean(x, y):  # a micro-batch's mean over its real rows (0 for one with none)
        n = int((y != -100).sum())
        return summed(x, y) / n if n else summed(x, y) * 0

    found = {"right": grads(summed(rows, labels) / real),
             f"each micro-batch's mean loss, added up ({m} times the batch's mean on a full "
             "batch)": grads(sum(mean(x, y) for x, y in pieces)),
             "the mean of the micro-batches' means, whose real rows differ on a short batch":
             grads(sum(mean(x, y) for x, y in pieces) / m),
             f"the loss divided by the batch's {len(rows)} rows, padding included, not its "
             f"{real} real ones": grads(summed(rows, labels) / len(rows))}
    for label in range(3):
        for n, counted in ((real, "real"), (len(rows), "padded")):
            found[f"the padding rows counted, as wines of class {label}, over the {counted} "
                  f"rows"] = grads(summed(rows, labels, label) / n)
    return found


def close(grads, others):
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, others,
                                                                          strict=True))


def check_gradients(trained, module, wines, exercise):
    """Step by step, the stages' gradients put together are the whole model's gradient of the
    batch's mean loss over its real rows; the first step where they are not names the mistake."""
    model = module.WineMLP(layers=flag(exercise.flags, "--layers"))
    m = flag(exercise.flags, "--microbatches")
    shapes = [p.shape for p in model.parameters()]
    for step in range(len(trained[0]["steps"])):
        params = whole(trained, "params", step)
        if [p.shape for p in params] != shapes:
            raise Mistake("your stages' weights, put together in rank order, are not the "
                          "lesson's model's", "split the lesson's WineMLP (--layers) into "
                          "consecutive stages, one per rank, in rank order",
                          readme("10_pipeline_parallel", "by-hand-all-forwards-then-all-backwards"))
        for log in trained:
            if any(g is None for g in log["grads"][step]):
                raise Mistake(f"in step {step + 1}, rank {log['rank']}'s layers got no gradient",
                              "a stage that never sends its gradient back: after each "
                              "micro-batch's backward, every stage but the first sends its "
                              "input's gradient (x.grad) to the stage before, whose backward "
                              "starts from it", BY_HAND)
        with torch.no_grad():
            for p, value in zip(model.parameters(), params, strict=True):
                p.copy_(value)
        rows = trained[0]["steps"][step]
        ids = wines.ids(rows, wines.train)
        labels = torch.tensor([-100 if i is None else int(wines.train_set.labels[i])
                               for i in ids])
        found = candidates(model, rows, labels, m)
        grads, right = whole(trained, "grads", step), found.pop("right")
        if close(grads, right):
            continue
        for what, expected in found.items():
            if close(grads, expected):
                mistake = ("the padding rows counted: give them the target -100, "
                           "cross_entropy's ignore_index, so that they add nothing"
                           if what.startswith("the padding") else
                           "the loss not divided by the batch's real rows: each micro-batch's "
                           "loss is the sum of its rows' losses (reduction=\"sum\") over the "
                           "real rows of the whole batch, and the shares add up to its mean")
                raise Mistake(f"in step {step + 1}, your gradients are those of {what}",
                              mistake, THE_LOSS)
        last = len(trained[-1]["grads"][step])  # the last stage's tensors
        if close(grads[-last:], right[-last:]):
            raise Mistake(f"in step {step + 1}, the last stage's gradients are the whole "
                          "model's, and the earlier stages' are not",
                          "backwards in the wrong order: each stage must use the gradient it "
                          "receives on the micro-batch it was computed for; receive them in the "
                          "order the next stage sends them", BY_HAND)
        raise Mistake(f"in step {step + 1}, your stages' gradients are not the whole model's "
                      "gradient of the batch's mean loss", "compare your afab_step and loss "
                      "with the lesson's: each micro-batch's activations forward, its gradient "
                      "back, the loss over the batch's real rows", BY_HAND)



def check_loss_figure(losses, lesson_losses, wines, steps_per_epoch, exercise):
    """The weights are the lesson's, the epoch's losses not: over the padded rows?"""
    padded = steps_per_epoch * flag(exercise.flags, "--batch-size")
    share = wines.train_size / padded
    if len(losses) == len(lesson_losses) and torch.allclose(
            torch.tensor(losses), torch.tensor(lesson_losses) * share, rtol=0, atol=1e-5):
        raise Mistake(f"the weights match the lesson's, but each epoch's train_loss is the "
                      f"lesson's times {wines.train_size}/{padded}", "the padding rows counted: "
                      f"the epoch's mean is over its {wines.train_size} real rows, not the "
                      f"{padded} the padded batches hold", THE_LOSS)


# ---------------------------------------------------------------------------------------------
# Part two (exercise 10b): the backward split in two, B then W, on one process
# ---------------------------------------------------------------------------------------------
SPLIT = readme("10_pipeline_parallel", "zero-bubble-the-backward-split-in-two")
EXACT = 1e-12  # float64: the same products summed in another order differ by ~1e-15


def grads_of(stage):
    return [None if p.grad is None else p.grad.clone() for p in stage.parameters()]


def equal(grads, others, factor=1):
    return all(g is not None and torch.allclose(g, factor * o, rtol=0, atol=EXACT)
               for g, o in zip(grads, others, strict=True))


def check_split(script):
    """Two micro-batches through your B, both, then your W, both, as a zero-bubble schedule
    defers W: each B must hand back one backward's input gradient and leave the weights alone;
    the W's must add up to the two backwards' weight gradients, in float64, to rounding."""
    # Its imports, model.py and pipeline.py, from its own folder, not another lesson's.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for name in ("model", "pipeline"):
        sys.modules.pop(name, None)
    split = load_beside(script, "split_backward.py")
    stage, x, grad = split.middle_stage()
    generator = torch.Generator().manual_seed(1)
    batches = [(x, grad), (torch.randn(x.shape, generator=generator, dtype=x.dtype),
                           torch.randn(grad.shape, generator=generator, dtype=grad.dtype))]
    handed, per_batch = one_backward_each(stage, batches)
    both = [a + b for a, b in zip(*per_batch, strict=True)]
    saved = check_b(split, stage, batches, handed, both)
    check_w(split, stage, saved, per_batch, both)


def one_backward_each(stage, batches):
    """What one ordinary backward per micro-batch gives, on a copy of the stage: the gradient of
    its input, and the weights' gradients."""
    whole = copy.deepcopy(stage)
    handed, per_batch = [], []
    for x, grad in batches:
        x = x.detach().requires_grad_()
        whole.zero_grad(set_to_none=True)
        whole(x).backward(grad)
        handed.append(x.grad)
        per_batch.append(grads_of(whole))
    return handed, per_batch


def check_b(split, stage, batches, handed, both):
    """Each micro-batch's B (your backward_input): one backward's input gradient handed back, the
    weights left alone. Returns what each W needs, (inputs, douts) a micro-batch."""
    saved, before_w = [], None
    for i, ((x, grad), expected) in enumerate(zip(batches, handed, strict=True)):
        x = x.detach().requires_grad_()
        out, inputs, outputs = split.forward_keeping(stage, x)
        dx, douts = call("backward_input", split.backward_input, out, grad, x, outputs)
        if not isinstance(dx, torch.Tensor) or dx.shape != expected.shape or not torch.allclose(
                dx, expected, rtol=0, atol=EXACT):
            seen = "no tensor" if not isinstance(dx, torch.Tensor) else (
                "zeros" if not dx.any() else "another tensor")
            raise Mistake(f"for micro-batch {i + 1}, backward_input returned {seen} as the "
                          "gradient of the stage's input, not one backward's",
                          "B's result not handed back: the stage before waits for the gradient "
                          "of this stage's input x, the first of torch.autograd.grad(out, "
                          "[x, *outputs], grad); return it", SPLIT)
        saved.append((inputs, douts))
        before_w = grads_of(stage)
    if any(g is not None and g.any() for g in before_w):
        if equal(before_w, both):
            raise Mistake("after both micro-batches' B, before any W, the weights' gradients are "
                          "already one backward's", "B computed the weights' gradients too "
                          "(out.backward, or autograd.grad asked for the weights): it must ask "
                          "for the input's and the layers' outputs' gradients only, so that W, "
                          "run later, is what fills the bubble", SPLIT)
        raise Mistake("backward_input changed the weights' gradients", "B asks autograd for the "
                      "gradients of x and of each layer's output, and of no weight", SPLIT)
    return saved


def check_w(split, stage, saved, per_batch, both):
    """Both micro-batches' W (your backward_weight), after both B: the weights' gradients add up
    to the two backwards', once each."""
    for inputs, douts in saved:
        call("backward_weight", split.backward_weight, stage, inputs, douts)
    after = grads_of(stage)
    if all(g is None or not g.any() for g in after):
        raise Mistake("after both micro-batches' W, the weights have no gradient",
                      "W dropped: backward_weight must add each layer's dW = dz^T a and "
                      "db = dz summed over the rows to .grad", SPLIT)
    if equal(after, both, 2):
        raise Mistake("after both micro-batches' W, every weight's gradient is twice one "
                      "backward's", "W run twice: each micro-batch's W adds its gradients "
                      "once", SPLIT)
    if equal(after, per_batch[-1]):
        raise Mistake("after both micro-batches' W, the weights' gradients are those of the "
                      "last micro-batch alone", "each W replaced .grad: add to it (a gradient "
                      "of None the first time), as backward does, so that the micro-batches' "
                      "gradients add up", SPLIT)
    if not equal(after, both):
        gap = max(float("inf") if g is None else (g - o).abs().max().item()
                  for g, o in zip(after, both, strict=True))
        raise Mistake(f"after both micro-batches' W, the weights' gradients differ from two "
                      f"backwards' by up to {gap:.3g}", "each layer's dW is dz^T a (dz: the "
                      "gradient at its output, a: its input) and db dz summed over the rows; "
                      "compare your backward_weight with the README's", SPLIT)
