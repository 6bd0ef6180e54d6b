"""Troubleshooting: which network interface gloo uses (GLOO_SOCKET_IFNAME).

gloo listens on the address this machine's name resolves to, unless GLOO_SOCKET_IFNAME names an
interface. On a machine with several networks (Ethernet, Wi-Fi, Docker, InfiniBand) the name may
resolve to one the other nodes cannot reach, or to the loopback address, and a multi-node job
hangs at its first collective; the fix is to name the interface that reaches node 0. A common
slip is to give gloo NCCL's syntax (NCCL_SOCKET_IFNAME=^lo,docker0 excludes interfaces; gloo
takes exactly one name). This shows what gloo picks here, that slip, and the fix.
See TROUBLESHOOTING.md.

    python troubleshooting/socket_ifname.py
"""

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist


def start_group(ifname):
    """A group of one process, with GLOO_SOCKET_IFNAME=ifname when gloo creates its device."""
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=5))
        dist.destroy_process_group()
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def main():
    names = [name for _, name in socket.if_nameindex()]
    print(f"This machine's interfaces: {', '.join(names)}")
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
        where = ("a loopback address: fine on one machine, unreachable from other nodes"
                 if ipaddress.ip_address(address).is_loopback else
                 "check that the other nodes reach it: ping it from them")
        print(f"Without GLOO_SOCKET_IFNAME gloo listens on {address} (what {host!r} resolves "
              f"to): {where}")
    except OSError:
        print(f"{host!r} does not resolve: gloo falls back to the loopback address, with a "
              "warning that tells you to set GLOO_SOCKET_IFNAME")

    try:
        start_group("^lo")
    except RuntimeError as error:
        print(f"GLOO_SOCKET_IFNAME=^lo: init_process_group raised RuntimeError:\n  {error}")
        print("symptom: gloo takes one interface name; ^lo is NCCL's syntax for 'all but lo'")

    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is None:
        print("(no interface named lo or lo0 here, so the fix is not shown)")
        return
    start_group(loopback)
    print(f"fix: GLOO_SOCKET_IFNAME={loopback}, an interface of this machine: the group started. "
          "Across nodes, name the one that reaches node 0: ip route get <node 0's address>")


if __name__ == "__main__":
    main()
