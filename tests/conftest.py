import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch reads OMP_NUM_THREADS when it is imported: only now.
import pytest
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, counters


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters reset before and after the test, so counts are the test's own."""
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    yield
    torch._dynamo.reset()
