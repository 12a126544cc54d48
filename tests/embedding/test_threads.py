import threading

import numpy as np

from tensorkv.embedding.optimizers import Adagrad
from tensorkv.embedding.table import EmbeddingTable

N_THREADS = 4


def run_threads(fns):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def state(t):
    ch = list(t.export(chunk_rows=10**7))[0]
    order = np.argsort(ch.keys)
    return {f: np.asarray(getattr(ch, f))[order] for f in ("keys", "values", "slots", "freq")}


def test_parallel_lookups_of_present_keys_equal_serial():
    t = EmbeddingTable(16, seed=1)
    keys = np.arange(50_000, dtype=np.int64)
    t.lookup(keys)
    expected = t.lookup(keys, insert=False)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, keys.size, 4096) for _ in range(N_THREADS * 8)]
    results: dict[int, np.ndarray] = {}

    def reader(i):
        def fn():
            for j in range(i, len(batches), N_THREADS):
                results[j] = t.lookup(batches[j])
        return fn

    run_threads([reader(i) for i in range(N_THREADS)])
    for j, b in enumerate(batches):
        np.testing.assert_array_equal(results[j], expected[b])
    # frequency counting stays exact under concurrent lookups
    total = np.bincount(np.concatenate(batches), minlength=keys.size) + 1
    np.testing.assert_array_equal(t.frequency(keys), total)


def test_concurrent_inserts_of_overlapping_keys():
    t = EmbeddingTable(8, seed=2)
    rng = np.random.default_rng(1)
    batches = [rng.integers(-100_000, 100_000, 5000) for _ in range(N_THREADS * 6)]

    def inserter(i):
        def fn():
            for j in range(i, len(batches), N_THREADS):
                out = t.lookup(batches[j])
                np.testing.assert_array_equal(out, t.initializer.values(batches[j], 8, 2))
        return fn

    run_threads([inserter(i) for i in range(N_THREADS)])
    serial = EmbeddingTable(8, seed=2)
    for b in batches:
        serial.lookup(b)
    assert len(t) == len(serial)
    a, b = state(t), state(serial)
    for f in a:
        np.testing.assert_array_equal(a[f], b[f])


def test_mixed_lookups_and_updates_equal_serial_run():
    dim = 8
    rng = np.random.default_rng(2)
    # each writer owns a disjoint key range; readers read a shared, never-updated range
    work = []
    for w in range(N_THREADS):
        steps = []
        for _ in range(15):
            k = rng.integers(0, 3000, 2000) + w * 10_000  # duplicates included
            steps.append((k, rng.standard_normal((k.size, dim)).astype(np.float32)))
        work.append(steps)
    shared = np.arange(100_000, 120_000, dtype=np.int64)

    def make():
        t = EmbeddingTable(dim, optimizer=Adagrad(lr=0.05), seed=3)
        t.lookup(shared)
        return t

    t = make()
    expect_shared = t.lookup(shared, insert=False)
    read_errors = []

    def writer(steps):
        def fn():
            for k, g in steps:
                t.lookup(k)
                t.apply_gradients(k, g)
        return fn

    def reader():
        for _ in range(20):
            idx = rng.integers(0, shared.size, 3000)
            if not np.array_equal(t.lookup(shared[idx], insert=False), expect_shared[idx]):
                read_errors.append(idx)

    run_threads([writer(s) for s in work] + [reader, reader])
    assert not read_errors

    serial = make()
    for steps in work:
        for k, g in steps:
            serial.lookup(k)
            serial.apply_gradients(k, g)
    a, b = state(t), state(serial)
    for f in a:
        np.testing.assert_array_equal(a[f], b[f])


def test_concurrent_remove_and_lookup_stay_consistent():
    t = EmbeddingTable(4, seed=4)
    keys = np.arange(20_000, dtype=np.int64)
    t.lookup(keys)
    init = t.initializer.values(keys, 4, 4)

    def remover():
        for chunk in np.array_split(keys[::2], 20):
            t.remove(chunk)

    def reader():
        for _ in range(20):
            # removed keys read their (deterministic) initial value, kept keys their row:
            # both equal the initializer here, so any torn read would show
            np.testing.assert_array_equal(t.lookup(keys, insert=False), init)

    run_threads([remover, reader, reader])
    assert len(t) == 10_000
