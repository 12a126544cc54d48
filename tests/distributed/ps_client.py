"""A client of a parameter server in a process of its own, stopped at a chosen message.

``python ps_client.py ADDRESS PS_NAME TABLE SEED POINT`` attaches to the Ray at ADDRESS and
the parameter server PS_NAME, then runs :func:`batches` (lookup, then apply_gradients, of
each) on TABLE. POINT is ``none`` or ``BATCH:KIND:PHASE:N:SIGNAL``: in batch BATCH, once the
shard answered the N-th PHASE message (``stage`` or ``commit``) of the KIND operation
(``pull``: the lookup, ``push``: the update), the process prints ``at POINT`` and sends
itself SIGNAL (``KILL``, or ``STOP``: it goes on after a SIGCONT). :func:`drive` does the same
inside another process (a Ray worker actor).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

DIM = 4


def batches(seed: int, n: int = 4, keys: int = 200, size: int = 40, grads: str = "normal"):
    """The client's ``(keys, gradients)`` batches (the tests build their references alike)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = rng.integers(0, keys, size) if size < keys else np.arange(keys)
        g = rng.standard_normal((k.size, DIM)).astype(np.float32) if grads == "normal" \
            else np.ones((k.size, DIM), np.float32)
        out.append((k, g))
    return out


def drive(ps_name: str, table: str, seed: int, point: str, **batch_args) -> int:
    """Run the batches through the parameter server, stopping at ``point``; batches run."""
    import ray

    from tensorkv.distributed import ParameterServer, channel

    where: dict = {"batch": -1, "seen": 0}
    stop = None if point == "none" else point.split(":")
    send = channel.Channel.send

    def hooked(self, s, method, name, args, mutating, dim=0, op=0, parts=(), part=None):
        ref, req = send(self, s, method, name, args, mutating, dim, op, parts, part)
        if stop is None or name != table or where["batch"] != int(stop[0]):
            return ref, req
        phase = "stage" if op else method
        kind = method if op else getattr(part, "method", None)
        if (kind, phase) == (stop[1], stop[2]):
            where["seen"] += 1
            if where["seen"] == int(stop[3]):
                ray.get(ref)  # the shard has done it
                print(f"at {point}", flush=True)
                os.kill(os.getpid(), getattr(signal, f"SIG{stop[4]}"))
        return ref, req

    channel.Channel.send = hooked
    try:
        t = ParameterServer(name=ps_name).table(table)
        done = 0
        for i, (k, g) in enumerate(batches(seed, **batch_args)):
            where["batch"] = i
            t.lookup(k)
            t.apply_gradients(k, g)
            done += 1
        return done
    finally:
        channel.Channel.send = send


if __name__ == "__main__":
    import ray

    address, ps_name, table, seed, point = sys.argv[1:6]
    extra = {k: (int(v) if v.isdigit() else v)
             for k, v in (a.split("=", 1) for a in sys.argv[6:])}
    ray.init(address=address, namespace="tensorkv", log_to_driver=False,
             configure_logging=False)
    print(f"done {drive(ps_name, table, int(seed), point, **extra)}", flush=True)
