"""The companion notebooks: stored without outputs, and each executed top to bottom on the CPU.

They are executed by the very commands README.md shows a learner for executed copies (`jupyter
nbconvert --execute`, three notebooks a line): the listings check leaves that block to this
file (its marker says so), which runs each line as it stands with bash, one test a line, in a
copy of the repository, with this interpreter's jupyter and a kernel that runs this interpreter.
So each notebook runs once in CI and the README's commands are proven. Each test then reads the
executed copies in runs/notebooks/executed and checks what each notebook printed and drew; a
notebook that fails is named with the cell and its traceback, from nbconvert's output. (nbmake
would add a plugin and a requirement; nbval is made to compare stored outputs, which these
notebooks do not keep.)

They are stored without outputs, so that diffs stay readable and no stale number or figure can
disagree with the code: nbstripout, with the arguments of its hook in .pre-commit-config.yaml,
strips them after a run (`pre-commit run --all-files`), and a test fails until it has.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys

import nbformat
import pytest
import yaml  # pre-commit's own dependency: it reads .pre-commit-config.yaml with it
from nbclient import NotebookClient

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from check_listings import copy_repository  # noqa: E402

NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
LESSONS = sorted({p.parent.name for name in ("train.py", "plan.py")  # 14's program: plan.py
                  for p in ROOT.glob(f"[0-9][0-9]_*/{name}")})

# README.md's block of commands that execute the notebooks, right after this marker: the
# listings check does not run it, the tests below do, line by line.
README_MARKER = ("<!-- listing: not run (tests/test_notebooks.py runs these lines as they "
                 "stand) -->")
EXECUTED = "runs/notebooks/executed"
README_LINE = re.compile(r"jupyter nbconvert --to notebook --execute --output-dir "
                         rf"{EXECUTED} (notebooks/\S+\.ipynb) *(?:#.*)?")
RUN_TIMEOUT = 840  # seconds one line's notebooks may take, within the test's timeout below
COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # the terminal colours of IPython's tracebacks


def readme_lines():
    """The lines of README.md's ```bash block right after README_MARKER; [] if it has none."""
    lines = (ROOT / "README.md").read_text().splitlines()
    if README_MARKER not in lines:
        return []
    start = lines.index(README_MARKER) + 2  # the marker, then the ```bash fence
    return lines[start:lines.index("```", start)]


def notebooks_of(line):
    """The notebooks a README line executes: its pattern, globbed as bash does."""
    match = README_LINE.fullmatch(line)
    return sorted(ROOT.glob(match.group(1))) if match else []


README_LINES = readme_lines()

