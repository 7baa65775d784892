"""run_gloo's one rerun of a run whose rank died of SIGABRT ([Note: gloo's aborts] in tests/dist_utils.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dist_utils import run_gloo


def _runs(directory: str | Path, rank: int = 0) -> int:
    """How many runs ``rank`` started, as ``_record_run`` counted them in ``directory``."""
    path = Path(directory) / f"rank{rank}"
    return len(path.read_text()) if path.exists() else 0


def _record_run(rank: int, directory: str) -> int:
    """Counts this rank's run in ``directory``; returns how many it made before."""
    before = _runs(directory, rank)
    with (Path(directory) / f"rank{rank}").open("a") as file:
        file.write("x")
    return before


def _abort_on_the_first_run(rank, world_size, directory):
    if _record_run(rank, directory) == 0 and rank == 1:
        os.abort()


def _always_abort(rank, world_size, directory):
    _record_run(rank, directory)
    if rank == 1:
        os.abort()


def _always_raise(rank, world_size, directory):
    _record_run(rank, directory)
    if rank == 1:
        raise RuntimeError("a failure of the test itself")


def test_a_run_whose_rank_aborted_runs_again_with_a_warning_that_holds_its_stacks(tmp_path):
    with pytest.warns(UserWarning, match=r"SIGABRT; ran again(.|\n)* in _abort_on_the_first_run"):
        run_gloo(_abort_on_the_first_run, 2, str(tmp_path))
    assert _runs(tmp_path) == 2


def test_a_rank_that_aborts_again_fails_the_test_and_shows_its_stacks(tmp_path, capsys):
    with pytest.warns(UserWarning, match="SIGABRT"), pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_gloo(_always_abort, 2, str(tmp_path))
    assert _runs(tmp_path) == 2
    shown = capsys.readouterr().err
    assert "rank 1, SIGABRT:" in shown and " in _always_abort" in shown


def test_an_exception_in_a_rank_fails_the_test_without_a_rerun(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="a failure of the test itself"):
        run_gloo(_always_raise, 2, str(tmp_path))
    assert _runs(tmp_path) == 1
