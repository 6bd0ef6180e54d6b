"""Run a lesson with one piece swapped, for the tests that need a fault or a control.

    python tests/patched_lesson.py <lesson>/train.py PATCH [lesson arguments...]

PATCH is one of:
  no-ddp          replace DistributedDataParallel by a wrapper that does not synchronise
                  gradients: each rank trains on its own (the control for the DDP-math test)
  raise-on-rank-1 rank 1 raises at the start of its second epoch (a crashed rank)

spawn starts each rank by re-running this file's top level (as __mp_main__), so the patch is
applied in every rank, not only in the launching process.
"""

import importlib.util
import sys

from torch import nn

script, patch = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("lesson", script)
lesson = importlib.util.module_from_spec(spec)
sys.modules["lesson"] = lesson  # so the ranks can unpickle lesson.main
spec.loader.exec_module(lesson)


class NoSync(nn.Module):
    def __init__(self, module, **_ignored):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        return self.module(*inputs)


def raise_on_rank_1(self, epoch):
    if self.rank == 1 and epoch == 1:
        raise RuntimeError("injected failure on rank 1")
    return original_train_epoch(self, epoch)


original_train_epoch = lesson.Trainer.train_epoch
if patch == "no-ddp":
    lesson.DDP = NoSync
elif patch == "raise-on-rank-1":
    lesson.Trainer.train_epoch = raise_on_rank_1
else:
    sys.exit(f"error: unknown patch {patch!r}")

if __name__ == "__main__":
    # sys.argv stays as it is: spawn hands it to the ranks, which need the patch's name.
    entry = getattr(lesson, "launch", None) or lesson.main
    entry(lesson.parse_args(sys.argv[3:]))
