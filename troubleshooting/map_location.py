"""Troubleshooting: a checkpoint loads onto the wrong GPU, or not at all (map_location).

torch.save records, for every tensor, the device it was on ("cuda:1"), and torch.load puts it
back there. A checkpoint written by the rank on GPU 1 therefore loads onto GPU 1 on every rank
that reads it (rank 0's copy lands on GPU 1, next to rank 1's), onto a GPU that does not exist
on a smaller machine, or not at all on a laptop. map_location says where the tensors go instead.
See TROUBLESHOOTING.md.

    python troubleshooting/map_location.py
"""

import os
import tempfile

import torch
from torch import nn

# This machine may have no GPU, so the checkpoint is written as rank 1 on cuda:1 would write
# it: a tagger registered with torch.serialization.register_package (the hook torch uses to
# record each tensor's device) records "cuda:1" for the CPU tensors of this one save.
pretend_cuda1 = False


def tag_as_cuda1(storage):
    return "cuda:1" if pretend_cuda1 and storage.device.type == "cpu" else None


def leave_to_torch(storage, location):
    return None  # loading is torch's own business


torch.serialization.register_package(-1, tag_as_cuda1, leave_to_torch)


def main():
    global pretend_cuda1
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        pretend_cuda1 = True
        torch.save(nn.Linear(13, 3).state_dict(), path)
        pretend_cuda1 = False
        print(f"A checkpoint written on cuda:1; this machine has {torch.cuda.device_count()} "
              "GPU(s).")

        try:
            weights = torch.load(path, weights_only=True)
            print(f"symptom: torch.load without map_location put the weights on "
                  f"{weights['weight'].device}, the GPU of the rank that saved them, whichever "
                  "rank loads them")
        except RuntimeError as error:
            print(f"torch.load without map_location raised RuntimeError:\n  {error}")
            print("symptom: the checkpoint names a GPU this machine does not have")

        weights = torch.load(path, map_location="cpu", weights_only=True)
        print(f"fix: torch.load(path, map_location='cpu') put them on "
              f"{weights['weight'].device}")
        if torch.cuda.is_available():
            local_rank = 0  # in a DDP program: this process's local rank
            weights = torch.load(path, map_location=f"cuda:{local_rank}", weights_only=True)
            print(f"fix: map_location=f'cuda:{{local_rank}}' put them on "
                  f"{weights['weight'].device}, this rank's own GPU")


if __name__ == "__main__":
    main()
