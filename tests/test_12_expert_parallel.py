"""Lesson 12, run as a learner runs it: python 12_expert_parallel/train.py (mp.spawn, gloo/CPU)
and its proof, python 12_expert_parallel/prove_experts.py.

The MoE layer by hand (sorted by expert, exchanged, combined) equals every expert run on every
token, on one process and on 4 ranks, with and without a capacity limit; training with --ep 2,
--ep 4 and --dp 2 --ep 2 ends on the weights of --ep 1, one process, routes the same rows to each
expert every step, and with a capacity limit drops the same ones; torchrun restarts a crashed
run, which resumes bitwise, a checkpoint loads into another --ep, and two torchrun nodes share
one EP group; the balance loss reaches the router. In-process, on plain tensors, each definition
the README gives (the router's weights, the balance loss, the capacity, each expert's recorded
load, the load line) is checked against the definition written out by hand: a mistake every
layout makes alike passes the layouts' comparisons, and fails there. Every flag's bad values
stop in one line before any rank starts, and without --dp the launcher picks one for 1 to 16
GPUs, or from torchrun's ranks.

Tolerance. In float64 (--float64), the layouts differ only in the order of their sums: each rank
adds its own sequences' gradients, an expert adds the rows it received from every rank in its
own order, and all-reduce adds the ranks' shares. Measured on this course's 2-core machine
(AMD EPYC, torch 2.14.1), against --ep 1: after 1 epoch (25 Adam steps) 1.6e-14 (--ep 2),
8.5e-15 (--ep 4), 1.5e-14 (--dp 2 --ep 2); after 2 epochs (50 steps) 2.8e-13, 5.4e-13 and
3.8e-13: Adam, which divides each step by its gradient's running size, makes rounding grow 12
to 18% a step here. TOLERANCE = 1e-10,
a hundred times that; one wrong line of the dispatch moves the weights by 1e-3 and more."""

import json
import math
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    GPUS,
    ROOT,
    assert_final_pt_holds_cpu_tensors,
    assert_one_line_error,
    check_ok,
    import_lesson,
    max_weight_difference,
    read_metrics,
    run_lesson,
    run_torchrun,
    run_torchrun_nodes,
)

