"""The exercises' checker (exercises/check.py): each lesson passes its own check; each mistake the
checker names is shown by a lesson with that mistake made in a copy of it, here, and the line it
prints; bad input gets one line, within the time bound, and leaves nothing behind.

The runs are many (about 50 lesson runs, 5 ranks for exercise 02, 4 for 09), so these tests
carry the `exercises` mark, which the README's test command leaves out: CI runs them in a step
of their own, `python -m pytest -m exercises` (tests/README.md says how long it takes). The
cheap checks of the exercise pages and the checker's links run in every suite."""

import ast
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from mutants import MUTANTS  # noqa: E402
from test_mutate import readme_anchors  # noqa: E402

CHECK = ROOT / "exercises" / "check.py"
MUTANT = {m.id: m for m in MUTANTS}


@dataclass(frozen=True)
class Case:
    """A lesson with one mistake, and what the checker must say of it."""
    exercise: str
    lesson: str
    changes: tuple  # (find, replace) pairs, each find once in one of the lesson's .py files
    says: str  # a fragment of the checker's "most likely" line
    id: str


def from_mutant(exercise, mutant_id, says):
    """A mistake of tools/mutants.py, the list the mutation check uses."""
    m = MUTANT[mutant_id]
    return Case(exercise, m.file.split("/")[0], ((m.find, m.replace),), says, mutant_id)


DDP_LINE = 'model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)'
STRIDE = "self.test_set.{0}[self.rank::self.world_size]"
PADDED = ("self.test_set.{0}[list(DistributedSampler(self.test_set, self.world_size, "
          "self.rank, shuffle=False))]")
