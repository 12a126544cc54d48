"""Where a repository put's time goes: each step of a put, timed inside the put.

A chain of ``layers`` dense layers (``model_mb`` MB, one tensor per layer) is put whole into
an LMDB repository (``sync=False`` and durable) and into a loopback Redis one; then a
``child_layers``-layer model is put whole, and a child of it sharing ``shared`` of its
tensors (the first layers) is put with ``parent=``. Each figure is the median over
``repeat`` puts of one step's seconds, with the whole put as its baseline (the ratio is the
step's share). Steps marked "writer threads" run on the providers' writer threads, at the
same time as the calling thread's steps; the calling thread waits for them in "wait for the
writers". A data batch on LMDB is a copy into the transaction's pages (also reported alone,
adding up every transaction of the put) and a commit (the page-cache writes, and the fsync
of a durable store); on Redis, the sending and the server's answer. Counting references on
LMDB waits for a data batch in flight: LMDB has one writer at a time. The steps are timed by
wrapping the repository's functions for the duration of the run, which adds a few
microseconds per call.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from tensorkv.bench.common import Report
from tensorkv.bench.redis_server import RedisServer
from tensorkv.bench.repo import chain_graph, chain_state, interleaved
from tensorkv.errors import import_optional

#: (owner, attribute, step name) of the functions timed; a step name ending in "*" runs on
#: the writer threads.
STEPS = (
    ("tensorkv.repository.repo:Repository", "_prepare", "graph and tensor views"),
    ("tensorkv.repository.tensors", "stage", "hashing (one pass over the bytes)"),
    ("tensorkv.repository.refs", "incref", "counting references (intent ahead)"),
    ("tensorkv.repository.repo:Repository", "absent", "presence probes of counted tensors"),
    ("tensorkv.repository.write:PutWriter", "finish", "wait for the writers"),
    ("tensorkv.repository.index:ModelIndex", "append", "publish (manifest + log entry)"),
    ("tensorkv.repository.write:PutWriter", "_write_to", "data batches, whole*"),
    ("tensorkv.stores.lmdb:LMDBStore", "_apply", "LMDB: copies into transaction pages"),

)


def _resolve(spec: str) -> Any:
    import importlib

    mod, _, cls = spec.partition(":")
    obj = importlib.import_module(mod)
    return getattr(obj, cls) if cls else obj


@contextlib.contextmanager
def timed_steps(acc: dict[str, float]) -> Iterator[None]:
    """Add each step's seconds to ``acc`` while the block runs (see :data:`STEPS`)."""
    lock = threading.Lock()
    undo: list[tuple[Any, str, Any]] = []
    for spec, attr, step in STEPS:
        owner = _resolve(spec)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        static = isinstance(raw, staticmethod)
        fn = raw.__func__ if static else raw

        def wrapper(*args: Any, _fn: Callable[..., Any] = fn, _step: str = step,
                    **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                with lock:
                    acc[_step] += time.perf_counter() - t0

        setattr(owner, attr, staticmethod(wrapper) if static else wrapper)
        undo.append((owner, attr, raw))
    try:
        yield
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def _profile(report: Report, label: str, put: Callable[[], Any], setup: Callable[[], Any],
             repeat: int) -> None:
    runs: list[dict[str, float]] = []
    totals = []
    for _ in range(repeat):
        setup()
        acc: dict[str, float] = defaultdict(float)
        with timed_steps(acc):
            t0 = time.perf_counter()
            put()
            totals.append(time.perf_counter() - t0)
        runs.append(acc)
    total = statistics.median(totals)
    for _, _, step in STEPS:
        got = [r.get(step, 0.0) for r in runs]
        if not any(got):
            continue
        name = step.rstrip("*")
        where = " (writer threads)" if step.endswith("*") else ""
        report.add(f"{label}: {name}{where}", "ms", statistics.median(got) * 1e3,
                   "whole put", total * 1e3)


def _putter(repo: Any, graph: Any, state: Any) -> Callable[[], Any]:
    return lambda: repo.put(graph, state)


def run(quick: bool, report: Report, *, model_mb: float | None = None, layers: int = 100,
        child_layers: int = 50, shared: float = 0.75, repeat: int = 3,
        root: str | None = None) -> None:
    """Profile puts (see the module docstring).

    Parameters
    ----------
    model_mb
        Size of the large model (default 500, 64 with ``--quick``).
    layers
        Layers (tensors) of the large model.
    child_layers
        Layers of the model whose child is profiled (of ``model_mb * child_layers / layers``
        MB).
    shared
        Share of the child's tensors that are its parent's.
    repeat
        Puts timed per case (the median is reported).
    root
        Directory for the repositories (default: the temp directory).
    """
    import_optional("torch", "the repository put profile", "torch")
    from tensorkv.bench.kv import bench_root
    from tensorkv.repository import Repository

    model_mb = model_mb if model_mb is not None else (64.0 if quick else 500.0)
    cols = 1000
    rows = max(1, int(model_mb * 1e6 / 4 / cols / layers))
    report.params.update(model_mb=round(layers * rows * cols * 4 / 1e6, 1), layers=layers,
                         child_layers=child_layers, shared=shared, repeat=repeat)
    base = tempfile.mkdtemp(prefix="tensorkv-bench-repo-put-", dir=bench_root(root))
    server = RedisServer()
    try:
        g = chain_graph(layers, rows, cols)
        sd = chain_state(layers, rows, cols, 0)

        def fresh() -> None:  # new content: nothing deduplicates between puts
            for t in sd.values():
                t.add_(1.0)

        mb = layers * rows * cols * 4 / 1e6
        for label, url, opts in (("LMDB, sync=False", os.path.join(base, "lm"), {"sync": False}),
                                 ("LMDB, durable", os.path.join(base, "lms"), {}),
                                 ("Redis", server.url, {})):
            with Repository(url, **opts) as repo:
                repo.put(g, sd)  # the store's first write (map growth, allocator) untimed
                _profile(report, f"{mb:.0f} MB put ({label})", _putter(repo, g, sd), fresh,
                         repeat)

        # what the page cache alone costs here: the model's bytes written to new files
        files = [0]

        def write_file(per_tensor: bool) -> Callable[[], None]:
            def go() -> None:
                files[0] += 1
                bufs = [t.numpy().data.cast("B") for t in sd.values()]
                fd = os.open(os.path.join(base, f"f{files[0]}"), os.O_WRONLY | os.O_CREAT)
                try:
                    if per_tensor:
                        for b in bufs:
                            os.write(fd, b)
                    else:
                        os.writev(fd, bufs)
                finally:
                    os.close(fd)
            return go

        t = interleaved({"one": write_file(False), "each": write_file(True)}, repeat, fresh)
        report.add(f"page cache: {mb:.0f} MB to a new file, one writev", "MB/s", mb / t["one"],
                   "one write() per tensor", mb / t["each"],
                   "large writes take large page-cache folios")

        # a child sharing `shared` of its tensors with its parent, put with parent=
        cg = chain_graph(child_layers, rows, cols)
        cstate = chain_state(child_layers, rows, cols, 1)
        keep = int(round(child_layers * shared))
        child_g = chain_graph(child_layers, rows, cols)
        for i in range(keep, child_layers):
            child_g["nodes"][i + 1]["config"]["tag"] = "child"
        cmb = child_layers * rows * cols * 4 / 1e6
        torch = import_optional("torch", "the repository put profile", "torch")
        with Repository(os.path.join(base, "child"), sync=False) as repo:
            parent = [repo.put(cg, cstate)]
            child = dict(cstate)

            def fresh_parent() -> None:
                for t in cstate.values():
                    t.add_(1.0)

            def fresh_child() -> None:
                parent[0] = repo.put(cg, cstate)
                for i in range(keep, child_layers):
                    child[f"l{i}.w"] = torch.rand(rows, cols)
                for i in range(keep):
                    child[f"l{i}.w"] = cstate[f"l{i}.w"]

            _profile(report, f"{cmb:.0f} MB, {child_layers}-layer put (LMDB, sync=False)",
                     lambda: repo.put(cg, cstate), fresh_parent, repeat)
            _profile(report, f"{child_layers}-layer child, {shared:.0%} shared (LMDB, "
                     "sync=False)", lambda: repo.put(child_g, child, parent=parent[0]),
                     fresh_child, repeat)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
