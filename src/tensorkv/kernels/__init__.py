"""Numba kernels over numpy arrays: hash index, row arena, hashing, initializers, filters.

Every kernel is ``@njit(nogil=True, cache=True)``: it releases the GIL, so threads run kernels
in parallel, and its machine code is cached on disk after the first compilation. See
docs/internals.md.
"""
