"""The course's deliberate mistakes: each breaks one claim a README makes, and a test catches it.

`python tools/mutate.py` applies each one to a fresh copy of the repository and runs its tests
there; a mistake that every test lets through is a claim without a proof. The table of claims,
tests and mistakes in tests/README.md is printed from this list (`python tools/mutate.py --table`).

An entry replaces `find`, which must occur exactly once in `file` (else the list has gone stale), by
`replace`: one line that a learner writes by mistake ("learner") or that a tidy-up could slip in
("refactor"). `tests` name the fewest and fastest tests that must fail on it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str  # "02-loss-from-rank-0": the lesson's number, then the mistake in a few words
    file: str  # relative to the repository root, e.g. "02_multi_gpu_spawn/train.py"
    find: str  # text that occurs exactly once in file
    replace: str  # what replaces it: the mistake
    claim: str  # the claim it breaks, as the README states it, in one short sentence
    readme: str  # where that claim is made, e.g. "02_multi_gpu_spawn/README.md#global-metrics"
    tests: tuple  # pytest node ids ("tests/test_x.py::test_y") that must fail on it
    kind: str = "learner"  # "learner" (a mistake learners make) or "refactor"


MUTANTS = [
    # --- lesson 02: mp.spawn, DistributedSampler, all-reduced metrics ---
    # --- lesson 03: torchrun, global and local rank ---
    # --- lesson 04: checkpoints, resume ---
    # --- lesson 05: a model split over two devices, DDP over the pairs ---
    # --- lesson 06: gradient accumulation, mixed precision, learning-rate schedule ---
    # --- lesson 07: FSDP and sharded checkpoints ---
    # --- lesson 08: DDP from scratch ---
]
