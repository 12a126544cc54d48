"""``tensorkv demo`` (training, :mod:`tensorkv.cli.demo_train`) and ``tensorkv demo tour``.

The tour writes tensors into a store and reads them back.

The demo is a list of steps (:data:`STEPS`); each takes the shared :class:`DemoState`, does
one thing, and returns a one-line summary (extra lines go to ``state.details``). Steps that
need optional parts of tensorkv raise :class:`SkipStep` when those are missing, so the demo
always runs to the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
import numpy as np

from tensorkv import codec, config
from tensorkv.cli.fmt import human_bytes
from tensorkv.errors import TensorKVError
from tensorkv.stores import KVStore, open_store

#: Key prefix of the demo's tensors in the store.
PREFIX = b"demo/tensor/"


class SkipStep(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a step whose optional dependency is not available."""


@dataclass
class DemoState:
    """What the steps share: the store, the tensors written, and per-step timings."""

    url: str
    store: KVStore | None = None
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    bytes_written: int = 0
    details: list[str] = field(default_factory=list)  # extra lines printed under a step


def default_scheme() -> str:
    """The embedded backend the demo uses by default (``config.DEFAULT_EMBEDDED_SCHEME``)."""
    return getattr(config, "DEFAULT_EMBEDDED_SCHEME", "lmdb")


def default_url(path: str) -> str:
    """The store URL for a data directory: ``SCHEME:///abs/path/SCHEME``."""
    scheme = default_scheme()
    return f"{scheme}://{os.path.join(os.path.abspath(path), scheme)}"


def sample_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A small model's worth of tensors in several dtypes and shapes (deterministic)."""
    rng = np.random.default_rng(seed)
    import ml_dtypes

    return {
        "embedding.weight": rng.standard_normal((10_000, 64), dtype=np.float32),
        "mlp.0.weight": rng.standard_normal((256, 64), dtype=np.float32).astype(
            ml_dtypes.bfloat16
        ),
        "mlp.0.bias": np.zeros(256, dtype=np.float32),
        "mlp.1.weight": rng.standard_normal((1, 256)).astype(np.float16),
        "vocab.ids": rng.integers(0, 2**62, size=4096, dtype=np.int64),
        "step": np.array(1234, dtype=np.int64),  # a 0-d scalar
    }


# ----------------------------------------------------------------------------- steps
def step_open(state: DemoState) -> str:
    """Open (or create) the store."""
    state.store = open_store(state.url)
    caps = [_CAP_WORDS[name] for name, on in state.store.capabilities.as_dict().items() if on]
    return f"{state.url}  ({', '.join(caps) or 'no guarantees'})"


_CAP_WORDS = {
    "ordered_scans": "ordered",
    "atomic_batches": "atomic",
    "durable_on_return": "durable",
    "multi_process": "multi-process",
    "distributed": "distributed",
}


def step_write(state: DemoState) -> str:
    """Encode the tensors as records and write them in one batch."""
    assert state.store is not None
    t0 = time.perf_counter()
    records = [(PREFIX + name.encode(), codec.encode(a)) for name, a in state.tensors.items()]
    state.store.put_many(records)
    state.store.flush()
    dt = time.perf_counter() - t0
    state.bytes_written = sum(len(r) for _, r in records)
    return (
        f"{len(records)} tensors, {human_bytes(state.bytes_written)} in one put_many "
        f"({_rate(state.bytes_written, dt)})"
    )


def step_read(state: DemoState) -> str:
    """Read the records back, decode them and check they are bit-identical."""
    assert state.store is not None
    names = list(state.tensors)
    t0 = time.perf_counter()
    raw = state.store.get_many([PREFIX + n.encode() for n in names])
    decoded = [
        None if buf is None else codec.decode(buf, key=name)
        for name, buf in zip(names, raw, strict=True)
    ]
    dt = time.perf_counter() - t0
    nbytes = sum(0 if buf is None else len(buf) for buf in raw)
    bad = []
    for name, got in zip(names, decoded, strict=True):
        want = state.tensors[name]
        if (
            got is None
            or got.dtype != want.dtype
            or got.shape != want.shape
            or got.tobytes() != want.tobytes()
        ):
            bad.append(name)
    if bad:
        raise click.ClickException(f"read back different data for {', '.join(bad)}")
    return (
        f"{len(names)}/{len(names)} bit-identical ({_rate(nbytes, dt)} with checksums)"
    )


def step_list(state: DemoState) -> str:
    """List the stored tensors from their record headers."""
    assert state.store is not None
    rows = []
    for key, value in state.store.scan(PREFIX):
        head = codec.read_header(value, key=key)
        shape = "(" + ", ".join(str(s) for s in head.shape) + ("," if len(head.shape) == 1 else "")
        rows.append((key[len(PREFIX) :].decode(), str(head.dtype), shape + ")", len(value)))
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(_LIST_HEAD)]
    titles = [h.ljust(w) for h, w in zip(_LIST_HEAD[:3], widths, strict=False)]
    lines = ["      " + "  ".join([*titles, _LIST_HEAD[3].rjust(widths[3])])]
    for r in rows:
        lines.append(
            "      "
            + "  ".join(
                [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2])]
                + [human_bytes(r[3]).rjust(widths[3])]
            )
        )
    state.details = lines
    return f"{len(rows)} tensors under {PREFIX.decode()!r}"


_LIST_HEAD = ("name", "dtype", "shape", "bytes")


