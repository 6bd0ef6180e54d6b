"""torch 2.14's DCP loads a shard whose bytes changed, without a word (why the lessons' sharded
checkpoints carry checksums.json: guard_rails.py, record_checksums and check_checksums).

    python tools/repro_dcp_no_checksum.py

One process saves a tensor with torch.distributed.checkpoint, one bit of the tensor's bytes in
its shard file is flipped (a disk's error; another epoch's shard copied in does the same to
every byte), and dcp.load reads it back: the metadata and the file's size are as they were,
nothing checks the bytes themselves, and one element comes back changed. torch.load, which DCP
calls on each piece, checks no checksum either. Upstream, a checksum manifest for DCP
checkpoints was proposed in pytorch/torchtitan#4011. Prints what it loaded, and exits 0 if the
changed tensor loaded without an error.
"""

import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: meant

with tempfile.TemporaryDirectory() as folder:
    saved = torch.arange(1024, dtype=torch.float32)
    dcp.save({"weight": saved}, checkpoint_id=folder, no_dist=True)
    shard = f"{folder}/__0_0.distcp"
    data = bytearray(open(shard, "rb").read())
    where = bytes(data).find(saved[100:104].numpy().tobytes())  # the tensor's own bytes
    data[where] ^= 1  # one bit of element 100
    open(shard, "wb").write(data)
    loaded = {"weight": torch.zeros(1024)}
    try:
        dcp.load(loaded, checkpoint_id=folder, no_dist=True)
    except Exception as error:
        print(f"dcp.load refused the changed shard: {type(error).__name__}: {error}")
        sys.exit(1)
    changed = (loaded["weight"] != saved).nonzero().flatten().tolist()
    print(f"dcp.load read the changed shard without an error; elements that differ: {changed} "
          f"({saved[100].item()} saved, {loaded['weight'][100].item()} loaded)")
    sys.exit(0 if changed else 1)
