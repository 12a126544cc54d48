"""longest_prefix against a brute-force DStore-style structural match on random DAGs."""

from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorkv.repository import Repository

_n = itertools.count()


def random_dag(rng: random.Random, n: int, base: list[dict] | None = None,
               keep: int = 0) -> list[dict]:
    """A DAG of ``n`` nodes; the first ``keep`` copied from ``base`` (a shared prefix)."""
    nodes = [{"name": "in", "op": "input", "type": "input"}]
    if base:
        nodes = [dict(d) for d in base[: max(1, keep)]]
    while len(nodes) < n:
        k = rng.choice([1, 1, 1, 2]) if len(nodes) > 1 else 1
        ins = rng.sample([d["name"] for d in nodes], min(k, len(nodes)))
        nodes.append({"name": f"n{len(nodes)}-{rng.randrange(1 << 30)}",
                      "type": rng.choice("abc"), "inputs": ins})
    return nodes


def brute_force(query: list[dict], stored: list[tuple[list[dict], float | None]]):
    """Index of the best stored graph and its match count (DStore's definition, no hashes)."""
    def sig(d):
        return (d.get("op", "module"), d["type"])

    def matcher(ga, gb):
        ia = {d["name"]: d for d in ga}
        ib = {d["name"]: d for d in gb}
        memo: dict = {}

        def base_eq(a, b, sa, sb):
            if sig(a) != sig(b) or len(a.get("inputs", [])) != len(b.get("inputs", [])):
                return False
            return all(full_eq(sa[x], sb[y], sa, sb)
                       for x, y in zip(a.get("inputs", []), b.get("inputs", []), strict=True))

        def occ(node, graph, idx):
            pos = [d["name"] for d in graph].index(node["name"])
            return sum(base_eq(w, node, idx, idx) for w in graph[:pos])

        def full_eq(a, b, sa, sb):
            key = (id(sa), a["name"], id(sb), b["name"])
            if key not in memo:
                memo[key] = base_eq(a, b, sa, sb) and (
                    occ(a, ga if sa is ia else gb, sa) == occ(b, gb if sb is ib else ga, sb))
            return memo[key]

        return sum(any(full_eq(a, b, ia, ib) for b in gb) for a in ga)

    best = None
    for i, (g, metric) in enumerate(stored):
        c = matcher(query, g)
        if c == 0:
            continue
        key = (c, -float("inf") if metric is None else metric, -i)
        if best is None or key > best[0]:
            best = (key, i)
    return (None, 0) if best is None else (best[1], best[0][0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_models=st.integers(1, 8))
def test_longest_prefix_equals_brute_force(seed, n_models):
    rng = random.Random(seed)
    repo = Repository(f"memory://prefix-{os.getpid()}-{next(_n)}")
    base = random_dag(rng, rng.randint(2, 9))
    stored = []
    ids = []
    for _ in range(n_models):
        src = rng.choice([base] + [g for g, _ in stored]) if rng.random() < 0.8 else None
        g = random_dag(rng, rng.randint(2, 10), src, rng.randint(1, len(src)) if src else 0)
        metric = rng.choice([None, 0.1, 0.2])
        ids.append(repo.put({"nodes": g}, {}, metrics=None if metric is None else
                            {"val_acc": metric}))
        stored.append((g, metric))
    if n_models > 2 and rng.random() < 0.5:  # a deleted model must never be answered
        k = rng.randrange(n_models)
        repo.delete(ids[k])
        del ids[k], stored[k]
    src = rng.choice([base] + [g for g, _ in stored])
    query = random_dag(rng, rng.randint(2, 12), src, rng.randint(1, len(src)))
    mid, layers = repo.longest_prefix({"nodes": query}, "val_acc")
    want, count = brute_force(query, stored)
    assert (mid, len(layers)) == ((None if want is None else ids[want]), count)
    repo.close()


def test_exact_model_matches_all_layers_and_ties_use_the_metric():
    rng = random.Random(3)
    g = random_dag(rng, 12)
    repo = Repository(f"memory://prefix-tie-{os.getpid()}")
    low = repo.put({"nodes": g}, {}, metrics={"val_acc": 0.1})
    high = repo.put({"nodes": g}, {}, metrics={"val_acc": 0.9})
    repo.put({"nodes": g[:5]}, {}, metrics={"val_acc": 1.0})
    mid, layers = repo.longest_prefix({"nodes": g})
    assert mid == high and len(layers) == 12
    assert repo.longest_prefix({"nodes": g}, metric=None)[0] == low  # then the oldest
    assert repo.longest_prefix({"nodes": [{"name": "z", "type": "other"}]}) == (None, [])


def test_index_is_shared_between_clients(tmp_path):
    url = f"lmdb://{tmp_path}/r"
    a, b = Repository(url), Repository(url)
    g = random_dag(random.Random(1), 6)
    mid = a.put({"nodes": g}, {})
    assert b.longest_prefix({"nodes": g})[0] == mid  # b's index catches up from the log
    a.delete(mid)
    assert b.longest_prefix({"nodes": g}) == (None, [])
    a.close()
    b.close()


@pytest.mark.parametrize("where, n", [({"val_acc": (">", 0.5)}, 1), ({"name": "m0"}, 1),
                                      (lambda r: r["layers"] > 0, 2), (None, 2)])
def test_list_where(where, n):
    repo = Repository(f"memory://prefix-list-{os.getpid()}-{next(_n)}")
    g = random_dag(random.Random(2), 4)
    repo.put({"nodes": g}, {}, name="m0", metrics={"val_acc": 0.3})
    repo.put({"nodes": g}, {}, name="m1", metrics={"val_acc": 0.7})
    assert len(repo.list(where)) == n


def graph(edges: dict[str, list[str]]) -> dict:
    """A graph dict from ``name -> inputs`` (in topological order); ``x`` is the input."""
    return {"nodes": [{"name": "x", "op": "input", "type": "input"}]
            + [{"name": k, "type": k, "inputs": v} for k, v in edges.items()]}


def test_the_maximal_prefix_wins_when_found_after_a_smaller_one():
    """The query's sinks t1..t4 are held by small models; the model holding the most
    layers (x, p1..p4) holds no sink and is only reached once the sinks are peeled off."""
    repo = Repository(f"memory://prefix-late-{os.getpid()}-{next(_n)}")
    small = [repo.put(graph({f"p{i}": ["x"], f"t{i}": [f"p{i}"]}), {},
                      metrics={"val_acc": 1.0}) for i in range(1, 5)]
    wide = repo.put(graph({f"p{i}": ["x"] for i in range(1, 5)}), {}, metrics={"val_acc": 0.0})
    query = graph({**{f"p{i}": ["x"] for i in range(1, 5)},
                   **{f"t{i}": [f"p{i}"] for i in range(1, 5)}})
    assert repo.longest_prefix(query) == (wide, ["x", "p1", "p2", "p3", "p4"])
    assert repo.longest_prefix(graph({"p2": ["x"], "t2": ["p2"]}))[0] == small[1]
    repo.close()


def test_a_tie_found_late_goes_to_the_higher_metric_then_the_older_model():
    """Two models share 4 layers with the query; the better one holds no sink of the query
    (a3, b2), so it is reached only in a later round, after the first has been ranked."""
    repo = Repository(f"memory://prefix-late-tie-{os.getpid()}-{next(_n)}")
    first = repo.put(graph({"a1": ["x"], "a2": ["a1"], "a3": ["a2"]}), {},
                     metrics={"val_acc": 0.1})
    repo.put(graph({"b1": ["x"], "b2": ["b1"]}), {}, metrics={"val_acc": 1.0})
    late = repo.put(graph({"a1": ["x"], "a2": ["a1"], "b1": ["x"]}), {},
                    metrics={"val_acc": 0.9})
    query = graph({"a1": ["x"], "a2": ["a1"], "a3": ["a2"], "b1": ["x"], "b2": ["b1"]})
    assert repo.longest_prefix(query) == (late, ["x", "a1", "a2", "b1"])
    assert repo.longest_prefix(query, metric=None)[0] == first  # no metric: the older model
    assert repo.longest_prefix(query, metric="loss")[0] == first  # absent metric: -inf
    repo.close()
