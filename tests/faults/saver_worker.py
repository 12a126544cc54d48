"""A process that saves a small model (dense tensors and a table) seeded by its argument.

Usage: ``python saver_worker.py URL TAG SEED START_AT [delay]``. It waits until the time
START_AT (so several workers start together), saves, and prints ``ok``, ``exists: ...`` or
``restarted: ...``, then exits 0 (1 on any other error).
"""

from __future__ import annotations

import sys
import time

import numpy as np


def model(seed: int, rows: int = 3000, dim: int = 8) -> dict:
    """Dense tensors and a trained EmbeddingTable, all determined by ``seed``."""
    from tensorkv import EmbeddingTable

    rng = np.random.default_rng(seed)
    t = EmbeddingTable(dim, optimizer="adagrad", seed=seed)
    keys = rng.integers(0, 1 << 40, rows, dtype=np.int64)
    t.lookup(keys)
    t.apply_gradients(keys[: rows // 2], rng.standard_normal((rows // 2, dim)).astype(np.float32))
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": np.full(7, seed, np.int64),
        "emb": t,
    }


def assert_model_equal(got: dict, want: dict) -> None:
    """Dense tensors and every table field (keys, values, slots, freq, version) bit-equal."""
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["b"], want["b"])
    ea, eb = (next(iter(t.export(chunk_rows=1 << 30))) for t in (got["emb"], want["emb"]))
    oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
    for f in ("keys", "values", "slots", "freq", "version"):
        np.testing.assert_array_equal(np.asarray(getattr(ea, f))[oa],
                                      np.asarray(getattr(eb, f))[ob], err_msg=f)


def main() -> int:
    import tensorkv
    from tensorkv.errors import StoreRestartedError, TagExistsError

    url, tag, seed, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    m = model(seed)
    time.sleep(max(0.0, start_at - time.time()))
    try:
        tensorkv.save(m, url, tag, block_rows=256, progress=False)
    except TagExistsError as exc:
        print(f"exists: {exc}")
        return 0
    except StoreRestartedError as exc:
        print(f"restarted: {exc}")
        return 0
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
