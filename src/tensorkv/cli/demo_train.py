"""``tensorkv demo``: train a DLRM-style click-through model on a tiered dynamic table.

The model and its data are :mod:`tensorkv.bench.dlrm`. Its 26 categorical features share one
``DynamicEmbeddingBag`` whose table keeps hot rows in DRAM and spills the rest to an SSDHASH
tier under ``PATH/spill``; checkpoints go into LMDB under ``PATH/lmdb``. Mid-run the model is
saved in the background (``blocking=False``: training goes on while it is written), and at the
end a fresh process (``python -m tensorkv.cli.demo_train``) loads that checkpoint and trains
the same steps again; its losses must equal this process's bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
import numpy as np

from tensorkv.bench.dlrm import DLRM, N_CAT, SyntheticCTR, auc

#: Embedding width, samples per step, learning rates (table Adagrad, dense Adam).
DIM = 16
BATCH = 2048
TABLE_LR = 0.05
DENSE_LR = 1e-3
#: Tier-0 (DRAM) budget of the table; the rest of the rows spill to the SSDHASH tier.
TIER0_BYTES = "32MiB"
#: Steps after the mid-run checkpoint that the fresh process trains again.
RESUME_STEPS = 10
#: Prefix of the demo's checkpoint tags (a re-run deletes the previous run's).
TAG_PREFIX = "demo-step-"
#: Progressive AUC: over the predictions of the last this many samples (made before each
#: batch's update, so they are out-of-sample).
AUC_WINDOW = 40_960


def data_urls(path: str) -> tuple[str, str, str]:
    """(LMDB checkpoint URL, spill directory of the run, spill directory of the resume)."""
    root = os.path.abspath(path)
    return f"lmdb://{os.path.join(root, 'lmdb')}", os.path.join(root, "spill"), os.path.join(
        root, "spill-resume")


def build(spill: str, *, tier0: str = TIER0_BYTES, seed: int = 0) -> tuple[Any, Any]:
    """The model on a DRAM+SSDHASH table spilling to ``spill``, and its optimizer."""
    import torch

    from tensorkv import StorageOption
    from tensorkv.embedding.optimizers import Adagrad
    from tensorkv.torch import DynamicEmbeddingBag, Optimizer

    storage = StorageOption(storage_type="DRAM_SSDHASH", storage_path=spill, overwrite=True,
                            storage_size=[tier0], cache_strategy="lfu")
    emb = DynamicEmbeddingBag(DIM, mode="sum", storage=storage, optimizer=Adagrad(lr=TABLE_LR),
                              seed=seed)
    model = DLRM(emb, dim=DIM, seed=seed)
    return model, Optimizer(model, dense=torch.optim.Adam(model.parameters(), lr=DENSE_LR))


def train_step(model: Any, opt: Any, data: SyntheticCTR, step: int,
               batch: int) -> tuple[float, np.ndarray, np.ndarray]:
    """One step on batch ``step``: (loss, predictions before the update, labels)."""
    import torch

    b = data.batch(step, batch)
    out = model(torch.from_numpy(b.dense), torch.from_numpy(b.keys))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(out, torch.from_numpy(b.labels))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item()), out.detach().numpy(), b.labels


def save_checkpoint(model: Any, opt: Any, url: str, step: int, parent: str | None = None,
                    blocking: bool = True) -> tuple[str, float, Any]:
    """Save the model with its dense optimizer state as tag ``demo-step-N``.

    Returns ``(tag, seconds the call took, handle)``: ``blocking=False`` returns once the
    snapshot is taken, with the save's :class:`~tensorkv.checkpoint.handle.SaveHandle`
    (None for a blocking save).
    """
    from tensorkv.torch import save

    tag = f"{TAG_PREFIX}{step}"
    t0 = time.perf_counter()
    out = save(model, url, tag, optimizer=opt, step=step, incremental=parent is not None,
               parent=parent, progress=False, blocking=blocking)
    return tag, time.perf_counter() - t0, None if blocking else out


def resume(url: str, tag: str, start: int, steps: int, batch: int, spill: str) -> list[float]:
    """Load ``tag`` into a fresh model and train steps ``start .. start+steps-1``."""
    from tensorkv.torch import load

    model, opt = build(spill)
    load(model, url, tag, optimizer=opt, progress=False)
    data = SyntheticCTR(0)
    try:
        return [train_step(model, opt, data, s, batch)[0] for s in range(start, start + steps)]
    finally:
        model.embedding.table.close()


def resume_in_fresh_process(url: str, tag: str, start: int, steps: int, batch: int,
                            spill: str) -> list[float]:
    """Run :func:`resume` in a new Python process; its losses."""
    args = [sys.executable, "-m", "tensorkv.cli.demo_train", url, tag, str(start), str(steps),
            str(batch), spill]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise click.ClickException(
            f"the fresh process failed to resume from {tag!r} (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-2000:]}")
    return [float(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]


@dataclass
class Progress:
    """The one-line progress bar (redrawn in place on a terminal, else a line per 10%)."""

    total_s: float
    echo: Callable[[str], Any]
    tty: bool
    t0: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    printed: int = -1

    def update(self, step: int, samples: int, loss: float, score: float, *,
               final: bool = False) -> None:
        """Redraw with the current figures (at most every 0.25 s on a terminal)."""
        now = time.perf_counter()
        done = min((now - self.t0) / self.total_s, 1.0)
        tenth = int(done * 10)
        if not final and (now - self.last < 0.25 if self.tty else tenth <= self.printed):
            return
        self.last, self.printed = now, tenth
        bar = "#" * int(done * 24) + "-" * (24 - int(done * 24))
        rate = samples / max(now - self.t0, 1e-9)
        line = (f"  [{bar}] {now - self.t0:5.1f} s  step {step:5d}  {rate:8,.0f} samples/s  "
                f"loss {loss:.4f}  AUC {score:.4f}")
        if self.tty:
            click.echo("\r" + line, nl=final)
        else:
            self.echo(line)


@dataclass
class RunResult:
    """What the summary prints."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    first_loss: float = float("nan")
    loss: float = float("nan")
    auc: float = float("nan")
    mid_tag: str = ""
    mid_step: int = 0
    mid_seconds: float = 0.0  # the call: training paused for the snapshot
    mid_write_seconds: float = 0.0  # the background write
    final_tag: str = ""
    final_seconds: float = 0.0
    after_mid: list[float] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def forget_earlier_runs(url: str) -> None:
    """Delete the checkpoint tags an earlier demo run left in the store, and their data."""
    import tensorkv
    from tensorkv.checkpoint import delete_tag, list_tags

    try:
        old = [t for t in list_tags(url) if t.startswith(TAG_PREFIX)]
    except tensorkv.TensorKVError:
        return
    for tag in old:
        delete_tag(url, tag, force=True)
    if old:
        tensorkv.checkpoint.gc(url, grace=0)


