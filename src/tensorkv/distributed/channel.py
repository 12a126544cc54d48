"""A client's link to the shards: sequence numbers, the replay log, recovery from failures.

Every mutating request a client sends to shard ``s`` carries ``(worker, seq)``, ``seq``
counting up by one per shard. The client keeps each mutating request in a log until the
shard reports a checkpoint holding it. When a shard dies, Ray restarts its actor, which
reloads its newest checkpoint; the client then asks which of its requests the shard holds
and sends the rest again, in order, so each is applied exactly once and none is lost.
Reads carry the client's last number, so a shard that is behind is noticed by reads too.

A change that spans several shards is an :class:`Op`: its parts are staged on every shard,
then committed (or aborted and run again), so it lands on every shard or on none
(:mod:`tensorkv.distributed.ops`). Each client puts a small object into Ray (its *lease*) and
gives every shard a reference: Ray reports the object lost once the client's process died.
"""

from __future__ import annotations

import collections
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from tensorkv.distributed import shm, wire
from tensorkv.distributed.ops import settle
from tensorkv.distributed.wire import BEHIND, REFUSED, REREAD, STAGED
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
    op: int = 0  #: stages part of this operation (0: applied at once)
    parts: tuple[int, ...] = ()  #: the operation's shards
    part: Any = None  #: a commit's stage request (not sent; to read a pull's rows again)


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
    on_lost
        Called with a shard's number when its actor is gone, before waiting for it to come
        back: raises if it never will (the parameter server was resharded or shut down).
    """

    def __init__(self, actors: list[Any], worker: str | None = None, logging: bool = True,
                 recover_timeout: float = 60.0, shared_memory: bool = True,
                 on_lost: Callable[[int], None] | None = None) -> None:
        self.actors = list(actors)
        self.worker = worker or uuid.uuid4().hex
        self.logging = logging
        self.recover_timeout = float(recover_timeout)
        self.on_lost = on_lost
        self.seq = [0] * len(self.actors)
        self.op = 0  # operations over several shards sent so far
        self.log: list[collections.deque[Request]] = [collections.deque() for _ in self.actors]
        self.recoveries = 0
        self.link = shm.Link(len(self.actors)) if shared_memory and shm.available() else None
        self._op_bufs: dict[tuple[int, int], list[shm.Buffer]] = {}
        self.lease = ray_module().put(self.worker) if self.actors else None
        for s in range(len(self.actors)):  # before any request of ours (Ray keeps the order)
            self._register(s)

    def _register(self, s: int) -> None:
        """Give shard ``s`` this client's lease (it asks Ray whether the client lives)."""
        self.actors[s].register.remote(self.worker, [self.lease])

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.actors)

    def send(self, s: int, method: str, name: str, args: tuple, mutating: bool,
             dim: int = 0, op: int = 0, parts: tuple[int, ...] = (),
             part: Request | None = None) -> tuple[Any, Request]:
        """Send one request to shard ``s``; ``(object ref, request)``.

        ``dim``: the table's row width; a small ``pull``/``peek``/``push`` then travels as
        one frame (:func:`tensorkv.distributed.wire.fits`). ``op``, ``parts``: stage it as
        the part of operation ``op`` over shards ``parts`` (see :class:`Op`); ``part``: the
        stage request of a ``commit``.
        """
        if mutating:
            self.seq[s] += 1
        req = Request(self.seq[s], method, name, args, mutating,
                      bool(dim) and wire.fits(method, args, dim), dim, op, parts, part)
        if mutating and self.logging:
            self.log[s].append(req)
        ref = self._remote(s, req)
        if method in ("commit", "abort"):  # the part's buffers stay put until it is done
            for buf in self._op_bufs.pop((s, args[0]), ()):
                if method == "commit":
                    buf.holders.append(ref)
        return ref, req

    def _remote(self, s: int, req: Request, plain: bool = False, replay: bool = False) -> Any:
        """Send ``req`` to shard ``s``; ``replay``: sent again to a restarted shard."""
        a = self.actors[s]
        if req.frame:
            data = wire.pack_request(req.method, req.name, self.worker, req.seq, req.args,
                                     req.op, req.parts)
            return a.replay.remote("frame", data) if replay else a.frame.remote(data)
        if not plain and self.link is not None and self.link.enabled[s]:
            ref = self._remote_shm(s, req)
            if ref is not None:
                return ref
        method, args = req.method, (req.name, self.worker, req.seq, *req.args)
        if req.op:
            method, args = "stage", (*args[:3], req.op, req.parts, req.method, *req.args)
        if replay:
            return a.replay.remote(method, *args)
        return getattr(a, method).remote(*args)

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
            descs = (shm.descriptor(q, 0, np.int64, kc.shape),
                     shm.descriptor(r, 0, np.float32, (n, req.dim)), insert)
            if req.op:
                ref = a.stage_shm.remote(req.name, self.worker, req.seq, req.op, req.parts,
                                         "pull", *descs)
                self._op_bufs[(s, req.op)] = [q, r]
            else:
                ref = a.pull_shm.remote(req.name, self.worker, req.seq, *descs)
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
        pdescs = (shm.descriptor(buf, at_k, np.int64, keys.shape),
                  shm.descriptor(buf, at_g, np.float32, grads.shape), step, tick)
        if req.op:
            ref = a.stage_shm.remote(req.name, self.worker, req.seq, req.op, req.parts, "push",
                                     *pdescs)
            self._op_bufs[(s, req.op)] = [buf]
        else:
            ref = a.push_shm.remote(req.name, self.worker, req.seq, *pdescs)
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
        ``seq`` (0 and 0 for reads). A stage answers ``(STAGED, would)`` or
        :data:`~tensorkv.distributed.wire.REFUSED` (see :class:`Op`); a change a save barrier
        refused is sent again once the barrier is gone.
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
            self.lost(s)
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
        if isinstance(out, str) and out == REFUSED:
            if req.op:
                return REFUSED, 0, 0
            return self._again(s, req)
        if isinstance(out, str) and out == REREAD:  # a repeated commit of a pull
            return self._reread(s, req)
        value, ckpt, delta, seq = out
        if isinstance(value, shm.Rows):  # valid until the next request to the shard
            assert link is not None
            value = link.reply[s].array(0, np.float32, (value.m, value.dim))
        self._trim(s, ckpt)
        return value, delta, seq

    def lost(self, s: int) -> None:
        """Shard ``s``'s actor is gone: raise if it will not come back (see ``on_lost``)."""
        if self.on_lost is not None:
            self.on_lost(s)

    def _again(self, s: int, req: Request) -> Any:
        """Send a change a save barrier refused again, once the barrier is gone."""
        log = self.log[s]
        for i, r in enumerate(log):  # a replay must not apply it: it was not applied
            if r.seq == req.seq:
                log[i] = r._replace(method="noop", args=(), frame=False)
        self.wait_thawed([s])
        ref, again = self.send(s, req.method, req.name, req.args, True, req.dim)
        return self.result(s, ref, again)

    def _reread(self, s: int, req: Request) -> Any:
        """The rows of a committed pull, read again (its answer was lost)."""
        stage = req.part
        if stage is None or stage.method != "pull":
            return None, 0, 0
        kc = stage.args[0]
        ref, read = self.send(s, "pull", stage.name, (kc, False, False), False, stage.dim)
        value, _, _ = self.result(s, ref, read)
        return value, 0, 0

    def wait_thawed(self, shards: list[int]) -> None:
        """Wait until no save barrier holds on ``shards`` (a save is taking its snapshot)."""
        ray = ray_module()
        delay = 0.001
        while any(ray.get([self.actors[s].frozen.remote() for s in shards])):
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

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
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, BaseException) and not isinstance(
                        cause, ray.exceptions.RayActorError):
                    raise cause from None
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if isinstance(exc, ray.exceptions.RayActorError):
                    self.lost(s)
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
            self._register(s)  # a restarted shard knows this client's lease no more
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
            refs = [(r, self._remote(s, r, plain=True, replay=True)) for r in todo]
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


