import pytest

from tensorkv.testing import StoreTests


class TestMemoryStore(StoreTests):
    persistent = False
    supports_subprocess = False

    @pytest.fixture
    def store_url(self):
        return "memory://"
