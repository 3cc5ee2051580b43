"""Fixtures shared by the test files."""
import os
import tempfile

import pytest

from starpu_llm import Runtime

# No calibration or autotuner cache of this machine from outside the suite (--workers auto
# would read them). Tests that want one make it.
os.environ["STARPU_LLM_HOME"] = tempfile.mkdtemp(prefix="starpu-llm-tests-home-")


@pytest.fixture(scope="module")
def runtime():
    """A StarPU runtime on the default partition (one worker on every usable core), started
    once per test file; a file that needs another partition defines its own."""
    rt = Runtime()
    yield rt
    rt.shutdown()
