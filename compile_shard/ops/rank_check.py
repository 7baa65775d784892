"""``fsdp::rank_check``: compare a compiled graph's collectives across each group's ranks before it issues them.

The pass ``rank_check`` (compile_shard.passes, [Note: the rank check]) puts this op first
in each compiled graph, with the graph's collective record as its argument. Its
kernel costs a set lookup on every run but the first of each new record.

[Note: the rank check's exchange]
The first time a rank runs a record, it checks each group of the record whose
sequence it has not agreed on with that group before, over the rendezvous store (the
default process group's, under a prefix naming the group's ranks), never over a
collective: a rank of another group, another pipeline stage or a rank that is behind
waits for nothing, and a mismatch cannot hang the check itself.

- Round ``r`` of a group is its ``r``-th new sequence. Each rank sets
  ``<r>/<rank>/digest`` (a sha256 of the sequence: one small fixed-size value) and
  ``<r>/<rank>/record`` (the record, read only on a mismatch), then waits for its
  peers' digests. Equal digests: agreed, and a later graph with the same sequence
  (a recompile that changed no collective, on any rank) checks nothing.
- Different digests: every rank of the group sees them at once and raises
  ``RankMismatchError`` naming the first differing collective (a rank waiting in
  another group's round raises the job's stop, below).
- A peer that sets no digest for the round within ``settings.rank_check_timeout_s``
  (not counting time while any rank of the job compiles: ranks count their compiles
  in the store, so a rank that compiles slowly or misses a cache is late, not lost) runs a
  graph it agreed on before while this rank runs a new one (a recompile or a graph
  break on one rank), or does not check (its check switched off). This rank raises,
  comparing with that peer's last record of the same graph.

A rank that raises sets the job's ``stop`` key to its message: a mismatch in one group
stops the job, and every rank should say why. A rank waiting in a round of another
group, or finishing a round of its own, reads it and raises it. A rank blocked in a
collective (it passed its checks before the stop was set) cannot raise where it waits: on gloo its collective fails as the raising rank's process exits, and the
root's compiled forward then reads ``stop`` and raises the same ``RankMismatchError``
instead of the collective's error (``raise_for_a_peer_stop``), where the store is
still there: the rank that hosts it (rank 0, for ``init_process_group``'s) waits up
to ``_STOP_GRACE_S`` for the others to know before it raises. Nothing polls for the
stop in between: a thread that polled once a second cost 3-6% of config B's steady
step on two cores (docs/benchmarks.md, "Rank check").
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from .._compile_events import call_around_each_compile
from .library import _lib

_lib.define("rank_check(str record) -> ()")
torch.fx.node.has_side_effect(torch.ops.fsdp.rank_check.default)

_PREFIX = "compile_shard/rank_check"
# A waiting rank polls the store at 1 ms, doubling up to 100 ms: a peer that arrives at
# once is seen at once, and one that is still compiling is not slowed by the polling
# (the store lives in rank 0's process, on the cores the compiles run on; a fixed 10 ms
# poll cost config B's cold step about 2%).
_FIRST_POLL_S = 0.001
_LAST_POLL_S = 0.1
# Ranks a mismatch message describes (of a group of thousands, the first few).
_PEERS_SHOWN = 3
_STOP_GRACE_S = 3.0


class RankMismatchError(RuntimeError):
    """The ranks of a process group would run different collectives; raised on every rank instead of a hang."""


class _State:
    """What this process has checked and heard; shared by the kernel and the root's forward."""

    def __init__(self):
        self.lock = threading.Lock()
        self.checked_records: set[str] = set()
        self.agreed: set[tuple[str, str]] = set()  # (group, digest)
        self.rounds: dict[str, int] = {}
        self.knows_the_stop = False
        # Seconds spent checking new records (benchmarks/train_bench.py reports them).
        self.seconds = 0.0


_state = _State()


def _store(group: str) -> dist.Store:
    return dist.PrefixStore(f"{_PREFIX}/{group}/", dist.distributed_c10d._get_default_store())


def _digest(record: dict, group: str) -> str:
    """What the ranks of ``group`` must agree on: the graph's kind, whether it is split, its collectives on the group."""
    return hashlib.sha256(json.dumps([record["graph"], record["partial"], record["groups"][group]]).encode()).hexdigest()


def _rank_check(record_text: str) -> None:
    if record_text in _state.checked_records:
        return
    started = time.perf_counter()
    with _state.lock:
        record = json.loads(record_text)
        try:
            for group in record["groups"]:
                digest = _digest(record, group)
                if (group, digest) not in _state.agreed:
                    _check_group(group, digest, record)
                    _state.agreed.add((group, digest))
        finally:
            _state.seconds += time.perf_counter() - started
        _state.checked_records.add(record_text)


# No tensor argument selects a backend, so the kernel is CompositeExplicitAutograd; the
# Meta kernel (FakeTensor mode) checks nothing.
_lib.impl("rank_check", _rank_check, "CompositeExplicitAutograd")
_lib.impl("rank_check", lambda record_text: None, "Meta")


