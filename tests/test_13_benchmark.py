"""benchmarks/capstone.py, run as its README shows: --quick, one start of 8 gloo ranks.

What each layout of lesson 13 holds, saves for backward and sends per step equals its formula
on every rank (the benchmark prints the verdict and fails without it); here the rows are checked
again against facts the benchmark's formulas do not compute: the weights of 2 x 2 x 2 are one
process's over 8 (plus the norms TP keeps whole, and FSDP's padding), dp halves what the blocks
save and pp halves it too, TP does not (it keeps the inputs it gathers whole), a dimension of
size 1 sends nothing, TP's collectives grow with the micro-batches and with the blocks on a stage,
a pipeline's sends are one sequence-split activation per micro-batch, and FSDP gathers each block
m + 1 times a step as the lesson runs it, once with torchtitan's setting. No figure is timed."""

import json
import statistics
import subprocess
import sys

from helpers import ROOT

LAYERS, DIM, SEQ_LEN, BATCH = 4, 32, 64, 16  # lesson 13's defaults
WHOLE = 213_556  # bytes of the tiny GPT's 53,389 float32 parameters (1 x 1 x 1 holds them all)


def test_what_each_layout_costs_is_measured_beside_its_formula(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capstone.py"),
                           "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured equal the formulas: True" in done.stdout, done.stdout
    report = json.loads((tmp_path / "capstone.json").read_text())
    rows = {(r["dp"], r["pp"], r["tp"], r["microbatches"]): r for r in report["rows"]}
    assert set(rows) == {(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 2, 2),
                         (1, 1, 2, 4)}
    for (dp, pp, tp, m), row in rows.items():
        ranks = row["ranks"]
        assert sorted(r["rank"] for r in ranks) == list(range(dp * pp * tp))  # every rank
        for r in ranks:
            assert r["gradients"] == r["weights"] and r["optimizer"] == 2 * r["weights"]
            sent = r["collectives"]
            # a dimension of one rank sends nothing; every other one does
            for dim, size in (("dp", dp), ("pp", pp), ("tp", tp)):
                assert any(k.startswith(dim) for k in sent) == (size > 1), (dim, sent)
            if pp > 1:  # one activation per micro-batch, split by token over tp, each way
                assert sent["pp send"] == [m, m * (BATCH // dp // m) * SEQ_LEN * DIM * 4 // tp]
        tokens = [BATCH * SEQ_LEN / s for s in row["seconds"]]
        assert len(tokens) == 2 and row["tokens_per_s"] == statistics.median(tokens) > 0
    assert rows[1, 1, 1, 2]["ranks"][0]["weights"] == WHOLE

    # 2 x 2 x 2: each rank about 1/8 of the weights; together, all of them once, but the 832
    # numbers TP keeps whole on each tp rank (the norms, out's and fc2's biases) twice
    weights = [r["weights"] for r in rows[2, 2, 2, 2]["ranks"]]
    assert sum(weights) == WHOLE + 832 * 4
    assert all(0.9 * WHOLE / 8 < w < 1.1 * WHOLE / 8 for w in weights)
    # dp = 2: each rank reduce-scatters half of all the gradients, padded to even rows
    scattered = rows[2, 1, 1, 2]["ranks"][0]["collectives"]["dp reduce-scatter"][1]
    assert WHOLE / 2 <= scattered < 1.01 * WHOLE / 2

    # What the blocks save: dp and pp each halve it; tp = 2 does not (gathered inputs, kept whole)
    def saved(layout):
        return statistics.mean(r["activations_in_blocks"] for r in rows[layout]["ranks"])

    one = saved((1, 1, 1, 2))
    assert saved((2, 1, 1, 2)) == saved((1, 2, 1, 2)) == one / 2
    assert one / 2 < saved((1, 1, 2, 2)) < 0.6 * one
    assert saved((2, 2, 2, 2)) > one / 8

    # TP's all-gathers grow with the micro-batches and with the blocks on the rank's stage: 4
    # per block and micro-batch, and 2 more per micro-batch at each end of the model
    def tp_gathers(layout, rank):
        return rows[layout]["ranks"][rank]["collectives"]["tp all-gather"][0]

    assert tp_gathers((1, 1, 2, 4), 0) == 2 * tp_gathers((1, 1, 2, 2), 0) == 2 * 2 * (
        4 * LAYERS + 4)
    for r in rows[2, 2, 2, 2]["ranks"]:  # 2 blocks a stage, one end each
        assert r["collectives"]["tp all-gather"][0] == 2 * (4 * LAYERS // 2 + 2)
    # FSDP under the pipeline: as the lesson runs it, each block gathered for each micro-batch's
    # forward and once for backward (2 blocks a stage at 2 x 2 x 2, and the root once); with
    # torchtitan's setting (the blocks kept gathered from forward to backward), once a step,
    # whatever the micro-batches, on every rank
    for r in rows[2, 2, 2, 2]["ranks"]:
        assert r["collectives"]["dp all-gather"][0] == 2 * (2 + 1) + 1
    kept = {row["microbatches"]: row["dp_all_gathers"] for row in report["kept_gathered"]}
    assert kept == {2: [2 + 1] * 8, 4: [2 + 1] * 8}
    for rule in report["rule"]:  # the suggestions use every GPU, TP within a node of 8
        assert rule["dp"] * rule["pp"] * rule["tp"] == rule["gpus"] and rule["tp"] <= 8
