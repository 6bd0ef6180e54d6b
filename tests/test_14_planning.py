"""Lesson 14, run as a learner runs it: python 14_planning/plan.py and the three proofs.

The planner measures what lesson 13's real 8-rank run measures: its weights, gradients and Adam
state per rank equal the run's bytes_per_rank, and the collectives of a step, calls and bytes,
equal benchmarks/capstone.py's formulas (which that benchmark checks against real runs), for
several layouts and every stage. Its shortcuts are proven against the long way: a stage built
with one block and two, and min(m, 3) micro-batches, give what whole stages and every
micro-batch give; the GPU's kernels that gpu_kernels stands in for save what it says (a layer on
fake CUDA tensors, the CUDA flash kernel beside the CPU's). torch's own MemTracker (private)
agrees with the saved bytes. The three tables: Korthikanti et al.'s Table 2 to the byte but for
the differences each row names, the ZeRO paper's Figure 1 likewise, the Llama 3 paper's layouts
measured; each proof's control must be caught. Bad input: one line naming the fix.

The measurements would clash, in pytest's Python, with other lessons' modules of the same names
(model, parallelize, guard_rails), so they run in one Python of their own, started once (the
fixture `worker`), each piece when a test first needs it, answering what the tests assert on:
the three proofs too, each main() as its script runs it."""

import json
import re
import subprocess
import sys

import pytest

from helpers import ROOT, assert_one_line_error, assert_prints_what_the_readme_shows, read_metrics

LESSON = "14_planning"
# The measurements take a minute or two each on 2 quiet cores; on a busy machine, many times that.
pytestmark = pytest.mark.timeout(900)
PLAN_13 = ["--model", "tiny", "--gpus", "8", "--layout", "2,2,2", "--batch-size", "16",
        "--microbatches", "2", "--fp32", "--data", "fsdp", "--schedule", "gpipe"]

# What the checks' Python measures (each a Python of its own, the lesson's folder first on its
# path): lesson 13's layouts; the shortcuts against the long way; the kernels and trackers.
LESSON_13 = r'''
import json
import fake_ranks as R
import plan
from model import CONFIGS
# lesson 13's layouts of its tiny GPT, as its benchmark runs them: float32, GPipe, FSDP
tiny = CONFIGS["tiny"]
out["tiny"] = {}
for dp, pp, tp, m in [(2, 2, 2, 2), (1, 1, 2, 4), (2, 1, 1, 2), (1, 2, 1, 2)]:
    layout = R.Layout(dp, pp, tp, 1, m, 16 // dp // m, 64, "fsdp", "none", "gpipe", False)
    out["tiny"][f"{dp},{pp},{tp},{m}"] = {
        s: row["collectives"] for s, row in plan.measure_layout(tiny, layout).items()}
# 1F1B on 4 stages of one block, 8 micro-batches: what each stage holds in flight
layout = R.Layout(1, 4, 1, 1, 8, 1, 64, "fsdp", "none", "1f1b", False)
out["1f1b"] = {s: [row["in_flight"], row["activations"], row["micro_batch"]]
               for s, row in plan.measure_layout(tiny, layout, stages=[0, 1, 2, 3]).items()}

'''

LONG = r'''
import dataclasses, json
import fake_ranks as R
import plan
from model import CONFIGS
tiny = CONFIGS["tiny"]

def direct(config, layout, stage, blocks):  # a whole stage, every micro-batch
    with R.as_rank(0, layout.world):
        mesh, cp = R.make_groups(layout)
        held, saved, counter = R.run(config, layout, stage, blocks, mesh, cp)
    sent = {}
    for (phase, dim, kind), calls in counter.calls.items():
        total = sent.setdefault(dim, {}).setdefault(kind, [0, 0])
        total[0] += calls
        total[1] += counter.bytes[phase, dim, kind]
    return held, saved, sent

# the shortcuts against the long way: 4 blocks and 4 micro-batches, lesson 13's FSDP and
# Llama's kept gathered with context parallelism
small = dataclasses.replace(CONFIGS["llama3-8b"], dim=256, heads=4, kv_heads=2, hidden=512,
                            vocab=500, layers=4)
out["long way"] = []
for config, layout in [(tiny, R.Layout(2, 1, 2, 1, 4, 2, 64, "fsdp", "none", "gpipe", False)),
                       (small, R.Layout(2, 1, 2, 2, 4, 1, 128, "kept"))]:
    short = plan.measure_layout(config, layout)[0]
    held, saved, sent = direct(config, layout, 0, 4)
    out["long way"].append({
        "collectives": [short["collectives"], sent],
        "weights": [short["weights"], held["weights"]],
        "optimizer": [short["optimizer"], held["optimizer"]],
        "gradients": [short["gradients"], max(held["gradients"], held["accumulated"])],
        "micro-batch": [short["micro_batch"], saved[-1]], "saved": saved})

'''

