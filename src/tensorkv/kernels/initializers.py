"""Counter-based random initialisation: a row's value is a pure function of (seed, key, column).

:func:`init_uniform`, :func:`init_normal` (normal and two-sigma truncated normal by inverse
CDF, :func:`norm_ppf`) and :func:`init_constant` fill arena rows. The generator and why its
values are bit-identical across machines: docs/internals.md ("Kernels").
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from tensorkv.kernels.hashindex import mix64

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TWO_PI = 2.0 * math.pi
_INV_2_53 = 1.0 / 9007199254740992.0
_INV_2_32 = 1.0 / 4294967296.0


@njit(nogil=True, cache=True, inline="always")
def key_stream(seed, key):  # pragma: no cover - compiled
    """The per-key stream value ``kh`` of (seed, key)."""
    return mix64(np.uint64(key) ^ mix64(np.uint64(seed) + GOLDEN))


@njit(nogil=True, cache=True, inline="always")
def word(kh, col, attempt):  # pragma: no cover - compiled
    """The 64-bit random word of a key stream at (column, attempt)."""
    ctr = (np.uint64(attempt) << np.uint64(32)) + np.uint64(col) + np.uint64(1)
    return mix64(kh + ctr * GOLDEN)


@njit(nogil=True, cache=True)
def init_uniform(out, rows, keys, seed, lo, hi):  # pragma: no cover - compiled
    """``out[rows[i], c] = U(lo, hi)`` drawn from (seed, keys[i], c); rows ``< 0`` skipped."""
    dim = out.shape[1]
    span = hi - lo
    for i in range(keys.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        kh = key_stream(seed, keys[i])
        for c in range(dim):
            u = np.float64(word(kh, c, 0) >> np.uint64(11)) * _INV_2_53
            out[r, c] = lo + span * u


# Wichura's AS 241 (PPND16): the normal quantile to about 1e-16 relative accuracy.
_A = (3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3,
      1.3731693765509461125e4, 4.5921953931549871457e4, 6.7265770927008700853e4,
      3.3430575583588128105e4, 2.5090809287301226727e3)
_B = (1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3,
      2.1213794301586595867e4, 3.9307895800092710610e4, 2.8729085735721942674e4,
      5.2264952788528545610e3)
_C = (1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0,
      3.64784832476320460504e0, 1.27045825245236838258e0, 2.41780725177450611770e-1,
      2.27238449892691845833e-2, 7.74545014278341407640e-4)
_D = (1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
      1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4,
      1.05075007164441684324e-9)
_E = (6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0,
      2.96560571828504891230e-1, 2.65321895265761230930e-2, 1.24266094738807843860e-3,
      2.71155556874348757815e-5, 2.01033439929228813265e-7)
_F = (1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1, 1.48753612908506148525e-2,
      7.86869131145613259100e-4, 1.84631831751005468180e-5, 1.42151175831644588870e-7,
      2.04426310338993978564e-15)
_A_ARR = np.array(_A)
_B_ARR = np.array(_B)
_C_ARR = np.array(_C)
_D_ARR = np.array(_D)
_E_ARR = np.array(_E)
_F_ARR = np.array(_F)
PHI_MINUS_2 = 0.022750131948179195  # standard normal CDF at -2
PHI_PLUS_2 = 0.9772498680518208  # standard normal CDF at +2


@njit(nogil=True, cache=True, inline="always")
def _poly(c, x):  # pragma: no cover - compiled
    return ((((((c[7] * x + c[6]) * x + c[5]) * x + c[4]) * x + c[3]) * x + c[2]) * x
            + c[1]) * x + c[0]


@njit(nogil=True, cache=True, error_model="numpy")
def norm_ppf(p):  # pragma: no cover - compiled
    """Standard normal quantile of ``p`` in (0, 1) (AS 241, as ``statistics.NormalDist``)."""
    q = p - 0.5
    if abs(q) <= 0.425:
        r = 0.180625 - q * q
        return q * _poly(_A_ARR, r) / _poly(_B_ARR, r)
    r = p if q < 0.0 else 1.0 - p
    r = math.sqrt(-math.log(r))
    if r <= 5.0:
        r -= 1.6
        z = _poly(_C_ARR, r) / _poly(_D_ARR, r)
    else:
        r -= 5.0
        z = _poly(_E_ARR, r) / _poly(_F_ARR, r)
    return -z if q < 0.0 else z


#: Values per pass of :func:`init_normal` (whole rows; at least one row).
NORMAL_BLOCK = 2048


@njit(nogil=True, cache=True, error_model="numpy")
def init_normal(out, rows, keys, seed, mean, std, truncated):  # pragma: no cover - compiled
    """Normal (or two-sigma truncated normal) draws from (seed, keys[i], c) by inverse CDF.

    Rows are done in blocks of about ``NORMAL_BLOCK`` values, each in branch-free passes
    that vectorise (``error_model="numpy"`` drops the zero-division check that would block
    SIMD): the probabilities, the central AS 241 branch for every value, the positions with
    ``|p - 0.5| > 0.425`` packed into a list, then their tail branch (``log``, ``sqrt``, the
    ``r <= 5`` rational function; ``r > 5`` redone by :func:`norm_ppf`). Every operation is
    :func:`norm_ppf`'s, in its order, so the result equals it value by value.
    """
    dim = out.shape[1]
    lo = PHI_MINUS_2 if truncated else 0.0
    span = (PHI_PLUS_2 - PHI_MINUS_2) if truncated else 1.0
    per = max(1, NORMAL_BLOCK // max(dim, 1))
    cap = per * dim
    p = np.empty(cap, np.float64)
    z = np.empty(cap, np.float64)
    t = np.empty(cap, np.float64)
    tail = np.empty(cap, np.int64)
    brow = np.empty(per, np.int64)
    n = keys.shape[0]
    i = 0
    while i < n:
        m = 0  # rows of this block
        while i < n and m < per:
            if rows[i] >= 0:
                brow[m] = rows[i]
                kh = key_stream(seed, keys[i])
                b = m * dim
                for c in range(dim):
                    u = (np.float64(word(kh, c, 0) >> np.uint64(11)) + 0.5) * _INV_2_53
                    p[b + c] = lo + span * u
                m += 1
            i += 1
        nv = m * dim
        for v in range(nv):
            q = p[v] - 0.5
            x = 0.180625 - q * q
            z[v] = q * _poly(_A_ARR, x) / _poly(_B_ARR, x)
        nt = 0
        for v in range(nv):
            tail[nt] = v
            nt += abs(p[v] - 0.5) > 0.425
        for j in range(nt):
            pv = p[tail[j]]
            t[j] = math.log(pv if pv - 0.5 < 0.0 else 1.0 - pv)
        for j in range(nt):
            t[j] = math.sqrt(-t[j])
        for j in range(nt):
            r = t[j] - 1.6
            zt = _poly(_C_ARR, r) / _poly(_D_ARR, r)
            v = tail[j]
            z[v] = -zt if p[v] - 0.5 < 0.0 else zt
        for j in range(nt):
            if t[j] > 5.0:  # p below 1.4e-11 or above 1 - 1.4e-11 (plain normal only)
                z[tail[j]] = norm_ppf(p[tail[j]])
        for k in range(m):
            r = brow[k]
            b = k * dim
            for c in range(dim):
                out[r, c] = mean + std * z[b + c]


def threads() -> int:
    """Threads of numba's pool (what the ``*_parallel`` kernels split work over)."""
    return int(numba.get_num_threads())


