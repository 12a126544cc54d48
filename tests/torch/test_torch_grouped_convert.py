"""convert(group=True): per-feature modules served by one fused pass, as separate modules."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
from tensorkv.torch import DynamicEmbeddingBagCollection, Optimizer, convert  # noqa: E402
from tensorkv.torch.grouping import Deferred, GroupedEmbeddingBag  # noqa: E402

N_FEAT, DIM = 5, 4


def table_rows(table) -> tuple[bytes, ...]:
    chunks = list(table.export(chunk_rows=1 << 20))
    if not chunks:
        return (table.step,)
    [ch] = chunks
    order = np.argsort(ch.keys)
    return tuple(np.asarray(a)[order].tobytes()
                 for a in (ch.keys, ch.values, ch.slots, ch.freq, ch.version)) + (table.step,)


class DLRMish(torch.nn.Module):
    """The usual per-feature model: a ModuleList of bags, each called on its column."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        modes = ["sum", "mean", "sum", "max", "sum"]
        self.embs = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(20, DIM, mode=modes[i], padding_idx=0 if i == 2 else None)
             for i in range(N_FEAT)])
        self.tok = torch.nn.Embedding(20, DIM, padding_idx=1)
        with torch.no_grad():
            self.tok.weight[1] = 0
        self.top = torch.nn.Linear(DIM * (N_FEAT + 2), 1)

    def forward(self, x, bag_ids, bag_offsets):
        embs = [e(x[:, i:i + 1]) for i, e in enumerate(self.embs[:-1])]
        embs.append(self.embs[-1](bag_ids, bag_offsets))
        tok = self.tok(x[:, :2]).reshape(x.shape[0], -1)
        return self.top(torch.cat(embs + [tok], 1)).squeeze(1)


def batches(n, b=6):
    rng = np.random.default_rng(0)
    for _ in range(n):
        x = torch.from_numpy(rng.integers(0, 40, (b, N_FEAT)))  # ids beyond the old rows too
        lengths = rng.integers(0, 3, b)
        ids = torch.from_numpy(rng.integers(0, 40, int(lengths.sum())))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        yield x, ids, offsets, torch.from_numpy(rng.random(b).astype(np.float32))


def test_grouped_convert_trains_bit_identically_to_convert():
    base = DLRMish()
    grouped = convert(copy.deepcopy(base), optimizer=tensorkv.Adagrad(lr=0.1), group=True)
    plain = convert(copy.deepcopy(base), optimizer=tensorkv.Adagrad(lr=0.1))
    assert isinstance(grouped.embs[0], GroupedEmbeddingBag)
    assert sorted(grouped.state_dict()) == sorted(plain.state_dict())
    opt_g = Optimizer(grouped, torch.optim.SGD(grouped.top.parameters(), lr=0.1))
    opt_p = Optimizer(plain, torch.optim.SGD(plain.top.parameters(), lr=0.1))
    f = torch.nn.functional.binary_cross_entropy_with_logits
    for x, ids, offsets, y in batches(4):
        out_g, out_p = grouped(x, ids, offsets), plain(x, ids, offsets)
        assert torch.equal(out_g, out_p)
        for out, opt in ((out_g, opt_g), (out_p, opt_p)):
            opt.zero_grad()
            f(out, y).backward()
            opt.step()
    for (name, m), (_, ref) in zip(grouped.named_modules(), plain.named_modules(), strict=True):
        if hasattr(m, "table"):
            assert table_rows(m.table) == table_rows(ref.table), name
    assert torch.equal(grouped.top.weight, plain.top.weight)


def test_grouped_outputs_wait_and_run_as_one_pass():
    model = convert(DLRMish(), group=True)
    lazy = model.embs[0].lazy
    x, ids, offsets, _ = next(batches(1))
    outs = [e(x[:, i:i + 1]) for i, e in enumerate(model.embs[:-1])]
    assert all(type(o) is Deferred for o in outs)
    assert lazy.pending() == N_FEAT - 1
    def lookups(e):
        st = e.table.stats()
        return st["hits"] + st["misses"]

    assert all(lookups(e) == 0 for e in model.embs)  # nothing looked up yet
    joined = torch.cat(outs, 1)  # the first use runs every waiting lookup
    assert type(joined) is torch.Tensor and joined.shape == (6, DIM * (N_FEAT - 1))
    assert lazy.pending() == 0
    assert all(lookups(e) > 0 for e in model.embs[:-1])
    assert outs[0].shape == (6, DIM)  # a used Deferred answers with its real tensor


