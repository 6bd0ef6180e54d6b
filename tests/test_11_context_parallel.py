"""Lesson 11, run as a learner runs it: python 11_context_parallel/train.py (mp.spawn, gloo/CPU)
and its proof, python 11_context_parallel/prove_ring.py.

Ring attention and the all-gather way give full attention's output and gradients at 4 ranks,
balanced and not, and the balanced layout gives every rank the same work; the ring attends to a
block while the next travels and holds two of the others' blocks in forward (prove_ring.py
counts both as they run); merge, the layout and the blocks each rank computes, each against its
definition on plain tensors; training with --cp 2, --cp 4 and --dp 2 --cp 2 ends on the weights
of --cp 1, one process; torchrun restarts a crashed run, which resumes bitwise, and a checkpoint
loads into another layout; every flag refuses what cannot work in one line, a batch that leaves
no step included, and without --dp the layout fits the GPUs and the batch (checked in-process
for 1 to 16 GPUs, no rank started); what attention keeps for backward and sends, per rank,
measured by benchmarks/context_parallel.py, equals the README's formulas.

Tolerance. In float64 (--float64), the layouts differ only in the order of their sums: each CP
rank adds its tokens' loss and gradient shares, the ring adds each query's blocks in its own
order, and all-reduce adds the ranks' gradients. Measured after 2 epochs (50 Adam steps), on
this course's 2-core machine: 1.1e-14 between --cp 2 and --cp 1, 1.6e-14 for --cp 4 (with 8
threads per rank, or ATEN_CPU_CAPABILITY=default, within 2e-14): TOLERANCE = 1e-12. (With a
bias on the keys, whose gradient is only rounding, one CI machine measured 1.8e-7: the model has
none.) In float32 the same runs end about 5e-7 apart, as Adam divides each
step by its gradient's running size and so turns rounding into steps of about lr, which is why
the proof runs in float64."""

import json
import math
import shutil
import subprocess
import sys

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
)