# Besides running without an error and drawing a figure, what each notebook must have printed:
# the lesson's own result, from the script it ran or from the demo it is about.
EXPECTED_TEXT = {
    "01_single_gpu": ["test accuracy:", "18 steps; the last batch has 6 wines"],
    "02_multi_gpu_spawn": ["every rank ends with the sum of all 4 gradients: True",
                           "all_reduce over one rank gives back", "AttributeError",
                           "test accuracy:", "largest difference between the two loss curves"],
    "03_multi_node": ["rank 3 = 1 * 2 + 1", "node 1 wrote: nothing", "test accuracy:"],
    "04_checkpointing": ["simulated crash of rank 1", "resuming from",
                         "losses equal: True; final.pt bitwise equal: True",
                         "weights_only=True refused it"],
    "05_model_parallel_ddp": ["same outputs: True", "test accuracy:",
                              "largest difference between the loss curves"],
    "06_ddp_in_practice": ["accumulated gradient equals the big batch's: True",
                           "all-reduces: 1 for the batch of 32, 1 for 2 micro-batches with "
                           "no_sync, 2 without it", "test accuracy:",
                           "rank 1: 180 gradient all-reduces in 100 optimizer steps",
                           "both ranks measured the same gradient norms: True"],
    "07_sharding": ["same weights under all three strategies: True",
                    "drawing agrees with the measured bytes: True",
                    "model.fc1.weight rows 2048-4095 in __1_0.distcp", "test accuracy:"],
    "08_ddp_from_scratch": ["--bucket-mb 1: 4 bucket(s)", "gradient all-reduces per step: 10",
                            "  bucket 3 (57,344 bytes): fc1.bias fc1.weight", "test accuracy:",
                            "all-reduces in one step, counted in the trace: after-backward 10, "
                            "buckets 4", "first all-reduce launched during backward: "
                            "after-backward False, buckets True"],
    "09_tensor_parallel": ["sum of the 2 partial outputs equals the whole model's: True",
                           "drawing agrees with the measured bytes: True",
                           "drawing agrees with the checkpoint's chunks: True",
                           "equal within 1e-6: True", "test accuracy:"],
    "11_context_parallel": ["blocks per rank, balanced: [9, 9, 9, 9]",
                            "merged equals full attention: True",
                            "--cp 2 against --cp 1 in float64: largest difference",
                            "equal within 1e-12: True"],
    "10_pipeline_parallel": ["as 1f1b defines: yes", "as interleaved defines: yes",
                             "every rank ran the order its schedule defines: True",
                             "gpipe: at most [4, 4] micro-batches held; all m = 4: True",
                             "1f1b: at most [2, 1] micro-batches held; p - s = [2, 1]: True",
                             "replayed without overheads, each defined order has the formula's "
                             "bubble: True",
                             "same weights under all four schedules (within 1e-6): True",
                             "no more than 1F1B's 2 whole ones: True",
                             "test accuracy:"],
    "12_expert_parallel": ["drawing agrees with MoE.load: True",
                           "MoE equals every expert on every token: True",
                           "kept 24 of 32 choices (75%)",
                           "each expert takes the first min(choices, 4), and MoE.load counts "
                           "those: True", "dropped tokens get 0 from the layer: True",
                           "every step routes all 2048 choices of each block: True",
                           "--ep 2 against --ep 1 in float64: largest difference",
                           "equal within 1e-10: True"],
    "13_capstone": ["as in torch.arange(8).view(2, 2, 2): True",
                    "groups as build_mesh's docstring lists them: True",
                    "the rule agrees with the checkpoint's chunks: True",
                    "fake ranks agree with the run's measured bytes: True",
                    "--dp 2 --pp 2 --tp 2 against one process in float64: largest difference",
                    "equal within 1e-12: True"],
    "14_planning": ["$ python 14_planning/plan.py", "$ python 13_capstone/train.py",
                    "every layout uses the 64 GPUs: True",
                    "more than 4 times the bytes (the scores grow as s^2): True",
                    "16 times the tokens, 16 times the bytes: True",
                    "FSDP2 is ZeRO-3 to the byte: True",
                    "the planner's bytes equal the real run's: True"],
}


def read(path):
    return nbformat.read(path, as_version=4)


def nbstripout(*args):
    """nbstripout with the arguments its pre-commit hook passes, so the tests check the stored
    notebooks against exactly what the hook writes."""
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hook = next(hook for repo in config["repos"] for hook in repo["hooks"]
                if hook["id"] == "nbstripout")
    return subprocess.run([sys.executable, "-m", "nbstripout", *hook["args"], *args],
                          capture_output=True, text=True)


@pytest.fixture(scope="session")
def jupyter_path(tmp_path_factory):
    """A folder holding a `python3` kernel that runs this very interpreter.

    Put first on JUPYTER_PATH, it wins over any python3 kernel registered elsewhere (for example
    with `ipykernel install --user` from another Python), so the notebooks run with the packages
    the tests run with."""
    path = tmp_path_factory.mktemp("jupyter")
    kernel = path / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
    }))
    return path