CASES = [
    from_mutant("02", "02-no-set-epoch", "call train_loader.sampler.set_epoch(epoch)"),
    from_mutant("02", "02-evaluation-counts-not-reduced", "counts were not summed"),
    from_mutant("02", "02-loss-from-rank-0", "sum the losses and the sample counts"),
    Case("02", "02_multi_gpu_spawn",
         (("num_replicas=world_size, rank=rank", "num_replicas=1, rank=0"),),
         "every rank trains on the whole set", "02-no-distributed-sampler"),
    Case("02", "02_multi_gpu_spawn",
         (("cpu_state_dict(model.module)", "cpu_state_dict(model)"),),
         "saved the DDP wrapper's state_dict", "02-saves-the-ddp-wrapper"),
    Case("02", "02_multi_gpu_spawn",
         ((DDP_LINE, DDP_LINE + "\n    model.require_backward_grad_sync = False"),),
         "not averaged at all", "02-gradients-not-averaged"),
    Case("02", "02_multi_gpu_spawn",
         tuple((STRIDE.format(name), PADDED.format(name)) for name in ("features", "labels")),
         "padding of a DistributedSampler was counted", "02-evaluation-counts-padding"),
    from_mutant("03", "03-global-rank-is-local-rank", "node_rank * nproc_per_node + local_rank"),
    from_mutant("03", "03-data-sliced-by-local-rank", "the sampler's rank is the global rank"),
    from_mutant("03", "03-every-nodes-first-rank-writes", "only global rank 0 writes"),
    from_mutant("04", "04-resume-skips-an-epoch", "it skipped an epoch"),
    from_mutant("04", "04-optimizer-state-not-loaded", "restore the optimizer's state"),
    from_mutant("04", "04-load-without-map-location", "give map_location=device"),
    from_mutant("04", "04-load-with-weights-only-false", "load with weights_only=True"),
    from_mutant("04", "04-resume-without-the-weights", "load the model's state_dict"),
    from_mutant("07", "07-fsdp-wraps-only-the-root", "call fully_shard on each layer first"),
    from_mutant("07", "07-ranks-seeded-apart", "FSDP does not broadcast rank 0's weights"),
    from_mutant("07", "07-final-pt-holds-shards", "gather the whole tensors first"),
    from_mutant("08", "08-overlap-forgets-to-divide", "summed, not averaged"),
    # Lesson 08 seeds every rank alike, so without the broadcast its ranks still start
    # together; a learner who also seeds each rank apart does not.
    Case("08", "08_ddp_from_scratch",
         (("    broadcast_from_rank_0(model)\n", ""),
          ("torch.manual_seed(args.seed)", "torch.manual_seed(args.seed + dist.get_rank())")),
         "broadcast them from rank 0", "08-no-broadcast-ranks-seeded-apart"),
    from_mutant("09", "09-row-wise-without-all-reduce", "must be all-reduced over the TP group"),
    from_mutant("09", "09-tp-ranks-read-apart", "deal the batches to the TP groups"),
    from_mutant("09", "09-test-counts-summed-over-tp", "sum the counts over the dp group only"),
    # The run stops in fc2's forward (a shape error): the plan is read from the first forward.
    Case("09", "09_tensor_parallel",
         (("RowwiseParallel() if i % 2", "ColwiseParallel() if i % 2"),),
         "split fc2 row-wise", "09-both-layers-column-wise"),
    Case("09", "09_tensor_parallel", (("    if args.hidden % args.tp:\n", "    if False:\n"),),
         "refuse a --tp that does not divide --hidden", "09-tp-not-dividing-hidden-reaches-ranks"),
    Case("09", "09_tensor_parallel",
         (('        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}',
           "        pass"),),
         "the norms' gradients not reduced across the TP group", "09-sp-norm-grads-not-reduced"),
    from_mutant("10", "10-mean-loss-per-micro-batch", "the loss not divided by the batch's real"),
    # Stage 0 waits for micro-batch 1's gradient while stage 1 waits for micro-batch 2: a
    # deadlock, which --timeout 20 ends, and the sends and recvs begun name.
    Case("10", "10_pipeline_parallel",
         (("            dist.send(out.detach(), group=pp_group, group_dst=s + 1)\n",
           "            dist.send(out.detach(), group=pp_group, group_dst=s + 1)\n"
           "            dist.recv(torch.empty_like(out), group=pp_group, group_src=s + 1)\n"),),
         "backwards in the wrong order", "10-backward-before-the-forwards-end"),
    # The last stage runs its backwards last micro-batch first, the others in order: nothing
    # waits, since every gradient has the same shape, but stage 0 adds each one to the wrong
    # micro-batch's graph.
    Case("10", "10_pipeline_parallel",
         (("    for x, out in zip(inputs, outputs, strict=True):\n",
           "    pairs = list(zip(inputs, outputs, strict=True))\n"
           "    for x, out in (reversed(pairs) if s == p - 1 else pairs):\n"),),
         "receive them in the order the next stage sends them", "10-last-stage-backwards-reversed"),
    Case("10", "10_pipeline_parallel",
         (("            dist.send(x.grad, group=pp_group, group_dst=s - 1)", "            pass"),),
         "never sends its gradient back", "10-gradient-never-sent-back"),
    Case("10", "10_pipeline_parallel",
         (("labels.new_full((short,), IGNORE)", "labels.new_full((short,), 0)"),),
         "the padding rows counted", "10-padding-counted-in-the-loss"),
    Case("10", "10_pipeline_parallel",
         (("totals[1] += len(labels) * self.has_last_stage",
           "totals[1] += self.args.batch_size * self.has_last_stage"),),
         "the padding rows counted", "10-padding-counted-in-the-figure"),
    # Exercise 10b, on one process: two micro-batches' B, then their W.
    from_mutant("10b", "10-b-not-handed-back", "B's result not handed back"),
    from_mutant("10b", "10-w-run-twice", "W run twice"),
    Case("10b", "10_pipeline_parallel",
         (("            param.grad = g if param.grad is None else param.grad + g",
           "            pass"),),
         "W dropped", "10b-w-dropped"),
    Case("10b", "10_pipeline_parallel",
         (("            param.grad = g if param.grad is None else param.grad + g",
           "            param.grad = g"),),
         "each W replaced .grad", "10b-w-replaces-the-gradient"),
    # B by one ordinary backward: W then adds the weights' gradients a second time.
    Case("10b", "10_pipeline_parallel",
         (("    dx, *douts = torch.autograd.grad(out, [x, *outputs], grad)\n",
           "    dx, *douts = torch.autograd.grad(out, [x, *outputs], grad, retain_graph=True)\n"
           "    out.backward(grad)\n"),),
         "B computed the weights' gradients too", "10b-b-computes-the-weights-too"),
    from_mutant("11", "11-blocks-averaged-not-merged", "merge averaged the outputs"),
    from_mutant("11", "11-later-chunks-not-masked", "the causal mask dropped across chunks"),
    Case("11", "11_context_parallel",
         (('        scores = scores.masked_fill(~causal, float("-inf"))', "        pass"),),
         "the causal mask dropped inside the diagonal block", "11-diagonal-block-not-masked"),
    # Exercise 12 on one process: what each token got (with top-1, one result each) names it.
    from_mutant("12", "12-router-weights-not-applied", "the router's weights were not applied"),
    # The tokens left unsorted: their rows reach the experts in token order.
    from_mutant("12", "12-combined-in-the-unsorted-order", "not grouped by expert"),
    Case("12", "12_expert_parallel",
         (("        order = expert.argsort(stable=True)\n",
           "        order = expert.argsort(stable=True)\n        unsorted = token\n"),
          ("index_add(0, token,", "index_add(0, unsorted,")),
         "added each result to another token than the one it was run for",
         "12-combine-in-the-order-before-the-sort"),
    Case("12", "12_expert_parallel",
         (("token, expert, weight = token[order], expert[order], weight[order]",
           "token, expert = token[order], expert[order]"),),
         "multiplied by another choice's weight", "12-weights-not-sorted"),
    Case("12", "12_expert_parallel",
         (("torch.zeros_like(x).index_add(0,", "torch.zeros_like(x).index_copy(0,"),),
         "were not both added", "12-results-copied-not-added"),
    Case("12", "12_expert_parallel",
         (("token.expand_as(chosen)[kept], chosen[kept], weights[kept]",
           "token.expand_as(chosen).flatten(), chosen.flatten(), weights.flatten()"),),
         "the choices the capacity limit drops were run too", "12-dropped-choices-run"),
    Case("12", "12_expert_parallel", (("y * weight[:, None]", "y * weight.detach()[:, None]"),),
         "the router learns through the weights", "12-weights-detached"),
    # Top-1 right, top-2 not, and both results added: the top-2 weights as softmax gave them.
    Case("12", "12_expert_parallel",
         (("weights = weights / weights.sum(dim=-1, keepdim=True)", "weights = weights"),),
         "top-2 weights were not rescaled to sum to 1", "12-top-k-weights-not-rescaled"),
    # Off the checker's list: each result times its weight squared, no choice's weight. The
    # checker says what differs and where to look, and names no cause.
    Case("12", "12_expert_parallel", (("y * weight[:, None]", "y * weight[:, None] ** 2"),),
         "no mistake on the checker's list gives that weight", "12-off-the-list-weights-squared"),
    # Exercise 12 on 2 and 4 ranks, one process right: only a rank that receives rows from
    # several ranks for several experts has rows to group by expert, and to put back.
    from_mutant("12", "12-results-sent-back-in-the-wrong-order",
                "put the results back in the order received"),
    Case("12", "12_expert_parallel",
         (("torch.arange(len(mine), device=rows.device).repeat(ep)",
           "torch.arange(len(mine), device=rows.device).repeat_interleave(ep)"),),
         "the rows a rank received were run by the wrong experts", "12-received-grouped-wrongly"),
    Case("12", "12_expert_parallel",
         (("            dist.all_to_all_single(received_counts, counts, group=group)\n",
           "            pass\n"),),
         "exchange the counts first", "12-counts-not-exchanged"),
    Case("12", "12_expert_parallel",
         (("        received = exchange(rows, send, receive, group)",
           "        received = rows\n"
           "        if group is not None:  # a bare all-to-all: no gradient on the way back\n"
           "            received = rows.new_empty(sum(receive), *rows.shape[1:])\n"
           "            dist.all_to_all_single(received, rows.detach(), receive, send, "
           "group=group)"),),
         "the rows must cross ranks by exchange()", "12-rows-sent-by-a-bare-all-to-all"),
    # Off the checker's list: a loader that drops each epoch's short last batch. The count read
    # is wrong, and no listed cause fits it: the checker says where to look, and names none.
    Case("02", "02_multi_gpu_spawn",
         (("DataLoader(dataset, batch_size=batch_size, sampler=sampler)",
           "DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)"),),
         "deals or batches the wines otherwise than the lesson's", "02-off-the-list-drop-last"),
]
LESSONS = {"02": "02_multi_gpu_spawn", "03": "03_multi_node", "04": "04_checkpointing",
           "07": "07_sharding", "08": "08_ddp_from_scratch", "09": "09_tensor_parallel",
           "10": "10_pipeline_parallel", "10b": "10_pipeline_parallel",
           "11": "11_context_parallel", "12": "12_expert_parallel"}


