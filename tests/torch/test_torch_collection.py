"""Embedding collections: bit-identical to separate modules, every input form, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
from tensorkv.errors import ConfigError, ShapeError  # noqa: E402
from tensorkv.torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingCollection,
    EmbeddingBagConfig,
    EmbeddingConfig,
    Optimizer,
)

#: table -> (dim, pooling, padding_idx, features): mixed dims, every pooling mode, padding,
#: and a table shared by two features.
TABLES = {
    "t_sum": (4, "sum", None, ["f_sum"]),
    "t_pad": (4, "sum", 3, ["f_pad"]),
    "t_mean": (4, "mean", 3, ["f_mean"]),
    "t_max": (4, "max", None, ["f_max"]),
    "t_shared": (8, "sum", None, ["f_a", "f_b"]),
    "t_wide": (8, "mean", None, ["f_wide"]),
}
FEATURES = [f for *_, feats in TABLES.values() for f in feats]
WEIGHTED = {"f_sum", "f_a"}  # features with per-sample weights


def table_rows(table) -> tuple[bytes, ...]:
    """Keys, values, slots, frequencies, versions and step of ``table``, sorted by key."""
    chunks = list(table.export(chunk_rows=1 << 20))
    if not chunks:
        return (table.step,)
    cols = [np.concatenate([np.asarray(getattr(ch, f)) for ch in chunks])
            for f in ("keys", "values", "slots", "freq", "version")]
    order = np.argsort(cols[0])
    return tuple(a[order].tobytes() for a in cols) + (table.step,)


def make_collection(optimizer=None, **kw):
    cfgs = [EmbeddingBagConfig(name, dim, feature_names=feats, pooling=mode, padding_idx=pad,
                               seed=i)
            for i, (name, (dim, mode, pad, feats)) in enumerate(TABLES.items())]
    return DynamicEmbeddingBagCollection(cfgs, optimizer=optimizer or tensorkv.Adam(lr=0.05),
                                         **kw)


class Separate(torch.nn.Module):
    """The reference: one DynamicEmbeddingBag per feature (shared tables through table=)."""

    def __init__(self, optimizer=None, **kw):
        super().__init__()
        self.mods = torch.nn.ModuleDict()
        for i, (name, (dim, mode, pad, feats)) in enumerate(TABLES.items()):
            path = {} if "storage_path" not in kw else {
                "storage_path": f"{kw['storage_path']}/{name}"}
            first = DynamicEmbeddingBag(dim, mode, padding_idx=pad, seed=i,
                                        optimizer=optimizer or tensorkv.Adam(lr=0.05),
                                        **{**kw, **path})
            self.mods[feats[0]] = first
            for f in feats[1:]:
                self.mods[f] = DynamicEmbeddingBag(dim, mode, padding_idx=pad, table=first.table)

    def forward(self, batch):
        return {f: self.mods[f](ids, offsets, per_sample_weights=w)
                for f, (ids, offsets, w) in batch.items()}


def make_batch(rng, b=6, grad_weights=False):
    """Feature -> (ids, offsets, weights) with duplicates, padding ids and an empty bag."""
    out = {}
    for f in FEATURES:
        lengths = rng.integers(0, 4, b)
        lengths[0] = 0
        n = int(lengths.sum())
        ids = torch.from_numpy(rng.integers(0, 12, n))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        w = None
        if f in WEIGHTED:
            w = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))
            w.requires_grad_(grad_weights)
        out[f] = (ids, offsets, w)
    return out


def pending(module):
    items = module.take_gradients()
    module.restore_gradients(items)
    return [(k.tobytes(), g.tobytes()) for k, g in items]


@pytest.mark.parametrize("grad_weights", [False, True])
def test_collection_trains_bit_identically_to_separate_modules(grad_weights):
    """Outputs, gradients (rows and per-sample weights), values, slots, freq, version, step."""
    col, ref = make_collection(), Separate()
    head_c, head_r = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    head_r.load_state_dict(head_c.state_dict())
    opt_c = Optimizer(col, torch.optim.SGD(head_c.parameters(), lr=0.1))
    opt_r = Optimizer(ref, torch.optim.SGD(head_r.parameters(), lr=0.1))
    rng = np.random.default_rng(0)
    for _ in range(4):
        batch = make_batch(rng, grad_weights=grad_weights)
        twin = {f: (i, o, None if w is None else w.detach().clone().requires_grad_(grad_weights))
                for f, (i, o, w) in batch.items()}
        kt = col(batch)
        got = kt.to_dict()
        want = ref(twin)
        for f in FEATURES:
            assert torch.equal(got[f], want[f]), f
        assert torch.equal(kt.values(), torch.cat([want[f] for f in FEATURES], 1))

        def loss(out, head):
            return sum((head(out[f][:, :4]) ** 2).sum() + out[f].sum() for f in FEATURES)

        loss(got, head_c).backward()
        loss(want, head_r).backward()
        for name, (*_, feats) in TABLES.items():
            want_items = [it for f in feats for it in pending(ref.mods[f])]
            assert pending(col.embedding_bags[name]) == want_items, name
        if grad_weights:
            for f in WEIGHTED:
                assert torch.equal(batch[f][2].grad, twin[f][2].grad), f
        opt_c.step()
        opt_r.step()
    for name, (*_, feats) in TABLES.items():
        assert table_rows(col.embedding_bags[name].table) == table_rows(
            ref.mods[feats[0]].table), name
    assert torch.equal(head_c.weight, head_r.weight)


def test_collection_fused_optimizer_and_eval_match_separate_modules():
    col, ref = make_collection(), Separate()
    opt_c, opt_r = Optimizer(col, fused=True), Optimizer(ref, fused=True)
    rng = np.random.default_rng(1)
    for _ in range(3):
        batch = make_batch(rng)
        sum(v.sum() for v in col(batch).to_dict().values()).backward()
        sum(v.sum() for v in ref(batch).values()).backward()
        opt_c.step()
        opt_r.step()
    for name, (*_, feats) in TABLES.items():
        assert table_rows(col.embedding_bags[name].table) == table_rows(
            ref.mods[feats[0]].table), name
    col.eval()
    ref.eval()
    batch = make_batch(rng)
    batch["f_sum"] = (torch.tensor([1000, 1001]), torch.tensor([0, 1, 1, 2, 2, 2]), None)
    with torch.no_grad():
        got, want = col(batch), ref(batch)
    for f in FEATURES:
        assert torch.equal(got[f], want[f]), f
    assert 1000 not in col.embedding_bags["t_sum"].table  # eval inserts nothing


def test_one_id_per_sample_and_2d_bags_match_separate_modules():
    """The DLRM shape (a [B] or [B, 1] tensor per feature) and [B, L] bags."""
    modes = ["sum", "mean", "sum", "max"]
    cfgs = [EmbeddingBagConfig(f"t{i}", 4, pooling=mode, seed=i) for i, mode in enumerate(modes)]
    col = DynamicEmbeddingBagCollection(cfgs, optimizer="adagrad")
    ref = torch.nn.ModuleList([DynamicEmbeddingBag(4, mode, seed=i, optimizer="adagrad")
                               for i, mode in enumerate(modes)])
    opt_c, opt_r = Optimizer(col), Optimizer(ref)
    rng = np.random.default_rng(2)
    for _ in range(3):
        x = torch.from_numpy(rng.integers(0, 9, (7, 3)))
        bags = torch.from_numpy(rng.integers(0, 9, (7, 2)))
        got = col({"t0": x[:, 0], "t1": x[:, 1:2], "t2": bags, "t3": bags}).to_dict()
        want = [ref[0](x[:, 0:1]), ref[1](x[:, 1:2]), ref[2](bags), ref[3](bags)]
        for i in range(4):
            assert torch.equal(got[f"t{i}"], want[i])
        sum((o * o).sum() for o in got.values()).backward()
        sum((o * o).sum() for o in want).backward()
        opt_c.step()
        opt_r.step()
    for i in range(4):
        assert table_rows(col.embedding_bags[f"t{i}"].table) == table_rows(ref[i].table)


class HandMadeKJT:
    """A KeyedJaggedTensor built by hand: TorchRec's fields, not its class."""

    def __init__(self, keys, values, lengths=None, offsets=None, weights=None):
        self._keys, self._values, self._weights = keys, values, weights
        self._lengths, self._offsets = lengths, offsets

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths_or_none(self):
        return self._lengths

    def offsets_or_none(self):
        return self._offsets

    def lengths(self):
        return self._lengths

    def offsets(self):
        return self._offsets

    def weights_or_none(self):
        return self._weights


