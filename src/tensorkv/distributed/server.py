"""ParameterServer: shard actors on Ray, their tables, checkpoints, resharding, shutdown.

A parameter server named ``name`` is a small registry actor (``tensorkv-ps-<name>``, holding
the shard count and generation) and ``num_shards`` shard actors
(:class:`~tensorkv.distributed.shard.ShardServer`), all named in the Ray namespace
``tensorkv``, so any process of the Ray job attaches to them by name. With a
``checkpoint_url`` the shard actors restart after a failure (Ray's ``max_restarts``), reload
their newest checkpoint, and the clients replay the updates since (see
:mod:`tensorkv.distributed.channel`). Changes over several shards are all or nothing
(:mod:`tensorkv.distributed.ops`); saves take every shard at one agreed state behind a save
barrier (:meth:`ParameterServer.save`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import pickle
import re
import uuid
import weakref
from typing import Any

import numpy as np

from tensorkv.distributed.channel import Channel, ray_module, save_barrier
from tensorkv.distributed.local import start_local_ray
from tensorkv.distributed.ops import NAMESPACE, settle, shard_actor_name
from tensorkv.distributed.shard import ShardServer, dumps
from tensorkv.distributed.table import ShardedEmbeddingTable, resolve_tag
from tensorkv.errors import ConfigError, ReshardedError, ShardUnavailableError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LIVE: weakref.WeakSet[ParameterServer] = weakref.WeakSet()


class Registry:
    """What every client of a parameter server must agree on (a tiny named actor)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = dict(state)

    def get(self) -> dict[str, Any]:
        """The shard count, generation and settings."""
        return dict(self.state)

    def set(self, state: dict[str, Any]) -> None:
        """Replace the state (after a reshard)."""
        self.state = dict(state)


