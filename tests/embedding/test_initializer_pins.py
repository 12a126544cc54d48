"""Initial values pinned bit for bit: a faster kernel must produce the very same rows.

The digests were computed with the original one-row-at-a-time kernels; every change to the
initializer kernels must leave them unchanged (checkpoints and tiers rely on a key's initial
value being the same function of (seed, key) forever).
"""

import hashlib

import numpy as np
import pytest

from tensorkv.embedding.initializers import Normal, TruncatedNormal, Uniform
from tensorkv.kernels.initializers import norm_ppf

KEYS = np.concatenate([
    np.arange(-3000, 3000, dtype=np.int64),
    np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 20000, dtype=np.int64,
                                      endpoint=True),
    np.array([2**62, -(2**63), 2**63 - 1], np.int64),
])
SEEDS = (0, 7, 2**64 - 1)
PINS = {
    "truncated_normal": {
        1: ("8e3d2b81ddcd9be6", "0adc602506be9721", "eb2b4eccc98fba43"),
        5: ("b8937250492857bb", "0d45d77ca113f6ec", "075c32edf891bc6c"),
        64: ("f01a7cf3c0aa90e3", "3d7c1c0c1cb3f018", "d89fd864596275bf"),
    },
    "normal": {
        1: ("913d41f054d1f737", "b79ec3d3d571754d", "977eb18c4913a6e5"),
        5: ("5fb60c19624a3e8a", "60e66dc99dcb5353", "6b2e27cd908def89"),
        64: ("c8c5bd49970e31c0", "aac1628c2639fcbf", "71e51e889c9250e0"),
    },
    "uniform": {
        1: ("62fcebf28bf3ccbe", "247dc35544fb0f43", "c14d45da6907fd21"),
        5: ("a81b2e7ffdc1d66c", "d9b79a9006e83481", "e918c3d4b1331940"),
        64: ("944ea78ad82bcfcd", "21a1c6697ed54173", "d757d92292299ffd"),
    },
}
INITS = {"truncated_normal": TruncatedNormal(std=0.05), "normal": Normal(mean=0.5, std=2.0),
         "uniform": Uniform(-1, 1)}


@pytest.mark.parametrize("name", sorted(PINS))
@pytest.mark.parametrize("dim", [1, 5, 64])
def test_initial_values_are_pinned(name, dim):
    for seed, digest in zip(SEEDS, PINS[name][dim], strict=True):
        v = INITS[name].values(KEYS, dim, seed)
        assert hashlib.sha256(v.tobytes()).hexdigest()[:16] == digest, (name, dim, seed)


def test_truncated_normal_rows_pinned_by_value():
    got = TruncatedNormal(std=0.05).values(np.array([0, 1, -1, 2**62], np.int64), 3, 0)
    want = [[-0.01988561823964119, -0.029196321964263916, -0.028851382434368134],
            [0.0026994249783456326, -0.026777172461152077, 0.07341895252466202],
            [-0.09221170097589493, 0.08019188046455383, 0.052033714950084686],
            [0.013840315863490105, 0.07091999053955078, -0.03975006937980652]]
    np.testing.assert_array_equal(got, np.array(want, np.float32))


@pytest.mark.parametrize("truncated", [False, True])
def test_normal_kernel_equals_norm_ppf_value_by_value(truncated):
    # the blocked kernel against the scalar quantile, over rows that skip (row -1) and
    # blocks that end mid-batch
    from tensorkv.kernels.initializers import PHI_MINUS_2, PHI_PLUS_2, key_stream, word

    keys = np.arange(-700, 700, dtype=np.int64) * 7919
    dim = 37
    out = np.full((keys.size, dim), np.nan, np.float32)
    rows = np.arange(keys.size, dtype=np.int64)
    rows[::5] = -1
    init = TruncatedNormal(std=1.5) if truncated else Normal(std=1.5)
    init.fill(out, rows, keys, 11)
    lo, span = (PHI_MINUS_2, PHI_PLUS_2 - PHI_MINUS_2) if truncated else (0.0, 1.0)
    for i in range(0, keys.size, 97):
        if rows[i] < 0:
            assert np.isnan(out[i]).all()
            continue
        kh = np.uint64(key_stream(np.uint64(11), keys[i]))
        for c in range(dim):
            u = (float(int(word(kh, c, 0)) >> 11) + 0.5) / 9007199254740992.0
            assert out[i, c] == np.float32(0.0 + 1.5 * norm_ppf(lo + span * u))
