"""HBMArena: the RowArena API with rows in torch tensors (device='cpu' here, CUDA if present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorkv.embedding.arena import RowArena
from tensorkv.embedding.initializers import get_initializer
from tensorkv.embedding.optimizers import get_optimizer
from tensorkv.embedding.tiers.dram import DRAMTier
from tensorkv.embedding.tiers.hbm_arena import HBMArena
from tensorkv.errors import ConfigError
from tensorkv.kernels import arena as ak
from tensorkv.testing.tiers import TierTests

DIM = 8


def twin(optimizer: str, device: str = "cpu"):
    opt_a, opt_b = get_optimizer(optimizer), get_optimizer(optimizer)
    sw = len(opt_a.slot_names()) * DIM
    return (RowArena(DIM, sw, capacity=16), HBMArena(DIM, sw, capacity=16, device=device),
            opt_a, opt_b)


def init(arena, opt, rows, keys):
    ini = get_initializer("normal")
    slot_init = np.asarray(opt.slot_initial_values(), np.float32)
    if isinstance(arena, HBMArena):
        arena.init_rows(ini, rows, keys, 7, slot_init)
    else:
        ini.fill(arena.values, rows, keys, 7)
        if arena.slot_width:
            ak.fill_slots(arena.slots, rows, slot_init, DIM)
        arena.freq[rows] = 0


def run_twins(device: str, optimizer: str) -> None:
    dram, hbm, opt_d, opt_h = twin(optimizer, device)
    rng = np.random.default_rng(0)
    for step in range(1, 40):
        keys = np.unique(rng.integers(0, 300, 40))
        g = np.ascontiguousarray(rng.standard_normal((keys.size, DIM), np.float32))
        for a, o in ((dram, opt_d), (hbm, opt_h)):
            rows, is_new = a.insert(keys)
            init(a, o, rows[is_new], keys[is_new])
            if a is dram:
                o.apply(a.values, a.slots, rows, g, step)
            else:
                a.apply_optimizer(o, rows, g, step)
        if step % 7 == 0:
            gone = keys[::3]
            np.testing.assert_array_equal(dram.remove(gone) >= 0, hbm.remove(gone) >= 0)
    assert len(dram) == len(hbm)
    assert hbm.capacity > 16  # grew
    keys = np.sort(dram.keys())
    np.testing.assert_array_equal(keys, np.sort(hbm.keys()))
    rd, rh = dram.find(keys), hbm.find(keys)
    np.testing.assert_array_equal(dram.gather(rd), hbm.gather(rh))  # bit-identical
    np.testing.assert_array_equal(dram.gather_slots(rd), hbm.gather_slots(rh))
    t = hbm.lookup_torch(keys)
    assert isinstance(t, torch.Tensor) and t.device.type == torch.device(device).type
    np.testing.assert_array_equal(t.cpu().numpy(), dram.gather(rd))
    np.testing.assert_array_equal(hbm.row_l2(rh), ak.row_l2(dram.values, rd))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_hbm_arena_bit_identical_to_dram(optimizer):
    run_twins("cpu", optimizer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hbm_arena_on_cuda(tmp_path):
    run_twins("cuda", "adagrad")
    a = HBMArena(DIM, DIM, device="cuda")
    assert a.values.is_cuda and a.slots.is_cuda
    from tensorkv.embedding.table import EmbeddingTable

    from .test_chain import steps
    from .test_exactness import assert_same

    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=2)
    with hbm_table(tmp_path, "HBM_SSDHASH", [24 * 80], device="cuda") as t:
        steps([ref, t], n_steps=20, n_ids=300)
        assert t.lookup_torch(np.arange(5), insert=False).is_cuda  # ref has no such lookup
        assert_same(ref, t)


def test_lookup_and_gather_of_absent_keys():
    a = HBMArena(DIM, 0, device="cpu")
    rows, _ = a.insert(np.array([5, 6], np.int64))
    a.scatter(rows, np.ones((2, DIM), np.float32))
    out = a.lookup_torch(np.array([5, 99, 6]))
    np.testing.assert_array_equal(out.numpy()[1], np.zeros(DIM, np.float32))
    fill = np.full((3, DIM), 7.0, np.float32)
    np.testing.assert_array_equal(a.lookup_torch(np.array([5, 99]), fill=fill[:2]).numpy()[1],
                                  fill[1])
    host = np.full((3, DIM), -1.0, np.float32)
    rows, misses = a.find_gather(np.array([5, 99, 6], np.int64), host)
    assert misses == 1 and rows[1] == -1 and (host[1] == -1).all() and (host[0] == 1).all()
    # a later duplicate wins, as in the DRAM arena
    a.scatter(np.array([rows[0], rows[0]]), np.stack([np.zeros(DIM), np.full(DIM, 3.0)]))
    assert (a.gather(rows[:1]) == 3).all()
    assert a.nbytes > a.device_bytes > 0


def test_bad_device():
    with pytest.raises(ConfigError, match="not a torch device"):
        HBMArena(DIM, device="floppy")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            HBMArena(DIM)


# --- tables with an HBM tier 0 (device="cpu": the same code path as CUDA) -----------------------
def hbm_table(tmp_path, storage, sizes, device="cpu", **kw):
    from tensorkv.embedding import EmbeddingTable

    return EmbeddingTable(DIM, optimizer=kw.pop("optimizer", "adagrad"), seed=2,
                                storage=storage, storage_path=str(tmp_path / "t"),
                                storage_size=sizes, device=device, **kw)


@pytest.mark.parametrize("storage", ["HBM", "HBM_SSDHASH", "HBM_DRAM_SSDHASH"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_hbm_table_bit_identical_to_dram_table(tmp_path, storage, optimizer):
    from tensorkv.embedding.table import EmbeddingTable
    from tensorkv.embedding.tiers.base import RecordLayout

    from .test_chain import steps
    from .test_exactness import assert_same

    rb = RecordLayout(DIM, num_slots=1 if optimizer == "adagrad" else 2).record_bytes
    sizes = {"HBM": None, "HBM_SSDHASH": [24 * rb], "HBM_DRAM_SSDHASH": [24 * rb, 60 * rb]}
    ref = EmbeddingTable(DIM, optimizer=optimizer, seed=2,
                         eviction={"l2_threshold": 0.12, "every_n_steps": 7})
    t = hbm_table(tmp_path, storage, sizes[storage], optimizer=optimizer,
                  eviction={"l2_threshold": 0.12, "every_n_steps": 7})
    with t:
        steps([ref, t], n_steps=30, n_ids=300)
        st = t.stats()
        assert st["tiers"][0]["kind"] == "HBM"
        if storage != "HBM":
            assert st["tiers"][0]["rows"] <= 24 and st["tiers"][1]["promotions"] > 0
        if storage == "HBM_DRAM_SSDHASH":
            assert st["tiers"][1]["kind"] == "dram" and st["tiers"][2]["rows"] > 0
        assert ref.stats()["evictions"] == st["evictions"] > 0
        keys = np.arange(-3, 300, dtype=np.int64)
        out = t.lookup_torch(keys, insert=False)
        assert isinstance(out, torch.Tensor) and out.device == t.device
        np.testing.assert_array_equal(out.numpy(), ref.lookup(keys, insert=False))
        assert_same(ref, t)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("storage", ["HBM", "HBM_SSDHASH"])
def test_hbm_lookup_torch_trains_like_lookup(tmp_path, storage, device):
    """lookup_torch in the training loop: the DRAM table's lookup values, admission included."""
    from tensorkv.embedding.filters import CounterFilter
    from tensorkv.embedding.table import EmbeddingTable

    from .test_exactness import assert_same

    adm = CounterFilter(min_count=2).config()
    ref = EmbeddingTable(DIM, optimizer="adagrad", seed=2, admission=adm)
    sizes = None if storage == "HBM" else [24 * 80]
    t = hbm_table(tmp_path, storage, sizes, device=device, admission=adm)
    rng = np.random.default_rng(5)
    with t:
        for _ in range(25):
            keys = rng.choice(300, 20, replace=False).astype(np.int64)
            keys[-1] = keys[0]  # a duplicate in the batch
            g = rng.standard_normal((keys.size, DIM)).astype(np.float32)
            out = t.lookup_torch(keys)
            assert isinstance(out, torch.Tensor) and out.device.type == device
            np.testing.assert_array_equal(out.cpu().numpy(), ref.lookup(keys))
            probe = rng.integers(-5, 320, 30)
            np.testing.assert_array_equal(t.lookup_torch(probe, insert=False).cpu().numpy(),
                                          ref.lookup(probe, insert=False))
            for x in (ref, t):
                x.apply_gradients(keys, g)
        assert ref.stats()["admissions_rejected"] > 0
        assert_same(ref, t)


def test_dram_table_lookup_torch(tmp_path):
    from tensorkv.embedding import EmbeddingTable

    t = EmbeddingTable(DIM, storage="DRAM")
    out = t.lookup_torch([1, 2, 3])
    assert isinstance(out, torch.Tensor) and out.shape == (3, DIM) and t.device == "cpu"


class TestDRAMTier(TierTests):
    """The host-memory lower tier (below HBM) passes the LowerTier conformance suite."""

    persistent = False

    @pytest.fixture
    def make_tier(self):
        return DRAMTier
