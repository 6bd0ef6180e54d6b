"""benchmarks/expert_parallel.py, run as its README shows: --quick, one start of 4 gloo ranks.

What lesson 12's MoE layer sends per rank and step, counted at all_to_all_single, equals its
formula from the router's counts (the benchmark prints the verdict and fails without it); here
the rows are checked again against facts the benchmark's formula does not compute: nothing
leaves a group of one rank, the group's bytes are 4 x the rows that cross ranks x dim x 4
bytes, a rank keeps batch x T x top-k rows without a capacity limit (top-2 twice top-1) and
fewer with one, and rank 0 routes its tokens alike at every N. No figure is timed here."""

import json
import statistics
import subprocess
import sys

from helpers import ROOT


def test_what_expert_parallelism_sends_is_measured_beside_its_formula(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "expert_parallel.py"),
                           "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured bytes equal the formulas: True" in done.stdout, done.stdout
    rows = {(r["top_k"], r["capacity_factor"], r["seq_len"], r["ep"]): r
            for r in json.loads((tmp_path / "expert_parallel.json").read_text())["rows"]}
    assert len(rows) == 3 * 2 * 3  # routings x --quick's T = 16, 64 x N = 1, 2, 4
    for (top_k, capacity, length, ep), row in rows.items():
        ranks, dim, experts = row["ranks"], row["dim"], row["experts"]
        assert [r["rank"] for r in ranks] == list(range(ep))  # every rank of the group counted
        assert all((r["exchanges"], r["count_exchanges"]) == (4, 1) for r in ranks)
        # Every row that leaves its rank is sent 4 times a step, by one rank or the other.
        crossing = sum(map(sum, row["rows_to_ranks"])) - sum(
            row["rows_to_ranks"][i][i] for i in range(ep))
        assert sum(r["sent_bytes"] for r in ranks) == 4 * crossing * dim * 4  # float32
        assert all(r["count_bytes"] == experts // ep * (ep - 1) * 8 for r in ranks)  # int64
        if ep == 1:
            assert (ranks[0]["sent_bytes"], ranks[0]["count_bytes"]) == (0, 0)
        else:
            assert crossing > 0
        choices = row["batch"] * length * top_k
        if capacity:
            assert all(0 < r["kept_rows"] <= choices for r in ranks)
        else:
            assert all(r["kept_rows"] == choices for r in ranks)
        # Rank 0 has the same tokens and layer at every N: its tokens choose the same experts.
        assert sum(row["rows_to_ranks"][0]) == sum(rows[top_k, capacity, length, 1][
            "rows_to_ranks"][0])
        tokens = [ep * row["batch"] * length / s for s in row["seconds"]]
        assert len(tokens) == 2 and row["tokens_per_s"] == statistics.median(tokens) > 0
        assert 0 < row["exchange_share"] < 1  # each round's time in all-to-all, of its step
    for length in (16, 64):
        assert rows[2, 0, length, 4]["ranks"][0]["kept_rows"] == 2 * rows[1, 0, length, 4][
            "ranks"][0]["kept_rows"]
        assert any(r["kept_rows"] < row["batch"] * length  # the capacity limit drops some
                   for row in (rows[1, 1.0, length, ep] for ep in (1, 2, 4))
                   for r in row["ranks"])
