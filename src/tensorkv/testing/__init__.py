"""Conformance suites shipped with tensorkv, for backends and tiers written anywhere."""

from tensorkv.testing.stores import StoreTests
from tensorkv.testing.tables import TableTests
from tensorkv.testing.tiers import TierTests

__all__ = ["StoreTests", "TableTests", "TierTests"]
