"""send/recv: one way (send on rank 0, recv on rank 1) or both ways (sendrecv)."""

from __future__ import annotations

import pydatacopy


def sendrecv(sweep):
    def run():
        if sweep.both:
            pydatacopy.sendrecv(sweep.src, sweep.peer, sweep.out, sweep.peer)
        elif sweep.sends:
            pydatacopy.send(sweep.src, sweep.peer)
        else:
            pydatacopy.recv(sweep.out, sweep.peer)

    return sweep.measure(run, sweep.out)