def kjt_of(batch, keys, use_offsets=False):
    values, lengths, weights = [], [], []
    for f in keys:
        ids, offsets, w = batch[f]
        n = ids.shape[0]
        lengths.append(torch.diff(torch.cat([offsets, torch.tensor([n])])))
        values.append(ids)
        weights.append(torch.ones(n) if w is None else w)
    lengths_t = torch.cat(lengths)
    offsets_t = torch.cat([torch.tensor([0]), torch.cumsum(lengths_t, 0)])
    return HandMadeKJT(keys, torch.cat(values), None if use_offsets else lengths_t,
                       offsets_t if use_offsets else None, torch.cat(weights))


@pytest.mark.parametrize("use_offsets", [False, True])
def test_keyed_jagged_input_matches_the_dict_input(use_offsets):
    col_a, col_b = make_collection(), make_collection()
    batch = {f: (i, o, None) for f, (i, o, _) in make_batch(np.random.default_rng(3)).items()}
    kjt = kjt_of(batch, FEATURES, use_offsets)
    kjt._weights = None
    got, want = col_a(kjt).to_dict(), col_b(batch).to_dict()
    for f in FEATURES:
        assert torch.equal(got[f], want[f]), f
    for name in TABLES:
        assert table_rows(col_a.embedding_bags[name].table) == table_rows(
            col_b.embedding_bags[name].table)


