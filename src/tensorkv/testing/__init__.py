"""Conformance suites shipped with tensorkv, for backends and tiers written anywhere."""

from tensorkv.testing.stores import StoreTests
from tensorkv.testing.tiers import TierTests

__all__ = ["StoreTests", "TierTests"]
