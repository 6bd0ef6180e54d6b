"""Exercise 12's checks (exercises/check.py calls them): your experts.py's dispatch and combine
(MoE.forward: the kept choices sorted by expert, counted, and each result added to its token
times the router's weight; MoE.run_experts: the counts, then the rows, to the experts' ranks,
grouped there by expert, and back), against every expert run on every token (lesson 12's
prove_experts.py's reference) in float64, where a correct rewrite differs only by rounding.

On one process first, in this process: top-2 routing, top-1 with a capacity factor of 1 (which
drops choices), and top-1 with no limit, where each token has one result and the checker can
tell whose output each token got. Then 4 ranks, started once, which run the same three with
their experts shared out, 2 per rank: as two EP groups of 2 ranks (4 experts), then one of 4
(8 experts). A rank that receives rows from 2 ranks for 2 experts is where the grouping by
expert, and its undoing, show. Each mistake is named from what was measured: whose output
each token got, and whether the output, the tokens' gradients, the router's or the experts'
differ."""

import contextlib
import datetime
import logging
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verdicts import Mistake, Unchecked, free_port, load_beside, read, readme

CLOSE = 1e-12  # float64: the same sums in another order differ by ~1e-15
BATCH, TOKENS, DIM = 4, 16, 8  # prove_experts.py's: 4 sequences of 16 tokens, 8 features
EXPERTS = 8  # on one process
PER_RANK = 2  # experts per rank in the ranks' runs
RANKS = 4
EP_GROUPS = {2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}  # --ep: its groups of ranks, of the 4
# (top_k, capacity factor): prove_experts.py's two, and top-1 with no limit, where each token
# has one result, so that the checker can tell whose output each token got.
SETTINGS = ((2, 0), (1, 1.0), (1, 0))
TOP_2, CAPACITY, ONE_EACH = range(3)

# Literal names: tests/test_exercises.py finds each readme(...) link and checks its heading.
DISPATCH = readme("12_expert_parallel", "dispatch-and-combine")
EQUAL = readme("12_expert_parallel", "equal-to-one-process")


def setting_name(setting):
    top_k, capacity_factor = SETTINGS[setting]
    return f"top-{top_k}, capacity factor {capacity_factor or 'none'}"


# ---------------------------------------------------------------------------------------------
# Your experts.py, and one layer's run of it
# ---------------------------------------------------------------------------------------------
def describe(error, path):
    """'MoE.run_experts raised NotImplementedError': the function of your file that was
    running when the error came (the deepest of its frames in the traceback)."""
    where, tb = "MoE.forward", error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if os.path.abspath(frame.f_code.co_filename) == path:
            where = getattr(frame.f_code, "co_qualname", None) or (  # Python 3.11 on
                f"{type(frame.f_locals['self']).__name__}.{frame.f_code.co_name}"
                if "self" in frame.f_locals else frame.f_code.co_name)
        tb = tb.tb_next
    said = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{where} raised {type(error).__name__}{': ' + said if said else ''}"


def build(module, experts, setting):
    """The layer and the batch, the same in every process: seeded, float64 (set by the caller)."""
    top_k, capacity_factor = SETTINGS[setting]
    torch.manual_seed(0)
    moe = module.MoE(DIM, experts, top_k, capacity_factor)
    x = torch.randn(BATCH, TOKENS, DIM)
    grad_out = torch.randn(BATCH, TOKENS, DIM)
    return moe, x, grad_out