# These fixtures are made once per worker; CI's last step (--dist loadgroup) sends each exercise's
# tests to one worker by their xdist_group, so that each is made once. pytest 9.2 made node ids
# structured, and pytest-xdist 3.8 still marks a group by rewriting the old field: nothing fails,
# the groups are simply dealt to both workers, and each made exercise 13's copies (66 s) and the
# lessons' reference runs again (pytest-dev/pytest-xdist#1386). requirements.txt keeps pytest
# below 9.2 until a fixed xdist is out; this test fails where the groups fall apart.
def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the course's addopts
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_where(i):\n"
        "    with open(os.environ['SEEN'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    seen = tmp_path / "seen.txt"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not ours
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                           "-p", "no:cacheprovider", str(tmp_path / "test_grouped.py")],
                          cwd=tmp_path, env={**clean, "SEEN": str(seen)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = seen.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, (
        f"one xdist group ran on {sorted(set(workers))}: pytest {pytest.__version__} with this "
        "pytest-xdist does not keep a group together (pytest-dev/pytest-xdist#1386)")


# Session-wide, not per module: a worker that runs another file's test (a notebook's) between two
# of this file's tears a module's fixtures down, and they were made again (CI's exercise 13: 97 s).
@pytest.fixture(scope="session")
def lesson_runs(tmp_path_factory):
    """The lessons' reference runs, made once by the first check of each exercise."""
    return tmp_path_factory.mktemp("lesson_runs")


def check(exercise, script, cwd, lesson_runs=None, timeout=None):
    env = dict(os.environ, TMPDIR=str(cwd / "tmp"))
    (cwd / "tmp").mkdir(exist_ok=True)
    if lesson_runs:
        env["EXERCISE_LESSON_RUNS"] = str(lesson_runs)
    command = [sys.executable, str(CHECK), exercise, str(script)]
    if timeout:
        command += ["--timeout", str(timeout)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert not os.listdir(cwd / "tmp"), "the checker left files in its temporary folder"
    return done


def copy_lesson(lesson, folder, changes=()):
    """The lesson's Python files in folder (train.py, guard_rails.py, its own modules), each
    change made in the one file that holds its find once; the copy's train.py."""
    folder.mkdir()
    sources = {path.name: path.read_text() for path in (ROOT / lesson).glob("*.py")}
    for find, replace in changes:
        holders = [name for name, source in sources.items() if source.count(find) == 1]
        assert len(holders) == 1, f"{find!r} is not once in one file of {lesson}"
        sources[holders[0]] = sources[holders[0]].replace(find, replace)
    for name, source in sources.items():
        (folder / name).write_text(source)
    return folder / "train.py"


def by_exercise(values, exercise_of):
    """Each value as a parameter in its exercise's xdist group: with --dist loadgroup one worker
    takes all of an exercise's tests, so its lesson's reference run (lesson_runs) is made once."""
    return [pytest.param(value, marks=pytest.mark.xdist_group(f"exercise-{exercise_of(value)}"))
            for value in values]


@pytest.mark.exercises
@pytest.mark.parametrize("exercise", by_exercise(LESSONS, lambda exercise: exercise))
def test_every_lesson_passes_its_own_exercise(exercise, tmp_path, lesson_runs):
    # Exercise 08's reference is lesson 02's DDP: lesson 08's own averaging must end on it.
    script = copy_lesson(LESSONS[exercise], tmp_path / "mine")
    done = check(exercise, script, tmp_path, lesson_runs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"PASS exercise {exercise} ")


@pytest.mark.exercises
@pytest.mark.parametrize("case", by_exercise(CASES, lambda case: case.exercise),
                         ids=lambda case: case.id)
def test_each_mistake_is_named(case, tmp_path, lesson_runs):
    script = copy_lesson(case.lesson, tmp_path / "mine", case.changes)
    done = check(case.exercise, script, tmp_path, lesson_runs)
    assert done.returncode == 1, done.stdout + done.stderr
    verdict, likely, where = done.stdout.splitlines()
    assert verdict.startswith(f"NOT YET exercise {case.exercise} "), verdict
    assert likely.startswith("  most likely: ") and case.says in likely, done.stdout
    assert where.startswith("  where to look: ")


BAD = {
    "fails": ("import sys\nsys.exit('error: no such flag')\n", "stopped with exit status 1; "
              "its last line: error: no such flag"),
    "hangs": ("import os, sys, time\nopen(os.environ['PID_FILE'], 'w').write(str(os.getpid()))\n"
              "time.sleep(600)\n", "did not finish within the time bound"),
    "writes nothing": ("print('trained')\n", "wrote no final.pt into --out-dir"),
    "writes a model object": (
        "import sys, os, torch\nd = sys.argv[sys.argv.index('--out-dir') + 1]\n"
        "os.makedirs(d)\ntorch.save(torch.nn.Linear(13, 3), os.path.join(d, 'final.pt'))\n",
        "final.pt is not a file of plain tensors"),
}


@pytest.mark.exercises
@pytest.mark.parametrize("what", BAD)
def test_bad_input_gets_one_line_within_the_bound(what, tmp_path, monkeypatch):
    source, says = BAD[what]
    script = tmp_path / "train.py"
    script.write_text(source)
    started = time.monotonic()
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pid"))  # where a hanging script says who it is
    done = check("02", script, tmp_path, timeout=15)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("CANNOT CHECK exercise 02 ")
    assert says in done.stdout, done.stdout
    if what == "hangs":  # stopped at the bound, and not left running
        assert time.monotonic() - started < 60
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "pid").read_text()), 0)