CHECKS = r'''
import contextlib, dataclasses, json, sys
import torch, torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker  # private, torch 2.14
import fake_ranks as R
import plan
from measure import SavedBytes
from model import CONFIGS, Block
# gpu_kernels' RMSNorm: F.rms_norm's values and gradients, saving the input and 1 / RMS
x, w = torch.randn(3, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
mine = R.RMSNormAsOnGpu.apply(x, [16], w, 1e-5)
grads = torch.autograd.grad(mine.square().sum(), (x, w))
theirs = F.rms_norm(x, [16], w, 1e-5)
out["rms norm"] = [(mine - theirs).abs().max().item(), *[
    (a - b).abs().max().item() for a, b in zip(grads, torch.autograd.grad(
        theirs.square().sum(), (x, w)))]]

# attention as a GPU computes it: CUDA's flash kernel saves what the CPU's does, and its
# random state (24 bytes); SDPA on fake CUDA tensors cannot ask the device for its kernels
with FakeTensorMode():
    seen = {}
    for device in ("cpu", "cuda"):
        q = torch.empty(1, 32, 2048, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(1, 8, 2048, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        saved = SavedBytes()
        with saved.micro_batch():
            if device == "cpu":
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            else:
                torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
        seen[device] = saved.bytes[0]
    out["flash"] = seen

# torch's MemTracker (private) after a layer's forward: its activations are the bytes saved
# for backward and the layer's output
gpt = dataclasses.replace(CONFIGS["gpt3-175b"], dim=512, heads=8, seq_len=256, hidden=2048)
with FakeTensorMode():
    torch.set_default_dtype(torch.bfloat16)
    layer, x = Block(gpt), torch.empty(1, 256, 512, requires_grad=True)
    torch.set_default_dtype(torch.float32)
    tracker, saved = MemTracker(), SavedBytes()
    tracker.track_external(layer)
    with R.gpu_kernels(), tracker, saved.micro_batch():
        y = layer(x)
        snapshot = next(iter(tracker.get_tracker_snapshot("current").values()))
    out["mem tracker"] = [{str(k): v for k, v in snapshot.items()}, saved.bytes[0],
                          y.numel() * y.element_size()]

# a cluster on which nothing fits: one line, after the search
args = plan.parse_args(["--model", "tiny", "--gpus", "2", "--memory-gb", "0.000002",
                        "--spare-gb", "0", "--out-dir", sys.argv[1]])
try:
    with contextlib.redirect_stdout(None):
        plan.main(args)
except SystemExit as stop:
    out["nothing fits"] = str(stop.code)
'''

