"""Show the warning that guard_rails.py switches off for lesson 10's pipelines on NCCL.

    python tools/repro_nccl_p2p_warning.py        # needs 2 CUDA GPUs

With torch 2.14, a process group made with `device_id` (as the lessons make theirs, so that NCCL
connects at once: "eager init") runs every unbatched `send` and `recv` on the group's own
communicator, and each rank warns once: "An unbatched P2P op (send/recv) was called on this
ProcessGroup with size 2.  In eager initialization mode, unbatched P2P ops are treated as
independent collective ops, and are thus serialized with ...", and it names the switch that
squashes it.
The pipeline's sends and receives are ordered by its schedule anyway. The warning came with
pytorch/pytorch#132900 (whose ProcessGroupNCCL reads the switch it names,
TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING, when a send or receive is made) and was
reworked in #156748; the rank's environment must hold it before its first send.

This script starts 2 ranks, one per GPU, each sends or receives one tensor, twice: without the
switch and with it set to false, each rank's stderr captured. It exits 0 when the warning
appears without the switch and not with it (the behaviour guard_rails.py relies on), 1
otherwise, and 2 on a machine with fewer than 2 GPUs.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SWITCH = "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"
WARNING = "unbatched P2P op"


def rank_main(rank, port, log_dir, switched_off):
    # Everything this rank writes to stderr, C++ warnings included, goes to its own file.
    stderr = os.open(os.path.join(log_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT)
    os.dup2(stderr, 2)
    if switched_off:
        os.environ[SWITCH] = "false"
    else:
        os.environ.pop(SWITCH, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    tensor = torch.ones(4, device=device)
    if rank == 0:
        dist.send(tensor, dst=1)
    else:
        dist.recv(tensor, src=0)
    torch.cuda.synchronize(device)
    dist.destroy_process_group()


def warned(switched_off):
    """How many of the 2 ranks printed the warning."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as log_dir:
        mp.spawn(rank_main, args=(port, log_dir, switched_off), nprocs=2)
        return sum(WARNING in open(os.path.join(log_dir, f"rank{r}.err")).read() for r in (0, 1))


def main():
    gpus = torch.cuda.device_count()
    if gpus < 2 or not dist.is_nccl_available():
        print(f"needs 2 CUDA GPUs and NCCL (one rank per GPU); this machine has {gpus} GPU(s)")
        sys.exit(2)
    default, silenced = warned(False), warned(True)
    print(f"ranks that warned '{WARNING}': {default} of 2 by default, {silenced} of 2 with "
          f"{SWITCH}=false")
    sys.exit(0 if default == 2 and silenced == 0 else 1)


if __name__ == "__main__":
    main()
