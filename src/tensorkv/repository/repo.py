"""The model repository: put, get, read tensors, longest-prefix queries, transfer, delete.

Layout (all keys under ``repo/``; docs/repository.md has the full specification):

- on every provider: ``repo/provider`` (the provider's id, for placement) and the tensor
  chunks ``repo/t/<tensor id>/<i>``;
- on the metadata provider (the first URL): the manifests ``repo/m/<model id>``, the log
  ``repo/log/<seq>``, the reference counts ``repo/r/<tensor id>`` and the put intents
  ``repo/p/<model id>``.

A put writes new tensor data first, then counts references, then the manifest, and becomes
visible with its log entry, last: a writer killed at any point leaves no half model, and
:meth:`Repository.gc` reclaims what it wrote.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tensorkv.checkpoint.dense import to_numpy
from tensorkv.checkpoint.objects import gather_tables, spread_tables
from tensorkv.errors import (
    ConfigError,
    CorruptRecordError,
    GraphError,
    ModelNotFoundError,
    RepositoryError,
    StoreFullError,
    TensorNotFoundError,
)
from tensorkv.repository import refs, tensors
from tensorkv.repository.capture import Trace, capture, is_module
from tensorkv.repository.graph import Graph, as_graph
from tensorkv.repository.index import ModelIndex, log_key, matcher
from tensorkv.repository.layout import PROVIDER_KEY, intent_key, load_json, manifest_key
from tensorkv.repository.write import PutWriter
from tensorkv.stores import KVStore, open_store

#: Environment variable naming the default repository (a path or a store URL).
ENV_REPOSITORY = "TENSORKV_REPOSITORY"


def default_location() -> str:
    """The repository :class:`Repository` opens without a URL (an embedded LMDB)."""
    where = os.environ.get(ENV_REPOSITORY)
    if where:
        return where
    return str(Path.home() / ".cache" / "tensorkv" / "repository")


def _as_url(u: str) -> str:
    return u if "://" in u else "lmdb://" + str(Path(u).expanduser().resolve())


class Repository:
    """A repository of models that share their unchanged tensors.

    Parameters
    ----------
    url_or_urls
        One store URL or path (a plain path is an embedded LMDB), several URLs (providers:
        tensors are spread over them, metadata lives on the first), or opened
        :class:`~tensorkv.KVStore` objects. Default: ``$TENSORKV_REPOSITORY`` or
        ``~/.cache/tensorkv/repository``.
    chunk_bytes
        Size of the row chunks big tensors are cut into (a slice reads only its chunks).
    threads
        Threads fetching from providers in parallel.
    options
        Passed to :func:`tensorkv.open_store` for every URL.

    Examples
    --------
    >>> import torch
    >>> repo = Repository("models")  # a path: an embedded LMDB store
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> mid = repo.put(model, metrics={"val_acc": 0.93})
    >>> state = repo.get(mid)  # the state dict, bit for bit
    >>> all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    True
    >>> repo.close()
    """

    def __init__(self, url_or_urls: str | KVStore | Sequence[str | KVStore] | None = None, *,
                 chunk_bytes: int = tensors.DEFAULT_CHUNK_BYTES, threads: int | None = None,
                 **options: Any) -> None:
        if url_or_urls is None:
            url_or_urls = default_location()
        items = [url_or_urls] if isinstance(url_or_urls, (str, KVStore)) else list(url_or_urls)
        if not items:
            raise ConfigError("Repository needs at least one store URL; got an empty list")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1024:
            raise ConfigError(f"chunk_bytes={chunk_bytes!r}: give an int >= 1024 (bytes)")
        self.chunk_bytes = chunk_bytes
        self._owned: list[KVStore] = []
        self.providers: list[KVStore] = []
        for it in items:
            if isinstance(it, KVStore):
                self.providers.append(it)
            elif isinstance(it, str):
                st = open_store(_as_url(it), **options)
                self._owned.append(st)
                self.providers.append(st)
            else:
                raise ConfigError(f"provider {it!r} is neither a URL nor a KVStore")
        self.meta = self.providers[0]
        self.provider_ids = [self._provider_id(p) for p in self.providers]
        if len(set(self.provider_ids)) != len(self.provider_ids):
            raise ConfigError("two providers are the same store (same provider id); give each "
                              "store once")
        self.index = ModelIndex()
        self.lock = threading.RLock()
        self.manifests: dict[str, dict[str, Any]] = {}
        self.pool = ThreadPoolExecutor(threads or max(4, 2 * len(self.providers)),
                                       thread_name_prefix="tensorkv-repo")

    def _provider_id(self, store: KVStore) -> str:
        pid = store.get(PROVIDER_KEY)
        if pid is None:
            if not store.readonly:
                store.put_if_absent(PROVIDER_KEY, uuid.uuid4().hex.encode())
            pid = store.get(PROVIDER_KEY)
            if pid is None:
                raise RepositoryError(f"store {store.url!r} holds no repository and is read-only")
        return pid.decode()

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the stores this repository opened; closing twice is harmless."""
        self.pool.shutdown(wait=True)
        for st in self._owned:
            st.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Repository {[p.url for p in self.providers]!r}>"

    # ----------------------------------------------------------------- metadata
    def refresh(self) -> None:
        """Bring the model index up to date with the log (one round trip if nothing changed)."""
        with self.lock:
            self.index.refresh(self.meta)

    def _missing(self, mid: Any) -> ModelNotFoundError:
        live = [m.id for m in self.index.live()]
        shown = ", ".join(live[-10:]) or "none"
        return ModelNotFoundError(
            f"no model {mid!r} in the repository ({len(live)} stored; latest: {shown}); "
            "repo.list() lists them all"
        )

    def manifest(self, mid: str) -> dict[str, Any]:
        """The stored manifest of model ``mid`` (graph, tensors, metrics); cached."""
        if not isinstance(mid, str):
            raise ModelNotFoundError(f"model ids are str, got {type(mid).__name__} {mid!r}")
        m = self.manifests.get(mid)
        if m is not None:
            return m
        raw = self.meta.get(manifest_key(mid))
        if raw is None:
            self.refresh()
            raise self._missing(mid)
        m = load_json(manifest_key(mid), raw)
        with self.lock:
            self.manifests[mid] = m
        return m

    def graph(self, mid: str) -> Graph:
        """The architecture graph of model ``mid``."""
        return Graph.from_dict(self.manifest(mid)["graph"])

    # ----------------------------------------------------------------- put
    def _prepare(self, model: Any, state_dict: Mapping[str, Any] | None, example_inputs: Any,
                 trace: Trace) -> tuple[Graph, dict[str, tuple[np.ndarray, str | None]]]:
        if is_module(model):
            graph = capture(model, example_inputs, trace=trace)
            state = model.state_dict() if state_dict is None else state_dict
        else:
            graph = as_graph(model)
            if state_dict is None:
                raise GraphError("a graph description needs its state_dict: "
                                 "repo.put(graph, state_dict, ...)")
            state = state_dict
        if not isinstance(state, Mapping):
            raise GraphError(f"state_dict must be a mapping of name -> tensor, got "
                             f"{type(state).__name__}")
        # a dynamic module's table (rows, slots, counts) is stored as tensors as well
        arrays = {str(k): to_numpy(str(k), v) for k, v in spread_tables(state).items()}
        for n in graph.nodes:
            for p in n.params:
                got = arrays.get(p.tensor)
                if got is None:
                    raise GraphError(f"node {n.name!r} names tensor {p.tensor!r}, which the "
                                     f"state dict does not hold ({len(arrays)} tensors)")
                if tuple(got[0].shape) != p.shape:
                    raise GraphError(f"tensor {p.tensor!r} has shape {tuple(got[0].shape)}; "
                                     f"node {n.name!r} says {p.shape}")
        return graph, arrays

    def put(self, model: Any, state_dict: Mapping[str, Any] | None = None, *,
            name: str | None = None, metrics: Mapping[str, float] | None = None,
            parent: str | None = None, example_inputs: Any = None,
            trace: Trace = "auto") -> str:
        """Store a model; return its id.

        Parameters
        ----------
        model
            An ``nn.Module`` (its graph is captured, see :func:`capture`), or a graph
            description (a :class:`Graph` or the documented dict) with ``state_dict``.
        state_dict
            Name -> tensor (torch or numpy); default: ``model.state_dict()``.
        name, metrics, parent
            A label, numbers to query and rank by (``list(where=...)``, ``longest_prefix``
            ties), and the id of the model this one derives from.
        example_inputs, trace
            How to capture the graph of a module fx cannot trace (see :func:`capture`).

        Raises
        ------
        StoreFullError
            Every provider refused the data; nothing was stored.
        """
        graph, arrays = self._prepare(model, state_dict, example_inputs, trace)
        mets = _check_metrics(metrics)
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name={name!r} must be a str")
        parent_entries: set[str] = set()
        if parent is not None:
            parent_entries = {e["id"] for e in self.manifest(parent)["tensors"].values()}
        mid = uuid.uuid4().hex[:20]
        writer = PutWriter(self, mid, parent, parent_entries)
        published = False
        try:
            entries = writer.send(arrays)
            # built while the providers write the last tensors
            manifest = {
                "id": mid, "name": name, "parent": parent, "metrics": mets,
                "created": time.time(), "graph": graph.to_dict(),
                "hashes": [h.hex() for h in graph.hashes()], "tensors": entries,
            }
            mdata = json.dumps(manifest, separators=(",", ":")).encode()
            entry = {"op": "add", "id": mid, "name": name, "parent": parent, "metrics": mets,
                     "created": manifest["created"], "h": graph.hash_keys().tobytes().hex(),
                     "b": sum(e["nbytes"] for e in entries.values()), "n": len(entries)}
            writer.finish()
            with self.lock:
                # the manifest and the entry that publishes it: one round trip
                self.index.append(self.meta, entry, before=[(manifest_key(mid), mdata)])
                published = True  # visible: from here on, nothing is undone
                self.manifests[mid] = manifest
        except BaseException as exc:
            if not published:
                self._rollback(mid, writer.counted, writer.by_tid, exc)
            raise
        if writer.by_tid:
            self.meta.delete(intent_key(mid))
        return mid

    def _rollback(self, mid: str, counted: list[str], by_tid: Mapping[str, Any],
                  exc: BaseException) -> None:
        try:
            self.meta.delete(manifest_key(mid))
            if counted:  # the put wrote only tensors it counted: dropping the counts retires them
                chunks = {t: by_tid[t][1]["chunks"] for t in counted}
                refs.decref(self.meta, counted,
                            lambda ts, fence: self.delete_data(ts, chunks, fence))
            self.meta.delete(intent_key(mid))
        except Exception as again:  # the intent stays: gc() reclaims the rest
            exc.add_note(f"tensorkv: cleaning up the failed put also failed ({again}); "
                         "repo.gc() reclaims what it left")
        if isinstance(exc, StoreFullError):
            exc.add_note("tensorkv: the model was not stored and the repository is unchanged; "
                         "free space (repo.delete, repo.gc) or add a provider")

    def absent(self, tids: list[str], entries: Mapping[str, dict[str, Any]]) -> list[str]:
        """The tensors of ``tids`` whose chunks no provider holds in full."""
        if not tids:
            return []
        left = list(tids)
        for rank_pos in range(len(self.providers)):
            groups: dict[int, list[str]] = {}
            for t in left:
                groups.setdefault(tensors.rank(t, self.provider_ids)[rank_pos], []).append(t)
            still: list[str] = []
            for p, ts in groups.items():
                keys = [k for t in ts for k in tensors.chunk_keys(entries[t])]
                sizes = self.providers[p].value_sizes(keys)
                pos = 0
                for t in ts:
                    n = entries[t]["chunks"]
                    if (sizes[pos:pos + n] < 0).any():
                        still.append(t)
                    pos += n
            left = still
            if not left:
                break
        return left

    def delete_data(self, tids: Sequence[str], chunks: Mapping[str, int] | None = None,
                    fence: refs.Fence | None = None) -> None:
        """Delete the chunks of tensors ``tids`` from every provider (no count is checked).

        ``fence`` (see :data:`refs.Fence <tensorkv.repository.refs.Fence>`) is asked before
        each provider's deletion which of the tensors may still go.
        """
        left = list(tids)
        for p in self.providers:
            if fence is not None and left:
                left = fence(left)
            if not left:
                return
            keys: list[bytes] = []
            for t in left:
                n = chunks.get(t) if chunks else None
                if n is None:
                    n = self._chunk_count(t)
                keys.extend(tensors.chunk_key(t, i) for i in range(n))
            p.delete_many(keys)

    def _chunk_count(self, tid: str) -> int:
        """Chunks tensor ``tid`` has on any provider (probing keys; used when no manifest says)."""
        n = 0
        for p in self.providers:
            i = 0
            while p.value_sizes([tensors.chunk_key(tid, i)])[0] >= 0:
                i += 1
            n = max(n, i)
        return max(n, 1)

    # ----------------------------------------------------------------- reads
    def _entry(self, mid: str, m: dict[str, Any], name: str) -> dict[str, Any]:
        e = m["tensors"].get(name) if isinstance(name, str) else None
        if e is None:
            have = sorted(m["tensors"])
            raise TensorNotFoundError(f"model {mid!r} has no tensor {name!r}; it has {len(have)}: "
                           f"{', '.join(have[:20])}{' ...' if len(have) > 20 else ''}")
        return e

    def read_tensors(self, mid: str, names: Sequence[str] | None = None, *,
                     index: Any = None, as_numpy: bool = False, copy: bool = True,
                     verify: bool = True) -> dict[str, Any]:
        """Read several tensors of a model (all by default), fetching providers in parallel.

        ``index`` (a basic index, applied to each) reads only the row chunks it touches.
        Tensors come back as torch tensors for models put from torch, numpy arrays otherwise
        (or always with ``as_numpy=True``).

        ``copy=False`` returns read-only numpy arrays without copying where the store allows
        it: on LMDB, a tensor of one chunk (or a slice inside one chunk) is a view of the
        data file, and the read snapshot stays pinned for as long as any such array lives
        (LMDB reuses none of its pages, so the file grows meanwhile: drop views when done).
        Tensors of several chunks are assembled into new arrays. ``verify=False`` skips the
        xxh3 checksum of each chunk (on by default: it reads every byte once, at 10+ GB/s).
        """
        m = self.manifest(mid)
        if names is None:
            names = list(m["tensors"])
        elif isinstance(names, str):
            raise ConfigError(f"names={names!r} is one str; pass a list, or use read_tensor")
        want = [(n, self._entry(mid, m, n)) for n in names]
        plans = [(n, e, *tensors.chunk_range(e, index)) for n, e in want]
        fetch = self._fetch if copy else self._fetch_views
        arrays = fetch(mid, [(n, e, r) for n, e, r, _, _ in plans], verify)
        out: dict[str, Any] = {}
        for (n, e, _r, _base, rel), arr in zip(plans, arrays, strict=True):
            if rel is not None:
                try:
                    arr = np.ascontiguousarray(arr[rel]) if copy else arr[rel]
                except IndexError as exc:
                    from tensorkv.errors import BadIndexError

                    raise BadIndexError(f"read_tensor({n!r}, {index!r}): {exc}") from None
            out[n] = (arr if as_numpy or not copy or e.get("torch_dtype") is None
                      else tensors.as_torch(arr, e["torch_dtype"]))
        return out

    def read_tensor(self, mid: str, name: str, index: Any = None, *,
                    as_numpy: bool = False, copy: bool = True, verify: bool = True) -> Any:
        """Read one tensor of a model, or ``tensor[index]`` reading only the chunks it needs.

        ``copy`` and ``verify``: see :meth:`read_tensors`.
        """
        return self.read_tensors(mid, [name], index=index, as_numpy=as_numpy, copy=copy,
                                 verify=verify)[name]

    def get(self, mid: str, *, as_numpy: bool = False, copy: bool = True,
            verify: bool = True) -> dict[str, Any]:
        """The state dict of model ``mid`` (``copy``, ``verify``: see :meth:`read_tensors`).

        The tables of dynamic modules come back as the dicts their ``state_dict()`` made.
        """
        return gather_tables(self.read_tensors(mid, None, as_numpy=as_numpy, copy=copy,
                                               verify=verify))

    def load_into(self, module: Any, mid: str, *, strict: bool = True) -> Any:
        """Load model ``mid``'s tensors into ``module`` (``load_state_dict``); return its result."""
        return module.load_state_dict(self.get(mid), strict=strict)

    def _fetch(self, mid: str, plans: list[tuple[str, dict[str, Any], range]],
               verify: bool = True) -> list[np.ndarray]:
        """Fetch the chunk ranges of several tensors into new arrays, providers in parallel.

        Each chunk is decoded (checksum verified) straight from the store's buffer into its
        place in the output (LMDB hands out its own memory: one copy in all).
        """
        outs = tensors.empty_many([(e, r) for _, e, r in plans])
        targets: dict[tuple[str, int], list[int]] = {}
        for pi, (_, e, r) in enumerate(plans):
            for i in r:
                targets.setdefault((e["id"], i), []).append(pi)

        # the version check rides along with the metadata provider's read: whether the log
        # has an entry this client has not seen (a put or a delete by someone else)
        vkey = log_key(self.index.seq)
        changed = [False]

        def one(p: int, items: list[tuple[str, int]], check: bool = False
                ) -> list[tuple[str, int]]:
            keys = [tensors.chunk_key(t, i) for t, i in items]
            missing = []
            with self.providers[p].get_many_buffers(keys + [vkey] if check else keys) as bufs:
                if check:
                    changed[0] = bufs[-1] is not None
                for (t, i), key, b in zip(items, keys, bufs, strict=False):
                    if b is None:
                        missing.append((t, i))
                        continue
                    for pi in targets[(t, i)]:
                        name, e, r = plans[pi]
                        tensors.place(e, r, i, b, key, outs[pi], name, verify)
            return missing

        self._gather(mid, plans, list(targets), one, changed)
        return outs

    def _fetch_views(self, mid: str, plans: list[tuple[str, dict[str, Any], range]],
                     verify: bool = True) -> list[np.ndarray]:
        """Like :meth:`_fetch`, but a tensor read from one chunk is a view of that chunk.

        The chunks come from ``get_many_views`` (LMDB: pinned views of its data file).
        """
        got: dict[tuple[str, int], np.ndarray] = {}
        wanted = {(e["id"], i): None for _, e, r in plans for i in r}
        vkey = log_key(self.index.seq)
        changed = [False]

        def one(p: int, items: list[tuple[str, int]], check: bool = False
                ) -> list[tuple[str, int]]:
            keys = [tensors.chunk_key(t, i) for t, i in items]
            vals = self.providers[p].get_many_views(keys + [vkey] if check else keys)
            if check:
                changed[0] = vals[-1] is not None
            missing = []
            for ti, v in zip(items, vals, strict=False):
                if v is None:
                    missing.append(ti)
                else:
                    got[ti] = v
            return missing

        self._gather(mid, plans, list(wanted), one, changed)
        outs = []
        for name, e, r in plans:
            if len(r) == 1:
                key = tensors.chunk_key(e["id"], r[0])
                outs.append(tensors.view_of(e, r, r[0], got[(e["id"], r[0])], key, name, verify))
                continue
            out = tensors.empty_for(e, r)
            for i in r:
                tensors.place(e, r, i, got[(e["id"], i)], tensors.chunk_key(e["id"], i), out,
                              name, verify)
            outs.append(out)
        return outs

    def _gather(self, mid: str, plans: list[tuple[str, dict[str, Any], range]],
                left: list[tuple[str, int]], one: Any, changed: list[bool]) -> None:
        """Run ``one(provider, chunks, check)`` over the providers in rendezvous order.

        Chunks a provider lacks go to the next one; the metadata provider also answers the
        version check (``check``), after which the index is refreshed if the log moved.
        """
        for rank_pos in range(len(self.providers)):
            groups: dict[int, list[tuple[str, int]]] = {}
            for t, i in left:
                groups.setdefault(tensors.rank(t, self.provider_ids)[rank_pos], []).append((t, i))
            if rank_pos == 0:
                groups.setdefault(0, [])  # the metadata provider answers the version check
            if len(groups) == 1:
                (p, items), = groups.items()
                left = one(p, items, rank_pos == 0)
            else:
                futs = [self.pool.submit(one, p, items, rank_pos == 0 and p == 0)
                        for p, items in groups.items()]
                left = [ti for f in futs for ti in f.result()]
            if not left:
                break
        if changed[0] or left or self.index.get(mid) is None:
            self.refresh()
            if self.index.get(mid) is None:
                raise self._missing(mid)
        if left:
            t, i = left[0]
            name = next(n for n, e, _ in plans if e["id"] == t)
            raise CorruptRecordError(f"tensor {name!r}: chunk {tensors.chunk_key(t, i).decode()} "
                                     f"is missing from every provider ({len(left)} chunks "
                                     "missing); repo.check() lists the damage")

    # ----------------------------------------------------------------- queries
    def _query_graph(self, model: Any, example_inputs: Any, trace: Trace) -> Graph:
        return capture(model, example_inputs, trace=trace) if is_module(model) else as_graph(model)

    def longest_prefix(self, model_or_graph: Any, metric: str | None = "val_acc", *,
                       example_inputs: Any = None,
                       trace: Trace = "auto") -> tuple[str | None, list[str]]:
        """The stored model sharing the longest common prefix with a model or graph.

        A layer matches when its whole ancestry matches (generalised LCP on DAGs); the model
        with the most matching layers wins, ties go to the higher ``metric``, then the older
        model.

        Returns
        -------
        (model id or None, names of the query's matching layers in graph order)
        """
        g = self._query_graph(model_or_graph, example_inputs, trace)
        with self.lock:
            self.index.refresh(self.meta)
            o, mask = self.index.longest_prefix(g.hash_keys(), g.predecessors(), metric)
            if o is None:
                return None, []
            return self.index.infos[o].id, [n.name for n, hit in zip(g.nodes, mask, strict=True)
                                            if hit]

    def matches(self, model_or_graph: Any, mid: str, *, example_inputs: Any = None,
                trace: Trace = "auto") -> dict[str, str]:
        """Query tensor name -> stored tensor name of the layers the query shares with ``mid``."""
        g = self._query_graph(model_or_graph, example_inputs, trace)
        stored = self.manifest(mid)
        sg = Graph.from_dict(stored["graph"])
        where = {bytes.fromhex(h): i for i, h in enumerate(stored["hashes"])}
        out: dict[str, str] = {}
        for n, h in zip(g.nodes, g.hashes(), strict=True):
            i = where.get(h)
            if i is None:
                continue
            theirs = {p.local: p.tensor for p in sg.nodes[i].params}
            for p in n.params:
                if p.local in theirs:
                    out[p.tensor] = theirs[p.local]
        return out

    def transfer(self, new_model: Any, mid: str | None = None, *, metric: str | None = "val_acc",
                 example_inputs: Any = None, trace: Trace = "auto") -> dict[str, Any]:
        """Copy the weights of the layers ``new_model`` shares with ``mid`` into it.

        ``mid`` defaults to :meth:`longest_prefix`'s answer. A module is updated in place;
        for a graph, nothing is updated. Returns the copied tensors by the new model's names.
        """
        if mid is None:
            mid, _ = self.longest_prefix(new_model, metric, example_inputs=example_inputs,
                                         trace=trace)
            if mid is None:
                return {}
        pairs = self.matches(new_model, mid, example_inputs=example_inputs, trace=trace)
        got = self.read_tensors(mid, sorted(set(pairs.values())))
        out = {mine: got[theirs] for mine, theirs in pairs.items()}
        if is_module(new_model):
            import torch

            state = new_model.state_dict(keep_vars=True)
            with torch.no_grad():
                for k, v in out.items():
                    state[k].copy_(v)
        return out

    def list(self, where: Any = None) -> list[dict[str, Any]]:
        """The stored models, oldest first, as dicts (id, name, parent, metrics, created, layers).

        ``where`` filters them: a callable(row) -> bool, or a dict of field or metric -> value
        (equality) or ``(op, value)`` with op one of ``== != > >= < <=``.
        """
        pred = matcher(where)
        self.refresh()
        return [r for r in (m.as_dict() for m in self.index.live()) if pred(r)]

    # ----------------------------------------------------------------- delete
    def delete(self, mid: str) -> int:
        """Delete a model; tensors no other model uses are retired. Returns how many were."""
        self.refresh()
        raw = self.meta.get(manifest_key(mid)) if isinstance(mid, str) else None
        if raw is None:
            if isinstance(mid, str) and self.index.get(mid) is not None:
                with self.lock:  # manifest gone (a killed delete): finish it
                    self.index.append(self.meta, {"op": "del", "id": mid})
            raise self._missing(mid)
        m = load_json(manifest_key(mid), raw)
        chunks = {e["id"]: e["chunks"] for e in m["tensors"].values()}
        ikey = intent_key(mid)
        self.meta.put(ikey, json.dumps({"tids": sorted(chunks), "time": time.time(),
                                        "op": "del"}).encode())
        if not self.meta.compare_and_set(manifest_key(mid), raw, None):
            self.meta.delete(ikey)
            raise self._missing(mid)
        with self.lock:
            if self.index.get(mid) is not None:
                self.index.append(self.meta, {"op": "del", "id": mid})
            self.manifests.pop(mid, None)
        retired = refs.decref(self.meta, sorted(chunks),
                              lambda ts, fence: self.delete_data(ts, chunks, fence))
        self.meta.delete(ikey)
        return retired

    # ----------------------------------------------------------------- maintenance
    def gc(self, grace: float = 3600.0) -> dict[str, int]:
        """Reclaim what killed writers left; see :func:`tensorkv.repository.maintenance.gc`."""
        from tensorkv.repository import maintenance

        return maintenance.gc(self, grace)

    def check(self, *, verify: bool = False, deep: bool | None = None) -> dict[str, Any]:
        """Verify manifests, chunks and reference counts; see ``maintenance.check``.

        ``verify=True`` also reads every chunk and verifies its checksum (the word
        :func:`tensorkv.check` uses for checkpoints); ``deep`` is its old name.
        """
        from tensorkv.repository import maintenance

        if deep is not None:
            import warnings

            warnings.warn("Repository.check(deep=...) is deprecated and will be removed in the "
                          "next release; use check(verify=...)", DeprecationWarning, stacklevel=2)
            verify = verify or bool(deep)
        return maintenance.check(self, verify=verify)

    def stats(self) -> dict[str, Any]:
        """Counts and sizes: models, tensors, bytes_stored, bytes_referenced, per provider."""
        from tensorkv.repository import maintenance

        return maintenance.stats(self)

    def rebalance(self) -> dict[str, int]:
        """Move tensors to their home provider (after adding one); run with no writers."""
        from tensorkv.repository import maintenance

        return maintenance.rebalance(self)


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics={metrics!r} must be a dict of name -> number")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not math.isfinite(v):
            raise ConfigError(f"metric {k!r}={v!r}: metrics are str names with finite numbers")
        out[k] = float(v)
    return out
