"""Troubleshooting: the same order every epoch (a missing set_epoch). See TROUBLESHOOTING.md.

DistributedSampler shuffles with the seed plus the epoch number, and it only learns the epoch
from sampler.set_epoch(epoch). Without that call every epoch deals every rank the same samples in
the same order, and nothing warns you. This shows rank 0's order for three epochs, without the
call and then with it, as lesson 02's Trainer.train_epoch makes it.

    python troubleshooting/missing_set_epoch.py
"""

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def orders(call_set_epoch, epochs=3):
    # 12 samples whose values are their indices, so a batch shows which samples it holds.
    dataset = TensorDataset(torch.arange(12))
    # num_replicas and rank are given, so no process group is needed to see what rank 0 of 2
    # would be dealt; in a DDP program they come from the process group.
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=3, sampler=sampler)
    seen = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)  # the fix: a new permutation, seeded by seed + epoch
        seen.append([int(i) for (batch,) in loader for i in batch])
    return seen


def show(title, seen):
    print(title)
    for epoch, order in enumerate(seen):
        print(f"  epoch {epoch}: rank 0 gets {order}")


def main():
    without = orders(call_set_epoch=False)
    show("Without set_epoch:", without)
    if all(order == without[0] for order in without):
        print(f"symptom: rank 0 gets the same samples in the same order in all {len(without)} "
              "epochs")

    fixed = orders(call_set_epoch=True)
    show("With sampler.set_epoch(epoch) at the start of every epoch:", fixed)
    if len({tuple(order) for order in fixed}) == len(fixed) and fixed == orders(True):
        print(f"fix: {len(fixed)} different orders, and the same three again on the next run "
              "(seed + epoch), so runs stay reproducible")


if __name__ == "__main__":
    main()
