"""A client's link to the shards: sequence numbers, the replay log, recovery from failures.

Every mutating request a client sends to shard ``s`` carries ``(worker, seq)``, ``seq``
counting up by one per shard. The client keeps each mutating request in a log until the
shard reports a checkpoint holding it. When a shard dies, Ray restarts its actor, which
reloads its newest checkpoint; the client then asks which of its requests the shard holds
and sends the rest again, in order, so each is applied exactly once and none is lost.
Reads carry the client's last number, so a shard that is behind is noticed by reads too.
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any, NamedTuple

import numpy as np

from tensorkv.distributed import shm, wire
from tensorkv.distributed.wire import BEHIND
from tensorkv.errors import ShardUnavailableError, import_optional


def ray_module() -> Any:
    """The ``ray`` module, or a clear error naming the extra to install."""
    return import_optional("ray", "the parameter server (tensorkv.distributed)", "ray")


class Request(NamedTuple):
    """One request of a client to a shard, as logged for replay."""

    seq: int
    method: str  #: ``pull``, ``push`` or ``call``
    name: str  #: the table
    args: tuple
    mutating: bool
    frame: bool = False  #: sent as one ``bytes`` frame (:mod:`~tensorkv.distributed.wire`)
    dim: int = 0  #: the table's row width (room for a pull's rows)


class Channel:
    """Requests of one client (``worker``) to the shards, applied exactly once.

    Parameters
    ----------
    actors
        The shard actors (Ray actor handles), by shard number.
    worker
        The client's id (unique per client; default a random one).
    logging
        Keep mutating requests until a shard checkpoint holds them (needs the shards to
        checkpoint; without it a restarted shard cannot be brought back up to date).
    recover_timeout
        Seconds to wait for a restarted shard before raising
        :class:`~tensorkv.errors.ShardUnavailableError`.
    shared_memory
        Move large pulls and pushes to shards on this node through shared-memory buffers
        (:mod:`~tensorkv.distributed.shm`) rather than Ray's object store.
    """

    def __init__(self, actors: list[Any], worker: str | None = None, logging: bool = True,
                 recover_timeout: float = 60.0, shared_memory: bool = True) -> None:
        self.actors = list(actors)
        self.worker = worker or uuid.uuid4().hex
        self.logging = logging
        self.recover_timeout = float(recover_timeout)
        self.seq = [0] * len(self.actors)
        self.log: list[collections.deque[Request]] = [collections.deque() for _ in self.actors]
        self.recoveries = 0
        self.link = shm.Link(len(self.actors)) if shared_memory and shm.available() else None

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.actors)

    def send(self, s: int, method: str, name: str, args: tuple, mutating: bool,
             dim: int = 0) -> tuple[Any, Request]:
        """Send one request to shard ``s``; ``(object ref, request)``.

        ``dim``: the table's row width; a small ``pull``/``peek``/``push`` then travels as
        one frame (:func:`tensorkv.distributed.wire.fits`).
        """
        if mutating:
            self.seq[s] += 1
        req = Request(self.seq[s], method, name, args, mutating,
                      bool(dim) and wire.fits(method, args, dim), dim)
        if mutating and self.logging:
            self.log[s].append(req)
        return self._remote(s, req), req

    def _remote(self, s: int, req: Request, plain: bool = False) -> Any:
        if req.frame:
            return self.actors[s].frame.remote(
                wire.pack_request(req.method, req.name, self.worker, req.seq, req.args))
        if not plain and self.link is not None and self.link.enabled[s]:
            ref = self._remote_shm(s, req)
            if ref is not None:
                return ref
        fn = getattr(self.actors[s], req.method)
        return fn.remote(req.name, self.worker, req.seq, *req.args)

    def _free(self, buf: shm.Buffer) -> bool:
        """Whether no request uses ``buf`` (those whose answers were never read are done)."""
        h = buf.holders
        if not h:
            return True
        if len(ray_module().wait(h, num_returns=len(h), timeout=0)[0]) == len(h):
            h.clear()
            return True
        return False

    def staging(self, nbytes: int) -> shm.Buffer | None:
        """A shared-memory buffer to build a push's keys and gradients in, or None.

        The arrays of a push that lie in it travel without a copy. None when the buffers are
        off, busy (updates in flight) or the requests are logged for replay (the log must
        keep its own copy).
        """
        link = self.link
        if link is None or self.logging or not all(link.enabled) or \
                not self._free(link.staging):
            return None
        try:
            link.staging.ensure(nbytes)
        except OSError:  # /dev/shm is full
            return None
        return link.staging

    def _remote_shm(self, s: int, req: Request) -> Any:
        """Send a pull or push through the shared-memory buffers of shard ``s``, or None."""
        assert self.link is not None
        q, r = self.link.request[s], self.link.reply[s]
        a = self.actors[s]
        if req.method == "pull" and not req.args[2] and self._free(q) and self._free(r):
            kc, insert = req.args[0], req.args[1]
            n = int(kc[1].sum())  # room for every sighting: the shard looks them all up
            try:
                q.ensure(kc.nbytes)
                r.ensure(n * req.dim * 4)
            except OSError:  # /dev/shm is full: Ray's object store
                return None
            q.array(0, np.int64, kc.shape)[...] = kc
            ref = a.pull_shm.remote(
                req.name, self.worker, req.seq, shm.descriptor(q, 0, np.int64, kc.shape),
                shm.descriptor(r, 0, np.float32, (n, req.dim)), insert)
            q.holders.append(ref)
            r.holders.append(ref)
            return ref
        if req.method != "push":
            return None
        keys, grads, step, tick = req.args
        st = self.link.staging
        at_k, at_g = st.offset_of(keys), st.offset_of(grads)
        if at_k >= 0 and at_g >= 0:  # built in the staging buffer: no copy
            buf = st
        elif self._free(q):
            buf, at_k, at_g = q, 0, -(-keys.nbytes // 64) * 64
            try:
                q.ensure(at_g + grads.nbytes)
            except OSError:
                return None
            q.array(0, np.int64, keys.shape)[...] = keys
            q.array(at_g, np.float32, grads.shape)[...] = grads
        else:
            return None
        ref = a.push_shm.remote(
            req.name, self.worker, req.seq, shm.descriptor(buf, at_k, np.int64, keys.shape),
            shm.descriptor(buf, at_g, np.float32, grads.shape), step, tick)
        buf.holders.append(ref)
        return ref

    @staticmethod
    def _get(ray: Any, ref: Any, **kw: Any) -> Any:
        """``ray.get(ref)``, a reply frame unpacked."""
        out = ray.get(ref, **kw)
        return wire.unpack_reply(out) if isinstance(out, bytes) else out

    def result(self, s: int, ref: Any, req: Request) -> Any:
        """``(result, delta, seq)`` of a request sent by :meth:`send`, recovering if needed.

        ``delta``: how much the request grew the table's ``mutation_seq`` on the shard, to
        ``seq`` (0 and 0 for reads).
        """
        ray = ray_module()
        try:
            out = self._get(ray, ref)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BaseException) and not isinstance(
                    cause, ray.exceptions.RayActorError):
                raise cause from None
            out = BEHIND
        except ray.exceptions.RayActorError:
            out = BEHIND
        link = self.link
        if link is not None:
            for buf in (link.request[s], link.reply[s], link.staging):
                if ref in buf.holders:
                    buf.holders.remove(ref)
            if isinstance(out, str) and out == shm.NO_SHM:  # the shard is on another node
                link.enabled[s] = False
                out = self._get(ray, self._remote(s, req))
        if isinstance(out, str) and out == BEHIND:
            out = self._recover(s, req)
        value, ckpt, delta, seq = out
        if isinstance(value, shm.Rows):  # valid until the next request to the shard
            assert link is not None
            value = link.reply[s].array(0, np.float32, (value.m, value.dim))
        self._trim(s, ckpt)
        return value, delta, seq

    def _trim(self, s: int, ckpt: int) -> None:
        log = self.log[s]
        while log and log[0].seq <= ckpt:
            log.popleft()

    def _applied(self, s: int) -> tuple[int, int]:
        """Wait for shard ``s`` to answer; its ``(applied, checkpointed)`` numbers for us."""
        ray = ray_module()
        deadline = time.monotonic() + self.recover_timeout
        while True:
            try:
                return tuple(ray.get(self.actors[s].applied_seq.remote(self.worker),
                                     timeout=max(1.0, deadline - time.monotonic())))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise ShardUnavailableError(
                        f"shard {s} did not come back within {self.recover_timeout:g} s "
                        f"({type(exc).__name__}); check the Ray cluster (ray status) and the "
                        "shard's log, or raise recover_timeout=") from exc
                time.sleep(0.05)

    def _recover(self, s: int, req: Request) -> Any:
        """Bring shard ``s`` up to date (replay the log), then answer ``req``."""
        ray = ray_module()
        self.recoveries += 1
        for _attempt in range(5):
            applied, ckpt = self._applied(s)
            self._trim(s, ckpt)
            todo = [r for r in self.log[s] if r.seq > applied]
            last = self.seq[s]
            if applied < last and (not todo or todo[0].seq != applied + 1
                                   or todo[-1].seq != last):
                raise ShardUnavailableError(
                    f"shard {s} restarted and lost this client's requests {applied + 1}.."
                    f"{last}: its newest checkpoint is older and the client no longer holds "
                    "them. Give the ParameterServer a checkpoint_url= so shards checkpoint "
                    "and clients keep what came after; the table must be restored from a "
                    "checkpoint now")
            refs = [(r, self._remote(s, r, plain=True)) for r in todo]
            own, failed = None, False
            for r, ref in refs:
                try:
                    out = self._get(ray, ref)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if not isinstance(cause, BaseException) or isinstance(
                            cause, ray.exceptions.RayActorError):
                        failed = True
                        break
                    if r.seq == req.seq and req.mutating:
                        raise cause from None
                    continue  # it failed the first time too, and changed nothing either time
                except ray.exceptions.RayActorError:
                    failed = True
                    break
                if isinstance(out, str) and out == BEHIND:
                    failed = True
                    break
                if r.seq == req.seq and req.mutating:
                    own = out
            if failed:
                continue
            if own is not None:
                return own
            try:
                out = self._get(ray, self._remote(s, req, plain=True))
            except ray.exceptions.RayActorError:
                continue
            if not (isinstance(out, str) and out == BEHIND):
                return out
        raise ShardUnavailableError(
            f"shard {s} kept failing while this client replayed its requests; check the "
            "shard's log (a request that crashes the shard cannot be replayed)")


__all__ = ["Channel", "Request", "ray_module"]
