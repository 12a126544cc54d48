"""A hypothesis state machine that checks a KVStore against a dict model."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorkv.stores import KVStore

_keys = st.binary(min_size=1, max_size=6).filter(lambda k: not k.startswith(b"\xff\xff"))
_values = st.binary(max_size=64)


def make_dict_machine(store: KVStore) -> type[RuleBasedStateMachine]:
    """Build a state machine class bound to ``store`` (emptied at the start of each run)."""

    class DictModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            store.delete_prefix(b"")
            self.model: dict[bytes, bytes] = {}

        @rule(items=st.dictionaries(_keys, _values, max_size=8))
        def put_many(self, items: dict[bytes, bytes]) -> None:
            store.put_many(items)
            self.model.update(items)

        @rule(keys=st.lists(_keys, max_size=6))
        def delete_many(self, keys: list[bytes]) -> None:
            store.delete_many(keys)
            for k in keys:
                self.model.pop(k, None)

        @rule(keys=st.lists(_keys, max_size=6))
        def get_many(self, keys: list[bytes]) -> None:
            got = store.get_many(keys)
            assert [None if v is None else bytes(v) for v in got] == [
                self.model.get(k) for k in keys
            ]

        @rule(puts=st.dictionaries(_keys, _values, max_size=5), dels=st.lists(_keys, max_size=3))
        def batch(self, puts: dict[bytes, bytes], dels: list[bytes]) -> None:
            with store.batch() as b:
                b.put_many(puts)
                b.delete_many(dels)
            self.model.update(puts)
            for k in dels:
                self.model.pop(k, None)

        @precondition(lambda self: bool(self.model))
        @rule(data=st.data())
        def delete_prefix(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.model)))
            prefix = key[: data.draw(st.integers(1, len(key)))]
            n = store.delete_prefix(prefix)
            doomed = [k for k in self.model if k.startswith(prefix)]
            assert n == len(doomed)
            for k in doomed:
                del self.model[k]

        @rule(prefix=st.binary(max_size=2))
        def scan(self, prefix: bytes) -> None:
            got = {k: bytes(v) for k, v in store.scan(prefix)}
            assert got == {k: v for k, v in self.model.items() if k.startswith(prefix)}

        @rule(start=st.none() | _keys, stop=st.none() | _keys, limit=st.none() | st.integers(0, 5))
        def scan_range(self, start: bytes | None, stop: bytes | None, limit: int | None) -> None:
            got = [(k, bytes(v)) for k, v in store.scan(start=start, stop=stop, limit=limit)]
            expect = sorted(
                (k, v)
                for k, v in self.model.items()
                if (start is None or k >= start) and (stop is None or k < stop)
            )
            if store.capabilities.ordered_scans:
                assert got == expect[:limit]
            elif limit is None:
                assert sorted(got) == expect
            else:
                assert len(got) == min(limit, len(expect)) and set(got) <= set(expect)

        @invariant()
        def count(self) -> None:
            assert store.count() == len(self.model)

    return DictModel