def test_keyed_jagged_weights_go_to_their_features():
    cfgs = [EmbeddingBagConfig("t", 4, feature_names=["x", "y"], seed=1)]
    col_a = DynamicEmbeddingBagCollection(cfgs)
    col_b = DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig("t", 4, feature_names=["x", "y"], seed=1)])
    kjt = HandMadeKJT(["x", "y"], torch.tensor([1, 2, 2, 5, 1]), torch.tensor([2, 0, 1, 2]),
                      weights=torch.tensor([0.5, 2.0, 1.5, -1.0, 3.0]))
    got = col_a(kjt)
    want = col_b({"x": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([2, 0]),
                        "weights": torch.tensor([0.5, 2.0])},
                  "y": (torch.tensor([2, 5, 1]), torch.tensor([0, 1]),
                        torch.tensor([1.5, -1.0, 3.0]))})
    assert torch.equal(got.values(), want.values())
    assert got.keys() == ["x", "y"] and got.offset_per_key() == [0, 4, 8]


def test_torchrec_keyed_jagged_tensor_when_importable():
    trs = pytest.importorskip("torchrec.sparse.jagged_tensor")
    col_a, col_b = make_collection(), make_collection()
    batch = make_batch(np.random.default_rng(4))
    nw = {f: (i, o, None) for f, (i, o, _) in batch.items()}
    mine = kjt_of(nw, FEATURES)
    kjt = trs.KeyedJaggedTensor(keys=FEATURES, values=mine.values(), lengths=mine.lengths())
    got, want = col_a(kjt), col_b(nw)
    assert torch.equal(got.values(), want.values())


def test_embedding_collection_matches_separate_modules():
    cfgs = [EmbeddingConfig("u", 4, feature_names=["p", "q"], padding_idx=0, seed=3),
            EmbeddingConfig("v", 6, seed=4)]
    col = DynamicEmbeddingCollection(cfgs, optimizer="adagrad")
    p = DynamicEmbedding(4, padding_idx=0, seed=3, optimizer="adagrad")
    ref = torch.nn.ModuleDict({"p": p, "q": DynamicEmbedding(4, padding_idx=0, table=p.table),
                               "v": DynamicEmbedding(6, seed=4, optimizer="adagrad")})
    opt_c, opt_r = Optimizer(col), Optimizer(ref)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = torch.from_numpy(rng.integers(0, 6, (3, 2)))
        q = torch.from_numpy(rng.integers(0, 6, 5))
        v = torch.from_numpy(rng.integers(0, 6, 3))
        got = col({"p": x, "q": {"values": q, "lengths": torch.tensor([2, 0, 3])}, "v": v})
        want = {"p": ref["p"](x), "q": ref["q"](q), "v": ref["v"](v)}
        assert got["p"].shape == (3, 2, 4) and got["q"].shape == (5, 4)
        assert got["v"].shape == (3, 6)
        for f in want:
            assert torch.equal(got[f], want[f]), f
        sum((o * o).sum() for o in got.values()).backward()
        sum((o * o).sum() for o in want.values()).backward()
        opt_c.step()
        opt_r.step()
    assert table_rows(col.embeddings["u"].table) == table_rows(p.table)
    assert table_rows(col.embeddings["v"].table) == table_rows(ref["v"].table)