@pytest.mark.exercises
def test_a_split_backward_not_yet_written_cannot_be_checked_and_says_why(tmp_path):
    # Exercise 10b's start: backward_input's body replaced by raise NotImplementedError.
    script = copy_lesson("10_pipeline_parallel", tmp_path / "mine", [(
        "    dx, *douts = torch.autograd.grad(", "    raise NotImplementedError\n"
                                             "    dx, *douts = torch.autograd.grad(")])
    done = check("10b", script.parent / "split_backward.py", tmp_path)
    assert (done.returncode, done.stdout.strip()) == (
        2, "CANNOT CHECK exercise 10b (the backward split in two): backward_input raised "
           "NotImplementedError"), done.stdout + done.stderr


@pytest.mark.exercises
def test_a_ring_not_yet_written_cannot_be_checked_and_says_why(tmp_path):
    # Exercise 11's start: the functions' bodies replaced by raise NotImplementedError.
    script = copy_lesson("11_context_parallel", tmp_path / "mine", [(
        "    if k_chunk > q_chunk:\n        return None\n    scores",
        "    raise NotImplementedError\n    scores")])
    done = check("11", script.parent / "ring_attention.py", tmp_path)
    assert (done.returncode, done.stdout.strip()) == (
        2, "CANNOT CHECK exercise 11 (the ring's causal mask and merge): attend_block raised "
           "NotImplementedError"), done.stdout + done.stderr