def step_embedding(state: DemoState) -> str:
    """Create a small dynamic embedding table, look ids up, apply a gradient, show stats."""
    try:
        from tensorkv.embedding import EmbeddingTable
    except ImportError as exc:
        raise SkipStep("tensorkv.embedding.EmbeddingTable is not available") from exc
    dim = 16
    table = EmbeddingTable(dim, optimizer="sgd", seed=0)
    ids = np.array([3, 14, 15, 92, 65, 35, 14, 3], dtype=np.int64)  # 3 and 14 repeat
    before = np.array(table.lookup(ids), copy=True)
    table.apply_gradients(ids, np.ones((len(ids), dim), dtype=np.float32))
    after = np.asarray(table.lookup(ids, insert=False))
    moved = float(np.abs(after - before).max())
    stats = table.stats()
    state.details = [
        f"      lookup of {len(ids)} ids -> {len(table)} new rows; "
        f"one SGD step moved them by up to {moved:.3g}",
        "      stats: "
        + ", ".join(
            f"{k}={_short(stats[k])}"
            for k in ("rows", "capacity", "load_factor", "bytes_per_key", "step")
            if k in stats
        ),
    ]
    return f"EmbeddingTable(dim={dim}): lookup, apply_gradients, stats()"


def _short(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


Step = tuple[str, Callable[[DemoState], str]]

#: The demo, in order: (title, function).
STEPS: list[Step] = [
    ("open store", step_open),
    ("write tensors", step_write),
    ("read back + verify", step_read),
    ("list tensors", step_list),
    ("embedding table", step_embedding),
]


# ----------------------------------------------------------------------------- output
def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e6:,.0f} MB/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def run_demo(url: str, *, echo: Callable[[str], Any] = click.echo) -> DemoState:
    """Run :data:`STEPS` against the store at ``url``, printing one line per step.

    Returns
    -------
    DemoState
        The state after the last step (the store is closed).
    """
    from tensorkv import __version__

    state = DemoState(url=url, tensors=sample_tensors())
    echo(click.style(f"tensorkv {__version__} demo", bold=True))
    width = max(len(title) for title, _ in STEPS)
    n = len(STEPS)
    t_all = time.perf_counter()
    try:
        for i, (title, fn) in enumerate(STEPS, 1):
            state.details = []
            t0 = time.perf_counter()
            try:
                summary = fn(state)
            except SkipStep as skip:
                echo(
                    f"[{i}/{n}] {title.ljust(width)}  "
                    + click.style(f"skipped: {skip}", fg="yellow")
                )
                continue
            dt = time.perf_counter() - t0
            state.timings[title] = dt
            echo(
                f"[{i}/{n}] {click.style(title.ljust(width), fg='cyan')}  "
                f"{click.style(_ms(dt), fg='green')}  {summary}"
            )
            for line in state.details:
                echo(line)
    finally:
        if state.store is not None:
            state.store.close()
    total = time.perf_counter() - t_all
    echo(click.style(f"done in {total:.2f} s", bold=True))
    return state


@click.command(short_help="Write tensors into a store, read back, list.")
@click.option(
    "--path",
    default="./tensorkv-data",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for the tour's store (embedded default backend).",
)
@click.option("--url", default=None, help="Use this store URL instead, e.g. redis://localhost:6379/0.")
def tour(path: str, url: str | None) -> None:
    """Write a few tensors into a store, read them back bit-identical, and list them."""
    target = url or default_url(path)
    try:
        run_demo(target)
    except TensorKVError as exc:  # a bad URL, a missing package, a locked store, ...
        raise click.ClickException(str(exc)) from exc
    if url is None:
        click.echo(f"data kept in {path} (delete the directory to start over)")


#: Training time of ``tensorkv demo`` and of ``tensorkv demo --quick``, in seconds.
TRAIN_SECONDS = 60.0
QUICK_SECONDS = 3.0


@click.group(invoke_without_command=True,
             short_help="Train a click-through model on a tiered table (or: demo tour).")
@click.option(
    "--path",
    default="./tensorkv-data",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for the spilled rows and the LMDB checkpoints (re-runs replace them).",
)
@click.option("--quick", is_flag=True, help=f"Train {QUICK_SECONDS:g} s instead of "
              f"{TRAIN_SECONDS:g} s.")
@click.option("--seconds", type=click.FloatRange(min=0.5), default=None,
              help="Training time in seconds (overrides --quick).")
@click.pass_context
def demo(ctx: click.Context, path: str, quick: bool, seconds: float | None) -> None:
    """Train a DLRM-style click-through model whose embedding rows spill to SSD.

    13 dense and 26 categorical features (Zipf-distributed ids over 10^8 values each), one
    DynamicEmbeddingBag on a DRAM+SSDHASH table, checkpoints into LMDB under PATH, a resume
    in a fresh process, and a summary. `tensorkv demo tour` runs the short store tour instead.
    """
    if ctx.invoked_subcommand is not None:
        return
    from tensorkv.cli.demo_report import print_summary
    from tensorkv.cli.demo_train import train

    budget = seconds if seconds is not None else (QUICK_SECONDS if quick else TRAIN_SECONDS)
    click.secho(f"tensorkv demo: DLRM-style click-through model, {budget:g} s of training",
                bold=True)
    try:
        result = train(path, seconds=budget)
    except ImportError as exc:
        raise click.ClickException(f"{exc}; or run `tensorkv demo tour`") from exc
    except TensorKVError as exc:
        raise click.ClickException(str(exc)) from exc
    print_summary(result, path)


demo.add_command(tour)
