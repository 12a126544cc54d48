"""Conformance suites shipped with tensorkv, for backends and tiers written anywhere."""

from tensorkv.testing.stores import StoreTests

__all__ = ["StoreTests"]