@njit(nogil=True, cache=True, parallel=True)
def init_normal_parallel(out, rows, keys, seed, mean, std, truncated,
                         parts):  # pragma: no cover - compiled
    """:func:`init_normal` over ``parts`` contiguous ranges of keys on numba's threads.

    A key's value depends on (seed, key, column) only, so the result equals the serial
    kernel's bit for bit.
    """
    n = keys.shape[0]
    for j in prange(parts):
        lo = n * j // parts
        hi = n * (j + 1) // parts
        init_normal(out, rows[lo:hi], keys[lo:hi], seed, mean, std, truncated)


@njit(nogil=True, cache=True, parallel=True)
def init_uniform_parallel(out, rows, keys, seed, lo, hi, parts):  # pragma: no cover - compiled
    """:func:`init_uniform` over ``parts`` contiguous ranges of keys on numba's threads."""
    n = keys.shape[0]
    for j in prange(parts):
        a = n * j // parts
        b = n * (j + 1) // parts
        init_uniform(out, rows[a:b], keys[a:b], seed, lo, hi)


@njit(nogil=True, cache=True)
def init_constant(out, rows, value):  # pragma: no cover - compiled
    """``out[rows[i], :] = value``; rows ``< 0`` skipped."""
    dim = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        for c in range(dim):
            out[r, c] = value
