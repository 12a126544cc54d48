"""Save while training: the demo's DLRM trained with a save every N steps, blocking or not.

Part of ``tensorkv bench checkpoint``. The model and data of ``tensorkv demo``
(:mod:`tensorkv.bench.dlrm`, ``tensorkv.torch.Optimizer`` with dense Adam) train on a DRAM
table and on a DRAM+SSDHASH table (tier 0 of 32 MiB, as the demo's) in four passes of the
same length, saving the whole model (tables, dense parameters and Adam state) into LMDB:

* undisturbed: no save (before and after the others; its median step is the baseline);
* blocking: ``tensorkv.torch.save(model, ...)`` every ``every`` steps, from the training loop;
* non-blocking: the same with ``blocking=False``; a save that comes due while the previous
  one still writes is made at the first step boundary after it is written (the loop checks
  ``handle.done()``), so no save waits for another.

Per save: the stall (the longest step from the save's call until it is written, minus the
median undisturbed step: for a blocking save the step that made it), the blocking save's
duration, and, for non-blocking saves, samples/s over the steps run while a save was writing
(after the step that called it), against undisturbed training.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from tensorkv.bench.common import Report
from tensorkv.bench.dlrm import DLRM, SyntheticCTR

DIM = 16
TIER0 = "32MiB"


def _model(storage: Any) -> tuple[Any, Any]:
    import torch

    from tensorkv.embedding.optimizers import Adagrad
    from tensorkv.torch import DynamicEmbeddingBag, Optimizer

    emb = DynamicEmbeddingBag(DIM, mode="sum", storage=storage, optimizer=Adagrad(lr=0.05))
    model = DLRM(emb, dim=DIM)
    return model, Optimizer(model, dense=torch.optim.Adam(model.parameters(), lr=1e-3))


def _pass(model: Any, opt: Any, batches: list[Any], url: str | None, every: int,
          blocking: bool, first: int) -> dict[str, Any]:
    """Train on ``batches``; save every ``every`` steps (``url`` None: never)."""
    import torch

    from tensorkv.torch import save

    f = torch.nn.functional.binary_cross_entropy_with_logits
    times, saving, save_steps, durations, peaks = [], [], [], [], []
    windows: list[list[Any]] = []  # [handle, first step, step after it was written]
    handle: Any = None
    due = False
    for i, (dense, keys, labels) in enumerate(batches):
        for w in windows:
            if w[2] < 0 and w[0].done():
                w[2] = i  # the steps [call, i) ran while it wrote
        busy = handle is not None and not handle.done()
        t0 = time.perf_counter()
        out = model(dense, keys)
        loss = f(out, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        due = due or (url is not None and i % every == every - 1)
        if due and (handle is None or handle.done()):
            due = False
            s0 = time.perf_counter()
            got = save(model, url, f"bench-{first + i}", optimizer=opt, blocking=blocking,
                       progress=False)
            durations.append(time.perf_counter() - s0)
            save_steps.append(i)
            if not blocking:
                if handle is not None:
                    peaks.append(handle.stats()["peak_snapshot_bytes"])
                handle = got
                windows.append([got, i, -1])
        times.append(time.perf_counter() - t0)
        saving.append(busy)
    if handle is not None:
        handle.result()
        peaks.append(handle.stats()["peak_snapshot_bytes"])
    for w in windows:
        if w[2] < 0:
            w[2] = len(batches)
    return {"times": np.array(times), "saving": np.array(saving, bool), "saves": save_steps,
            "durations": durations, "peaks": peaks, "windows": [w[1:] for w in windows]}


def run_case(kind: str, root: str, report: Report, *, batch: int, steps: int, warm: int,
             every: int) -> None:
    """The four passes of one table kind; figures into ``report``."""
    import torch

    from tensorkv import StorageOption
    from tensorkv.checkpoint import delete_tag, gc, list_tags

    storage = None
    if kind == "dram_ssdhash":
        storage = StorageOption(storage_type="DRAM_SSDHASH",
                                storage_path=os.path.join(root, "train-spill"), overwrite=True,
                                storage_size=[TIER0], cache_strategy="lfu")
    url = f"lmdb://{os.path.join(root, 'train-ckpt')}"
    data = SyntheticCTR(0)
    n = warm + 4 * steps
    batches = []
    for s in range(n):
        b = data.batch(s, batch)
        batches.append((torch.from_numpy(b.dense), torch.from_numpy(b.keys.reshape(-1, 1)),
                        torch.from_numpy(b.labels)))
    model, opt = _model(storage)
    try:
        _pass(model, opt, batches[:warm], None, every, True, 0)
        parts = [batches[warm + k * steps: warm + (k + 1) * steps] for k in range(4)]
        base1 = _pass(model, opt, parts[0], None, every, True, warm)
        blk = _pass(model, opt, parts[1], url, every, True, warm + steps)
        for tag in list_tags(url):  # keep the store small
            delete_tag(url, tag, force=True)
        gc(url, grace=0)
        nb = _pass(model, opt, parts[2], url, every, False, warm + 2 * steps)
        base2 = _pass(model, opt, parts[3], None, every, True, warm + 3 * steps)
        rows = len(model.embedding.table)
    finally:
        model.embedding.table.close()
        shutil.rmtree(os.path.join(root, "train-ckpt"), ignore_errors=True)
        shutil.rmtree(os.path.join(root, "train-spill"), ignore_errors=True)
    undisturbed = np.concatenate([base1["times"], base2["times"]])
    med = float(np.median(undisturbed))
    rate = batch / med
    save_blk = float(np.median(blk["durations"]))
    stall_blk = float(np.median(blk["times"][blk["saves"]])) - med
    stalls = [float(nb["times"][lo:max(hi, lo + 1)].max()) - med for lo, hi in nb["windows"]
              if hi < len(nb["times"])]  # a save still writing at the end is not counted
    stalls = stalls or [float(nb["times"][nb["saves"]].max()) - med]
    stall_nb, worst_nb = float(np.median(stalls)), float(np.max(stalls))
    busy = nb["saving"]
    during = batch * int(busy.sum()) / float(nb["times"][busy].sum()) if busy.any() else rate
    write_s = [hi - lo for lo, hi in nb["windows"]]
    report.params[f"save_while_training_{kind}"] = {
        "rows": rows, "saves": len(blk["saves"]) + len(nb["saves"]),
        "steps_while_saving": int(busy.sum()), "steps_per_background_save": write_s,
        "peak_snapshot_bytes": int(max(nb["peaks"], default=0)),
        "call_seconds_non_blocking": [round(d, 4) for d in nb["durations"]],
        "stalls_non_blocking": [round(s, 4) for s in stalls],
    }
    name = kind.replace("_", "+").upper()
    report.add(f"save while training, {name}: blocking stall", "s", stall_blk,
               "undisturbed step", med, note=f"save {save_blk:.2f} s, {rows:,} rows")
    report.add(f"save while training, {name}: non-blocking stall", "s", stall_nb,
               "blocking save", save_blk, note=f"worst {worst_nb * 1e3:.0f} ms; call "
               f"{np.median(nb['durations']) * 1e3:.0f} ms; goal <= 0.05")
    report.add(f"save while training, {name}: samples/s while saving", "samples/s", during,
               "undisturbed training", rate, note="non-blocking; goal >= 0.8")
    for label, p in (("blocking", blk), ("non-blocking", nb)):
        report.add(f"save while training, {name}: samples/s, {label} saves", "samples/s",
                   batch * len(p["times"]) / float(p["times"].sum()), "undisturbed training",
                   rate, note=f"a save every {every} steps")


def run(quick: bool, report: Report, root: str, *, batch: int | None = None,
        steps: int | None = None, warm: int | None = None, every: int | None = None,
        kinds: tuple[str, ...] = ("dram", "dram_ssdhash")) -> None:
    """Save-while-training figures of every table kind (see the module docstring).

    Parameters
    ----------
    batch, steps, warm, every
        Samples per step (2048), steps per pass (quick 120, else 300), untimed steps first
        (quick 20, else 60), and steps between saves (quick 60, else 150).
    """
    batch = batch or 2048
    steps = steps or (120 if quick else 300)
    warm = warm if warm is not None else (20 if quick else 60)
    every = every or (60 if quick else 150)
    report.params.update(train_batch=batch, train_steps=steps, train_warm=warm,
                         train_save_every=every)
    for kind in kinds:
        run_case(kind, root, report, batch=batch, steps=steps, warm=warm, every=every)


__all__ = ["run", "run_case"]