def train(path: str, *, seconds: float, batch: int = BATCH,
          echo: Callable[[str], Any] = click.echo, tty: bool | None = None) -> RunResult:
    """Train for ``seconds``, checkpoint at half time and at the end, resume in a new process."""
    url, spill, spill_resume = data_urls(path)
    os.makedirs(os.path.abspath(path), exist_ok=True)
    forget_earlier_runs(url)
    model, opt = build(spill)
    table = model.embedding.table
    data = SyntheticCTR(0)
    res = RunResult()
    bar = Progress(seconds, echo, sys.stdout.isatty() if tty is None else tty)
    losses: list[float] = []
    scores: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    window = max(AUC_WINDOW // batch, 1)
    mid: Any = None
    t0 = time.perf_counter()
    step = 0
    try:
        while True:
            elapsed = time.perf_counter() - t0
            if not res.mid_tag and elapsed >= seconds / 2:
                res.mid_step = step
                res.mid_tag, res.mid_seconds, mid = save_checkpoint(model, opt, url, step,
                                                                    blocking=False)
                t0 += res.mid_seconds  # the bar shows training time
                elapsed = time.perf_counter() - t0
            if elapsed >= seconds and len(res.after_mid) >= RESUME_STEPS:
                break
            loss, out, y = train_step(model, opt, data, step, batch)
            step += 1
            losses.append(loss)
            if res.mid_tag and len(res.after_mid) < RESUME_STEPS:
                res.after_mid.append(loss)
            scores, labels = (scores + [out])[-window:], (labels + [y])[-window:]
            res.loss = float(np.mean(losses[-window:]))
            if step % 5 == 0:
                res.auc = auc(np.concatenate(labels), np.concatenate(scores))
            bar.update(step, step * batch, res.loss, res.auc)
        res.auc = auc(np.concatenate(labels), np.concatenate(scores))
        res.seconds = time.perf_counter() - t0
        res.steps, res.samples = step, step * batch
        res.first_loss = losses[0]
        bar.update(step, step * batch, res.loss, res.auc, final=True)
        if mid is not None:
            mid.result()  # written meanwhile; the final save builds on it
            res.mid_write_seconds = mid.stats()["write_seconds"]
        res.final_tag, res.final_seconds, _ = save_checkpoint(model, opt, url, step,
                                                              parent=res.mid_tag)
        res.stats = table.stats()
    finally:
        table.close()
    res.resumed = resume_in_fresh_process(url, res.mid_tag, res.mid_step, RESUME_STEPS, batch,
                                          spill_resume)
    return res


def main(argv: list[str]) -> None:
    """``python -m tensorkv.cli.demo_train URL TAG START STEPS BATCH SPILL``: print losses."""
    url, tag, start, steps, batch, spill = argv
    losses = resume(url, tag, int(start), int(steps), int(batch), spill)
    print(json.dumps(losses))


if __name__ == "__main__":  # pragma: no cover - run by resume_in_fresh_process
    main(sys.argv[1:])


__all__ = ["N_CAT", "RunResult", "build", "train"]
