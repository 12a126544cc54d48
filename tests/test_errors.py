"""errors.import_optional: an optional module, or an error that names the extra."""

import json

import pytest

from tensorkv.errors import MissingDependencyError, import_optional


def test_import_optional_returns_the_module():
    assert import_optional("json", "the test", "none") is json


def test_import_optional_names_the_extra():
    hint = r'the HBM tier needs no_such_mod_x, .*pip install "tensorkv\[torch\]"'
    with pytest.raises(MissingDependencyError, match=hint):
        import_optional("no_such_mod_x", "the HBM tier", "torch")
    with pytest.raises(ImportError):  # still an ImportError for callers that catch that
        import_optional("no_such_mod_x", "the HBM tier", "torch")


def test_the_deprecated_storage_module_warns_and_still_works():
    import importlib
    import sys

    import pytest

    sys.modules.pop("tensorkv.embedding.storage", None)
    with pytest.warns(DeprecationWarning, match="tensorkv.embedding.storage is deprecated"):
        storage = importlib.import_module("tensorkv.embedding.storage")
    import tensorkv

    assert storage.KVTier is tensorkv.KV and storage.StorageOption is tensorkv.StorageOption