def execute(notebook, cwd, jupyter_path, runs_dir, monkeypatch):
    """Run every cell in a fresh kernel started in cwd, as Jupyter would; raise at the first
    cell that fails. The notebook's runs write into runs_dir."""
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(
        filter(None, [str(jupyter_path), os.environ.get("JUPYTER_PATH")])))
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(runs_dir))
    client = NotebookClient(notebook, kernel_name="python3", timeout=240,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return notebook


def outputs(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs]


def test_every_lesson_has_a_notebook():
    names = [path.stem for path in NOTEBOOKS]
    assert names == LESSONS, "every lesson NN_name/ needs notebooks/NN_name.ipynb, and only those"
    assert set(EXPECTED_TEXT) == set(names)
    # ... and the README's table of notebooks has a row for each, linking it.
    readme = (ROOT / "README.md").read_text()
    missing = [path.name for path in NOTEBOOKS if f"](notebooks/{path.name})" not in readme]
    assert not missing, f"README.md's table of notebooks has no row for {missing}"


def test_stored_without_outputs():
    result = nbstripout("--verify", *map(str, NOTEBOOKS))
    assert result.returncode == 0, (result.stdout + result.stderr
                                    + "strip them with: pre-commit run nbstripout --all-files")


def test_stripping_restores_a_notebook_that_was_run(tmp_path):
    # The guard must bite: what a run leaves in a notebook is reported, and stripping it gives
    # back the stored file byte for byte, the cell ids and the collapsed answers included.
    stored = NOTEBOOKS[0]
    notebook = read(stored)
    for number, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
        cell.execution_count = number + 1
        cell.outputs = [nbformat.v4.new_output("stream", text="printed\n")]
        cell.metadata["execution"] = {"shell.execute_reply": "2024-01-01T00:00:00Z"}
    # What ipykernel writes on every run (an executed copy of this notebook had exactly these).
    notebook.metadata["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
        "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3", "version": "3.11.7"}
    run = tmp_path / stored.name
    nbformat.write(notebook, run)
    result = nbstripout("--verify", str(run))
    assert result.returncode == 1
    assert f"would have stripped {run}" in result.stdout
    assert nbstripout(str(run)).returncode == 0
    assert run.read_bytes() == stored.read_bytes()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_what_every_notebook_has(path):
    notebook = read(path)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert f'LESSON = "{path.stem}"' in code, "the notebook names its lesson"
    if path.stem != LESSONS[0]:
        assert "show_diff(LESSON)" in code, "it shows the diff from the lesson it builds on"
    headings = [cell.source.splitlines()[0] for cell in notebook.cells
                if cell.cell_type == "markdown"]
    assert "## Exercises" in headings
    answers = [i for i, cell in enumerate(notebook.cells) if cell.source == "## Answers"]
    assert len(answers) == 1 and answers[0] < len(notebook.cells) - 1, "one Answers section"
    # Every answer is collapsed, so that a learner opens it on purpose.
    for cell in notebook.cells[answers[0] + 1:]:
        assert cell.metadata.get("jupyter", {}).get("source_hidden"), (
            f"{path.name}, cell {cell.id}: an answer that is not collapsed")


def test_setup_cell_is_the_same_in_every_notebook():
    # Copied on purpose, so that each notebook stands alone; this keeps the copies from drifting.
    setups = {path.name: next(c.source for c in read(path).cells if c.id == "setup")
              for path in NOTEBOOKS}
    first = setups[NOTEBOOKS[0].name]
    for name, source in setups.items():
        assert source == first, f"{name}'s setup cell differs from {NOTEBOOKS[0].name}'s"


def test_setup_finds_the_repository_from_anywhere_inside_it(jupyter_path, tmp_path,
                                                            monkeypatch):
    # Started in the repository root (the notebook runs below start in notebooks/), then moved
    # to a folder below the root, then outside the repository.
    setup = next(c for c in read(NOTEBOOKS[0]).cells if c.id == "setup")
    notebook = nbformat.v4.new_notebook(cells=[
        setup,
        nbformat.v4.new_code_cell("print(ROOT)"),
        nbformat.v4.new_code_cell("os.chdir(ROOT / '01_single_gpu'); print(find_root())"),
        nbformat.v4.new_code_cell(
            f"os.chdir({str(tmp_path)!r})\n"
            "try:\n    find_root()\nexcept FileNotFoundError as error:\n    print(error)"),
    ])
    execute(notebook, ROOT, jupyter_path, tmp_path, monkeypatch)
    printed = [output.text.strip() for output in outputs(notebook)]
    assert printed[:2] == [str(ROOT), str(ROOT)]
    assert "start Jupyter inside the repository" in printed[2]


def test_readmes_lines_execute_every_notebook_once():
    assert README_LINES, f"README.md has no ```bash block right after {README_MARKER}"
    for line in README_LINES:
        assert README_LINE.fullmatch(line), (
            f"README.md: {line!r} is not `jupyter nbconvert --to notebook --execute "
            f"--output-dir {EXECUTED} notebooks/...`, the line the tests below check")
    executed = [path for line in README_LINES for path in notebooks_of(line)]
    assert sorted(executed) == NOTEBOOKS, (
        "README.md's lines must execute every notebook exactly once; they execute "
        f"{[path.name for path in executed]}")


def failed_cell(output):
    """From nbconvert's output: the cell that failed and its traceback, else its last lines."""
    output = COLOUR.sub("", output)
    start = output.rfind("An error occurred while executing the following cell:")
    return output[start:] if start >= 0 else "\n".join(output.splitlines()[-80:])


def run_line(line, cwd, env):
    """Run one line with bash in cwd; on RUN_TIMEOUT, stop it and everything it started."""
    with subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the kernel ends with nbconvert, its parent
            output, _ = process.communicate()
            return None, output
        return process.returncode, output


@pytest.mark.notebooks
@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("line", README_LINES, ids=lambda line: "+".join(
    path.stem for path in notebooks_of(line)) or line)
def test_readmes_line_executes_its_notebooks(line, jupyter_path, tmp_path):
    # As a learner runs it: from the root of the repository, jupyter from the virtual
    # environment, each notebook's kernel started in notebooks/, its runs in runs/notebooks/.
    copy = tmp_path / "repository"
    copy_repository(ROOT, copy)  # tools/check_listings.py's: a clone's files, no runs/
    env = {**os.environ,
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "JUPYTER_PATH": os.pathsep.join(filter(None, [str(jupyter_path),
                                                         os.environ.get("JUPYTER_PATH")]))}
    env.pop("DDP_NOTEBOOK_RUNS", None)
    returncode, output = run_line(line, copy, env)
    if returncode != 0:
        converting = re.findall(r"Converting notebook (\S+)", output)
        failed = converting[-1] if converting else "no notebook"
        what = (f"still running after {RUN_TIMEOUT} s, stopped" if returncode is None
                else f"exit {returncode}")
        pytest.fail(f"{failed} failed ({what}) in README.md's line\n    {line}\n"
                    f"{failed_cell(output)}")
    for path in notebooks_of(line):
        executed = copy / EXECUTED / path.name
        assert executed.is_file(), f"{line!r} wrote no {EXECUTED}/{path.name}"
        everything = outputs(read(executed))
        figures = [o for o in everything if "image/png" in o.get("data", {})]
        assert figures, f"{path.name} drew no figure"
        printed = "".join(o.text for o in everything if o.output_type == "stream")
        # It ran its lesson's script as a separate process, and that printed its results.
        program = {"14_planning": "plan.py",  # 14 trains nothing
                   "10_pipeline_parallel": "measure_bubble.py"}.get(path.stem, "train.py")
        for fragment in [f"$ python {path.stem}/{program}", *EXPECTED_TEXT[path.stem]]:
            assert fragment in printed, f"{path.name} did not print {fragment!r}"


def rank_runs(notebook):
    """The arguments of every run of several ranks a notebook starts (run_lesson calls and
    command lists naming --world-size, --nproc-per-node, --stages, --cp, --ep, --dp, --pp or
    --tp), with *name and *map(str, name) expanded from the notebook's own list assignments."""
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    code = code.replace("%matplotlib inline", "")  # IPython's, not Python's
    tree = ast.parse(code)
    lists = {node.targets[0].id: node.value for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and isinstance(node.value, ast.List)}

    def strings(nodes):
        for node in nodes:
            if isinstance(node, ast.Starred):
                node = node.value
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "map":
                    node = node.args[1]
                if isinstance(node, ast.Name) and node.id in lists:
                    yield from strings(lists[node.id].elts)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield node.value

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "run_lesson":
            found = list(strings(node.args))
        elif isinstance(node, ast.List):
            found = list(strings(node.elts))
        else:
            continue
        if {"--world-size", "--nproc-per-node", "--stages", "--cp", "--ep", "--dp", "--pp",
                "--tp"} & set(found):
            yield found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_ranks_run_on_gloo(path):
    # The notebooks' figures and printed checks are the CPU's; on a machine with 2 or more GPUs,
    # a run of several ranks without --backend gloo would pick NCCL instead.
    runs = list(rank_runs(read(path)))
    assert runs or path.stem == LESSONS[0], f"{path.name}: no run of several ranks found"
    for args in runs:
        assert "gloo" in args, f"{path.name} runs several ranks without --backend gloo: {args}"
