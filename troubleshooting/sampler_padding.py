"""Troubleshooting: evaluation that counts some samples twice (sampler padding).

DistributedSampler gives every rank the same number of samples. When the data does not split
evenly it pads it by repeating samples from the start. In training that is harmless; in
evaluation the repeats are counted twice and the accuracy is over more samples than the test set
has. This evaluates a fixed set of predictions for 36 test samples on 5 ranks, three ways.
See TROUBLESHOOTING.md.

    python troubleshooting/sampler_padding.py
"""

import torch
from torch.utils.data.distributed import DistributedSampler

TEST_SAMPLES, WORLD_SIZE = 36, 5
# Stand-ins for a model's output: right on every sample but four.
labels = torch.zeros(TEST_SAMPLES, dtype=torch.long)
predictions = labels.clone()
predictions[[0, 1, 17, 30]] = 1


def count(indices):
    """(correct, counted) over one rank's share of the test set."""
    indices = torch.as_tensor(list(indices), dtype=torch.long)
    return int((predictions[indices] == labels[indices]).sum()), len(indices)


def evaluate(shares):
    """Add up every rank's counts, as one all_reduce of [correct, counted] would."""
    correct = sum(count(share)[0] for share in shares)
    counted = sum(count(share)[1] for share in shares)
    return correct, counted


def sampler_shares(drop_last):
    # num_replicas and rank are given, so no process group is needed to see every rank's share.
    return [list(DistributedSampler(range(TEST_SAMPLES), num_replicas=WORLD_SIZE, rank=rank,
                                    shuffle=False, drop_last=drop_last))
            for rank in range(WORLD_SIZE)]


def report(how, correct, counted):
    print(f"  {how:48} {correct}/{counted} = {correct / counted:.1%}")


def main():
    print(f"{TEST_SAMPLES} test samples, {TEST_SAMPLES - 4} predicted right, {WORLD_SIZE} ranks:")
    report("one process (the truth)", *count(range(TEST_SAMPLES)))

    correct, counted = evaluate(sampler_shares(drop_last=False))
    report("DistributedSampler (pads with repeats)", correct, counted)
    if counted > TEST_SAMPLES:
        print(f"symptom: {counted} samples counted for a test set of {TEST_SAMPLES}: "
              f"{counted - TEST_SAMPLES} were counted twice, and the accuracy is off")

    correct, counted = evaluate(sampler_shares(drop_last=True))
    report("DistributedSampler(drop_last=True)", correct, counted)
    left_out = TEST_SAMPLES - counted
    print(f"  (no repeats, but {left_out} sample{'s' if left_out != 1 else ''} never counted)")

    # Lesson 02's evaluate: rank r takes samples r, r + world_size, ...; some ranks get one
    # fewer, which is fine in evaluation, where the ranks do not need to step together.
    correct, counted = evaluate([range(rank, TEST_SAMPLES, WORLD_SIZE)
                                 for rank in range(WORLD_SIZE)])
    report("a plain stride, test_set[rank::world_size]", correct, counted)
    if (correct, counted) == count(range(TEST_SAMPLES)):
        print(f"fix: the stride counts each of the {TEST_SAMPLES} samples exactly once and "
              "gives the true accuracy")


if __name__ == "__main__":
    main()