def test_an_output_never_used_is_never_looked_up():
    model = convert(DLRMish(), group=True)
    before = len(model.embs[0].table)
    out = model.embs[0](torch.tensor([[33]]))
    del out
    model.embs[1](torch.tensor([[34]])).sum()
    assert 33 not in model.embs[0].table and len(model.embs[0].table) == before
    assert 34 in model.embs[1].table


def test_grouped_bad_input_raises_at_the_call():
    model = convert(DLRMish(), group=True)
    with pytest.raises(tensorkv.errors.ShapeError, match="offsets"):
        model.embs[0](torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(tensorkv.errors.ShapeError, match="dtype"):
        model.embs[0](torch.tensor([[1.0]]))
    assert model.embs[0].lazy.pending() == 0


@dataclass
class FakeConfig:
    """TorchRec's EmbeddingBagConfig fields."""

    name: str
    embedding_dim: int
    num_embeddings: int
    feature_names: list
    pooling: str = "SUM"


class EmbeddingBagCollection(torch.nn.Module):
    """A stand-in with TorchRec's structure (its class name, configs and embedding_bags)."""

    def __init__(self, configs):
        super().__init__()
        self._configs = configs
        self.embedding_bags = torch.nn.ModuleDict({
            c.name: torch.nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, mode="sum")
            for c in configs})

    def embedding_bag_configs(self):
        return self._configs


def test_torchrec_style_collection_becomes_a_dynamic_collection():
    cfgs = [FakeConfig("t0", 4, 10, ["a", "b"]), FakeConfig("t1", 8, 5, ["c"])]
    model = torch.nn.Sequential(EmbeddingBagCollection(cfgs))
    old = {n: m.weight.detach().clone() for n, m in model[0].embedding_bags.items()}
    convert(model, group=True)
    col = model[0]
    assert isinstance(col, DynamicEmbeddingBagCollection)
    assert col.feature_names() == ["a", "b", "c"]
    out = col({"a": torch.tensor([3, 4]), "b": torch.tensor([9, 0]), "c": torch.tensor([1, 2])})
    assert torch.equal(out["a"], old["t0"][[3, 4]])
    assert torch.equal(out["c"], old["t1"][[1, 2]])
    assert sorted(model.state_dict()) == ["0.embedding_bags.t0._extra_state",
                                          "0.embedding_bags.t1._extra_state"]


def test_an_output_made_on_another_thread_is_computed_where_it_is_used():
    import threading

    model = convert(DLRMish(), group=True)
    box = {}
    t = threading.Thread(target=lambda: box.update(out=model.embs[0](torch.tensor([[35]]))))
    t.start()
    t.join()
    assert model.embs[0].lazy.pending() == 0  # this thread's queue is empty
    assert box["out"].shape == (1, DIM)  # the other thread's waiting lookup runs now
    assert 35 in model.embs[0].table


class TwoColumns(torch.nn.Module):
    """One bag called on two columns, as a model may share a table between features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.EmbeddingBag(20, DIM, mode="sum")

    def forward(self, x):
        return torch.cat([self.emb(x[:, :1]), self.emb(x[:, 1:2])], 1)


def test_a_module_called_twice_accumulates_like_convert():
    grouped = convert(TwoColumns(), optimizer=tensorkv.Adagrad(lr=0.1), group=True)
    plain = convert(TwoColumns(), optimizer=tensorkv.Adagrad(lr=0.1))
    opt_g, opt_p = Optimizer(grouped), Optimizer(plain)
    rng = np.random.default_rng(3)
    for _ in range(2):
        for _ in range(2):  # two backward passes before one step
            x = torch.from_numpy(rng.integers(0, 8, (5, 2)))
            w = torch.from_numpy(rng.standard_normal((5, 2 * DIM)).astype(np.float32))
            (grouped(x) * w).sum().backward()
            (plain(x) * w).sum().backward()
        items = [(k.tobytes(), g.tobytes()) for k, g in grouped.emb.take_gradients()]
        want = plain.emb.take_gradients()
        assert items == [(k.tobytes(), g.tobytes()) for k, g in want]
        grouped.emb.restore_gradients([(np.frombuffer(k, np.int64), np.frombuffer(
            g, np.float32).reshape(-1, DIM)) for k, g in items])
        plain.emb.restore_gradients(want)
        opt_g.step()
        opt_p.step()
    assert table_rows(grouped.emb.table) == table_rows(plain.emb.table)


def test_grouped_modules_are_configured_as_converted_ones():
    """A model repository's layer configuration (hence hash) does not see the waiting group."""
    from tensorkv.repository.capture import module_config

    g, p = convert(DLRMish(), group=True), convert(DLRMish())
    assert module_config(g.embs[0], False) == module_config(p.embs[0], False)
    assert module_config(g.tok, False) == module_config(p.tok, False)