@pytest.mark.exercises
@pytest.mark.parametrize("function, find", [
    # Exercise 12's start: the dispatch and combine replaced by raise NotImplementedError; and
    # half way, the dispatch and combine written, run_experts not yet.
    ("MoE.forward", "        # Every kept choice as (token, expert, weight), grouped by expert"),
    ("MoE.run_experts", "        group = self.ep_group\n")], ids=["forward", "run_experts"])
def test_exercise_12_not_yet_written_cannot_be_checked_and_says_which_function(function, find,
                                                                               tmp_path):
    script = copy_lesson("12_expert_parallel", tmp_path / "mine",
                         [(find, "        raise NotImplementedError\n" + find)])
    done = check("12", script.parent / "experts.py", tmp_path)
    assert (done.returncode, done.stdout.strip()) == (
        2, f"CANNOT CHECK exercise 12 (the dispatch and combine): {function} raised "
           "NotImplementedError"), done.stdout + done.stderr


def test_a_missing_script_and_an_unknown_exercise_get_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(CHECK), "02", str(tmp_path / "nope.py")],
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (
        2, f"CANNOT CHECK exercise 02 (make lesson 01 data-parallel with DDP and mp.spawn): "
           f"there is no file {tmp_path / 'nope.py'}")
    done = subprocess.run([sys.executable, str(CHECK), "05", "x.py"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "no exercise '05'" in done.stderr.splitlines()[-1]


# Each rank says who it is, then never returns. A rank stuck in a collective runs no Python
# signal handler until the collective returns, so the SIGINT that torch's mp.spawn sends its
# ranks when their parent dies does not stop it: SIG_IGN stands in for that.
HANGING_BLOCK = """import os, signal, time
def build_blocks(args, mesh, between):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w").close()
    time.sleep(600)
"""


@pytest.mark.exercises
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_transformer_block_that_hangs_is_stopped_with_both_its_ranks(tmp_path, monkeypatch):
    # Exercise 09's second part starts 2 ranks through exercises/block_probe.py: at the time
    # bound, the verdict names the hang, and neither rank is left running.
    (tmp_path / "pids").mkdir()
    (tmp_path / "transformer_block.py").write_text(HANGING_BLOCK)
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    monkeypatch.syspath_prepend(str(ROOT / "exercises"))
    check_tp = load_exercise_module("check_tp")

    class StartedFirst(subprocess.Popen):
        # The bound counts from when both ranks are up: on a loaded machine their start (an
        # import of torch each) can take longer than any bound short enough for a test.
        def communicate(self, timeout=None):
            deadline = time.monotonic() + 300
            while (timeout is not None and len(list((tmp_path / "pids").iterdir())) < 2
                   and self.poll() is None and time.monotonic() < deadline):
                time.sleep(0.2)
            return super().communicate(timeout=timeout)

    monkeypatch.setattr(check_tp.subprocess, "Popen", StartedFirst)
    with pytest.raises(check_tp.Mistake, match="did not finish one forward and backward"):
        check_tp.check_block(str(tmp_path / "train.py"), str(tmp_path), timeout=5)
    ranks = [int(pid.name) for pid in (tmp_path / "pids").iterdir()]
    assert len(ranks) == 2, "the ranks did not start within 300 s"

    def running(pid):  # a process that has exited but not been reaped yet (Z) is not
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5  # SIGKILL is delivered, not waited for
    while any(map(running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, ranks)), "a rank of the probe was left running"


def test_every_link_of_the_checker_points_at_a_heading():
    links = []
    for path in (ROOT / "exercises").glob("*.py"):  # check.py and the checks it calls
        tree = ast.parse(path.read_text())
        links += [(call.args[0].value, "".join(part.value for part in ast.walk(call.args[1])
                                               if isinstance(part, ast.Constant)))
                  for call in ast.walk(tree) if isinstance(call, ast.Call)
                  and getattr(call.func, "id", "") == "readme"]
    assert len(links) > 20
    for lesson, anchor in links:
        assert anchor in readme_anchors(ROOT / lesson / "README.md"), (lesson, anchor)


# ---------------------------------------------------------------------------------------------
# Exercise 13: a copy of lesson 13 with one mistake, each that exercises/break_3d.py makes and a
# few it does not, all checked by one start of the 8 ranks: exercises/check_3d.py's own command
# line, which prints each copy's verdict as check.py does (exercises/check.py 13 runs the same
# check on one copy).
# ---------------------------------------------------------------------------------------------
def load_exercise_module(name):
    spec = importlib.util.spec_from_file_location(f"exercise_{name}",
                                                  ROOT / "exercises" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BREAK_3D = load_exercise_module("break_3d")  # the standard library only: cheap to import
TP_FAILS = "the tp dimension (only layouts with tp 2 fail)"
MORE_3D = [  # mistakes break_3d.py does not make, each an error the checker reads
    BREAK_3D.Broken("13-attn-out-sums-whole", (("parallelize.py", '"attn.out": RowwiseParallel('
                                                "output_layouts=sequence)",
                                                '"attn.out": RowwiseParallel()'),),
                    TP_FAILS, "a layer's output whole where the residual stream is split"),
    BREAK_3D.Broken("13-head-scores-split", (("parallelize.py", "ColwiseParallel(input_layouts="
                                              "sequence, output_layouts=Replicate())",
                                              "ColwiseParallel(input_layouts=sequence)"),),
                    TP_FAILS, "the head's scores split by character"),
]
CASES_3D = [*BREAK_3D.MISTAKES, *MORE_3D]


@pytest.fixture(scope="session")  # as lesson_runs, made once
def verdicts_13(tmp_path_factory):
    """{copy: the lines of its verdict}: the lesson's copy, and one per case, checked at once."""
    folder = tmp_path_factory.mktemp("exercise_13")
    scripts = [copy_lesson("13_capstone", folder / "lesson")]
    for case in CASES_3D:
        BREAK_3D.make(str(folder / case.id), case)
        scripts.append(folder / case.id / "train.py")
    (folder / "tmp").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "exercises" / "check_3d.py"),
                           *map(str, scripts)], cwd=folder, capture_output=True, text=True,
                          env=dict(os.environ, TMPDIR=str(folder / "tmp")), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not os.listdir(folder / "tmp"), "the checker left files in its temporary folder"
    verdicts = {}
    for block in done.stdout.split("== ")[1:]:
        script, *lines = block.splitlines()
        verdicts[Path(script).parent.name] = lines
    return verdicts


@pytest.mark.exercises
@pytest.mark.xdist_group("exercise-13")
def test_exercise_13_passes_the_lesson(verdicts_13):
    assert verdicts_13["lesson"] == [
        "PASS exercise 13 (which dimension is wrong): every layout of your 3-D step equals one "
        "process, on every check"]


@pytest.mark.exercises
@pytest.mark.xdist_group("exercise-13")
@pytest.mark.parametrize("case", CASES_3D, ids=lambda case: case.id)
def test_exercise_13_names_the_dimension_and_the_mistake(case, verdicts_13):
    verdict, likely, where = verdicts_13[case.id]
    assert verdict.startswith("NOT YET exercise 13 (which dimension is wrong): dp x pp x tp = ")
    assert likely.startswith(f"  most likely: {case.dimension}: "), likely
    assert case.says in likely, likely
    # and where to look is the file the mistake is in
    assert where.startswith("  where to look: ") and any(
        f"{case.id}/{file}, " in where for file, _, _ in case.changes), where


@pytest.mark.exercises
@pytest.mark.xdist_group("exercise-13")
def test_exercise_13_without_the_lesson_s_files_cannot_be_checked(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text("")
    done = check("13", tmp_path / "mine" / "train.py", tmp_path)
    assert (done.returncode, done.stdout.strip()) == (
        2, f"CANNOT CHECK exercise 13 (which dimension is wrong): there is no parallelize.py "
           f"beside {tmp_path / 'mine' / 'train.py'}: the copy is the whole of 13_capstone's "
           "Python files"), done.stdout + done.stderr


def test_exercise_13_break_3d_makes_each_mistake_in_a_copy_of_the_lesson(tmp_path):
    # Each mistake's text is once in the lesson (else the list has gone stale), and a copy
    # differs from the lesson by that mistake alone.
    for case in CASES_3D:
        BREAK_3D.make(str(tmp_path / case.id), case)
        lesson = {path.name: path.read_text() for path in (ROOT / "13_capstone").glob("*.py")}
        copy = {path.name: path.read_text() for path in (tmp_path / case.id).glob("*.py")}
        assert sorted(copy) == sorted(lesson)
        changed = sorted(name for name in lesson if copy[name] != lesson[name])
        assert changed == sorted({file for file, _, _ in case.changes}), case.id
    # The command line: one of them at random, the same one for a seed; never over a copy.
    runs = [subprocess.run([sys.executable, str(ROOT / "exercises" / "break_3d.py"),
                            str(tmp_path / f"seeded{i}"), "--seed", "3"],
                           capture_output=True, text=True) for i in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr
    assert runs[0].stdout.startswith(f"{tmp_path / 'seeded0'}: lesson 13 with one mistake")
    assert ({p.name: p.read_text() for p in (tmp_path / "seeded0").glob("*.py")}
            == {p.name: p.read_text() for p in (tmp_path / "seeded1").glob("*.py")})
    again = subprocess.run([sys.executable, str(ROOT / "exercises" / "break_3d.py"),
                            str(tmp_path / "seeded0")], capture_output=True, text=True)
    assert again.returncode == 2 and "is not empty" in again.stderr
