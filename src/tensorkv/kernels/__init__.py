"""Numba kernels behind tensorkv's hot paths."""
