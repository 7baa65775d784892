import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch reads OMP_NUM_THREADS when it is imported: only now.
import pytest
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, counters

from compile_shard._regions import registry
from compile_shard.passes.settings import overridden


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters reset before and after the test, so counts are the test's own.

    So is what compile regions learned from earlier traces (what bodies read, which
    blocks run inlined), which holds per block signature: a test's body traces are its own.
    """
    torch._dynamo.reset()
    registry.reset()
    counters.clear()
    clear_compilation_metrics()
    yield
    torch._dynamo.reset()


@pytest.fixture
def per_group_collectives():
    """FSDP2's one all-gather and one reduce-scatter per group (``bucket_cap_mb=0``) in this process.

    For tests of the per-group graphs: by default the cost model would merge the
    groups of their small models ([Note: the cost model's buckets] in passes.bucket).
    A gloo rank is a process of its own and sets it itself.
    """
    with overridden(bucket_cap_mb=0):
        yield


# The slowest files on two cores, slowest first, as CI's --durations shows them.
# pytest-xdist hands whole files to the
# worker that frees up (--dist loadfile, --no-loadscope-reorder in pyproject.toml):
# starting with these keeps one worker from finishing the suite alone on a long file.
SLOWEST_FILES = (
    "test_regions.py",
    "test_inductor_numerics.py",
    "test_fsdp2_tutorial.py",
    "test_compile.py",
    "test_train_bench.py",
    "test_tensor_parallel.py",
    "test_fsdp_module.py",
    "test_mixed_precision.py",
    "test_gradient_sync.py",
    "test_hsdp.py",
    "test_collectives.py",
    "test_cold_start.py",
    "test_examples.py",
    "test_checkpointing.py",
    "test_frozen.py",
    "test_parity.py",
    "test_all_gather_extensions.py",
    "test_reshard_to_a_smaller_group.py",
    "test_packaging_and_demo.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
