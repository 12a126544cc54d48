"""Repository maintenance: garbage collection, consistency checks, statistics, rebalancing.

``gc`` reads, in this order, the data keys of every provider, the reference counts, the put
and delete intents, the log and the manifests; whatever a writer in flight touches is then
covered by its intent (written before anything else), so gc runs safely beside writers.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from tensorkv.errors import CorruptRecordError
from tensorkv.repository import refs, tensors
from tensorkv.repository.core import RepositoryCore
from tensorkv.repository.layout import INTENTS, MANIFESTS, load_json, manifest_key


def _data_tids(repo: RepositoryCore) -> list[dict[str, int]]:
    """Per provider: tensor id -> number of chunk keys it holds."""
    out = []
    for p in repo.providers:
        c: Counter[str] = Counter()
        for k in p.keys(tensors.DATA):
            c[k[len(tensors.DATA):].split(b"/", 1)[0].decode()] += 1
        out.append(dict(c))
    return out


def _intents(repo: RepositoryCore, grace: float) -> tuple[set[str], set[str], list[bytes]]:
    """(tensors of fresh intents, model ids of fresh intents, keys of stale intents)."""
    now = time.time()
    pending: set[str] = set()
    mids: set[str] = set()
    stale: list[bytes] = []
    for k, v in repo.meta.scan(INTENTS):
        doc = load_json(k, v)
        if now - float(doc.get("time", 0)) < grace:
            pending.update(doc.get("tids", []))
            mids.add(k[len(INTENTS):].decode())
        else:
            stale.append(k)
    return pending, mids, stale


def _expected(repo: RepositoryCore) -> tuple[Counter[str], dict[str, int], list[str]]:
    """References live models hold per tensor, chunk counts, and live ids whose manifest is gone."""
    exp: Counter[str] = Counter()
    chunks: dict[str, int] = {}
    lost = []
    for info in repo.index.live():
        raw = repo.meta.get(manifest_key(info.id))
        if raw is None:
            lost.append(info.id)
            continue
        m = load_json(manifest_key(info.id), raw)
        ids = {e["id"]: e["chunks"] for e in m["tensors"].values()}
        chunks.update(ids)
        exp.update(ids.keys())
    return exp, chunks, lost


def _deleter(repo: RepositoryCore, chunks: dict[str, int] | None = None) -> refs.DeleteData:
    return lambda ts, fence: repo.delete_data(ts, chunks, fence)


def gc(repo: RepositoryCore, grace: float = 3600.0) -> dict[str, int]:
    """Reclaim what killed writers and deleters left.

    Removes manifests no log entry made visible, finishes deletes whose manifest is gone,
    sets every reference count to the number of live models using the tensor (retiring
    tensors no model uses), and deletes chunk data nothing counts. Intents younger than
    ``grace`` seconds belong to writers still running: their tensors and models are left
    alone.
    """
    data = _data_tids(repo)
    counts = dict(repo.meta.scan(refs.REFS))
    pending, pending_mids, stale = _intents(repo, grace)
    repo.refresh()
    stored = [k[len(MANIFESTS):].decode() for k in repo.meta.keys(MANIFESTS)]
    exp, chunks, lost = _expected(repo)
    report = {"manifests_removed": 0, "deletes_finished": 0, "counts_fixed": 0,
              "tensors_retired": 0, "orphans_deleted": 0, "intents_removed": len(stale)}
    with repo.lock:
        for mid in lost:
            repo.index.append(repo.meta, {"op": "del", "id": mid})
            report["deletes_finished"] += 1
    for mid in stored:
        if repo.index.get(mid) is None and mid not in pending_mids:
            repo.meta.delete(manifest_key(mid))
            report["manifests_removed"] += 1
    for key, v in counts.items():
        tid = key[len(refs.REFS):].decode()
        if tid in pending:
            continue
        want = exp.get(tid, 0)
        tomb = v[:1] == b"-"  # not pending: its deleter's intent is stale, it was killed
        if tomb or int(v) != want:
            n = max((d.get(tid, 0) for d in data), default=0) or chunks.get(tid, 1)
            if refs.set_count(repo.meta, tid, v, want, _deleter(repo, {tid: n})):
                report["counts_fixed"] += 1
                report["tensors_retired"] += want == 0
    for tid, want in exp.items():
        if (refs.ref_key(tid) not in counts and tid not in pending
                and refs.set_count(repo.meta, tid, None, want, _deleter(repo))):
            report["counts_fixed"] += 1
    pending_now, _, _ = _intents(repo, grace)
    for p, held in zip(repo.providers, data, strict=True):
        orphans = [t for t in held if t not in exp and t not in pending
                   and t not in pending_now and refs.ref_key(t) not in counts]
        if orphans:
            p.delete_many([tensors.chunk_key(t, i) for t in orphans for i in range(held[t])])
            report["orphans_deleted"] += len(orphans)
    if stale:
        repo.meta.delete_many(stale)
    return report


def check(repo: RepositoryCore, *, verify: bool = False) -> dict[str, Any]:
    """Verify every live model: manifest present, every chunk on some provider, counts right.

    ``verify=True`` also reads every chunk and verifies its checksum.
    """
    problems: list[str] = []
    pending, _, _ = _intents(repo, float("inf"))
    repo.refresh()
    exp, _, lost = _expected(repo)
    problems += [f"model {mid}: manifest {manifest_key(mid).decode()} is missing"
                 for mid in lost]
    for info in repo.index.live():
        if info.id in lost:
            continue
        m = repo.manifest(info.id)
        ents = {e["id"]: e for e in m["tensors"].values()}
        for tid in repo.absent(sorted(ents), ents):
            problems.append(f"model {info.id}: tensor {tid} has chunks missing "
                            f"({tensors.chunk_key(tid, 0).decode()}...)")
        if verify:
            for name in m["tensors"]:
                try:
                    repo.read_tensor(info.id, name, as_numpy=True)
                except CorruptRecordError as exc:
                    problems.append(f"model {info.id}: {exc}")
    counts = dict(repo.meta.scan(refs.REFS))
    for key, v in counts.items():
        tid = key[len(refs.REFS):].decode()
        if tid not in pending and v[:1] != b"-" and int(v) != exp.get(tid, 0):
            problems.append(f"{key.decode()} counts {int(v)}, {exp.get(tid, 0)} live models "
                            "use it (repo.gc() fixes it)")
    for tid in exp:
        if refs.ref_key(tid) not in counts:
            problems.append(f"{refs.ref_key(tid).decode()} is missing; {exp[tid]} live models "
                            "use it (repo.gc() fixes it)")
    return {"ok": not problems, "models": len(repo.index.live()), "tensors": len(exp),
            "problems": problems}


def stats(repo: RepositoryCore) -> dict[str, Any]:
    """Models, tensors, bytes stored (chunk records on every provider) and referenced."""
    repo.refresh()
    live = repo.index.live()
    per = []
    for p in repo.providers:
        keys = list(p.keys(tensors.DATA))
        size = 0
        for i in range(0, len(keys), 4096):
            size += int(repo_sizes(p, keys[i:i + 4096]))
        per.append({"url": p.url, "chunks": len(keys), "bytes": size})
    n_tensors = sum(1 for _ in repo.meta.keys(refs.REFS))
    return {
        "models": len(live),
        "tensors": n_tensors,
        "bytes_stored": sum(d["bytes"] for d in per),
        "bytes_referenced": sum(m.nbytes for m in live),
        "providers": per,
    }


def repo_sizes(store: Any, keys: list[bytes]) -> int:
    """Total bytes of the values of ``keys`` (absent keys count 0)."""
    s = store.value_sizes(keys)
    return int(s[s > 0].sum())


def rebalance(repo: RepositoryCore) -> dict[str, int]:
    """Move every tensor's chunks to its home provider; run it with no writer active."""
    moved = moved_bytes = 0
    data = _data_tids(repo)
    for p, held in enumerate(data):
        for tid, n in held.items():
            home = tensors.rank(tid, repo.provider_ids)[0]
            if home == p:
                continue
            keys = [tensors.chunk_key(tid, i) for i in range(n)]
            vals = repo.providers[p].get_many(keys)
            pairs = [(k, v) for k, v in zip(keys, vals, strict=True) if v is not None]
            repo.providers[home].put_many(pairs)
            repo.providers[p].delete_many(keys)
            moved += 1
            moved_bytes += sum(len(v) for _, v in pairs)
    return {"moved_tensors": moved, "moved_bytes": moved_bytes}