def _check_group(group: str, digest: str, record: dict) -> None:
    """One round of ``group``'s exchange ([Note: the rank check's exchange]); raises on a mismatch."""
    rank = dist.get_rank()
    timeout_s = record["settings"]["rank_check_timeout_s"]
    members = [int(member) for member in group.split(",")]
    peers = [member for member in members if member != rank]
    store = _store(group)
    round_ = _state.rounds.get(group, 0)
    _state.rounds[group] = round_ + 1
    store.set(f"{round_}/{rank}/record", json.dumps(record))
    store.set(f"{round_}/{rank}/digest", digest)
    store.set(f"latest/{rank}", str(round_))
    store.add(f"{round_}/posted", 1)
    all_posted = _wait_for_round(store, round_, len(members), timeout_s)
    posted = peers if all_posted else [peer for peer in peers if store.check([f"{round_}/{peer}/digest"])]
    digests = store.multi_get([f"{round_}/{peer}/digest" for peer in posted]) if posted else []
    differing = [peer for peer, theirs in zip(posted, digests) if theirs.decode() != digest]
    missing = [peer for peer in peers if peer not in posted]
    if not differing and not missing:
        # A peer of this group may have stopped after it checked this round (in another
        # group's round): this rank would block in the group's first collective.
        stop_message = _read_stop()
        if stop_message is not None:
            _stop(stop_message)
        return
    shown = (differing + missing)[:_PEERS_SHOWN]
    records = {
        peer: json.loads(store.get(f"{round_}/{peer}/record")) if peer in differing else _last_record(store, peer, record)
        for peer in shown
    }
    message = mismatch_message(group, rank, record, records, missing, timeout_s)
    if len(differing) + len(missing) > len(shown):
        message += f"\n{len(differing) + len(missing) - len(shown)} more ranks of the group differ as well."
    _stop(message)


def _wait_for_round(store: dist.Store, round_: int, size: int, timeout_s: float) -> bool:
    """Waits until every rank of the group has checked ``round_``; ``False`` after ``timeout_s`` without a compile in the job.

    Raises the job's stop where another rank found a mismatch meanwhile: its peers there
    may never check.
    """
    waited_since = time.monotonic()
    pauses = _pauses()
    while store.add(f"{round_}/posted", 0) < size:
        stop_message = _read_stop()
        if stop_message is not None:
            _stop(stop_message)
        if _job_store().add(_COMPILING, 0) > 0:
            waited_since = time.monotonic()
        elif time.monotonic() - waited_since > timeout_s:
            return False
        time.sleep(next(pauses))
    return True


def _pauses() -> Iterator[float]:
    """The pauses between a waiting rank's polls: ``_FIRST_POLL_S``, doubling up to ``_LAST_POLL_S``, then that forever."""
    pause = _FIRST_POLL_S
    while True:
        yield pause
        pause = min(2 * pause, _LAST_POLL_S)


def _poll_until(done: Callable[[], bool], seconds: float) -> None:
    """Polls ``done`` with ``_pauses()`` until it holds or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    for pause in _pauses():
        if done() or time.monotonic() >= deadline:
            return
        time.sleep(pause)


def _last_record(store: dist.Store, peer: int, record: dict) -> dict | None:
    """The last record ``peer`` checked for the same kind of graph as ``record`` (``None``: it checked none)."""
    if not store.check([f"latest/{peer}"]):
        return None
    for round_ in range(int(store.get(f"latest/{peer}")), -1, -1):
        theirs = json.loads(store.get(f"{round_}/{peer}/record"))
        if theirs["graph"] == record["graph"]:
            return theirs
    return None


def _stop(message: str) -> NoReturn:
    """Stops the job with ``message`` (the first one set stays), once every rank knows it or after ``_STOP_GRACE_S``.

    Ranks read each other's records and the message from the store, which rank 0 hosts
    where ``init_process_group`` started it: no rank leaves before all know, and rank 0
    leaves last. A rank blocked in a collective knows only once its collective fails,
    after this one has left: it is waited for no longer than the grace.
    """
    world_size = dist.get_world_size()
    try:
        store = _job_store()
        store.compare_set(_STOP, "", message)
        _know_the_stop()
        _poll_until(lambda: store.add(_KNOWN, 0) >= world_size, _STOP_GRACE_S)
        store.add(_LEFT, 1)
        if dist.get_rank() == 0:
            _poll_until(lambda: store.add(_LEFT, 0) >= world_size, _STOP_GRACE_S)
    except RuntimeError:
        pass  # the rank that hosts the store has left: every rank is stopping
    raise RankMismatchError(message)


def _know_the_stop() -> None:
    """Counts this rank among those that know the job's stop (once)."""
    if not _state.knows_the_stop:
        _state.knows_the_stop = True
        _job_store().add(_KNOWN, 1)


def _job_store() -> dist.Store:
    return dist.PrefixStore(f"{_PREFIX}/", dist.distributed_c10d._get_default_store())


# The job's keys: the first mismatch's message, how many ranks know it and have left the
# store, and how many ranks are compiling (a peer that is compiling is late, not diverged).
_STOP = "stop"
_KNOWN = "stop_known"
_LEFT = "stop_left"
_COMPILING = "compiling"