def run_layer(module, experts, setting, group=None):
    """Your MoE's forward and backward on this rank's sequences (one process: all of them):
    its output, and the gradients of its tokens, of the router and of the experts it holds."""
    moe, x, grad_out = build(module, experts, setting)
    ep, rank = 1, 0
    if group is not None:
        moe.hold_experts(group)
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = slice(rank * BATCH // ep, (rank + 1) * BATCH // ep)
    tokens = x[mine].clone().requires_grad_()
    out = moe(tokens)
    if not torch.is_tensor(out) or out.shape != tokens.shape:
        shape = list(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise Unchecked(f"MoE.forward gave {shape} for tokens of shape {list(tokens.shape)}: it "
                        "returns a tensor of its input's shape")
    out.backward(grad_out[mine])
    router = moe.router.weight.grad
    return {"out": out.detach(), "tokens": tokens.grad if tokens.grad is not None else
            torch.zeros_like(tokens), "router": torch.zeros_like(moe.router.weight)
            if router is None else router, "experts": {
                name: torch.zeros_like(p) if p.grad is None else p.grad
                for name, p in moe.experts.named_parameters()}}


@contextlib.contextmanager
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


# ---------------------------------------------------------------------------------------------
# The reference: every expert on every token (prove_experts.py's), and what mistakes would give
# ---------------------------------------------------------------------------------------------
def reference(module, experts, setting):
    """The output and gradients of each token's kept choices' experts times the router's
    weights, computed with no sorting; beside it, what tells the mistakes apart: every
    expert's output for every token, each token's choices and weights, each choice's result
    apart, and the output without the weights, with the top-k probabilities not rescaled to
    sum to 1, and without the capacity limit."""
    moe, x, grad_out = build(module, experts, setting)
    top_k, capacity_factor = SETTINGS[setting]
    x.requires_grad_()
    probs = moe.router(x).softmax(dim=-1)
    top, chosen = probs.topk(top_k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    capacity = math.ceil(capacity_factor * TOKENS * top_k / experts) if capacity_factor else None
    kept = torch.ones_like(chosen, dtype=torch.bool)
    for b, sequence in enumerate(chosen.tolist()):  # each expert's first `capacity` choices
        taken = [0] * experts  # of each sequence, counted one by one
        for t, choices in enumerate(sequence):
            for j, e in enumerate(choices):
                kept[b, t, j] = capacity is None or taken[e] < capacity
                taken[e] += int(kept[b, t, j])
    table = torch.stack([moe.experts[str(e)](x) for e in range(experts)])  # [expert, b, t, dim]

    def terms(scale, keep):  # [k, batch, tokens, dim]: each choice's result, scaled and kept
        return torch.stack([(scale[..., j] * keep[..., j])[..., None] * table.gather(
            0, chosen[..., j][None, ..., None].expand(1, *x.shape))[0] for j in range(top_k)])

    def combine(scale, keep):
        return terms(scale, keep).sum(dim=0)

    out = combine(weights, kept)
    out.backward(grad_out)
    with torch.no_grad():
        return {"out": out.detach(), "tokens": x.grad, "router": moe.router.weight.grad,
                "experts": {name: p.grad for name, p in moe.experts.named_parameters()},
                "unweighted": combine(torch.ones_like(weights), kept).detach(),
                "not rescaled": combine(top, kept).detach(),
                "all kept": combine(weights, torch.ones_like(kept)).detach(),
                "terms": terms(weights, kept).detach(),
                "table": table.detach().flatten(1, 2), "chosen": chosen.flatten(0, 1),
                "weights": weights.detach().flatten(0, 1)}


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=CLOSE)


def token_name(i):
    return f"sequence {i // TOKENS}'s token {i % TOKENS}"


def whose_outputs(out, ref):
    """With one choice per token: for each token whose output is wrong, whose it is instead,
    expert e's output for token s times a scale (None where it is no single expert's output).
    The first finding of each kind, by kind."""
    got, table = out.flatten(0, 1), ref["table"]
    experts, n, _ = table.shape
    flat = table.reshape(experts * n, -1)
    found = {}
    for t in range(n):
        if torch.allclose(got[t], ref["out"].flatten(0, 1)[t], rtol=0, atol=CLOSE):
            continue
        if got[t].norm() == 0:
            found.setdefault("nothing", (t,))
            continue
        cosine = flat @ got[t] / (flat.norm(dim=1) * got[t].norm())
        best = int(cosine.argmax())
        if 1 - cosine[best] > 1e-9:
            found.setdefault("other", (t,))
            continue
        e, s = divmod(best, n)
        scale = float(flat[best] @ got[t] / (flat[best] @ flat[best]))
        chose, weight = int(ref["chosen"][t, 0]), float(ref["weights"][t, 0])
        if s != t:
            found.setdefault("another token's", (t, e, s))
        elif e != chose:
            found.setdefault("another expert's", (t, e, chose))
        elif abs(scale - 1) < 1e-9:
            found.setdefault("unweighted", (t,))
        elif abs(scale - weight) > 1e-9:
            found.setdefault("another weight", (t, scale, weight))
    return found


# ---------------------------------------------------------------------------------------------
# The judgement: the outputs first, then the gradients
# ---------------------------------------------------------------------------------------------
def judge_outputs(got, refs, who, ep):
    """got, refs: one per setting. Raise the Mistake that fits what differs."""
    for setting in (TOP_2, CAPACITY, ONE_EACH):
        out, ref = got[setting]["out"], refs[setting]
        if close(out, ref["out"]):
            continue
        seen = (f"{who}, {setting_name(setting)}: the output is "
                f"{(out - ref['out']).abs().max():.1e} from every expert run on every token")
        if close(out, ref["unweighted"]):
            raise Mistake(f"{who}, {setting_name(setting)}: the output is every token's experts' "
                          "outputs summed without the router's weights",
                          "the router's weights were not applied in the combine: multiply each "
                          "result by its weight before adding it to its token", DISPATCH)
        found = {} if close(got[ONE_EACH]["out"], refs[ONE_EACH]["out"]) else whose_outputs(
            got[ONE_EACH]["out"], refs[ONE_EACH])
        one_each = f"{who}, {setting_name(ONE_EACH)}: "
        if "another token's" in found:
            t, e, s = found["another token's"]
            seen = (f"{one_each}{token_name(t)} got expert {e}'s output for {token_name(s)}"
                    + (", though one process is right" if ep > 1 else ""))
            if ep > 1:
                raise Mistake(seen, "the results went back in another order than the rows came: "
                              "a rank groups the rows it received by expert to run them, and "
                              "must put the results back in the order received before sending "
                              "them back", DISPATCH)
            raise Mistake(seen, "the combine added each result to another token than the one it "
                          "was run for: row i of the experts' output belongs to token[i] of the "
                          "order sorted by expert (sort the tokens, experts and weights "
                          "together, and combine in that order)", DISPATCH)
        if "another expert's" in found:
            t, e, chose = found["another expert's"]
            seen = (f"{one_each}{token_name(t)} got expert {e}'s output for it, but it chose "
                    f"expert {chose}" + (", though one process is right" if ep > 1 else ""))
            if ep > 1:
                raise Mistake(seen, "the rows a rank received were run by the wrong experts: "
                              "they come by source rank, each source's grouped by expert; "
                              "group them by expert with the counts each source sent (the "
                              "exchanged counts), this rank's experts in order", DISPATCH)
            raise Mistake(seen, "the rows reached the experts not grouped by expert: sort the "
                          "tokens by expert, with the experts and weights (stable), before "
                          "taking the rows x[token], so that expert e's counts[e] rows are "
                          "together, in expert order", DISPATCH)
        if "another weight" in found:
            t, scale, weight = found["another weight"]
            seen = (f"{one_each}{token_name(t)} got its expert's output times {scale:.4f}, "
                    f"not its router weight {weight:.4f}")
            if (refs[ONE_EACH]["weights"] - scale).abs().min() < 1e-9:
                raise Mistake(f"{seen}, another token's", "each result was multiplied by "
                              "another choice's weight: sort the weights with the tokens and "
                              "experts", DISPATCH)
            raise Mistake(seen, "no mistake on the checker's list gives that weight (it is no "
                          "choice's router weight): compare how your combine weights each "
                          "result, and the weights route gives, with the lesson's", DISPATCH)
        if setting == TOP_2 and not found:  # top-1 right, and top-2 not
            seen += "; with one expert per token it is right"
            if close(out, ref["not rescaled"]):
                raise Mistake(f"{seen}, and it is each token's two results times the router's "
                              "probabilities of them as they are",
                              "a token's top-2 weights were not rescaled to sum to 1: route "
                              "divides the chosen experts' probabilities by their sum when "
                              "top_k > 1", readme("12_expert_parallel", "the-mixture-of-experts"))
            results = ref["terms"].flatten(1, 2)  # [choice, token, dim]: each result, weighted
            either = torch.stack([*results, results.sum(dim=0)])  # one result, or both
            if ((either - out.flatten(0, 1)).abs().amax(dim=-1) <= CLOSE).any(dim=0).all():
                raise Mistake(f"{seen}, and each token got one of its two results",
                              "a token's results from its two experts were not both added: "
                              "index_add sums every row of a token, an assignment keeps one",
                              DISPATCH)
            raise Mistake(seen, "no mistake on the checker's list fits: what differs is how a "
                          "token's two results are weighted and added; compare route's weights "
                          "when top_k > 1, and the combine, with the lesson's", DISPATCH)
        if setting == CAPACITY and close(out, ref["all kept"]):
            raise Mistake(f"{who}, {setting_name(setting)}: the output is that of every choice "
                          "run, as if there were no capacity limit",
                          "the choices the capacity limit drops were run too: dispatch only "
                          "the kept ones (within_capacity's mask)",
                          readme("12_expert_parallel", "load-capacity-and-balance"))
        raise Mistake(seen, "the dispatch and combine: each kept choice's row, sorted by "
                      "expert, through its expert, and back to its token times its weight",
                      DISPATCH)


def judge_gradients(got, refs, who, ep):
    for setting in (TOP_2, CAPACITY):
        grads, ref = got[setting], refs[setting]
        router = ref["router"]
        if grads["router"].abs().max() == 0 and router.abs().max() > 0:
            raise Mistake(f"{who}, {setting_name(setting)}: the output is right, but the router "
                          "got no gradient",
                          "the router learns through the weights in the combine: keep them in "
                          "autograd's graph (no .detach(), no torch.no_grad())", DISPATCH)
        held = sorted(grads["experts"])
        if sorted(ref["experts"]) != held:
            raise Unchecked(f"{who}: the ranks held the experts' parameters {held[:4]}..., not "
                            "one each of every expert's: keep hold_experts as the lesson has it")
        differences = {
            "the tokens": (grads["tokens"] - ref["tokens"]).abs().max(),
            "the router": (grads["router"] - router).abs().max(),
            "the experts": max((grads["experts"][name] - ref["experts"][name]).abs().max()
                               for name in held)}
        what, worst = max(differences.items(), key=lambda item: item[1])
        if worst <= CLOSE:
            continue
        seen = (f"{who}, {setting_name(setting)}: the output is right, but the gradients of "
                f"{what} are {worst:.1e} from every expert run on every token")
        if ep > 1:
            raise Mistake(f"{seen}, though one process's are right",
                          "the rows must cross ranks by exchange(), there and back: Exchange's "
                          "backward returns each row's gradient to the rank it came from (a "
                          "bare all_to_all_single has no gradient)", EQUAL)
        raise Mistake(seen, "keep the dispatch and combine in autograd's graph: index, multiply "
                      "and add with tensor operations, no .detach(), .item() or .tolist() of "
                      "the rows or the weights", EQUAL)


# ---------------------------------------------------------------------------------------------
# The ranks: started once, each runs every setting at --ep 2 (two groups) and at --ep 4
# ---------------------------------------------------------------------------------------------
def rank_main(rank, path, folder, port, timeout):
    # Its output in a file of its own: a rank that dies in gloo says why there, and the
    # checker reads its last line.
    with open(os.path.join(folder, f"rank{rank}.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=timeout))
    groups = {ep: [dist.new_group(ranks) for ranks in layout] for ep, layout in EP_GROUPS.items()}
    module = load_beside(path, "experts.py")
    results = {}
    for ep in EP_GROUPS:
        results[ep] = []
        for setting in range(len(SETTINGS)):
            with open(os.path.join(folder, f"rank{rank}.at"), "w") as at:
                at.write(f"--ep {ep}, {setting_name(setting)}")
            try:
                results[ep].append(run_layer(module, ep * PER_RANK, setting,
                                             groups[ep][rank // ep]))
            except Exception as error:  # noqa: BLE001 (one line: what raised, and where)
                said = str(error) if isinstance(error, Unchecked) else describe(error, path)
                with open(os.path.join(folder, f"rank{rank}.err"), "w") as err:
                    err.write(f"at --ep {ep}, {setting_name(setting)}, rank {rank}: {said}")
                sys.exit(1)
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def why_it_stopped(folder, error):
    """The rank's own line (what raised, where), or how it ended and its output's last line."""
    name = os.path.join(folder, f"rank{error.error_index}")
    if read(f"{name}.err"):
        return read(f"{name}.err")
    at = read(f"{name}.at")
    lines = [line.strip() for line in read(f"{name}.log").splitlines() if line.strip()]
    how = f"died of {error.signal_name}" if getattr(error, "signal_name", None) else \
        f"stopped with exit status {getattr(error, 'exit_code', '?')}"
    return (f"{'at ' + at if at else 'at the start'}, rank {error.error_index} {how}; its last "
            f"line: {(lines or ['(nothing)'])[-1][:300]}")


def run_ranks(path, folder, timeout):
    """4 ranks, started once (forked from a server that imported torch, as the lessons' are);
    each rank's results, or Unchecked saying why a rank stopped or that they hung."""
    folder = os.path.join(folder, "ranks")
    os.makedirs(folder)
    # spawn logs "Terminating process N via signal SIGTERM" for each rank it stops after one
    # failed: the verdict line says which one failed, and why.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    method = "spawn"  # macOS and Windows
    if sys.platform == "linux":
        mp.set_forkserver_preload(["torch", "torch.distributed"])
        method = "forkserver"
    # The fork server's socket, in a folder pymp-XXXXXXXX that multiprocessing removes when this
    # process exits, after check.py has removed its own folder: so it goes beside that folder,
    # and where that path is longer than a socket's may be (107 bytes, 103 on macOS), in /tmp,
    # as the lessons' spawn_guard does.
    before = tempfile.tempdir
    tempfile.tempdir = os.path.dirname(os.path.dirname(folder))
    if len(tempfile.tempdir) + len("/pymp-XXXXXXXX/listener-XXXXXXXX") > 103 and \
            os.path.isdir("/tmp"):
        tempfile.tempdir = "/tmp"
    try:
        context = mp.start_processes(
            rank_main, args=(path, folder, free_port(), max(5.0, min(30.0, timeout / 2))),
            nprocs=RANKS, join=False, start_method=method)
    finally:
        tempfile.tempdir = before
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                at = read(os.path.join(folder, "rank0.at"))
                raise Unchecked(f"the {RANKS} ranks did not finish within {timeout:g} s"
                                f"{', rank 0 at ' + at if at else ''} (a rank waits in an "
                                "exchange for rows that never come?)")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
        why = why_it_stopped(folder, error)
        if "Received data size doesn't match expected size" in why:  # gloo's, as it aborts
            raise Mistake(f"{why.split('; its last line')[0]}: it received another number of "
                          "rows than a rank sent it",
                          "the ranks disagree on how many rows go where: exchange the counts "
                          "first, so that each rank receives what the others send it, and "
                          "split both by rank (the sums of each rank's experts' counts)",
                          DISPATCH) from None
        raise Unchecked(why) from None
    finally:  # also on Ctrl-C: no rank is left running
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    return [torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=True)
            for rank in range(RANKS)]


def group_results(results, ep, ranks):
    """One EP group's results, per setting, put together as one process's: the outputs and the
    tokens' gradients in sequence order, the router's summed, every expert's from its rank."""
    together = []
    for setting in range(len(SETTINGS)):
        parts = [results[rank][ep][setting] for rank in ranks]
        together.append({
            "out": torch.cat([p["out"] for p in parts]),
            "tokens": torch.cat([p["tokens"] for p in parts]),
            "router": sum(p["router"] for p in parts),
            "experts": {name: grad for p in parts for name, grad in p["experts"].items()}})
    return together


def check(script, folder, timeout):
    module = load_beside(script, "experts.py")
    path = os.path.join(os.path.dirname(os.path.abspath(script)), "experts.py")
    with float64():
        try:
            refs = {n: [reference(module, n, s) for s in range(len(SETTINGS))]
                    for n in sorted({EXPERTS, *(ep * PER_RANK for ep in EP_GROUPS)})}
        except Exception as error:  # noqa: BLE001
            raise Unchecked(f"the reference could not use your MoE's router and experts "
                            f"({describe(error, path)}): keep MoE.__init__ as the lesson has "
                            "it") from None
        try:
            one = [run_layer(module, EXPERTS, s) for s in range(len(SETTINGS))]
        except Unchecked:
            raise
        except Exception as error:  # noqa: BLE001
            raise Unchecked(describe(error, path)) from None
        who = f"one process ({EXPERTS} experts)"
        judge_outputs(one, refs[EXPERTS], who, 1)
        judge_gradients(one, refs[EXPERTS], who, 1)
    results = run_ranks(path, folder, timeout)
    with float64():
        for ep, layout in EP_GROUPS.items():
            for ranks in layout:
                who = f"--ep {ep} ({PER_RANK} experts on each of ranks {ranks[0]}-{ranks[-1]})"
                got = group_results(results, ep, ranks)
                judge_outputs(got, refs[ep * PER_RANK], who, ep)
                judge_gradients(got, refs[ep * PER_RANK], who, ep)
