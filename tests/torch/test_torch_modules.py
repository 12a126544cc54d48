"""DynamicEmbedding / DynamicEmbeddingBag forward, gradients, optimizer, eval and threads."""

import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tensorkv  # noqa: E402
from tensorkv.errors import (  # noqa: E402
    ConcurrentUseError,
    ConfigError,
    NonFiniteGradientError,
    ShapeError,
)
from tensorkv.torch import DynamicEmbedding, DynamicEmbeddingBag, Optimizer  # noqa: E402


def static_twin(module, ids):
    """nn.EmbeddingBag weights holding the table's rows of ``ids`` (sorted), and the id map."""
    uniq = np.unique(ids)
    rows = module.table.lookup(uniq, insert=False)
    return torch.from_numpy(rows.copy()), {int(k): i for i, k in enumerate(uniq)}


def remap(ids, mapping):
    return torch.tensor([mapping[int(i)] for i in ids.reshape(-1)]).reshape(ids.shape)


def test_embedding_forward_matches_table_rows_any_shape():
    e = DynamicEmbedding(4, seed=3)
    ids = torch.tensor([[[7, 1], [7, 9]], [[1, 1], [2, 7]]])
    out = e(ids)
    assert out.shape == (2, 2, 2, 4) and out.dtype == torch.float32
    want = e.table.lookup(ids.reshape(-1).numpy(), insert=False).reshape(2, 2, 2, 4)
    assert np.array_equal(out.detach().numpy(), want)
    assert len(e.table) == 4


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_forward_and_gradients_match_nn_embeddingbag(mode):
    b = DynamicEmbeddingBag(5, mode=mode, seed=1)
    ids = torch.tensor([4, 9, 4, 11, 9, 9, 30])
    offsets = torch.tensor([0, 3, 3, 6])  # an empty bag too
    b(ids, offsets)  # inserts the rows
    weight, mapping = static_twin(b, ids.numpy())
    ref = torch.nn.EmbeddingBag(len(mapping), 5, mode=mode, _weight=weight.clone())
    got = b(ids, offsets)
    want = ref(remap(ids, mapping), offsets)
    assert torch.allclose(got, want, atol=1e-7)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    [(keys, grads)] = b.take_gradients()
    assert np.array_equal(keys, np.unique(ids.numpy()))
    assert np.allclose(grads, ref.weight.grad.numpy()[[mapping[int(k)] for k in keys]],
                       atol=1e-6)


def test_bag_2d_include_last_offset_per_sample_weights_and_padding():
    b = DynamicEmbeddingBag(3, mode="mean", padding_idx=0, seed=2)
    x2 = torch.tensor([[5, 0, 6], [0, 0, 6]])
    b(x2)
    weight, mapping = static_twin(b, np.array([5, 6]))
    mapping[0] = len(mapping)
    ref = torch.nn.EmbeddingBag(3, 3, mode="mean", padding_idx=2,
                                _weight=torch.cat([weight, torch.zeros(1, 3)]))
    assert torch.allclose(b(x2), ref(remap(x2, mapping)), atol=1e-7)
    assert 0 not in b.table  # the padding id never gets a row

    s = DynamicEmbeddingBag(3, mode="sum", include_last_offset=True, table=b.table)
    ids, offs = torch.tensor([5, 6, 6]), torch.tensor([0, 1, 3])
    w = torch.tensor([0.5, 2.0, -1.0])
    ref_s = torch.nn.EmbeddingBag(2, 3, mode="sum", include_last_offset=True, _weight=weight)
    assert torch.allclose(s(ids, offs, per_sample_weights=w),
                          ref_s(remap(ids, mapping), offs, per_sample_weights=w), atol=1e-7)


def test_string_ids_are_hashed_as_the_table_hashes_them():
    e = DynamicEmbedding(4)
    out = e(["user:1", "item:9", "user:1"])
    assert out.shape == (3, 4)
    want = e.table.lookup(["user:1", "item:9", "user:1"], insert=False)
    assert np.array_equal(out.detach().numpy(), want)
    assert set(e.table.keys().tolist()) == set(e.table.as_keys(["user:1", "item:9"]).tolist())


def test_each_distinct_row_is_read_and_counted_once_per_batch():
    e = DynamicEmbedding(2)
    e(torch.tensor([3, 3, 3, 8]))
    assert e.table.frequency(np.array([3, 8])).tolist() == [1, 1]
    assert e.table.stats()["hits"] + e.table.stats()["misses"] == 2


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_eval_and_no_grad_neither_insert_nor_count(how):
    e = DynamicEmbedding(4, seed=5)
    e(torch.tensor([1]))
    before = e.table.frequency(np.array([1]))
    if how == "eval":
        e.eval()
        out = e(torch.tensor([1, 2]))
    else:
        with torch.no_grad():
            out = e(torch.tensor([1, 2]))
    assert len(e.table) == 1 and e.table.frequency(np.array([1])).tolist() == before.tolist()
    # an id without a row reads as its initial value
    assert np.array_equal(out[1].detach().numpy(), e.table.lookup(np.array([2]), insert=False)[0])
    assert not out.requires_grad and e.pending_gradients() == 0