def _count_compile(delta: int) -> None:
    """Counts this rank's compile in or out; never fails a compile (a store without ``add``, the fake group's, counts nothing)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    try:
        _job_store().add(_COMPILING, delta)
    except RuntimeError:
        pass


def count_compiles() -> None:
    """Counts this rank's compiles in the rendezvous store, so a peer's check waits for them (registers once per process)."""
    call_around_each_compile(_compile_started, _compile_ended)


def _compile_started(*args) -> None:
    _count_compile(1)


def _compile_ended(*args) -> None:
    _count_compile(-1)


def _read_stop() -> str | None:
    """The job's ``stop`` message, if a rank set one (``None`` also when the store or the group is gone)."""
    try:
        store = _job_store()
        return store.get(_STOP).decode() if store.check([_STOP]) else None
    except Exception:  # noqa: BLE001 - a store of a job that is ending fails in many ways; there is nothing to read
        return None


def raise_for_a_peer_stop(error: BaseException) -> None:
    """Raises a peer's ``RankMismatchError`` for ``error`` (a collective failing) if a rank stopped the job."""
    if isinstance(error, RankMismatchError) or not _state.rounds:
        return
    stop_message = _read_stop()
    if stop_message is not None:
        try:
            _know_the_stop()
        except RuntimeError:
            pass  # the store is going with the job
        raise RankMismatchError(stop_message) from error


def _first_difference(ours: list[str], theirs: list[str]) -> int:
    index = 0
    while index < min(len(ours), len(theirs)) and ours[index] == theirs[index]:
        index += 1
    return index


def _at(collectives: list[str], index: int) -> str:
    return collectives[index] if index < len(collectives) else f"none (its graph issues {len(collectives)} on this group)"


def mismatch_message(
    group: str, rank: int, record: dict, records: dict[int, dict | None], missing: list[int], timeout_s: float
) -> str:
    """The error every rank of ``group`` raises: the first differing collective, each rank's version, and the likely cause."""
    graph = record["graph"]
    ours = record["groups"][group]
    lines = [
        f"compile_shard: the ranks of process group [{group}] would run different collectives; stopping at rank "
        f"{rank}'s new {graph} graph instead of hanging in the first collective that differs."
    ]
    for peer, theirs in sorted(records.items()):
        if peer in missing:
            lines.append(
                f"Rank {peer} checked no new {graph} graph within {timeout_s:g} s (compiles not counted) while rank "
                f"{rank} runs a newly compiled one: a recompile or a graph break on rank {rank} only, or rank "
                f"{peer}'s rank check is off (compile_shard.passes.settings.rank_check). Rank {peer}'s last "
                f"{graph} graph is compared."
            )
        if theirs is None:
            lines.append(f"Rank {peer} has checked no {graph} graph on this group.")
            continue
        sequence = theirs["groups"].get(group, [])
        index = _first_difference(ours, sequence)
        if index == len(ours) == len(sequence):
            lines.append(f"Both {graph} graphs issue the same {index} collectives on this group.")
        else:
            lines.append(
                f"First differing collective on this group: #{index} of the {graph} graph.\n"
                f"  rank {rank}: {_at(ours, index)}\n  rank {peer}: {_at(sequence, index)}"
            )
        lines.extend(_causes(rank, record, peer, theirs, late=peer in missing))
    # Each rank's folder of this graph, recorded by the pass while dumping.
    dumps = {which: where["dump"] for which, where in [(rank, record), *records.items()] if where and "dump" in where}
    if dumps:
        lines.extend(f"Rank {which}'s graph and its passes are dumped in {path}." for which, path in sorted(dumps.items()))
    else:
        lines.append("To compare the ranks' graphs, dump them: compile_shard.debug.dump_graphs(path), docs/debugging.md.")
    return "\n".join(lines)


def _causes(rank: int, record: dict, peer: int, theirs: dict, late: bool) -> list[str]:
    """What differs between two ranks' records beside the collectives: the likely cause.

    ``late``: the peer checked no new graph, which names the cause already (a recompile).
    """
    causes = []
    settings_differ = sorted(
        name for name in record["settings"] if record["settings"][name] != theirs["settings"].get(name)
    )
    if settings_differ:
        causes.append(
            "The pass settings differ (compile_shard.passes.settings): "
            + ", ".join(
                f"{name}: rank {rank} {record['settings'][name]!r}, rank {peer} {theirs['settings'].get(name)!r}"
                for name in settings_differ
            )
            + "."
        )
    for who, which in ((rank, record), (peer, theirs)):
        if which["partial"]:
            causes.append(
                f"Rank {who}'s graph holds only part of the sharded model: a graph break on rank {who}, after "
                "which it runs the rest of the model in other graphs or eagerly, with other collectives "
                "(TORCH_LOGS=graph_breaks shows where)."
            )
    if not causes and not late:
        causes.append(
            "The pass settings are equal and neither graph is split: a rank-dependent branch in the model's "
            "code, or inputs that differ between the ranks (TORCH_LOGS=recompiles shows a recompile)."
        )
    return causes