class Op:
    """A change over several shards: every shard's part staged, then committed, or redone.

    The parts are staged at once (:meth:`~tensorkv.distributed.shard.ShardServer.stage`);
    :meth:`decide` gathers the answers and commits the operation on every shard if each
    staged its part. A shard that refused its part (a save barrier holds) has the operation
    aborted everywhere; :meth:`run` then waits for the barrier to go and stages it again
    under a new number. Committed or not, it never lands on some shards only (see
    :mod:`tensorkv.distributed.ops` for a client that dies on the way).

    Parameters
    ----------
    channel
        The client's channel.
    method, name
        The request of each part (``pull``, ``push`` or ``call``) and the table.
    args_of
        The request arguments of shard ``s``'s part.
    shards
        The operation's shards.
    dim
        The table's row width (see :meth:`Channel.send`).
    """

    def __init__(self, channel: Channel, method: str, name: str,
                 args_of: Callable[[int], tuple], shards: list[int], dim: int = 0) -> None:
        self.channel = channel
        self.method = method
        self.name = name
        self.args_of = args_of
        self.shards = list(shards)
        self.dim = dim
        self.op = 0
        self.staged: list[tuple[int, Any, Request]] = []
        self.committed: list[tuple[int, Any, Request]] | None = None
        self.failed: Exception | None = None  #: the error that aborted it for good
        self._results: list[Any] | None = None
        self._stage()

    def _stage(self) -> None:
        ch = self.channel
        ch.op += 1
        self.op = ch.op
        parts = tuple(self.shards)
        self.staged = [(s, *ch.send(s, self.method, self.name, self.args_of(s), True,
                                    self.dim, self.op, parts)) for s in self.shards]

    def ready(self) -> bool:
        """Whether every shard answered its stage (:meth:`decide` would not wait)."""
        if self.committed is not None or self.failed is not None:
            return True
        refs = [ref for _, ref, _ in self.staged]
        return len(ray_module().wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def decide(self) -> bool:
        """Commit the operation if every shard staged its part; else abort it everywhere.

        Returns whether it is committed. A shard that failed its part (no such table, say)
        has the operation aborted everywhere and its error raised.
        """
        if self.committed is not None:
            return True
        ch = self.channel
        if self.failed is not None:
            raise self.failed
        acks: list[Any] = []
        err: Exception | None = None
        for s, ref, req in self.staged:
            try:
                acks.append(ch.result(s, ref, req)[0])
            except Exception as exc:
                err = err or exc
                acks.append(None)
        if err is not None or not all(isinstance(a, tuple) and a[0] == STAGED for a in acks):
            self.abort()
            if err is not None:
                self.failed = err
                raise err
            return False
        tick = any(bool(a[1]) for a in acks)  # some shard changes rows: all count the step
        self.committed = [(s, *ch.send(s, "commit", self.name, (self.op, tick), True,
                                       part=req)) for s, _, req in self.staged]
        return True

    def abort(self) -> None:
        """Drop the staged parts on every shard (each refuses the operation from now on).

        Not waited for: every later request of this client reaches each shard after it (and
        a shard that restarts gets it again with the client's other requests).
        """
        ch = self.channel
        for s in self.shards:
            ch.send(s, "abort", self.name, (self.op,), True)

    def withdraw(self) -> None:
        """Abort it whatever the shards answered (an earlier operation must be redone first)."""
        ch = self.channel
        for s, ref, req in self.staged:
            with contextlib.suppress(Exception):
                ch.result(s, ref, req)
        self.abort()

    def redo(self) -> Op:
        """Stage it again once no save barrier holds, and :meth:`run` it."""
        self.channel.wait_thawed(self.shards)
        self._stage()
        return self.run()

    def run(self) -> Op:
        """Decide it, staging it again after each refusal, until it is committed."""
        while not self.decide():
            self.channel.wait_thawed(self.shards)
            self._stage()
        return self

    def results(self) -> list[Any]:
        """``(value, delta, seq)`` of every shard's commit: what each request would answer."""
        if self._results is None:
            self.run()
            assert self.committed is not None
            ch = self.channel
            self._results = [ch.result(s, ref, req) for s, ref, req in self.committed]
        return self._results


def save_barrier(channel: Channel, save: Any, timeout: float | None = None) -> list[Any]:
    """Run ``save(actor, token)`` on every shard at one agreed state; the shards' answers.

    Every shard is frozen first (new changes are refused and retried by their clients once
    the barrier is gone); the changes in flight are then finished or undone on every shard
    (:func:`~tensorkv.distributed.ops.settle`), so every shard holds the same operations;
    then each shard saves and ends the barrier itself (``thaw=token``), all at once. The
    barrier ends on every shard whatever happens.
    """
    ray = ray_module()
    token = uuid.uuid4().hex
    actors = channel.actors
    if len(actors) == 1:  # one shard: its save is one call, between two of its requests
        return list(ray.get([save(a, None) for a in actors]))
    ray.get([a.freeze.remote(token, channel.worker) for a in actors])
    try:
        settle(dict(enumerate(actors)), channel.recover_timeout if timeout is None else timeout,
               force=True)
        return list(ray.get([save(a, token) for a in actors]))
    finally:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.get(a.thaw.remote(token))


__all__ = ["Channel", "Op", "Request", "ray_module", "save_barrier"]
