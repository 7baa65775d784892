"""Another commit of this repository, checked out beside it, for benchmarks that alternate their runs with it.

A change is measured against its parent in alternated runs: this machine's speed
drifts within an hour, so two runs an hour apart compare the machine, not the change.
``capture_time.py`` and ``train_bench.py`` take ``--against COMMIT``: each run here is
followed by the same run in ``COMMIT``'s checkout, whose rows are named ``<mode> at
<COMMIT>``.

[Note: a checkout imports its own passes]
``pyproject.toml`` maps the package ``compile_shard.passes`` to the top-level
``passes/`` folder, and the editable install's import finder resolves that name to
this repository's ``passes/``. Putting a checkout first on ``PYTHONPATH`` makes Python
import the checkout's ``compile_shard``, but ``compile_shard/passes`` does not exist
there, so the finder still supplies this repository's passes: a run "at COMMIT" would
mix COMMIT's runtime with this tree's passes. ``checkout`` links
``compile_shard/passes`` to the checkout's own ``passes/``, which Python's path finder
then reaches before the editable finder.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def checkout(commit: str | None) -> Iterator[Path | None]:
    """A temporary git worktree of ``commit`` (``None``: nothing), removed afterwards."""
    if commit is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as parent:
        tree = Path(parent) / commit
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", str(tree), commit], check=True)
        _link_passes(tree)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(tree)], check=True)


def _link_passes(tree: Path) -> None:
    """[Note: a checkout imports its own passes]"""
    package_passes = tree / "compile_shard" / "passes"
    if not package_passes.exists():
        package_passes.symlink_to(Path("..") / "passes", target_is_directory=True)


def environment(tree: Path) -> dict[str, str]:
    """This process's environment, with ``tree``'s compile_shard imported before the installed one."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def named(mode: str, commit: str) -> str:
    """The row of ``mode`` run at ``commit``."""
    return f"{mode} at {commit}"


def mode_of(row: str) -> tuple[str, str]:
    """A row's mode and the suffix naming its commit (``""`` for this tree's)."""
    mode, at, commit = row.partition(" at ")
    return mode, at + commit