LESSON = "11_context_parallel"
TOLERANCE = 1e-12
CPU = ["--backend", "gloo", "--dp", "1"]  # the CPU tier stays on gloo even where GPUs exist
SMALL = ["--float64", "--epochs", "2", "--save-every", "1"]
LAYOUTS = {"cp1": ["--cp", "1"], "cp2": ["--cp", "2"], "cp4": ["--cp", "4"],
           "dp2cp2": ["--dp", "2", "--cp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's run of 2 epochs in float64, made once: {name: out_dir}."""
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            check_ok(run_lesson(LESSON, *CPU, *LAYOUTS[name], *SMALL, "--out-dir", out))
            made[name] = out
        return made[name]

    return run


@pytest.fixture(scope="module")
def lesson():
    """train.py, imported (nothing runs); lesson.guard_rails is the guard_rails.py it imported."""
    return import_lesson(LESSON)


@pytest.fixture(scope="module")
def ring(lesson):
    """ring_attention.py, the module train.py imported from its folder."""
    module = sys.modules["ring_attention"]
    assert module.__file__ == str(ROOT / LESSON / "ring_attention.py")
    return module


def test_ring_and_all_gather_attention_equal_full_attention():
    done = subprocess.run([sys.executable, str(ROOT / LESSON / "prove_ring.py"), "--cp", "4"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal within 1e-12: True" in done.stdout, done.stdout
    assert done.stdout.count("largest difference") == 4  # ring and all-gather, both layouts
    # Balanced, every rank attends to as many blocks; unbalanced, the last rank to 5 times
    # as many as the first (chunks 6 and 7 see 7 and 8 of the 8; chunks 0 and 1, 1 and 2).
    assert "blocks per rank, balanced  : 9, 9, 9, 9" in done.stdout, done.stdout
    assert "blocks per rank, unbalanced: 3, 7, 11, 15" in done.stdout, done.stdout
    # Counted as they run (prove_ring.py's Watch). The ring overlaps: in forward, rank 0 (chunks
    # 0 and 7) computes all but the last step's 2 blocks while a pass travels, in backward all.
    assert ("blocks the ring computes while a pass travels: 7 of 9 in forward, 9 of 9 in "
            "backward") in done.stdout, done.stdout
    # What a rank holds of the others' (a block: 2 x 2 x 2 heads x 4 tokens x 8 x 8 bytes): the
    # ring, in forward, the block it attends to and the next; in backward those and two blocks
    # of gradients. The all-gather, the 3 others' blocks, from forward to the end of backward.
    assert ("blocks of 2,048 bytes a rank holds at once of what the others sent it: ring 2 in "
            "forward, 4 in backward; all-gather 3 in forward, 3 in backward") in done.stdout


def test_merge_is_the_softmax_over_both_blocks_keys(ring):
    # merge against its definition, on plain tensors, no ranks: two blocks' attention merged is
    # the softmax over all their scores at once, times all their values, and its lse their
    # log-sum-exp. A block of 1 key with one of 8 whose scores are masked in part (as inside a
    # chunk), in either order; a missing block (None) changes nothing.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, 4, generator=generator, dtype=torch.float64)
    blocks = []
    for keys in (1, 8):
        k, v = (torch.randn(2, 2, keys, 4, generator=generator, dtype=torch.float64)
                for _ in range(2))
        scores = q @ k.transpose(-2, -1) / 2
        if keys == 8:
            scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -math.inf)
        blocks.append((scores, v))
    partial = [(s.softmax(dim=-1) @ v, s.logsumexp(dim=-1, keepdim=True)) for s, v in blocks]
    scores, values = torch.cat([s for s, _ in blocks], dim=-1), torch.cat([v for _, v in blocks],
                                                                           dim=-2)
    whole = (scores.softmax(dim=-1) @ values, scores.logsumexp(dim=-1, keepdim=True))
    for first, second in (partial, partial[::-1]):
        for got, expected in zip(ring.merge(*first, second), whole, strict=True):
            assert (got - expected).abs().max() < TOLERANCE
    for merged in (ring.merge(None, None, partial[0]), ring.merge(*partial[0], None)):
        assert all(got is given for got, given in zip(merged, partial[0], strict=True))


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r(ring):
    # The layout against its definition: 2N chunks of 3 tokens; local_part gives rank r the
    # tokens of chunks r and 2N - 1 - r (unbalanced, 2r and 2r + 1), side by side, along the
    # sequence of [batch, tokens] (train.py's inputs) or of a sequence alone (its positions);
    # every chunk is held by one rank.
    for cp in range(1, 9):
        tokens = torch.arange(2 * cp * 3)
        held = []
        for rank in range(cp):
            for balanced, chunks in ((True, [rank, 2 * cp - 1 - rank]),
                                     (False, [2 * rank, 2 * rank + 1])):
                assert ring.sequence_chunks(rank, cp, balanced) == chunks
                mine = torch.cat([tokens[3 * c:3 * c + 3] for c in chunks])
                assert torch.equal(ring.local_part(tokens, rank, cp, balanced, dim=0), mine)
                assert torch.equal(ring.local_part(tokens.expand(2, -1), rank, cp, balanced),
                                   mine.expand(2, -1))
            held += ring.sequence_chunks(rank, cp)
        assert sorted(held) == list(range(2 * cp))


def test_the_balanced_layout_gives_every_rank_the_same_blocks(ring):
    # The blocks a rank computes: its two chunks of queries against all 2N chunks of keys, less
    # those that attend_block skips. By the causal mask a block is work when its keys' chunk is
    # not after its queries' (k <= q). Balanced, that is 2N + 1 for every rank; in order, rank
    # r gets 4r + 3 (the README: at 4 ranks 9 each, against 3 to 15).
    x = torch.zeros(1, 1, 1, 4)  # a token a chunk
    for cp in range(1, 9):
        for balanced in (True, False):
            mine = [ring.sequence_chunks(rank, cp, balanced) for rank in range(cp)]
            work = [sum(ring.attend_block(x, x, x, q, k) is not None
                        for q in chunks for k in range(2 * cp)) for chunks in mine]
            assert work == [sum(k <= q for q in chunks for k in range(2 * cp)) for chunks in mine]
            assert work == ([2 * cp + 1] * cp if balanced else [4 * r + 3 for r in range(cp)])


@pytest.mark.parametrize("layout", ["cp2", "cp4", "dp2cp2"])
def test_every_layout_takes_the_steps_of_one_process(runs, layout):
    assert max_weight_difference(runs(layout), runs("cp1")) < TOLERANCE
    ours, one = read_metrics(runs(layout)), read_metrics(runs("cp1"))
    for a, b in zip(ours["train_loss"], one["train_loss"], strict=True):
        assert abs(a - b) < TOLERANCE
    assert abs(ours["val_loss"] - one["val_loss"]) < TOLERANCE
    assert ours["train_loss"][-1] < ours["train_loss"][0]


def test_torchrun_restarts_a_crashed_run_which_resumes_bitwise(runs, tmp_path):
    # torchrun, --cp 2: rank 1 raises in epoch 2, torchrun starts both again (--max-restarts 1),
    # they resume from epoch 1's checkpoint and end bitwise on a run of 3 epochs that never
    # stopped. Then the 2-epoch --cp 4 run's checkpoint, resumed by --cp 2: within TOLERANCE.
    three = ["--cp", "2", "--float64", "--epochs", "3", "--backend", "gloo"]
    straight = tmp_path / "straight"
    check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", straight))
    restarted = tmp_path / "restarted"
    result = run_torchrun(LESSON, *three, "--save-every", 1, "--out-dir", restarted,
                          torchrun_args=["--max-restarts", 1], patch="raise-on-rank-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "injected failure on rank 1" in result.stderr
    assert ("1 of 3 epochs done, written by --dp 1 --cp 2 on 2 ranks, "
            "loaded by --dp 1 --cp 2 on 2") in result.stdout
    assert read_metrics(restarted)["launcher"] == "torchrun"
    assert max_weight_difference(straight, restarted) == 0
    other = tmp_path / "from_cp4"
    shutil.copytree(runs("cp4") / "checkpoint", other / "checkpoint")
    result = check_ok(run_lesson(LESSON, *CPU, *three, "--out-dir", other))
    assert ("2 of 3 epochs done, written by --dp 1 --cp 4 on 4 ranks, "
            "loaded by --dp 1 --cp 2 on 2") in result.stdout
    assert read_metrics(other)["resumed_after_epoch"] == 2
    assert max_weight_difference(straight, other) < TOLERANCE


def test_torchs_context_parallel_stops_on_a_cpu_mesh():
    # What the README says of torch 2.14's own CP (tools/repro_context_parallel_cpu.py).
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "repro_context_parallel_cpu.py")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "_scaled_dot_product_flash_attention_for_cpu" in done.stdout
    assert "does not have a sharding strategy registered" in done.stdout


@pytest.mark.parametrize(("flags", "says"), [
    (["--cp", "3"], "--seq-len 64 does not split into 2 x --cp = 6 equal chunks"),
    (["--batch-size", "500"], "--batch-size 500 leaves no step: with --dp 1, each group reads "
                              "403 of the 403 training sequences, in batches of 500"),
    (["--timeout", "0"], "--timeout must be positive (got 0)"),
], ids=["cp3", "batch500", "timeout0"])
def test_a_flag_that_cannot_work_stops_in_one_line(flags, says, tmp_path):
    # As the learner sees it; every flag's refusals are checked in-process, below. Without the
    # check, --batch-size 500 would train no step (every batch short, dropped), print "train
    # loss nan" and write an untrained final.pt.
    result = run_lesson(LESSON, *flags, "--out-dir", tmp_path)
    assert_one_line_error(result, says)
    assert "starting" not in result.stdout


COUNTS = ["--epochs", "--batch-size", "--save-every", "--cp", "--dp", "--seq-len", "--dim",
          "--heads", "--layers"]
REFUSED = [
    *[([flag, value], f"{flag} must be at least 1 (got {value})")
      for flag in COUNTS for value in ("0", "-1")],
    *[([flag, value], f"{flag} must be a finite number (got {value})")
      for flag in ("--lr", "--timeout") for value in ("nan", "inf")],
    *[([flag, value], f"{flag} must be positive (got {value})")
      for flag in ("--lr", "--timeout") for value in ("0", "-1")],
    (["--cp", "3"], "--seq-len 64 does not split into 2 x --cp = 6 equal chunks"),
    (["--cp", "1", "--seq-len", "63"], "--seq-len 63 does not split into 2 x --cp = 2 equal"),
    (["--cp", "64"], "--seq-len 64 does not split into 2 x --cp = 128 equal chunks"),
    (["--dp", "3"], "--batch-size 16, the global batch, does not split over --dp 3"),
    (["--heads", "5"], "--heads 5 does not divide --dim 32"),
    (["--dim", "30"], "--heads 4 does not divide --dim 30"),
    (["--batch-size", "500"], "--batch-size 500 leaves no step"),
    (["--dp", "2", "--batch-size", "500"], "with --dp 2, each group reads 201 of the 403 "
                                           "training sequences, in batches of 250; use a "
                                           "--batch-size of at most 402"),
    (["--seq-len", "2000"], "--batch-size 16 leaves no step"),  # 12 sequences of 2,000
    (["--cp", "1", "--dp", "41", "--batch-size", "41"], "--seq-len 64 cuts the validation text "
                                                        "into 40, fewer than the --dp 41 groups"),
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
    lesson.guard_rails.check_context_parallel(args, lesson.load_data)
    return args


@pytest.mark.parametrize(("flags", "says"), REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_every_flag_refuses_what_cannot_work_in_one_line(lesson, no_gpus, flags, says):
    with pytest.raises(SystemExit) as stop:
        launch_checks(lesson, flags)
    assert str(stop.value.code).startswith("error: ") and says in stop.value.code
    assert "\n" not in stop.value.code


def test_a_count_that_is_no_whole_number_is_refused_by_argparse(lesson, no_gpus, capsys):
    for flag in COUNTS:
        for value in ("nan", "inf", "1.5"):
            with pytest.raises(SystemExit) as stop:
                launch_checks(lesson, [flag, value])
            assert stop.value.code == 2
            said = capsys.readouterr().err
            assert f"error: argument {flag}: invalid int value: '{value}'" in said


def test_every_layout_it_accepts_has_a_step_for_every_rank(lesson, no_gpus):
    # The other side of the refusals: at the largest batch the check lets through, each of the
    # --dp groups' loaders (the lesson's own, drop_last) yields exactly one batch.
    train_set, _ = lesson.load_data(64)
    for dp in (1, 2, 3, 5):
        batch = len(train_set) // dp * dp
        args = launch_checks(lesson, ["--dp", str(dp), "--batch-size", str(batch)])
        with pytest.raises(SystemExit):
            launch_checks(lesson, ["--dp", str(dp), "--batch-size", str(batch + dp)])
        for rank in range(dp):
            loader = lesson.prepare_dataloader(train_set, args.batch_size // dp, 0, rank, dp)
            assert len(list(loader)) == 1


def test_without_dp_the_most_cp_groups_of_gpus_that_the_batch_splits_over(lesson, monkeypatch,
                                                                         capsys):
    # The defaults (--cp 2, --batch-size 16) on 1 to 16 GPUs, no rank started: --dp d, d x 2
    # GPUs with one rank each, the largest d <= GPUs // 2 that divides 16; at least 1 (one GPU:
    # the 2 ranks, more than the GPUs, train on the CPU, as choose_backend says). A note when
    # GPUs stay idle, naming how many.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for gpus in range(1, 17):
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        args = launch_checks(lesson, [])
        said = capsys.readouterr().out
        assert 16 % args.dp == 0 and args.dp * 2 <= max(gpus, 2)
        assert not any(16 % d == 0 for d in range(args.dp + 1, gpus // 2 + 1))
        idle = gpus - 2 * args.dp if gpus >= 2 else 0
        assert (f"{idle} stay idle" in said) == (idle > 0) and said.count("\n") == int(idle > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)  # the README's example
    assert launch_checks(lesson, []).dp == 2
    assert capsys.readouterr().out.startswith("note: 4 of the 6 GPUs train, one rank each: "
                                              "--dp 2 x --cp 2")
    assert launch_checks(lesson, ["--backend", "gloo"]).dp == 2  # the CPU: no GPU left idle
    assert launch_checks(lesson, ["--dp", "1"]).dp == 1  # given: kept
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # and then the backend:
    assert lesson.choose_backend("auto", 2, "--dp x --cp") == "gloo"
    assert capsys.readouterr().out.startswith("note: 2 ranks but 1 GPU(s); NCCL needs one GPU "
                                              "per rank, so the ranks train on the CPU")


def test_under_torchrun_dp_is_its_ranks_over_cp_or_one_line(lesson, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    args = lesson.parse_args(["--cp", "2"])
    args.world_size = 8  # torchrun's WORLD_SIZE
    lesson.guard_rails.check_context_parallel(args, lesson.load_data)
    assert args.dp == 4
    for flags, world, says in (
            (["--cp", "2"], 7, "torchrun started 7 ranks, which do not make CP groups of --cp 2; "
                               "start a multiple of 2"),
            (["--dp", "2", "--cp", "2"], 8, "--dp 2 x --cp 2 = 4 ranks, but torchrun started 8"),
            (["--cp", "2"], 6, "--batch-size 16, the global batch, does not split over --dp 3")):
        args = lesson.parse_args(flags)
        args.world_size = world
        with pytest.raises(SystemExit) as stop:
            lesson.guard_rails.check_context_parallel(args, lesson.load_data)
        assert stop.value.code.startswith("error: ") and says in stop.value.code



def test_what_it_costs_is_measured_beside_its_formula(tmp_path):
    # benchmarks/context_parallel.py --quick: T = 64 and 128, attention plain and by the ring at
    # N = 1, 2, 4. The bytes attention keeps for backward (counted by saved_tensors_hooks) and
    # sends (counted at batch_isend_irecv) equal the README's formulas: plain attention keeps the
    # T x T scores; the ring keeps 1/N of what it keeps at N = 1, and sends (3N - 2) blocks.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"),
                           "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured bytes equal the formulas: True" in done.stdout, done.stdout
    rows = {(r["seq_len"], r["attention"], r["cp"]): r
            for r in json.loads((tmp_path / "context_parallel.json").read_text())["rows"]}
    assert len(rows) == 8
    for length in (64, 128):
        ring = {n: rows[length, "ring", n] for n in (1, 2, 4)}
        for n in (2, 4):
            assert ring[n]["saved_bytes"] * n == ring[1]["saved_bytes"]
            blocks = 2 * 4 * (length // n) * 8 * 4  # keys and values: heads x tokens x dim x 4 B
            assert ring[n]["sent_bytes"] == (3 * n - 2) * blocks
        assert rows[length, "plain", 1]["saved_bytes"] > 2 * 4 * length ** 2 * 4  # the scores
        assert all(len(r["seconds"]) == 2 and r["tokens_per_s"] > 0 for r in rows.values())

# ---------------------------------------------------------------------------------------------
# GPU tier: the same on NCCL
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2+ GPUs; this machine has {GPUS}")
# float64 on a GPU adds in cuBLAS's order, not the CPU's: about 1e-15 a step, which Adam carries
# through 2 epochs; far below what one wrong block moves (1e-2 and more).
GPU_TOLERANCE = 1e-8


@needs_gpu
@pytest.mark.gpu
def test_gpu_one_rank_takes_the_cpus_steps(runs, tmp_path):
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["cp1"], "--dp", 1, *SMALL,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"]) == ("nccl", "cuda")
    assert max_weight_difference(tmp_path, runs("cp1")) < GPU_TOLERANCE
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_two
@pytest.mark.gpu
def test_gpu_the_ring_on_nccl_takes_one_processs_steps(runs, tmp_path):
    # batch_isend_irecv between two GPUs: each rank's keys and values go from GPU to GPU.
    check_ok(run_lesson(LESSON, "--backend", "nccl", *LAYOUTS["cp2"], "--dp", 1, *SMALL,
                        "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["world_size"]) == ("nccl", "cuda", 2)
    assert max_weight_difference(tmp_path, runs("cp1")) < GPU_TOLERANCE


@needs_gpu
@pytest.mark.gpu
def test_gpu_with_no_flags_it_trains_on_what_there_is(tmp_path):
    # python 11_context_parallel/train.py as the root README's GPU tier runs it (only its
    # --out-dir given). On 1 GPU, --cp 2 needs 2: --dp 1, gloo on the CPU, and a note says why.
    # On more, --dp d x --cp 2, one NCCL rank a GPU, d the largest <= GPUs // 2 that divides
    # --batch-size 16; a note says how many GPUs stay idle, if any.
    result = check_ok(run_lesson(LESSON, "--out-dir", tmp_path))
    metrics = read_metrics(tmp_path)
    if GPUS < 2:
        assert "note: 2 ranks but 1 GPU(s); NCCL needs one GPU per rank" in result.stdout
        assert (metrics["backend"], metrics["device"], metrics["dp"]) == ("gloo", "cpu", 1)
    else:
        dp = max(d for d in range(1, GPUS // 2 + 1) if 16 % d == 0)
        assert (metrics["backend"], metrics["device"], metrics["dp"], metrics["world_size"]) == (
            "nccl", "cuda", dp, 2 * dp)
        assert (f"{GPUS - 2 * dp} stay idle" in result.stdout) == (2 * dp < GPUS)
    assert metrics["cp"] == 2 and len(metrics["train_loss"]) == 30
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)


@needs_gpu
@pytest.mark.gpu
def test_gpu_torchrun_starts_one_nccl_rank_per_gpu(tmp_path):
    nproc = min(GPUS, 2)  # one CP group of them all
    result = run_torchrun(LESSON, "--cp", nproc, "--epochs", 2, "--out-dir", tmp_path,
                          nproc=nproc)
    check_ok(result)
    metrics = read_metrics(tmp_path)
    assert (metrics["backend"], metrics["device"], metrics["launcher"]) == (
        "nccl", "cuda", "torchrun")
    assert metrics["train_loss"][-1] < metrics["train_loss"][0]
    assert_final_pt_holds_cpu_tensors(tmp_path)