LESSON = "12_expert_parallel"
TOLERANCE = 1e-10
CPU = ["--backend", "gloo", "--dp", "1"]  # the CPU tier stays on gloo even where GPUs exist
SMALL = ["--float64", "--epochs", "2", "--save-every", "1"]
CAPACITY = ["--top-k", "1", "--capacity-factor", "1", "--epochs", "1"]  # drops some choices
LAYOUTS = {"ep1": ["--ep", "1", *SMALL], "ep2": ["--ep", "2", *SMALL],
           "ep4": ["--ep", "4", *SMALL], "dp2ep2": ["--dp", "2", "--ep", "2", *SMALL],
           "capacity_ep1": ["--ep", "1", *SMALL, *CAPACITY],
           "capacity_ep2": ["--ep", "2", *SMALL, *CAPACITY]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run in float64, made once: {name: out_dir}."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            check_ok(run_lesson(LESSON, *CPU, *LAYOUTS[name], "--out-dir", out))
            made[name] = out
        return made[name]

    return run


@pytest.fixture(scope="module")
def lesson():
    """train.py, imported (nothing runs); lesson.guard_rails is the guard_rails.py it imported,
    and experts.py, which it imports, is sys.modules' experts."""
    return import_lesson(LESSON)


@pytest.fixture(scope="module")
def experts(lesson):
    return sys.modules["experts"]

# ---------------------------------------------------------------------------------------------
# The README's definitions, checked on plain tensors against each written out by hand: a mistake
# every layout makes alike passes every comparison of layouts, and fails here.
# ---------------------------------------------------------------------------------------------
def test_the_routers_weights_are_its_top_k_probabilities_rescaled_to_sum_to_1(experts):
    torch.manual_seed(0)
    scores = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    for k in (1, 2, 3):
        probs, weights, chosen = experts.route(scores, k)
        assert torch.allclose(probs, scores.softmax(dim=-1), rtol=0, atol=1e-15)
        for p, w, c in zip(probs.flatten(0, 1).tolist(), weights.flatten(0, 1).tolist(),
                           chosen.flatten(0, 1).tolist(), strict=True):
            best = sorted(range(6), key=lambda e: -p[e])[:k]  # the k most probable experts
            top = [p[e] for e in best]
            assert c == best
            # k = 1: the probability itself (Switch), so that the loss reaches the router;
            # k > 1: rescaled to sum to 1 over the chosen (Mixtral).
            assert w == pytest.approx(top if k == 1 else [q / sum(top) for q in top], abs=1e-15)
    (grad,) = torch.autograd.grad(experts.route(scores, 1)[1].sum(), scores)
    assert grad.abs().max() > 0  # top-1's weight carries a gradient back to the scores


def test_the_balance_loss_is_the_switch_transformers_per_sequence(experts):
    # N x the sum over experts of (its share of a sequence's choices) x (its mean probability
    # over the sequence's tokens), summed over the sequences: eq. 4 of arXiv:2101.03961.
    torch.manual_seed(0)
    batch, tokens, n = 3, 10, 4
    probs = torch.randn(batch, tokens, n, dtype=torch.float64).softmax(dim=-1).requires_grad_()
    for k in (1, 2):
        chosen = probs.topk(k, dim=-1).indices
        shares = [[(chosen[b] == e).sum().item() / (tokens * k) for e in range(n)]
                  for b in range(batch)]
        means = probs.mean(dim=1).tolist()
        loss = experts.balance_loss(probs, chosen, n)
        assert loss.item() == pytest.approx(sum(
            n * sum(f * p for f, p in zip(shares[b], means[b], strict=True))
            for b in range(batch)), abs=1e-14)
        # Its gradient: the shares are counts, with none; each token's probability of expert e
        # gets N x e's share / tokens: the busier the expert, the harder it is pushed down.
        (grad,) = torch.autograd.grad(loss, probs)
        expected = torch.tensor(shares, dtype=torch.float64)[:, None, :] * n / tokens
        assert torch.allclose(grad, expected.expand_as(grad), rtol=0, atol=1e-15)
    # 1 when the load is even, whatever the probabilities; N x P_e when expert e takes all;
    # and an uneven load can give less than 1: it bounds, it does not measure, the imbalance.
    p = torch.randn(1, n, n, dtype=torch.float64).softmax(dim=-1)
    assert experts.balance_loss(p, torch.arange(n).view(1, n, 1), n).item() == pytest.approx(1)
    everything_to_0 = experts.balance_loss(p, torch.zeros(1, n, 1, dtype=torch.long), n)
    assert everything_to_0.item() == pytest.approx(n * p[0, :, 0].mean().item())
    assert everything_to_0 < n
    uneven = torch.tensor([[[0.51, 0.49], [0.51, 0.49], [0.0, 1.0]]], dtype=torch.float64)
    low = experts.balance_loss(uneven, torch.tensor([[[0], [0], [1]]]), 2).item()
    assert low == pytest.approx(2 * (2 / 3 * 1.02 / 3 + 1 / 3 * 1.98 / 3)) and low < 1


def test_an_expert_takes_the_first_capacity_of_its_choices_in_each_sequence(experts):
    torch.manual_seed(0)
    chosen = torch.randint(0, 4, (3, 16, 2))
    for capacity in (1, 3, 8, None):
        kept = experts.within_capacity(chosen, 4, capacity)
        for b in range(3):  # token by token, a token's first choice before its second
            taken = [0] * 4
            for t in range(16):
                for j in range(2):
                    e = int(chosen[b, t, j])
                    assert bool(kept[b, t, j]) == (capacity is None or taken[e] < capacity)
                    taken[e] += int(kept[b, t, j])
    # The layer's capacity: ceil(factor x tokens x k / experts) choices of each sequence.
    x = torch.randn(3, 16, 8)
    for factor in (0.5, 1.0, 1.25):
        moe = experts.MoE(8, 4, 2, capacity_factor=factor)
        capacity = math.ceil(factor * 16 * 2 / 4)
        with torch.no_grad():
            chosen = experts.route(moe.router(x), 2)[2]
            moe(x)
        wanted = torch.stack([torch.bincount(c.flatten(), minlength=4) for c in chosen])
        assert torch.equal(moe.load, wanted.clamp(max=capacity).sum(dim=0))
        assert (wanted > capacity).any()  # some choices were dropped


def test_each_experts_load_is_the_rows_it_ran(experts):
    # MoE.load, what train.py records, against the rows each expert's forward was given.
    torch.manual_seed(0)
    x = torch.randn(4, 16, 8)
    for top_k, factor in ((2, 0), (1, 1.0), (2, 0.5)):
        moe = experts.MoE(8, 4, top_k, capacity_factor=factor)
        ran = [0] * 4
        for e, expert in moe.experts.items():
            expert.register_forward_hook(lambda module, inputs, output, e=int(e), ran=ran:
                                         ran.__setitem__(e, len(inputs[0])))
        with torch.no_grad():
            moe(x)
        assert moe.load.tolist() == ran
        assert (sum(ran) < 4 * 16 * top_k) == (factor > 0)  # a capacity here drops some


def test_the_load_line_names_the_busiest_expert_and_the_busiest_rank(experts):
    # One step of one block, 4 experts on 2 ranks: rows 172, 62 (rank 0) and 83, 83 (rank 1),
    # 400 choices, an even share 100 an expert and 200 a rank.
    args = SimpleNamespace(ep=2, batch_size=1, seq_len=200, top_k=2)
    line = experts.describe_load(torch.tensor([[[172, 62, 83, 83]]]), args)
    assert line == "busiest expert 1.72x its share, busiest rank 1.17x, 0.0% dropped"
    args.ep = 4  # one expert a rank: the two are the same
    assert "busiest expert 1.72x its share, busiest rank 1.72x" in experts.describe_load(
        torch.tensor([[[172, 62, 83, 83]]]), args)

# ---------------------------------------------------------------------------------------------
# The layer and the layouts
# ---------------------------------------------------------------------------------------------
def test_the_moe_by_hand_equals_every_expert_on_every_token():
    done = subprocess.run([sys.executable, str(ROOT / LESSON / "prove_experts.py"), "--ep", "4"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal within 1e-12: True" in done.stdout, done.stdout
    assert done.stdout.count("largest difference") == 4  # one process, 4 ranks; twice
    # 8 experts on 4 ranks, 4 sequences of 16 tokens: top-2 keeps every choice (128 rows);
    # top-1 with a capacity of 16 x 1 / 8 = 2 per expert and sequence drops some.
    kept = [line for line in done.stdout.splitlines() if "of the choices" in line]
    assert len(kept) == 2 and "kept 100%" in kept[0] and "kept 100%" not in kept[1], kept
    sends = [line for line in done.stdout.splitlines() if "sends rows to ranks 0..3" in line]
    assert len(sends) == 8, done.stdout
    rows = [sum(map(int, line.split(": ")[1].split(", "))) for line in sends]
    assert rows[:4] == [32] * 4  # top-2: each rank sends 2 rows for each of its 16 tokens


@pytest.mark.parametrize("layout", ["ep2", "ep4", "dp2ep2"])
def test_every_layout_takes_the_steps_of_one_process(runs, layout):
    assert max_weight_difference(runs(layout), runs("ep1")) < TOLERANCE
    ours, one = read_metrics(runs(layout)), read_metrics(runs("ep1"))
    for a, b in zip(ours["train_loss"], one["train_loss"], strict=True):
        assert abs(a - b) < TOLERANCE
    assert abs(ours["val_loss"] - one["val_loss"]) < TOLERANCE
    assert ours["train_loss"][-1] < ours["train_loss"][0]
    # Every step, every expert of every block got the rows it gets in one process; 2 epochs
    # of 25 steps, each 16 sequences x 64 tokens x top-2 choices, none dropped.
    assert ours["expert_load"] == one["expert_load"]
    assert len(one["expert_load"]) == 50
    assert all(sum(block) == 16 * 64 * 2 for step in one["expert_load"] for block in step)


def test_a_capacity_limit_drops_the_same_choices_on_every_layout(runs):
    ep1, ep2 = read_metrics(runs("capacity_ep1")), read_metrics(runs("capacity_ep2"))
    assert ep2["expert_load"] == ep1["expert_load"]
    # top-1, capacity 64 x 1 / 4 = 16 per expert and sequence: at most 16 x 16 rows per step.
    assert max(n for step in ep1["expert_load"] for block in step for n in block) <= 16 * 16
    assert sum(sum(block) for step in ep1["expert_load"] for block in step) < 25 * 2 * 16 * 64
    assert max_weight_difference(runs("capacity_ep2"), runs("capacity_ep1")) < TOLERANCE


def test_the_balance_loss_reaches_the_router(runs, tmp_path):
    # The --ep 2 run again with --balance-loss 0 ends elsewhere: the loss moved the weights.
    check_ok(run_lesson(LESSON, *CPU, *LAYOUTS["ep2"], "--balance-loss", "0",
                        "--out-dir", tmp_path))
    assert max_weight_difference(tmp_path, runs("ep2")) > 1e-6
    assert read_metrics(tmp_path)["balance_loss"] == 0


def test_torchrun_restarts_a_crashed_run_which_resumes_bitwise(runs, tmp_path):
    # torchrun, --ep 2: rank 1 raises in epoch 2, torchrun starts both again (--max-restarts 1),
    # they resume from epoch 1's checkpoint and end bitwise on a run of 3 epochs that never
    # stopped. Then the 2-epoch --ep 4 run's checkpoint, resumed by --ep 2: within TOLERANCE.
    three = ["--ep", "2", "--float64", "--epochs", "3", "--backend", "gloo"]
    straight = tmp_path / "straight"
    check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", straight))
    restarted = tmp_path / "restarted"
    result = run_torchrun(LESSON, *three, "--save-every", 1, "--out-dir", restarted,
                          torchrun_args=["--max-restarts", 1], patch="raise-on-rank-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "injected failure on rank 1" in result.stderr
    assert ("1 of 3 epochs done, written by --dp 1 --ep 2 on 2 ranks, "
            "loaded by --dp 1 --ep 2 on 2") in result.stdout
    metrics = read_metrics(restarted)
    assert metrics["launcher"] == "torchrun" and metrics["backend"] == "gloo"
    assert max_weight_difference(straight, restarted) == 0
    assert metrics["expert_load"] == read_metrics(straight)["expert_load"]  # all 3 epochs'
    other = tmp_path / "from_ep4"
    shutil.copytree(runs("ep4") / "checkpoint", other / "checkpoint")
    result = check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", other))
    assert ("2 of 3 epochs done, written by --dp 1 --ep 4 on 4 ranks, "
            "loaded by --dp 1 --ep 2 on 2") in result.stdout
    assert read_metrics(other)["resumed_after_epoch"] == 2
    assert max_weight_difference(straight, other) < TOLERANCE


def test_two_torchrun_nodes_share_one_ep_group(runs, tmp_path):
    # Two torchrun "nodes" on this machine, one rank each: the EP group spans them, every
    # all-to-all crosses between the nodes. The run ends on --ep 2's weights. Both write their
    # shards of the checkpoint to the one --out-dir, as on a filesystem the nodes share.
    for node in run_torchrun_nodes(LESSON, *LAYOUTS["ep2"], "--backend", "gloo",
                                   "--out-dir", tmp_path):
        check_ok(node)
    metrics = read_metrics(tmp_path)
    assert (metrics["launcher"], metrics["world_size"], metrics["ep"]) == ("torchrun", 2, 2)
    assert max_weight_difference(tmp_path, runs("ep2")) < TOLERANCE


@pytest.mark.parametrize(("flags", "says"), [
    (["--ep", "3"], "--experts 4 does not share out over --ep 3"),
    (["--ep", "0"], "--ep must be at least 1 (got 0)"),
    (["--batch-size", "1000"], "--batch-size 1000 leaves no step: each of the 2 ranks reads 201 "
                               "of the 403 training sequences, in batches of 500")])
def test_a_layout_that_cannot_share_out_the_experts_stops_in_one_line(flags, says, tmp_path):
    # As the learner sees it; every flag's refusals are checked in-process, below.
    result = run_lesson(LESSON, *CPU, *flags, "--out-dir", tmp_path)
    assert_one_line_error(result, says)
    assert "starting" not in result.stdout


COUNTS = ["--epochs", "--batch-size", "--save-every", "--ep", "--dp", "--experts", "--top-k",
          "--seq-len", "--dim", "--heads", "--layers"]
REFUSED = [
    *[([flag, value], f"{flag} must be at least 1 (got {value})")
      for flag in COUNTS for value in ("0", "-1")],
    *[([flag, value], f"{flag} must be a finite number (got {value})")
      for flag in ("--capacity-factor", "--balance-loss", "--lr", "--timeout")
      for value in ("nan", "inf")],
    *[([flag, "-1"], "--capacity-factor and --balance-loss must be 0 (off) or more")
      for flag in ("--capacity-factor", "--balance-loss")],
    *[([flag, value], f"{flag} must be positive (got {value})")
      for flag in ("--lr", "--timeout") for value in ("0", "-1")],
    (["--ep", "3"], "--experts 4 does not share out over --ep 3"),
    (["--experts", "3"], "--experts 3 does not share out over --ep 2"),
    (["--top-k", "5"], "--top-k 5 must be from 1 to --experts 4"),
    (["--ep", "4", "--batch-size", "6"], "--batch-size 6, the global batch, does not split over "
                                         "--dp x --ep = 4 ranks"),
    (["--dp", "3", "--batch-size", "16"], "does not split over --dp x --ep = 6 ranks"),
    (["--dim", "30"], "--heads 4 does not divide --dim 30"),
    (["--heads", "5"], "--heads 5 does not divide --dim 32"),
    (["--batch-size", "1000"], "--batch-size 1000 leaves no step"),
    (["--seq-len", "2000"], "--seq-len 2000 cuts the texts into 12 training and 1 validation "
                            "sequences: too few for 2 ranks"),
    (["--seq-len", "3000"], "--seq-len 3000 is longer than a text load_data cuts"),
]


@pytest.fixture
def no_gpus(monkeypatch):
    """The launcher's view on a machine without GPUs, not under torchrun."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def launch_checks(lesson, argv):
    """What launch checks before any rank starts: parse_args (check_args), then the layout."""
    args = lesson.parse_args(argv)
    lesson.guard_rails.check_expert_parallel(args, lesson.load_data)
    return args


@pytest.mark.parametrize(("flags", "says"), REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_every_flag_refuses_what_cannot_work_in_one_line(lesson, no_gpus, flags, says):
    with pytest.raises(SystemExit) as stop:
        launch_checks(lesson, flags)
    assert str(stop.value.code).startswith("error: ") and says in stop.value.code
    assert "\n" not in stop.value.code


@pytest.mark.parametrize("flag", COUNTS)
def test_a_count_that_is_no_whole_number_is_refused_by_argparse(lesson, no_gpus, flag, capsys):
    for value in ("nan", "inf", "1.5"):
        with pytest.raises(SystemExit) as stop:
            launch_checks(lesson, [flag, value])
        assert stop.value.code == 2
        assert f"error: argument {flag}: invalid int value: '{value}'" in capsys.readouterr().err


def test_without_dp_the_most_ep_groups_of_gpus_that_the_batch_splits_over(lesson, monkeypatch,
                                                                         capsys):
    # The defaults (--ep 2, --batch-size 16) on 1 to 16 GPUs: --dp d, d x 2 GPUs with one rank
    # each, the largest d <= GPUs // 2 with 16 % (2 d) == 0; at least 1 (one GPU: 2 ranks, more
    # than the GPUs, go to the CPU, as choose_backend says). A note when GPUs stay idle.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    chosen = {}
    for gpus in range(1, 17):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        args = launch_checks(lesson, [])
        chosen[gpus] = args.dp
        said = capsys.readouterr().out
        assert 16 % (args.dp * 2) == 0 and args.dp * 2 <= max(gpus, 2)
        assert not any(16 % (d * 2) == 0 for d in range(args.dp + 1, gpus // 2 + 1))
        idle = gpus - 2 * args.dp if gpus >= 2 else 0
        assert (f"{idle} stay idle" in said) == (idle > 0) and said.count("\n") == int(idle > 0)
    assert chosen == {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2, 7: 2, **dict.fromkeys(range(8, 16), 4),
                      16: 8}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    assert launch_checks(lesson, ["--backend", "gloo"]).dp == 2  # the CPU: no GPU left idle
    assert capsys.readouterr().out == ""
    assert launch_checks(lesson, ["--dp", "1"]).dp == 1  # given: kept
    assert capsys.readouterr().out == ""


def test_under_torchrun_dp_is_its_ranks_over_ep_or_one_line(lesson, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    args = lesson.parse_args(["--ep", "2"])
    args.world_size = 8  # torchrun's WORLD_SIZE
    lesson.guard_rails.check_expert_parallel(args, lesson.load_data)
    assert args.dp == 4
    for flags, world, says in (
            (["--ep", "4"], 6, "torchrun started 6 ranks, which do not make EP groups of --ep "
                               "4; start a multiple of 4"),
            (["--dp", "2", "--ep", "2"], 8, "--dp 2 x --ep 2 = 4 ranks, but torchrun started 8"),
            (["--ep", "2"], 6, "--batch-size 16, the global batch, does not split over --dp x "
                               "--ep = 6 ranks")):
        args = lesson.parse_args(flags)
        args.world_size = world
        with pytest.raises(SystemExit) as stop:
            lesson.guard_rails.check_expert_parallel(args, lesson.load_data)
        assert stop.value.code.startswith("error: ") and says in stop.value.code


def test_a_checkpoint_of_other_experts_stops_in_one_line(runs, tmp_path):
    shutil.copytree(runs("ep2") / "checkpoint", tmp_path / "checkpoint")
    result = run_lesson(LESSON, *CPU, "--ep", "2", "--experts", "8", "--out-dir", tmp_path)
    assert_one_line_error(result, "holds a model with --experts 4, not 8")

# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# float64 on a GPU adds in cuBLAS's order, not the CPU's: about 1e-15 a step, which Adam grows
# as it grows the CPU layouts' differences (see the module's docstring); a wrong row moves 1e-3.
GPU_TOLERANCE = 1e-8


@needs_gpu
@pytest.mark.gpu
def test_gpu_one_rank_takes_the_cpus_steps(runs, tmp_path):
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["ep1"], "--dp", 1,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, runs("ep1")) < GPU_TOLERANCE
    assert metrics["expert_load"] == read_metrics(runs("ep1"))["expert_load"]
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_gpu
@pytest.mark.gpu
def test_gpu_with_no_flags_one_nccl_rank_per_gpu_or_two_gloo_ranks_beside_one(tmp_path):
    # The defaults, --ep 2 and --batch-size 16, as a learner runs them. One GPU: 2 ranks, more
    # than the GPUs, train on the CPU with gloo, and choose_backend says so. More: --dp is the
    # most EP groups of 2 GPUs that 16 sequences split over, one NCCL rank per GPU, and a note
    # names the GPUs left idle (6, 7, 10 to 15 GPUs).
    result = check_ok(run_lesson(LESSON, "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    if GPUS == 1:
        expected = ("gloo", "cpu", 1, 2)
        assert "note: 2 ranks but 1 GPU(s)" in result.stdout
    else:
        dp = max(d for d in range(1, GPUS // 2 + 1) if 16 % (2 * d) == 0)
        expected = ("nccl", "cuda", dp, 2 * dp)
        assert ("stay idle" in result.stdout) == (2 * dp < GPUS)
    assert (metrics["backend"], metrics["device"], metrics["dp"], metrics["world_size"]) == \
        expected
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_two
@pytest.mark.gpu
def test_gpu_the_all_to_alls_on_nccl_take_one_processs_steps(runs, tmp_path):
    # all_to_all_single between two GPUs: the counts, then the rows, from GPU to GPU.
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["ep2"], "--dp", 1,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 2)
    assert max_weight_difference(tmp_path, runs("ep1")) < GPU_TOLERANCE


@needs_gpu
@pytest.mark.gpu
def test_gpu_torchrun_starts_one_nccl_rank_per_gpu(tmp_path):
    nproc = min(GPUS, 2)  # one EP group of them all
    result = run_torchrun(LESSON, "--ep", nproc, "--epochs", 2, "--out-dir", tmp_path,
                          nproc=nproc)
    check_ok(result)
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "torchrun")
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)
    assert json.loads((tmp_path / "metrics.json").read_text())["ep"] == nproc
