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