# What needs no rank built: the rule's order, the stages' blocks, the flags refused.
CHEAP = r'''
import json
import plan
# the rule's order, and what needs no layout at all
args = plan.parse_args(["--model", "llama3-8b", "--gpus", "64", "--seq-len", "4096",
                        "--batch-size", "64"])
config = plan.model_config(args)
order = plan.candidates(config, args, plan.tp_degree(config, 64, 8))
out["order"] = [[x.recompute, x.cp, x.pp, x.dp, x.microbatches, x.batch] for x in order]
out["blocks"] = {f"{n} on {pp}": plan.stage_blocks(n, pp) for n, pp in
                 [(126, 16), (128, 16), (32, 4), (126, 5), (4, 3)]}

def refused(*argv):
    try:
        a = plan.parse_args(list(argv))
        config = plan.model_config(a)
        plan.given_layout(config, a) if a.layout else None
    except SystemExit as stop:
        return str(stop.code)
    return None

out["refused"] = {" ".join(argv): refused(*argv) for argv in [
    ("--model", "llama4"), ("--model", "llama3-8b", "--gpus", "64", "--layout", "4,2,4"),
    ("--model", "llama3-8b", "--gpus", "48", "--layout", "2,2,12"),
    ("--model", "llama3-405b", "--gpus", "40", "--layout", "1,5,8"),
    ("--model", "gpt3-175b", "--gpus", "16", "--layout", "1,1,8,2"),
    ("--model", "tiny", "--seq-len", "128"), ("--memory-gb", "nan"),
    ("--spare-gb", "90"), ("--gpus", "0"),
    ("--model", "llama3-8b", "--gpus", "8", "--layout", "8,1,1", "--batch-size", "12")]}
'''


# A proof, its main() as `python 14_planning/prove_*.py` runs it, its output kept.
PROOF = r'''
import contextlib, importlib, io, sys
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    importlib.import_module(sys.argv[1]).main()
out["printed"] = printed.getvalue()
'''

# The one Python the measurements share: it runs each piece of code it is sent, when a test
# first needs it, and answers with that code's `out` as JSON, after the line MARK.
MARK = "=== out:"
WORKER = r'''
import json, sys, traceback
for line in sys.stdin:
    asked, code, sys.argv[1:] = json.loads(line)
    scope = {"out": {}}
    try:
        exec(code, scope)
        answer = scope["out"]
    except BaseException:
        answer = {"failed": traceback.format_exc()}
    print("\n=== out:" + json.dumps([asked, answer]), flush=True)
'''


class Worker:
    """One start of Python, torch and the lesson for all the measurements (each start imports
    them again), each still run only when a test asks for it: a mutant's test pays for its own
    measurement alone."""

    def __init__(self, folder):
        self.stderr = open(folder / "stderr.txt", "w+")  # a file: a full pipe would block it
        self.process = subprocess.Popen([sys.executable, "-u", "-c", WORKER], cwd=ROOT / LESSON,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True)
        self.answers, self.asked = {}, 0

    def run(self, code, *args):
        key = (code, *map(str, args))
        if key not in self.answers:
            # Numbered: a test stopped by its timeout leaves its answer unread; the next skips it.
            self.asked += 1
            asked = self.asked
            self.process.stdin.write(json.dumps([asked, code, [str(a) for a in args]]) + "\n")
            self.process.stdin.flush()
            for line in self.process.stdout:
                if line.startswith(MARK):
                    number, answer = json.loads(line[len(MARK):])
                    if number == asked:
                        self.answers[key] = answer
                        break
            else:
                self.stderr.seek(0)
                pytest.fail("the measurements' Python stopped:\n" + self.stderr.read()[-5000:])
        answer = self.answers[key]
        assert "failed" not in answer, answer.get("failed")
        return answer

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.stderr.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    started = Worker(tmp_path_factory.mktemp("worker"))
    yield started
    started.close()


@pytest.fixture(scope="module")
def cheap(worker):
    return worker.run(CHEAP)


@pytest.fixture(scope="module")
def lesson_13_layouts(worker):
    return worker.run(LESSON_13)


@pytest.fixture(scope="module")
def long_way(worker):
    return worker.run(LONG)


@pytest.fixture(scope="module")
def checks(worker, tmp_path_factory):
    return worker.run(CHECKS, tmp_path_factory.mktemp("plan"))


def proof(worker, name):
    return worker.run(PROOF, name)["printed"]