def test_backward_passes_accumulate_and_step_without_backward_changes_nothing():
    e = DynamicEmbedding(3, optimizer=tensorkv.SGD(lr=0.5), initializer="zeros")
    opt = Optimizer(e)
    opt.step()  # nothing waiting
    assert e.table.step == 0 and len(e.table) == 0
    e(torch.tensor([1, 2, 1])).sum().backward()
    e(torch.tensor([2])).sum().backward()
    assert e.pending_gradients() == 2
    opt.step()
    assert e.table.step == 1
    assert np.allclose(e.table.lookup(np.array([1, 2]), insert=False), -1.0)  # 2 * 0.5 each
    opt.step()
    assert e.table.step == 1
    e(torch.tensor([1])).sum().backward()
    opt.zero_grad()
    opt.step()
    assert e.table.step == 1 and np.allclose(e.table.lookup(np.array([1]), insert=False), -1.0)


def test_optimizer_steps_dense_and_shared_tables_once():
    table = tensorkv.EmbeddingTable(2, optimizer=tensorkv.SGD(lr=1.0), initializer="zeros")
    model = torch.nn.ModuleDict({
        "a": DynamicEmbedding(2, table=table), "b": DynamicEmbeddingBag(2, "sum", table=table),
        "lin": torch.nn.Linear(2, 1)})
    opt = Optimizer(model, dense=torch.optim.SGD(model["lin"].parameters(), lr=0.1))
    b0 = model["lin"].bias.detach().clone()
    loss = model["lin"](model["a"](torch.tensor([4])) + model["b"](torch.tensor([[4, 5]]))).sum()
    loss.backward()
    opt.step()
    assert table.step == 1  # one table step for both modules
    assert not torch.equal(model["lin"].bias, b0)


def test_nonfinite_gradients_refused_before_anything_changes():
    e = DynamicEmbedding(2, optimizer="sgd", initializer="zeros")
    lin = torch.nn.Linear(2, 1)
    model = torch.nn.Sequential(e, lin)
    opt = Optimizer(model, dense=torch.optim.SGD(lin.parameters(), lr=0.1))
    (model(torch.tensor([1])).sum() * float("nan")).backward()
    w0 = lin.weight.detach().clone()
    with pytest.raises(NonFiniteGradientError, match="zero_grad"):
        opt.step()
    assert e.table.step == 0 and torch.equal(lin.weight, w0) and e.pending_gradients() == 1


def test_nonfinite_gradients_of_one_table_leave_every_table_unchanged():
    a = DynamicEmbedding(2, optimizer="sgd", initializer="zeros")
    b = DynamicEmbedding(2, optimizer="sgd", initializer="zeros")
    lin = torch.nn.Linear(2, 1)
    opt = Optimizer(torch.nn.ModuleList([a, b, lin]),
                    dense=torch.optim.SGD(lin.parameters(), lr=0.1))
    # NaN reaches b's row only: the dense gradients stay finite, the tables' check refuses
    (lin(a(torch.tensor([1]))).sum() + (b(torch.tensor([2])) * float("nan")).sum()).backward()
    assert torch.isfinite(lin.weight.grad).all()
    w0 = lin.weight.detach().clone()
    with pytest.raises(NonFiniteGradientError, match="ids \\[2\\]"):
        opt.step()
    assert a.table.step == b.table.step == 0 and torch.equal(lin.weight, w0)
    assert a.pending_gradients() == b.pending_gradients() == 1


def test_two_threads_at_once_are_refused():
    e = DynamicEmbedding(2)
    entered, release = threading.Event(), threading.Event()

    class SlowIds:  # an id source that holds the first forward pass open
        def __array__(self, dtype=None, copy=None):
            entered.set()
            release.wait(30)
            return np.array([1, 2], np.int64)

    t = threading.Thread(target=e, args=(SlowIds(),))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(ConcurrentUseError, match="one thread at a time"):
            e(torch.tensor([3]))
    finally:
        release.set()
        t.join()
    assert e(torch.tensor([3])).shape == (1, 2)  # free again afterwards


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ShapeError, match="dim=0"):
        DynamicEmbedding(0)
    with pytest.raises(ConfigError, match="mode='median'"):
        DynamicEmbeddingBag(2, mode="median")
    t = tensorkv.EmbeddingTable(4)
    with pytest.raises(ConfigError, match=r"table= was given together with \['optimizer'\]"):
        DynamicEmbedding(4, table=t, optimizer="sgd")
    with pytest.raises(ShapeError, match="dim=3 but table= has dim=4"):
        DynamicEmbedding(3, table=t)
    e = DynamicEmbedding(4, table=t)
    with pytest.raises(ShapeError, match="float32"):
        e(torch.tensor([1.0]))
    b = DynamicEmbeddingBag(4, "mean", table=t)
    with pytest.raises(ShapeError, match="needs offsets"):
        b(torch.tensor([1, 2]))
    with pytest.raises(ShapeError, match="offsets=None with a 2-D input"):
        b(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ConfigError, match="only with mode='sum'"):
        b(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    with pytest.raises(ConfigError, match="no DynamicEmbedding"):
        Optimizer(torch.nn.Linear(2, 2))


def test_import_without_torch_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import tensorkv.torch\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert 'pip install "tensorkv[torch]"' in out