def test_tiered_tables_train_like_separate_tiered_modules(tmp_path):
    opts = {"storage": "DRAM_SSDHASH", "storage_size": ["512B"]}  # tier 0 < the rows
    col = make_collection(storage_path=str(tmp_path / "c"), **opts)
    ref = Separate(storage_path=str(tmp_path / "r"), **opts)
    opt_c, opt_r = Optimizer(col), Optimizer(ref)
    rng = np.random.default_rng(6)
    try:
        for _ in range(3):
            batch = make_batch(rng, b=12)
            sum(v.sum() for v in col(batch).to_dict().values()).backward()
            sum(v.sum() for v in ref(batch).values()).backward()
            opt_c.step()
            opt_r.step()
        for name, (*_, feats) in TABLES.items():
            assert table_rows(col.embedding_bags[name].table) == table_rows(
                ref.mods[feats[0]].table), name
        st = col.embedding_bags["t_wide"].table.stats()
        assert st["tier0_rows"] < st["rows"]  # rows live in the SSDHASH tier too
    finally:
        for m in (*col.embedding_bags.values(), *ref.mods.values()):
            m.table.close()


def test_state_dict_and_save_see_each_table_by_its_module_path(tmp_path):
    col = make_collection()
    sum(v.sum() for v in col(make_batch(np.random.default_rng(7))).to_dict().values()).backward()
    Optimizer(col).step()
    sd = col.state_dict()
    assert sorted(sd) == sorted(f"embedding_bags.{t}._extra_state" for t in TABLES)
    other = make_collection()
    other.load_state_dict(sd)
    for t in TABLES:
        assert table_rows(other.embedding_bags[t].table) == table_rows(
            col.embedding_bags[t].table)
    url = f"lmdb://{tmp_path}/ckpt"
    tensorkv.save(col, url, tag="v1")
    third = make_collection()
    tensorkv.load(third, url, tag="v1")
    for t in TABLES:
        assert table_rows(third.embedding_bags[t].table) == table_rows(
            col.embedding_bags[t].table)


def snapshot(col):
    return [table_rows(m.table) + (m.table.stats()["mutation_seq"],)
            for m in col.embedding_bags.values()]


@pytest.mark.parametrize("bad, error, words", [
    ({"nope": torch.tensor([1])}, ConfigError, "not features of this collection"),
    ({}, ConfigError, "missing"),
    ({"f_sum": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([1, 2, 0, 0, 0, 0])}},
     ShapeError, "lengths sum to 3"),
    ({"f_mean": torch.arange(5)}, ShapeError, "different batch sizes"),
    ({"f_sum": (torch.tensor([1.0]), torch.tensor([0]))}, ShapeError, "dtype torch.float32"),
    ({"f_sum": (torch.tensor([1, 2]), torch.tensor([1, 2, 2, 2, 2, 2]))}, ShapeError,
     "start at 0"),
    ({"f_sum": (torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2, 2, 2]))}, ShapeError,
     "must not decrease"),
    ({"f_mean": (torch.tensor([1]), torch.tensor([0] * 6), torch.tensor([2.0]))}, ConfigError,
     "only with pooling='sum'"),
    ({"f_sum": "ids"}, ShapeError, "not a feature input"),
])
def test_bad_inputs_raise_a_clear_error_and_change_nothing(bad, error, words):
    col = make_collection()
    rng = np.random.default_rng(8)
    col(make_batch(rng))  # some rows exist
    before = snapshot(col)
    batch = {f: (i, o, w) for f, (i, o, w) in make_batch(rng).items()}
    if not bad:
        batch.pop("f_wide")
    batch.update(bad)
    with pytest.raises(error, match=words):
        col(batch)
    assert snapshot(col) == before
    col(make_batch(rng))  # still usable: the busy lock was released


