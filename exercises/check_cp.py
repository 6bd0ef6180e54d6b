"""Exercise 11's checks (exercises/check.py calls them): your ring_attention.py's block_scores,
attend_block and merge, on one process with plain tensors, then its ring at 4 ranks, each
against full causal attention (F.scaled_dot_product_attention) in float64, where a correct
rewrite differs only by rounding.

In this order: a block of later keys must give nothing; a block of the queries' own chunk must
be the causal attention within it; blocks merged in any order must give attention over all of
them (averaged outputs are the named mistake); then lesson 11's prove_ring.py, run with your
ring_attention.py at 4 ranks, must find the ring's output and gradients equal to full
attention's."""

import os
import re
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F

from verdicts import Mistake, Unchecked, call, load_beside, readme

LESSON = "11_context_parallel"
CLOSE = 1e-12  # float64: the same sums in another order differ by ~1e-15
CHUNKS, TOKENS = 4, 4  # a sequence of 4 chunks of 4 tokens


def sequence():
    generator = torch.Generator().manual_seed(0)
    shape = (2, 2, CHUNKS * TOKENS, 8)  # batch, heads, tokens, head dim
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3)]


def chunk(t, c):
    return t[:, :, c * TOKENS:(c + 1) * TOKENS]


def check_masks(module):
    q, k, v = sequence()
    later = call("attend_block", module.attend_block, chunk(q, 0), chunk(k, 1), chunk(v, 1), 0, 1)
    if later is not None:
        raise Mistake("queries of chunk 0 got an output from chunk 1's keys, which come after "
                      "every one of them",
                      "the causal mask dropped across chunks: a block of later keys gives "
                      "nothing (return None)", readme("11_context_parallel", "ring-attention"))
    own = call("attend_block", module.attend_block, chunk(q, 1), chunk(k, 1), chunk(v, 1), 1, 1)
    if not (isinstance(own, tuple) and len(own) == 2):
        raise Unchecked(f"attend_block gave {type(own).__name__} for the queries' own chunk, not "
                        "(output, log-sum-exp)")
    out = own[0]
    causal = F.scaled_dot_product_attention(chunk(q, 1), chunk(k, 1), chunk(v, 1), is_causal=True)
    if not torch.allclose(out, causal, rtol=0, atol=CLOSE):
        whole = F.scaled_dot_product_attention(chunk(q, 1), chunk(k, 1), chunk(v, 1))
        if torch.allclose(out, whole, rtol=0, atol=CLOSE):
            raise Mistake("within one chunk, each query saw the keys after its own",
                          "the causal mask dropped inside the diagonal block: mask the scores "
                          "above the diagonal with -inf",
                          readme("11_context_parallel", "ring-attention"))
        raise Mistake(f"a chunk's attention to its own keys is "
                      f"{(out - causal).abs().max():.1e} from causal attention's",
                      "attend_block: the scores (q @ k^T / sqrt(head dim)), their softmax, or the "
                      "log-sum-exp it returns", readme("11_context_parallel", "ring-attention"))


def check_merge(module):
    q, k, v = sequence()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = CHUNKS - 1
    blocks = [module.attend_block(chunk(q, last), chunk(k, c), chunk(v, c), last, c)
              for c in range(CHUNKS)]
    for order in (range(CHUNKS), reversed(range(CHUNKS))):  # a ring meets them in any order
        out = lse = None
        for c in order:
            merged = call("merge", module.merge, out, lse, blocks[c])
            if not (isinstance(merged, tuple) and len(merged) == 2):
                raise Unchecked(f"merge gave {type(merged).__name__}, not (output, log-sum-exp)")
            out, lse = merged
        if torch.allclose(out, chunk(full, last), rtol=0, atol=CLOSE):
            continue
        averaged = None
        for c in order:
            averaged = blocks[c][0] if averaged is None else (averaged + blocks[c][0]) / 2
        if torch.allclose(out, averaged, rtol=0, atol=CLOSE):
            raise Mistake("the merged blocks are their outputs averaged, not attention over all "
                          "of their keys",
                          "merge averaged the outputs: weigh each by e^(lse_i - lse), its share "
                          "of the softmax's denominator",
                          readme("11_context_parallel", "ring-attention"))
        raise Mistake(f"4 blocks merged are {(out - chunk(full, last)).abs().max():.1e} from "
                      f"attention over all of their keys",
                      "merge: lse = logaddexp(lse_1, lse_2), out = e^(lse_1 - lse) out_1 + "
                      "e^(lse_2 - lse) out_2", readme("11_context_parallel", "ring-attention"))


def check_ring(script, folder, timeout):
    """Lesson 11's prove_ring.py, beside a copy of your ring_attention.py, at 4 ranks."""
    ring = os.path.join(folder, "ring")
    os.makedirs(ring)
    shutil.copy(os.path.join(os.path.dirname(script), "ring_attention.py"), ring)
    lesson = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), LESSON)
    for name in ("prove_ring.py", "guard_rails.py"):  # the lesson's proof, and what it imports
        shutil.copy(os.path.join(lesson, name), ring)
    try:
        done = subprocess.run([sys.executable, "prove_ring.py", "--cp", "4"], cwd=ring,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Unchecked(f"the ring at 4 ranks did not finish within {timeout:g} s") from None
    if "equal within" not in done.stdout:
        lines = (done.stdout + done.stderr).strip().splitlines() or ["(nothing)"]
        raise Unchecked(f"the ring at 4 ranks stopped; its last line: {lines[-1]}")
    if done.returncode != 0:
        worst = max((line for line in done.stdout.splitlines() if "largest difference" in line),
                    key=lambda line: max(float(x) for x in re.findall(r"\d\.\de[-+]\d+", line)))
        raise Mistake(f"at 4 ranks the ring differs from full attention: {worst.strip()}",
                      "what the ring's forward saves: merge's lse is what backward uses",
                      readme("11_context_parallel", "ring-attention"))


def check(script, folder, timeout):
    module = load_beside(script, "ring_attention.py")
    check_masks(module)
    check_merge(module)
    check_ring(script, folder, timeout)
