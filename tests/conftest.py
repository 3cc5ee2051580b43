"""Fixtures shared by the test files."""
import pytest

from starpu_llm import Runtime


@pytest.fixture(scope="module")
def runtime():
    """A StarPU runtime on the default partition (one worker on every usable core), started
    once per test file; a file that needs another partition defines its own."""
    rt = Runtime()
    yield rt
    rt.shutdown()