def test_bad_keyed_jagged_lengths_change_nothing():
    col = make_collection()
    before = snapshot(col)
    kjt = HandMadeKJT(FEATURES, torch.arange(5), torch.ones(len(FEATURES) * 2 + 1,
                                                           dtype=torch.int64))
    with pytest.raises(ShapeError, match="do not split"):
        col(kjt)
    kjt = HandMadeKJT(FEATURES, torch.arange(5), torch.ones(len(FEATURES) * 2,
                                                           dtype=torch.int64))
    with pytest.raises(ShapeError, match="sum to"):
        col(kjt)
    assert snapshot(col) == before


@pytest.mark.parametrize("cfgs, words", [
    ([], "non-empty list"),
    ([EmbeddingBagConfig("a", 4), EmbeddingBagConfig("a", 4)], "different from the other"),
    ([EmbeddingBagConfig("a", 4), EmbeddingBagConfig("b", 4, feature_names=["a"])],
     "named twice"),
    ([EmbeddingBagConfig("a.b", 4)], "without '.'"),
    ([EmbeddingBagConfig("a", 4, pooling="median")], "pooling="),
    ([EmbeddingConfig("a", 4)], "is not an EmbeddingBagConfig"),
])
def test_bad_configs_are_refused(cfgs, words):
    with pytest.raises(ConfigError, match=words):
        DynamicEmbeddingBagCollection(cfgs)


def test_torchrec_pooling_enum_names_are_accepted():
    class PoolingType:
        name = "MEAN"

    col = DynamicEmbeddingBagCollection([EmbeddingBagConfig("a", 4, pooling=PoolingType())])
    assert col.embedding_bags["a"].mode == "mean"
    assert col.groups() == [["a"]]


def test_passes_accumulated_before_a_step_match_separate_modules():
    """Two backward passes, one step: a shared table sums its features' items in their order."""
    col, ref = make_collection(optimizer=tensorkv.Adagrad(lr=0.1)), Separate(
        optimizer=tensorkv.Adagrad(lr=0.1))
    opt_c, opt_r = Optimizer(col), Optimizer(ref)
    rng = np.random.default_rng(9)
    for _ in range(2):
        for _ in range(2):
            batch = make_batch(rng)
            sum((v * v).sum() for v in col(batch).to_dict().values()).backward()
            sum((v * v).sum() for v in ref(batch).values()).backward()
        want = [it for f in TABLES["t_shared"][3] for it in pending(ref.mods[f])]
        assert pending(col.embedding_bags["t_shared"]) == want
        opt_c.step()
        opt_r.step()
    for name, (*_, feats) in TABLES.items():
        assert table_rows(col.embedding_bags[name].table) == table_rows(
            ref.mods[feats[0]].table), name


def test_redis_resident_tables_train_like_separate_modules(redis_server):
    """Tables living in Redis (given through table=) serve a collection as separate modules."""
    import uuid

    run = uuid.uuid4().hex[:8]

    def table(who, name, dim):
        opt = tensorkv.StorageOption("REDIS", storage_path=f"redis://127.0.0.1:"
                                     f"{redis_server.port}/0",
                                     redis_options={"model_tag_runtime": f"{run}{who}{name}"})
        return tensorkv.EmbeddingTable(dim, storage=opt, optimizer=tensorkv.Adagrad(lr=0.1),
                                       seed=len(name))

    dims = {"r1": 4, "r2": 4}
    col = DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig(n, d, pooling="sum", table=table("c", n, d)) for n, d in dims.items()])
    ref = torch.nn.ModuleDict({n: DynamicEmbeddingBag(d, "sum", table=table("r", n, d))
                               for n, d in dims.items()})
    opt_c, opt_r = Optimizer(col), Optimizer(ref)
    rng = np.random.default_rng(10)
    try:
        for _ in range(3):
            x = {n: torch.from_numpy(rng.integers(0, 9, (5, 2))) for n in dims}
            got = col(x).to_dict()
            want = {n: ref[n](x[n]) for n in dims}
            for n in dims:
                assert torch.equal(got[n], want[n])
            sum((v * v).sum() for v in got.values()).backward()
            sum((v * v).sum() for v in want.values()).backward()
            opt_c.step()
            opt_r.step()
        for n in dims:
            assert table_rows(col.embedding_bags[n].table) == table_rows(ref[n].table), n
    finally:
        for m in (*col.embedding_bags.values(), *ref.values()):
            m.table.close()
