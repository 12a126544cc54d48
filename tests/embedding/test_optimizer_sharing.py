"""One optimizer or admission-filter object given to several tables: every table owns a copy.

Adam's bias correction and Adagrad's ``lr_decay`` read the optimizer's global step, and a
filter counts sightings: state that must be the table's own, whoever else was given the same
object. Each table here must train bit for bit like a table given an object of its own.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensorkv
from tensorkv.embedding.filters import BloomFilter, CounterFilter
from tensorkv.embedding.schedules import exponential_decay
from tensorkv.embedding.table import EmbeddingTable

DIM = 4

OPTIMIZERS = {
    "adam": lambda: tensorkv.Adam(lr=0.05, betas=(0.8, 0.9)),
    "adamw": lambda: tensorkv.AdamW(lr=0.05, weight_decay=0.1),
    "adagrad_lr_decay": lambda: tensorkv.Adagrad(lr=0.2, lr_decay=0.5),
    "adam_schedule": lambda: tensorkv.Adam(lr=exponential_decay(0.1, 0.5, 2)),
}


def rows(table: EmbeddingTable) -> tuple[bytes, ...]:
    """Keys, values, slots, frequencies and versions of ``table`` sorted by key, as bytes."""
    [ch] = list(table.export(chunk_rows=1 << 20))
    order = np.argsort(ch.keys)
    return tuple(np.asarray(a)[order].tobytes()
                 for a in (ch.keys, ch.values, ch.slots, ch.freq, ch.version))


def train(tables: list[EmbeddingTable], steps: int, seed: int = 0) -> None:
    """The same batches, step after step, on every table, interleaved."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, 40, 24)
        grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        for t in tables:
            t.apply_gradients(keys, grads)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tables_sharing_an_optimizer_train_like_a_lone_table(name):
    make = OPTIMIZERS[name]
    shared = make()
    a, b = (EmbeddingTable(DIM, optimizer=shared, seed=1) for _ in range(2))
    lone = EmbeddingTable(DIM, optimizer=make(), seed=1)
    train([a, b, lone], steps=5)
    assert rows(a) == rows(lone) == rows(b)
    assert a.optimizer.step == b.optimizer.step == lone.optimizer.step == 5
    # the object given is a template: the tables step their own copies
    assert shared.step == 0 and a.optimizer is not shared and a.optimizer is not b.optimizer
    assert a.optimizer.config() == shared.config()


def test_the_copy_keeps_the_given_state_and_the_schedule_object():
    sched = exponential_decay(0.1, 0.5, 2)
    opt = tensorkv.Adam(lr=sched)
    opt.load_state({"step": 7})
    t = EmbeddingTable(DIM, optimizer=opt)
    assert t.optimizer.step == 7 and t.optimizer.lr is sched


@pytest.mark.parametrize("make", [lambda: CounterFilter(min_count=2),
                                  lambda: BloomFilter(min_count=2, capacity=1000)],
                         ids=["counter", "bloom"])
def test_tables_sharing_an_admission_filter_count_their_own_sightings(make):
    shared = make()
    a, b = (EmbeddingTable(DIM, admission=shared) for _ in range(2))
    keys = np.array([5, 6])
    a.lookup(keys)
    assert len(a) == 0
    b.lookup(keys)  # a first sighting in b, whatever a saw
    assert len(b) == 0
    a.lookup(keys)
    assert len(a) == 2 and len(b) == 0
    assert shared.peek(keys).tolist() == [0, 0]


def test_checkpoint_restore_gives_each_table_its_own_step():
    """Tables restored into a model built with one shared optimizer keep their own steps."""
    url = f"memory://sharing-{os.getpid()}"
    src = {"a": EmbeddingTable(DIM, optimizer="adam", seed=1),
           "b": EmbeddingTable(DIM, optimizer="adam", seed=2)}
    train([src["a"]], steps=3, seed=1)
    train([src["b"]], steps=5, seed=2)
    tensorkv.save(src, url, "t")
    shared = tensorkv.Adam()
    dst = {"a": EmbeddingTable(DIM, optimizer=shared, seed=1),
           "b": EmbeddingTable(DIM, optimizer=shared, seed=2)}
    tensorkv.load(dst, url, "t")
    assert dst["a"].optimizer.step == 3 and dst["b"].optimizer.step == 5
    train([src["a"], dst["a"]], steps=2, seed=3)
    train([src["b"], dst["b"]], steps=2, seed=4)
    assert rows(dst["a"]) == rows(src["a"]) and rows(dst["b"]) == rows(src["b"])