class ParameterServer:
    """Embedding tables sharded over Ray actors.

    Parameters
    ----------
    num_shards
        Shards to start; None attaches to the running parameter server ``name``.
    name
        Name of the parameter server (letters, digits, ``-_.``); default a random one. If
        shards of that name run already, this attaches to them (``num_shards`` must then
        match or be None).
    checkpoint_url
        Store URL the shards checkpoint into (``lmdb:///abs/path``, ``redis://...``; every
        shard process must reach it). With it, a shard that dies is restarted by Ray,
        reloads its newest checkpoint and gets the updates since replayed by its clients:
        none is lost, none applied twice. Without it a lost shard's rows are gone.
    checkpoint_every
        Mutating requests a shard serves between two checkpoints (incremental saves).
    checkpoint_full_every
        Every this many checkpoints of a shard one is a full save, after which its older
        checkpoint tags are deleted.
    mode, staleness
        Defaults for :meth:`table`: ``"sync"`` or ``"async"`` updates (see
        :class:`ShardedEmbeddingTable`).
    worker
        This client's id for exactly-once updates (default: a new random id). Two live
        clients must not share one.
    max_restarts
        How often Ray may restart a shard actor (-1: without limit). Default -1 with a
        ``checkpoint_url``, else 0.
    actor_options
        Extra ``.options(...)`` for the shard actors (resources such as ``num_cpus``,
        ``scheduling_strategy``); shards default to ``num_cpus=0``.
    recover_timeout
        Seconds a client waits for a restarted shard.
    shared_memory
        Move large pulls and pushes to shards on this client's node through reused
        shared-memory buffers in ``/dev/shm`` rather than Ray's object store (shards on
        other nodes, and platforms without ``/dev/shm``, use the object store anyway).
    resolve_after
        Seconds a change over several shards may stay half-done (its client died between
        two of its messages) before the shards finish or undo it (see
        :mod:`tensorkv.distributed.ops`). Set when the parameter server starts.

    Notes
    -----
    Without a running Ray, this starts a local one that listens on the loopback address only
    (:func:`~tensorkv.distributed.start_local_ray`); ``ray.init(...)`` first for a cluster.

    Examples
    --------
    Not run as a doctest (it starts a local Ray cluster, which takes seconds);
    tests/distributed runs the same calls.

    >>> import numpy as np                                           # doctest: +SKIP
    >>> from tensorkv.distributed import ParameterServer, start_local_ray  # doctest: +SKIP
    >>> start_local_ray(num_cpus=2)                                   # doctest: +SKIP
    >>> ps = ParameterServer(2, name="demo")                          # doctest: +SKIP
    >>> t = ps.table("user", dim=8, optimizer="adagrad")              # doctest: +SKIP
    >>> t.lookup(np.array([3, 7, 3])).shape                           # doctest: +SKIP
    (3, 8)
    >>> ps.shutdown()                                                 # doctest: +SKIP
    """

    def __init__(self, num_shards: int | None = None, name: str | None = None,
                 checkpoint_url: str | None = None, *, checkpoint_every: int = 100,
                 checkpoint_full_every: int = 20, mode: str = "sync", staleness: int = 2,
                 worker: str | None = None,
                 max_restarts: int | None = None, actor_options: dict[str, Any] | None = None,
                 recover_timeout: float = 60.0, shared_memory: bool = True,
                 resolve_after: float = 2.0) -> None:
        ray = ray_module()
        if num_shards is not None and (isinstance(num_shards, bool) or
                                       not isinstance(num_shards, int) or num_shards < 1):
            raise ConfigError(f"num_shards={num_shards!r} must be a positive int (or None to "
                              "attach to a running parameter server by name)")
        if name is None:
            if num_shards is None:
                raise ConfigError("give num_shards to start a parameter server, or name= to "
                                  "attach to a running one")
            name = uuid.uuid4().hex[:12]
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"name={name!r} must be 1-64 letters, digits, '-', '_' or '.'")
        if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={checkpoint_every!r} must be an int >= 0")
        if not isinstance(checkpoint_full_every, int) or checkpoint_full_every < 1:
            raise ConfigError(f"checkpoint_full_every={checkpoint_full_every!r} must be an "
                              "int >= 1")
        if mode not in ("sync", "async"):
            raise ConfigError(f"mode={mode!r} must be 'sync' or 'async'")
        if isinstance(resolve_after, bool) or not isinstance(resolve_after, (int, float)) or \
                not resolve_after > 0:
            raise ConfigError(f"resolve_after={resolve_after!r} must be a number of seconds > 0")
        if not ray.is_initialized():
            start_local_ray()
        self.name = name
        self.mode = mode
        self.staleness = staleness
        self.recover_timeout = recover_timeout
        self.owner = False
        self._state: dict[str, Any] = {}
        reg_name = f"tensorkv-ps-{name}"
        try:
            self._registry = ray.get_actor(reg_name, namespace=NAMESPACE)
        except ValueError:
            self._registry = None
        if self._registry is None:
            if num_shards is None:
                raise ShardUnavailableError(
                    f"no parameter server named {name!r} runs in this Ray cluster; start one "
                    f"with ParameterServer(num_shards, name={name!r})")
            if max_restarts is None:
                max_restarts = -1 if checkpoint_url else 0
            state: dict[str, Any] = {
                "num_shards": num_shards, "generation": 0, "checkpoint_url": checkpoint_url,
                "checkpoint_every": checkpoint_every, "full_every": checkpoint_full_every,
                "max_restarts": max_restarts, "resolve_after": float(resolve_after),
                "actor_options": dict(actor_options or {})}
            reg_cls = ray.remote(num_cpus=0)(Registry)
            self._registry = reg_cls.options(name=reg_name, namespace=NAMESPACE).remote(state)
            self.owner = True
            self._state = state
            actors = self._start_shards(state)
        else:
            self._state = ray.get(self._registry.get.remote())
            if num_shards is not None and num_shards != self._state["num_shards"]:
                raise ConfigError(
                    f"parameter server {name!r} runs {self._state['num_shards']} shards, not "
                    f"num_shards={num_shards}; pass num_shards=None to attach")
            actors = self._find_shards(self._state)
        self.channel = Channel(actors, worker, logging=bool(self._state["checkpoint_url"]),
                               recover_timeout=recover_timeout, shared_memory=shared_memory,
                               on_lost=self._lost)
        self._tables: dict[str, ShardedEmbeddingTable] = {}
        self._dense: dict[str, Any] = {}  # dense servers this object made or attached to
        if self.owner:
            _LIVE.add(self)

    # --- shards --------------------------------------------------------------------------------
    def _start_shards(self, state: dict[str, Any],
                      init_from: tuple[str, str] | None = None) -> list[Any]:
        ray = ray_module()
        opts = {"num_cpus": 0, "max_restarts": state["max_restarts"], "max_task_retries": 0,
                **state["actor_options"]}
        cls = ray.remote(ShardServer)
        n, gen = state["num_shards"], state["generation"]
        actors = [cls.options(name=shard_actor_name(self.name, gen, i), namespace=NAMESPACE,
                              **opts).remote(self.name, i, n, gen, state["checkpoint_url"],
                                             state["checkpoint_every"], init_from,
                                             state.get("full_every", 20),
                                             state.get("resolve_after", 2.0))
                  for i in range(n)]
        ray.get([a.ping.remote() for a in actors])  # started (and restored) before first use
        return actors

    def _find_shards(self, state: dict[str, Any]) -> list[Any]:
        ray = ray_module()
        out = []
        for i in range(state["num_shards"]):
            try:
                out.append(ray.get_actor(shard_actor_name(self.name, state["generation"], i),
                                         namespace=NAMESPACE))
            except ValueError as exc:
                raise ShardUnavailableError(
                    f"shard {i} of parameter server {self.name!r} is gone; restore the tables "
                    "from a checkpoint into a new parameter server") from exc
        return out

    def _lost(self, s: int) -> None:
        """Shard ``s``'s actor is gone: raise if the shard set changed or stopped for good."""
        ray = ray_module()
        try:
            state = ray.get(self._registry.get.remote(), timeout=30)
        except Exception as exc:
            raise ShardUnavailableError(
                f"parameter server {self.name!r} is gone (its registry does not answer: "
                f"{type(exc).__name__}); it was shut down, or its Ray cluster stopped") from exc
        if state["generation"] != self._state["generation"]:
            raise ReshardedError(
                f"parameter server {self.name!r} was resharded to {state['num_shards']} shards "
                f"(generation {state['generation']}) after this client attached; this client "
                f"still addresses the {self._state['num_shards']} shards of generation "
                f"{self._state['generation']}. Attach again with "
                f"ParameterServer(name={self.name!r}) and take its tables from there "
                "(ps.table(name))")

    @property
    def handles(self) -> dict[int, Any]:
        """The shard actors by shard number (what :mod:`~tensorkv.distributed.ops` takes)."""
        return dict(enumerate(self.channel.actors))

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return self.channel.num_shards

    @property
    def checkpoint_url(self) -> str | None:
        """Where the shards checkpoint themselves."""
        return self._state["checkpoint_url"]

    @property
    def actors(self) -> list[Any]:
        """The shard actors' handles, by shard number."""
        return list(self.channel.actors)

    # --- tables --------------------------------------------------------------------------------
    def table(self, name: str, dim: int | None = None, *, mode: str | None = None,
              staleness: int | None = None, **kwargs: Any) -> ShardedEmbeddingTable:
        """The table ``name``, created on every shard if it does not exist yet.

        Parameters
        ----------
        name
            Table name.
        dim
            Row width; may be left out to attach to an existing table.
        mode, staleness
            This client's update mode (default: the parameter server's).
        **kwargs
            :class:`~tensorkv.EmbeddingTable` arguments (``optimizer``, ``initializer``,
            ``storage``, ``admission``, ``eviction``, ``seed`` ...), the same for every shard
            (a ``storage_path`` gets a directory per shard).

        Raises
        ------
        ConfigError
            Table ``name`` exists with other arguments than ``dim`` and ``kwargs`` (all of
            them, left-out ones at their defaults): the message names both.
        """
        ray = ray_module()
        if not isinstance(name, str) or not name:
            raise ConfigError(f"table name {name!r} must be a non-empty str")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0):
            raise ConfigError(f"dim={dim!r} must be a positive integer, e.g. dim=64")
        spec = {"dim": dim, **copy.deepcopy(kwargs)}
        if dim is None:
            found = self._existing(name)
            if found is None:
                raise ConfigError(f"table {name!r} does not exist on parameter server "
                                  f"{self.name!r}; give dim= (and its options) to create it")
            spec = found
        else:
            try:
                dumps(spec)
            except Exception as exc:
                raise ConfigError(f"table {name!r}: its arguments cannot be sent to the shards "
                                  f"({exc}); pass optimizers and filters as objects or "
                                  "configs that pickle") from exc
            # shard 0 decides (two clients creating the table at once get one table), the
            # others take its arguments
            info = ray.get(self.actors[0].create.remote(name, spec))
            if not info["created"]:
                have = pickle.loads(info["spec"])
                self._check_spec(name, have, spec)
                spec = have
        infos = ray.get([a.create.remote(name, spec) for a in self.actors[1:]])
        for i, info in enumerate(infos, 1):
            if not info["created"]:
                self._check_spec(name, pickle.loads(info["spec"]), spec, shard=i)
        t = ShardedEmbeddingTable(self.channel, name, int(spec["dim"]), spec,
                                  mode=mode or self.mode,
                                  staleness=self.staleness if staleness is None else staleness)
        self._tables[name] = t
        return t

    def _check_spec(self, name: str, have: dict[str, Any], want: dict[str, Any],
                    shard: int | None = None) -> None:
        """Raise ConfigError naming both if table ``name``'s arguments ``have`` are not ``want``."""
        keys = sorted(set(have) | set(want), key=lambda k: (k != "dim", k))
        diff = [k for k in keys if not _same(have.get(k), want.get(k))]
        if not diff:
            return

        def show(d: dict[str, Any]) -> str:
            return ", ".join(f"{k}={d[k]!r}" if k in d else f"{k} not given" for k in diff)
        where = "" if shard is None else f" on shard {shard}"
        raise ConfigError(
            f"table {name!r} exists on parameter server {self.name!r}{where} with {show(have)}; "
            f"requested {show(want)}. Attach to it with ps.table({name!r}) (no dim), give its "
            "arguments, or choose another name")

    def _existing(self, name: str) -> dict[str, Any] | None:
        ray = ray_module()
        if name not in ray.get(self.actors[0].info.remote())["tables"]:
            return None
        return pickle.loads(ray.get(self.actors[0].create.remote(name, None))["spec"])

    def tables(self) -> list[str]:
        """Names of the tables on the parameter server."""
        ray = ray_module()
        return list(ray.get(self.actors[0].info.remote())["tables"])

    def drop_table(self, name: str) -> None:
        """Remove table ``name`` from every shard (its rows are gone)."""
        ray = ray_module()
        t = self._tables.pop(name, None)
        if t is not None:
            t.drain()
        ray.get([a.drop.remote(name) for a in self.actors])

    # --- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self) -> list[str | None]:
        """Make every shard checkpoint itself now; the tags written."""
        ray = ray_module()
        for t in self._tables.values():
            t.drain()
        return list(ray.get([a.checkpoint.remote() for a in self.actors]))

    def save(self, url: str, tag: str, tables: list[str] | None = None,
             metadata: dict[str, Any] | None = None) -> str:
        """Save the tables as a sharded checkpoint: each shard writes its own rows, in parallel.

        The tag is an ordinary sharded save (``num_shards`` = this server's): ``tensorkv.load``
        restores it into a local table, or onto any number of shards (:meth:`load`). Every
        shard is saved at one agreed state, whatever other workers push meanwhile: a save
        barrier (:func:`~tensorkv.distributed.channel.save_barrier`) holds new changes back
        until the shards have saved.
        """
        for t in self._tables.values():
            t.drain()
        save_barrier(self.channel, lambda a, token: a.save_shard.remote(
            url, tag, tables, metadata, thaw=token))
        return tag

    def settle(self, timeout: float | None = None) -> int:
        """Finish or undo every change left half-done on the shards now; how many.

        A worker that dies between the messages of a change over several shards leaves parts
        of it staged; the shards resolve those by themselves after ``resolve_after`` seconds
        (:mod:`tensorkv.distributed.ops`). This resolves them at once (those of workers Ray
        reports dead, and those staged on every shard), and waits for live workers to finish
        theirs (up to ``timeout`` seconds, default ``recover_timeout``).
        """
        timeout = self.recover_timeout if timeout is None else float(timeout)
        return settle(self.handles, timeout)

    def load(self, url: str, tag: str = "latest", tables: list[str] | None = None) -> int:
        """Replace the tables' rows with a checkpoint's (saved from any number of shards).

        Each shard reads only its own keys. Tables missing here are created (with the
        arguments they were saved with). Clients must be idle. Returns the rows loaded.
        """
        ray = ray_module()
        for t in self._tables.values():
            t.drain()
        tag = resolve_tag(url, tag)
        n = int(sum(ray.get([a.load_shard.remote(url, tag, tables) for a in self.actors])))
        for t in self._tables.values():
            t.rebase()
        return n

    def reshard(self, num_shards: int, url: str | None = None) -> None:
        """Move every table onto ``num_shards`` shards, exactly (through a checkpoint).

        The shards save a sharded checkpoint into ``url`` (default: ``checkpoint_url``), new
        shards load their hash ranges from it, and the old ones stop. Clients must be idle;
        tables of this object keep working, other clients attach again
        (``ParameterServer(name=...)``).
        """
        ray = ray_module()
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ConfigError(f"num_shards={num_shards!r} must be a positive int")
        url = url or self.checkpoint_url
        if url is None:
            raise ConfigError("reshard needs a store for the transfer: pass url= "
                              "(e.g. 'lmdb:///tmp/reshard') or create the server with "
                              "checkpoint_url=")
        state: dict[str, Any] = dict(self._state)
        tag = f"ps-{self.name}-reshard-g{state['generation']}-{uuid.uuid4().hex[:8]}"
        for t in self._tables.values():
            t.drain()
        new = (state["generation"] + 1, num_shards)
        # saved behind a barrier, then retired: no change lands on the old shards after the
        # save, and a client still on them gets ReshardedError, never their rows
        save_barrier(self.channel, lambda a, token: a.save_shard.remote(
            url, tag, None, None, retire=new))
        old = self.actors
        state["generation"], state["num_shards"] = new
        actors = self._start_shards(state, init_from=(url, tag))
        ray.get(self._registry.set.remote(state))
        self._state = state
        for a in old:
            with contextlib.suppress(Exception):
                ray.get(a.forget_checkpoints.remote())
            ray.kill(a, no_restart=True)
        ch = Channel(actors, self.channel.worker, logging=bool(state["checkpoint_url"]),
                     recover_timeout=self.recover_timeout,
                     shared_memory=self.channel.link is not None, on_lost=self._lost)
        if self.channel.link is not None:
            self.channel.link.close()
        self.channel = ch
        for t in self._tables.values():
            t.channel = ch
            t.rebase()

    # --- dense parameters -----------------------------------------------------------------------
    def dense(self, model: Any, optimizer: Any = None, *, mode: str = "async",
              workers: int | None = None, name: str = "dense", **options: Any) -> Any:
        """Serve ``model``'s dense parameters from the parameter server.

        Parameters
        ----------
        model
            An ``nn.Module`` (its parameters that require a gradient) or a list of
            parameters. The first process to call this for ``name`` puts its values on the
            server; every later one (another worker) gets the server's values copied in.
        optimizer
            The dense optimizer class run by the server (default ``torch.optim.Adam``), with
            ``options`` as its keyword arguments (``lr=1e-3`` ...).
        mode
            ``"async"``: each worker's push is one step; ``"sync"``: one step per round of
            ``workers`` pushes, with their mean gradient (docs/distributed.md).
        workers
            Sync mode: the workers of a round (required there).
        name
            The dense server's name (one per model).

        Returns
        -------
        tensorkv.distributed.dense.RemoteDense
            A ``torch.optim.Optimizer`` for ``tensorkv.torch.Optimizer(model, dense=...)``:
            its ``step()`` pushes the gradients and pulls the new parameters.
        """
        import torch

        from tensorkv.distributed.dense import MODES, DenseServer, RemoteDense

        ray = ray_module()
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r} must be one of {', '.join(MODES)}")
        if mode == "sync" and (isinstance(workers, bool) or not isinstance(workers, int)
                               or workers < 1):
            raise ConfigError(f"mode='sync' steps once per round of pushes: give workers=N "
                              f"(the data-parallel workers), not {workers!r}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"name={name!r} must be 1-64 letters, digits, '-', '_' or '.'")
        params = ([p for p in model.parameters() if p.requires_grad]
                  if isinstance(model, torch.nn.Module) else list(model))
        if not params:
            raise ConfigError("the model has no dense parameters to serve")
        cls = torch.optim.Adam if optimizer is None else optimizer
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer class, "
                              "e.g. torch.optim.Adam (its options as keywords: lr=1e-3)")
        actor = ray.remote(num_cpus=0)(DenseServer).options(
            name=f"tensorkv-ps-{self.name}-dense-{name}", namespace=NAMESPACE,
            get_if_exists=True).remote(cls, options, mode, workers or 1)
        actor = self._dense.setdefault(name, actor)  # the creator's handle keeps it alive
        return RemoteDense(params, actor, mode)

    # --- operations ----------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """Per shard: tables (rows, bytes, tiers), requests served, requests/s, checkpoint."""
        ray = ray_module()
        return list(ray.get([a.status.remote() for a in self.actors]))

    def shutdown(self) -> None:
        """Stop the shards and the registry (their rows are gone; checkpoints stay)."""
        ray = ray_module()
        _LIVE.discard(self)
        for t in self._tables.values():
            with contextlib.suppress(Exception):
                t.drain()
        if not ray.is_initialized():
            return
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.get(a.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        for d in self._dense.values():
            with contextlib.suppress(Exception):
                ray.kill(d, no_restart=True)
        with contextlib.suppress(Exception):
            ray.kill(self._registry, no_restart=True)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owner:
            self.shutdown()

    def __repr__(self) -> str:
        return (f"ParameterServer(name={self.name!r}, num_shards={self.num_shards}, "
                f"checkpoint_url={self.checkpoint_url!r})")


def _same(a: Any, b: Any) -> bool:
    """Whether two table arguments are alike (arrays by value, objects by their pickles)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (str, int, float, bool, type(None))):
        return type(a) is type(b) and a == b
    return dumps(a) == dumps(b)


@atexit.register
def _shutdown_all() -> None:  # pragma: no cover - runs at interpreter exit
    for ps in list(_LIVE):
        with contextlib.suppress(Exception):
            ps.shutdown()


__all__ = ["NAMESPACE", "ParameterServer", "Registry"]
