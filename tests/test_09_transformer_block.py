"""Lesson 09's proof, run as a learner runs it: python 09_tensor_parallel/transformer_block.py
(mp.spawn, 2 gloo ranks on the CPU).

The block split by heads and hidden units, with sequence parallelism, gives the whole block's
output and gradients and makes the collectives its layout says; the head count hard-coded in
.view breaks it; a --tp that splits no head evenly stops in one line; and one Adam step moves
the k bias, whose gradient is rounding noise, by about lr."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

SCRIPT = "09_tensor_parallel/transformer_block.py"
# float32 sums added in another order (each rank adds its share, then the collective adds the
# shares) round ~1e-7 of their size apart; the block's outputs and gradients are of size ~1.
TOLERANCE = 1e-5
RUNS = {"default": [], "global-heads": ["--control", "global-heads"]}


@pytest.fixture(scope="module")
def runs():
    """The runs the tests below read, started together and each made once: most of a run is
    processes starting (torch imported three times), which the two cores overlap."""
    started = {name: subprocess.Popen([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
               for name, args in RUNS.items()}
    finished = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        finished[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                                     stderr)
    return finished


def number(pattern, text):
    found = re.search(pattern, text)
    assert found, f"no line matching {pattern!r} in:\n{text}"
    return float(found.group(1))


def collectives(stdout, direction):
    """{'all-gather': n, 'reduce-scatter': n, 'all-reduce': n} from the line it printed."""
    line = re.search(f"collectives in {direction}: (.*)", stdout).group(1)
    return {kind: int(n) for kind, n in (part.rsplit(" ", 1) for part in line.split(", "))}


def test_the_split_block_matches_the_whole_one(runs):
    result = runs["default"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert number(r"forward: largest difference (\S+)", result.stdout) < TOLERANCE
    assert number(r"gradients: largest difference (\S+)", result.stdout) < TOLERANCE
    assert "equal within 1e-05: True" in result.stdout


def test_sequence_parallel_makes_the_collectives_its_layout_says(runs):
    # Forward: all-gather the sequence's slices before attention and before the MLP, and
    # reduce-scatter the partial sums of o and w2. Backward: each one's reverse. No all-reduce.
    stdout = runs["default"].stdout
    expected = {"all-gather": 2, "reduce-scatter": 2, "all-reduce": 0}
    assert collectives(stdout, "forward") == expected, stdout
    assert collectives(stdout, "backward") == expected, stdout


def test_the_head_count_hard_coded_in_view_fails(runs):
    # Each rank's q holds 2 of the 4 heads: .view(..., 4, head_dim) does not fit it.
    result = runs["global-heads"]
    assert result.returncode != 0, result.stdout
    assert "equal within 1e-05: True" not in result.stdout
    assert "forward of the split block failed" in result.stdout, result.stdout + result.stderr


def test_a_tp_that_does_not_divide_the_heads_stops_in_one_line(monkeypatch):
    # The check the script makes in parse_args, before any rank starts (sys.exit with the line;
    # the README runs `transformer_block.py --tp 3` as a learner does, in the listings check).
    monkeypatch.syspath_prepend(str(ROOT / "09_tensor_parallel"))  # its tensor_parallel.py
    spec = importlib.util.spec_from_file_location("transformer_block", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--tp", "3", "--heads", "4"])
    with pytest.raises(SystemExit) as stop:
        script.parse_args()
    assert stop.value.code.startswith("error: --tp 3 does not divide --heads 4"), stop.value.code


def test_adam_moves_the_k_bias_by_about_lr_and_nothing_else(runs):
    stdout = runs["default"].stdout
    # The k bias's true gradient is 0: both layouts compute rounding noise, far below 1e-6.
    assert number(r"k\.bias gradient, largest magnitude: reference (\S+),", stdout) < 1e-6
    assert number(r"k\.bias gradient, largest magnitude: .*split (\S+)", stdout) < 1e-6
    k_bias = number(r"k\.bias differs by (\S+),", stdout)
    others = number(r"every other parameter by at most (\S+)", stdout)
    # Adam's first step moves each weight by at most lr (1e-3): the noise, of either sign, up
    # to lr each way. Everything else agrees to float32's rounding.
    assert 1e-4 < k_bias <= 2e-3 + 1e-6, stdout
    assert others < 1e-6, stdout
    assert k_bias > 100 * others, stdout


def test_its_count_of_collectives_is_the_lessons(monkeypatch):
    # The script keeps its own copy of tensor_parallel.count_collectives (it runs alone, and is
    # exercise 09's starting point): both name each kind alike, and the script prints 0s too.
    monkeypatch.syspath_prepend(str(ROOT / "09_tensor_parallel"))
    spec = importlib.util.spec_from_file_location("transformer_block", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from tensor_parallel import count_collectives

    class Seen:  # what CommDebugMode.get_comm_counts() returns: ops, by how often each ran
        def __init__(self, counts):
            self.counts = counts

        def get_comm_counts(self):
            return self.counts

    for seen in ({"c10d_functional.all_gather_into_tensor.default": 2,
                  "c10d_functional.reduce_scatter_tensor.default": 2},
                 {"c10d.allreduce_.default": 3, "c10d._allgather_base_.default": 1}):
        counts = count_collectives(Seen(seen))
        assert sum(counts.values()) == sum(seen.values())
        assert collectives(f"collectives in forward: {script.count(Seen(seen))}", "forward") == {
            kind: counts.get(kind, 0) for kind in ("all-gather", "reduce-scatter", "all-reduce")}
