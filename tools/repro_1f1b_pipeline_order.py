"""Show how torch 2.14's Schedule1F1B numbers the last stage's forwards in its pipeline_order.

    python tools/repro_1f1b_pipeline_order.py

A schedule's pipeline_order is its plan: for every rank, the forwards (F) and backwards (B) it
runs, each with its micro-batch. Schedule1F1B builds it in _get_pipeline_order
(torch/distributed/pipelining/schedules.py, added by pytorch/pytorch#155935). For the last
rank, which runs no warm-up forward, the micro-batch counter starts at 0 and is raised before
its first forward, so that rank's forwards are numbered 1 to m, not 0 to m - 1: with 4 stages
and 8 micro-batches, 3F1 ... 3F8, and micro-batch 8 does not exist. The schedule itself runs
3F0 ... 3F7 (its _step_microbatches counts on its own); only the plan is off.

Lesson 10 compares the order each rank ran with the order its schedule defines, so for 1F1B
it writes the order itself (defined_order in 10_pipeline_parallel/timeline.py) and reads
pipeline_order only for the interleaved schedule. The plan needs no process group: this script
calls _get_pipeline_order on a stand-in that has the two attributes it reads. It exits 0 while
the numbering is as described (the behaviour lesson 10 works around), 1 once it starts at 0:
then defined_order may read the library's plan for 1F1B too.
"""

import sys
from types import SimpleNamespace

from torch.distributed.pipelining.schedules import Schedule1F1B

STAGES, MICROBATCHES = 4, 8


def main():
    stand_in = SimpleNamespace(_num_stages=STAGES, _n_microbatches=MICROBATCHES)
    plan = Schedule1F1B._get_pipeline_order(stand_in)
    last = STAGES - 1
    forwards = [str(a) for a in plan[last] if a is not None and a.computation_type.value == "F"]
    expected = [f"{last}F{i}" for i in range(MICROBATCHES)]
    print(f"Schedule1F1B's plan for rank {last} of {STAGES}, {MICROBATCHES} micro-batches:")
    print(f"  forwards:   {' '.join(forwards)}")
    print(f"  micro-batches 0 to {MICROBATCHES - 1}: {' '.join(expected)}")
    shifted = forwards == [f"{last}F{i + 1}" for i in range(MICROBATCHES)]
    print("the last stage's forwards are numbered from 1:", shifted)
    sys.exit(0 if shifted else 1)


if __name__ == "__main__":
    main()
