"""Renamed public names: the old ones still work for one release, and each access warns."""

from __future__ import annotations

import pytest

import tensorkv


@pytest.mark.parametrize(("module", "old", "new"), [
    ("tensorkv", "restore_tag", "import_dump"),
    ("tensorkv", "tag_info", "tag_manifest"),
    ("tensorkv.checkpoint", "restore_tag", "import_dump"),
    ("tensorkv.checkpoint", "tag_info", "tag_manifest"),
    ("tensorkv.embedding", "Optimizer", "TableOptimizer"),
    ("tensorkv.embedding.optimizers", "Optimizer", "TableOptimizer"),
    ("tensorkv.embedding.chain", "ChainRows", "ChainBackend"),
])
def test_an_old_name_warns_and_is_the_new_object(module, old, new):
    import importlib

    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*{new}"):
        got = getattr(mod, old)
    assert got is getattr(mod, new)


def test_the_new_names_do_not_warn(recwarn):
    from tensorkv.embedding import TableOptimizer
    from tensorkv.embedding.chain import ChainBackend

    assert tensorkv.import_dump and tensorkv.tag_manifest and TableOptimizer and ChainBackend
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_repositorys_check_takes_verify_and_deep_still_works(tmp_path):
    import numpy as np

    graph = {"nodes": [{"name": "x", "op": "input", "type": "input"}]}
    with tensorkv.Repository(f"lmdb://{tmp_path}/repo") as repo:
        repo.put(graph, {"w": np.ones(4, np.float32)})
        assert repo.check(verify=True)["ok"]
        with pytest.warns(DeprecationWarning, match=r"check\(deep=...\) is deprecated"):
            assert repo.check(deep=True)["ok"]
