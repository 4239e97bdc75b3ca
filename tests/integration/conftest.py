import pytest

from tests.integration.stack import Stack


@pytest.fixture(scope="package")
def stack(model_dir):
    """The default stack: context 4096, prefill pool 8192 tokens, decode pool 32768 tokens."""
    s = Stack(model_dir)
    yield s
    s.close()
