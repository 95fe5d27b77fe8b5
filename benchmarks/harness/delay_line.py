"""A shared link with a rate and a one-way delay, in user space, for kernels without netem.

Each rank runs in a network namespace of its own with a TUN device ``tun0`` (10.200.0.<rank + 1>).
This process holds every namespace's TUN device: it reads each IP packet the ranks send, lets it
onto the link when the link is free (one link for all ranks: packets queue behind each other at
``rate``), and writes it into the destination's TUN device ``delay`` seconds after it has crossed.
Its timer has a resolution of about a millisecond, so keep the rate at 1 Gbit/s or below (a
packet of 64 KB takes half a millisecond at 1 Gbit/s); the kernel's tbf (``netns.py``) shapes
faster links without delay.

Run by ``netns.py`` as ``python delay_line.py RATE_BITS_PER_S DELAY_S NAMESPACE...`` (one
namespace per rank, in rank order): it prints ``ready`` once every device is open, then forwards
until it is killed.
"""

import ctypes
import fcntl
import heapq
import os
import select
import struct
import sys
import time

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
DEVICE = "tun0"
MTU = 65000


def address(rank):
    return f"10.200.0.{rank + 1}"


def open_tun(namespace):
    """The TUN device ``tun0`` of ``namespace`` (made there by ``ip tuntap``), opened from inside it."""
    libc = ctypes.CDLL(None, use_errno=True)
    ns = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEVICE.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def forward(devices, rate, delay):
    """Move packets between ``devices`` (rank -> TUN fd) forever, at ``rate`` bits/s plus ``delay`` s."""
    by_destination = {bytes(map(int, address(r).split("."))): fd for r, fd in devices.items()}
    poll = select.epoll()
    for fd in devices.values():
        poll.register(fd, select.EPOLLIN)
    due, count, link_free = [], 0, 0.0
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, fd, packet = heapq.heappop(due)
            os.write(fd, packet)
        for fd, _ in poll.poll(max(0.0, due[0][0] - now) if due else -1):
            while True:
                try:
                    packet = os.read(fd, MTU + 4096)
                except BlockingIOError:
                    break
                out = by_destination.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
                if out is None:
                    continue          # not IPv4 to a rank: nothing to deliver
                link_free = max(link_free, time.monotonic()) + len(packet) * 8 / rate
                heapq.heappush(due, (link_free + delay, count, out, packet))
                count += 1


def main(argv):
    rate, delay, namespaces = float(argv[0]), float(argv[1]), argv[2:]
    devices = {rank: open_tun(ns) for rank, ns in enumerate(namespaces)}
    print("ready", flush=True)
    forward(devices, rate, delay)


if __name__ == "__main__":
    main(sys.argv[1:])
