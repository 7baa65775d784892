"""The schedule's overlap, simulated: an 8-layer Llama at fake world size 8 on H100s across 400 Gb/s InfiniBand.

The figures come from ``benchmarks/overlap_sim.py`` (which prints them); this test
holds them to the targets: after the suite, at most 5% of the communication time is
exposed beyond the first all-gather and the last reduce-scatter (which nothing can
hide), against nearly all of it in the partitioner's order; and prefetching costs at
most one block's unsharded parameters of peak memory over the no-prefetch schedule.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overlap_sim  # noqa: E402
from overlap_sim import group_unsharded_bytes, simulate_schedules  # noqa: E402

from compile_shard.models import LlamaConfig  # noqa: E402
from compile_shard.passes import overridden  # noqa: E402


@pytest.mark.parametrize("compile_regions", [False, True], ids=["inlined", "regions"])
def test_suite_hides_communication_within_one_group_of_memory(compile_regions):
    """With ``compile_regions``, as inlined: the first block runs inlined, so its reduce-scatter hides behind
    its own input gradients' matmuls, which a region would return with its weight gradients."""
    config = LlamaConfig(dim=1024, n_layers=8, n_heads=8, ffn_hidden=2816, max_seq_len=2048)
    with overridden(compile_regions=compile_regions):
        reports = {
            report.schedule: report
            for report in simulate_schedules(
                config, 8, 16, 2048, "h100_ib400", ("partitioner", "no_prefetch", "suite")
            )
        }
    assert reports["suite"].exposed_beyond_first_and_last_pct <= 5.0
    assert reports["partitioner"].exposed_beyond_first_and_last_pct > 50.0
    extra_memory = reports["suite"].peak_memory_bytes - reports["no_prefetch"].peak_memory_bytes
    if compile_regions:  # the peak is where no prefetch is in flight: the same in both schedules
        assert extra_memory == 0
    else:
        assert 0 < extra_memory <= group_unsharded_bytes(config)


def test_a_schedule_that_changes_a_joint_graph_pass_is_refused(monkeypatch):
    """The step is captured once: a schedule may only change what ``run_partitioned_suite`` reads."""
    monkeypatch.setitem(overlap_sim.SCHEDULES, "buckets", {"bucket_cap_mb": 100.0})
    config = LlamaConfig(dim=16, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match=r"schedule 'buckets' overrides \['bucket_cap_mb'\], which the joint-graph"):
        simulate_schedules(config, 2, 1, 8, "h100_ib400", ("suite", "buckets"))


def test_hsdp_all_reduces_hide_behind_backward_except_the_last_two(per_group_collectives):
    """HSDP on two nodes (h100_nvlink_ib400, a (2, 8) mesh of 16): each replicate all-reduce crosses InfiniBand
    behind the next group's backward, except block 0's and the root's, which only the embedding's backward follows.

    One all-reduce per group: the cost model would put these two 12.6 MB blocks in one bucket."""
    config = LlamaConfig(dim=512, n_layers=2, n_heads=8, ffn_hidden=1408, max_seq_len=1024)
    reports = {
        report.schedule: report
        for report in simulate_schedules(
            config, 16, 16, 1024, "h100_nvlink_ib400", ("partitioner", "suite"), mesh_shape=(2, 8)
        )
    }
    assert reports["suite"].exposed_all_reduces == ["layers.0", "Llama"]
    assert reports["partitioner"].exposed_all_reduces == ["layers.1", "layers.0", "Llama"]