@pytest.fixture(scope="module")
def formulas():
    """benchmarks/capstone.py's formulas of lesson 13's collectives, in a Python of their own
    (it imports lesson 13): {layout: {stage: {"dim kind": [calls, bytes]}}}."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import capstone; print(json.dumps("
            "{f'{dp},{pp},{tp},{m}': {s: capstone.formulas((dp, pp, tp, m), s, 0) for s in "
            "range(pp)} for dp, pp, tp, m in [(2, 2, 2, 2), (1, 1, 2, 4), (2, 1, 1, 2), "
            "(1, 2, 1, 2)]}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def run_script(name, *args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / LESSON / name), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_parallelize_is_lesson_13s_byte_for_byte():
    # Lesson 13's idea, used unchanged: a copy checked identical, as the course keeps copies.
    assert (ROOT / LESSON / "parallelize.py").read_bytes() == (
        ROOT / "13_capstone" / "parallelize.py").read_bytes()


def test_the_tiny_gpt_is_lesson_13s_model():
    # model.py's "tiny" is TinyGPT: the same parameters by name and shape, and with the same
    # weights the same scores. In a Python of its own, which imports lesson 13 from its folder.
    code = """
import importlib.util, sys, torch
sys.path.insert(0, "13_capstone")
import train
spec = importlib.util.spec_from_file_location("model14", "14_planning/model.py")
model14 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model14)
torch.manual_seed(0)
theirs, ours = train.TinyGPT(64), model14.GPT(model14.CONFIGS["tiny"])
shapes = {k: v.shape for k, v in ours.state_dict().items()}
ours.load_state_dict(theirs.state_dict())
x = torch.randint(13, (2, 64))
same = shapes == {k: v.shape for k, v in theirs.state_dict().items()}
print(same, torch.equal(ours(x), theirs(x)))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr


def test_each_stage_holds_what_lesson_13s_real_run_held(lesson_run, tmp_path):
    # The planner on lesson 13's layout (2 x 2 x 2, float32, GPipe, 2 micro-batches) against
    # lesson 13's own 8-rank run: each stage's first rank, its weights, gradients and Adam's
    # averages as lesson 13's bytes_held counts them (the batch size changes none of them).
    result, out_dir = lesson_run("13_capstone", "--epochs", "1", "--batch-size", "64",
                                 "--backend", "gloo")
    assert result.returncode == 0, result.stderr
    real = read_metrics(out_dir)["bytes_per_rank"]
    done = run_script("plan.py", *PLAN_13, "--out-dir", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "fits: stage" in done.stdout, done.stdout
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert {int(s): row["at_rest"] for s, row in rows.items()} == {0: real[0], 1: real[4]}


def test_a_steps_collectives_are_lesson_13s_calls_and_bytes(lesson_13_layouts, formulas):
    # Every dimension's calls and bytes sent, of each stage's first rank, for four layouts and
    # their micro-batches: as benchmarks/capstone.py's formulas, checked there against real runs.
    for layout, stages in lesson_13_layouts["tiny"].items():
        for stage, lesson_13_layouts in stages.items():
            flat = {f"{dim} {kind}": v for dim, kinds in lesson_13_layouts.items()
                    for kind, v in kinds.items()}
            assert flat == formulas[layout][stage], (layout, stage)


def test_under_1f1b_a_stage_holds_pp_minus_stage_micro_batches(lesson_13_layouts):
    # Korthikanti et al.'s point, and the reason more stages do not shrink the first stage's
    # activations: stage s of p holds p - s micro-batches in flight (GPipe all m).
    held = lesson_13_layouts["1f1b"]
    assert [held[str(s)][0] for s in range(4)] == [4, 3, 2, 1], held
    # stages 1 and 2 are alike (one block, no embedding, no head): one micro-batch apart
    assert held["1"][1] - held["2"][1] == held["2"][2] > 0, held


def test_one_block_and_two_and_three_micro_batches_give_what_the_long_way_gives(long_way):
    # The planner builds each stage with one block and two and steps min(m, 3) micro-batches;
    # a whole stage of 4 blocks stepped with all 4 gives the same bytes and collectives.
    for case in long_way["long way"]:
        for what in ("collectives", "weights", "optimizer", "gradients", "micro-batch"):
            assert case[what][0] == case[what][1], what
        assert len(set(case["saved"][1:])) == 1  # every micro-batch after the first, the same


def test_the_gpu_kernels_stand_ins_compute_and_save_what_cuda_does(checks):
    # RMSNorm as CUDA's fused kernel: F.rms_norm's values and gradients. Attention: the CPU's
    # flash kernel saves what CUDA's does (q, k, v, the output, the log-sum-exp), but for
    # CUDA's 24 bytes of random state. Dropout and LayerNorm: prove_activations.py.
    assert max(checks["rms norm"]) < 1e-5, checks["rms norm"]
    assert checks["flash"]["cuda"] - checks["flash"]["cpu"] == 24, checks["flash"]


def test_torchs_mem_tracker_counts_the_saved_bytes_and_the_output(checks):
    snapshot, saved, output = checks["mem tracker"]
    assert snapshot["_MemRefType.ACT"] == saved + output


def test_the_rule_tries_no_recomputation_first_then_fewer_cp_then_fewer_stages(cheap):
    order = cheap["order"]
    keys = [({"none": 0, "selective": 1, "full": 2}[r], cp, pp) for r, cp, pp, *_ in order]
    assert keys == sorted(keys) and len(set(map(tuple, keys))) == len(keys)
    assert {r for r, *_ in order} == {"none", "full"}  # SDPA: no selective recomputation
    for _, cp, pp, dp, m, batch in order:  # each uses the 64 GPUs, and the 64 sequences
        assert dp * pp * 8 * cp == 64 and dp * m * batch == 64
    assert cheap["blocks"] == {"126 on 16": [7] + [8] * 14 + [7], "128 on 16": [8] * 16,
                                "32 on 4": [8] * 4, "126 on 5": None, "4 on 3": [1, 2, 1]}


@pytest.mark.parametrize("argv, says", [
    ("--model llama4", "no model 'llama4'; the models are tiny, gpt3-175b,"),
    ("--model llama3-8b --gpus 64 --layout 4,2,4", "is 32 ranks, not --gpus 64"),
    ("--model llama3-8b --gpus 48 --layout 2,2,12", "tp 12 must divide the 32 heads"),
    ("--model llama3-405b --gpus 40 --layout 1,5,8", "pp 5 cannot split 126 blocks"),
    ("--model gpt3-175b --gpus 16 --layout 1,1,8,2", "context parallelism needs rotary"),
    ("--model tiny --seq-len 128", "longer than tiny's 64 learned positions"),
    ("--memory-gb nan", "--memory-gb must be a finite number"),
    ("--spare-gb 90", "--spare-gb 90 must be at least 0 and less than --memory-gb 80"),
    ("--gpus 0", "--gpus must be at least 1"),
    ("--model llama3-8b --gpus 8 --layout 8,1,1 --batch-size 12", "do not split over dp 8"),
])
def test_bad_input_is_refused_with_the_fix(cheap, argv, says):
    assert says in cheap["refused"][argv], cheap["refused"][argv]


def test_a_cluster_on_which_nothing_fits_stops_in_one_line(checks):
    assert checks["nothing fits"].startswith("error: no layout of tiny on 2 GPUs of 2e-06 GB "
                                             "fits (with 0 GB spare): use more GPUs"), checks


def test_bad_input_stops_in_one_line_as_a_learner_meets_it(tmp_path):
    done = run_script("plan.py", "--model", "llama4", "--out-dir", tmp_path)
    assert_one_line_error(done, "no model 'llama4'", "--dim, --heads")


def test_korthikanti_table_2_to_the_byte_and_its_controls(worker):
    printed = proof(worker, "prove_activations")
    for line in ["every row equals the formula plus what it names, to the byte: True",
                 "LayerNorm's statistics in float32 (16,384 more): True",
                 "control, dropout as the CPU keeps it (masks in bf16): 452,984,832 bytes more",
                 "caught: True\ncontrol, tensor + sequence parallel built without SP"]:
        assert line in printed, printed
    assert printed.count("caught: True") == 2, printed
    # Each row's paper column is Table 2's formula, computed here; its bytes more, what it names.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh, stats, gathered = s * b * h, 8 * s * b, 4 * s * b * h * (t - 1) // t
    table_2 = [34 + 5 * a * s / h, 10 + 24 / t + 5 * a * s / (h * t), 34 / t + 5 * a * s / (h * t),
               10 + 24 / t, 34 / t, 2]
    more = [stats, stats, stats // t + gathered, stats, stats // t + gathered, 0]
    rows = re.findall(r"paper +([\d.]+) \| measured +([\d.]+) \| +([\d,]+) bytes more", printed)
    assert len(rows) == 6, printed
    for (paper, measured_gib, extra), formula, besides in zip(rows, table_2, more, strict=True):
        assert paper == f"{sbh * formula / 2**30:.3f}", (paper, formula)
        assert int(extra.replace(",", "")) == besides, (extra, besides)
        assert measured_gib == f"{(sbh * formula + besides) / 2**30:.3f}", measured_gib


def test_zero_figure_1_to_the_byte_and_its_control(worker):
    printed = proof(worker, "prove_zero")
    for line in ["every row the paper's formula and what it names, to the byte: True",
                 "FSDP gathers one layer at a time to compute, 0.250 GB: True",
                 "sharded weights and gradients as measured: True", "(4 bytes each): True",
                 "the whole model in bf16 (2 Psi), not one layer: caught: True",
                 "P_os+g+p   paper   1.9 (  1.875) | FSDP2                     1.875"]:
        assert line in printed, printed
    # Figure 1's four numbers from its formulas at Psi = 7.5 B, N_d = 64, K = 12, computed here,
    # and PyTorch's: float32 weights and gradients; ZeroRedundancyOptimizer's Adam state for one
    # of the 60 whole layers; FSDP2 kept, the bf16 weights gathered and float32 shards.
    psi, n, k = 7.5e9, 64, 12
    figure_1 = [(2 + 2 + k) * psi, 4 * psi + k * psi / n, 2 * psi + (2 + k) * psi / n,
                (2 + 2 + k) * psi / n]
    pytorch = [16 * psi, 8 * psi + 8 * psi / 60, 2 * psi + 16 * psi / n, 16 * psi / n]
    rows = re.findall(r"paper +([\d.]+) \( *([\d.]+)\) \| [^|]*? ([\d.]+): weights", printed)
    assert [float(paper) for paper, _, _ in rows] == [120.0, 31.4, 16.6, 1.9], rows
    for (_, formula, found), theirs, ours in zip(rows, figure_1, pytorch, strict=True):
        assert (formula, found) == (f"{theirs / 1e9:.3f}", f"{ours / 1e9:.3f}"), (formula, found)


def test_llama3s_layouts_measured_and_the_control(worker):
    printed = proof(worker, "prove_llama3")
    lines = [line for line in printed.splitlines() if " GPUs, tp 8" in line]
    assert len(lines) == 3, printed
    for line in lines:  # the largest rank is a middle stage's: 8 blocks, 15 micro-batches held
        assert " stage 1 holds " in line and "sent across nodes a step: dp " in line, line
        assert "tp " not in line.split("across nodes a step: ")[1]  # TP stays in a node
    assert "cp 16.1" in lines[2]
    # Table 4's layouts as the proof builds them: GPUs, TP, CP, PP, DP, tokens a sequence.
    table_4 = [(8192, 8, 1, 16, 64, 8192), (16384, 8, 1, 16, 128, 8192),
               (16384, 8, 16, 16, 8, 131072)]
    for line, (gpus, tp, cp, pp, dp, seq) in zip(lines, table_4, strict=True):
        assert line.startswith(f"  {gpus:6,} GPUs, tp {tp} cp {cp:2} pp {pp} dp {dp:3}, "
                               f"{seq:7,} tokens: "), line
        assert gpus == tp * cp * pp * dp
    assert "caught: True" in printed, printed


@pytest.mark.parametrize("name", ["prove_activations", "prove_zero", "prove_llama3"])
def test_the_readme_shows_what_each_proof_prints(worker, name):
    # As tools/check_listings.py holds a listing's output (`…` any text), here from the same run
    # the tests above read: every figure the README quotes is one this run printed.
    assert_prints_what_the_readme_shows(proof(worker, name), LESSON, f"python {LESSON}/{name}.py")


# ---------------------------------------------------------------------------------------------
# Exercise 14: a layout of Llama 3 70B on 64 GPUs, measured by the planner (exercises/check.py)
# ---------------------------------------------------------------------------------------------
def check_exercise(tmp_path, layout):
    path = tmp_path / "my_14.json"
    path.write_text(layout)
    # --timeout: the planner's bound (120 s by default), raised for a busy test machine.
    return subprocess.run([sys.executable, str(ROOT / "exercises" / "check.py"), "14", str(path),
                           "--timeout", "600"], capture_output=True, text=True, timeout=900)


def test_exercise_14_passes_a_layout_that_fits(tmp_path):
    # The planner's first choice for the task (plan.py on it, in the rule's order).
    done = check_exercise(tmp_path, '{"dp": 2, "pp": 2, "tp": 8, "cp": 2}')
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == ("PASS exercise 14 (choose a layout): your layout fits, with "
                                   "TP inside a node")


@pytest.mark.parametrize("layout, code, says", [
    ('{"dp": 4, "pp": 1, "tp": 16}', 1, "tp 16 spans 2 nodes"),
    ('{"dp": 8, "pp": 2, "tp": 8}', 1, "is 128 GPUs, not the cluster's 64"),
    ('{"dp": 8, "pp": 1, "tp": 8, "recompute": "some"}', 2, 'recompute must be "none"'),
    ("[8, 1, 8]", 2, "must hold dp, pp and tp"),
])
def test_exercise_14_names_what_is_wrong_before_measuring(tmp_path, layout, code, says):
    done = check_exercise(tmp_path, layout)
    assert done.returncode == code, done.stdout + done.stderr
    assert says in done.stdout.splitlines()[0], done.stdout


# Llama 3's context parallelism as fake_ranks.context_parallel builds it, on 2 real gloo ranks:
# each rank's attention over the keys and values it gathers equals full attention at its tokens.
CP_ATTENTION = r'''
import dataclasses, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import fake_ranks as R
from model import CONFIGS, GPT

def rank(r):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=r, world_size=2)
    torch.set_default_dtype(torch.float64)
    config = dataclasses.replace(CONFIGS["llama3-8b"], dim=64, heads=4, kv_heads=2, hidden=128,
                                 vocab=50, layers=1)
    torch.manual_seed(0)
    model, x = GPT(config), torch.randn(2, 16, 64)
    attention = model.blocks["0"].attn
    whole = attention(x)  # every token, one process
    R.context_parallel(model, dist.group.WORLD, R.Layout(cp=2, seq_len=16, bf16=False))
    mine = attention.positions  # this rank's tokens: chunks r and 3 - r of 4
    chunks = mine.tolist() == [*range(4 * r, 4 * r + 4), *range(12 - 4 * r, 16 - 4 * r)]
    difference = (attention(x[:, mine]) - whole[:, mine]).abs().max().item()
    sys.stdout.write(f"{r} {chunks} {difference}\n")  # one write: the two ranks share stdout
    sys.stdout.flush()
    dist.destroy_process_group()

mp.start_processes(rank, nprocs=2, start_method="fork")
'''


def test_context_parallel_attention_equals_full_attention_at_each_ranks_tokens():
    from helpers import free_port

    done = subprocess.run([sys.executable, "-c", CP_ATTENTION, str(free_port())],
                          cwd=ROOT / LESSON, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = sorted(line.split() for line in done.stdout.splitlines()
                   if line.startswith(("0 ", "1 ")))
    assert [(r, chunks) for r, chunks, _ in ranks] == [("0", "True"), ("1", "True")], done.stdout
    assert all(float(difference) < 1e-12 for *_, difference in ranks), done.stdout
