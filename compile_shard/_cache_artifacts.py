"""One file per rank that holds a process's compiled step, so that a restarted job skips compiling it.

[Note: a restarted job loads its compiled step]
A restarted job finds AOTAutograd's and Inductor's output in its local cache
directory, but traces the step with Dynamo again: most of what a restart costs
(docs/benchmarks.md, "A restarted job's first step"). Torch can keep Dynamo's output
too (from 2.15: ``CACHES_DYNAMO_OUTPUT``). Under
``torch._dynamo.config.caching_precompile``, set before ``torch.compile``, Dynamo
pickles what it traced: the bytecode and its guards, with every object a guard reads.
``torch.compiler.save_cache_artifacts`` bundles that with the other caches into
bytes, and ``load_cache_artifacts`` unpacks them in another process, where the next
``torch.compile`` installs the trace instead of running it.

The guards read the modules, and fully_shard gives modules classes made at run time
(``FSDP<Name>`` in ``_api``, the managed-attribute classes in ``_param``, the
write-counting classes in ``_regions._attribute_writes``). Pickle finds a class by its module
and name, which these do not resolve to, and torch's guard pickler takes any subclass
of torch's ``FSDPModule`` for one of FSDP2's own classes; ours are not (Dynamo then
skips the cache: "Expected nn.Module subclass"). So ``teach_guard_pickler`` reduces
each of our classes to its recipe (``class_recipe``): the user's class by module and
name, and the steps that made ours from it. At load, the restarted job's fully_shard
has made the same classes, and ``rebuild_class`` finds the live one. A model without
it raises ``RuntimeError``, which Dynamo answers by compiling anew.

Precompile drops the guards on identity (a module's, a global function's): the
restarted job must be the same program. Torch checks its own version and the source
of every function the trace ran. The passes run in the backend, outside what Dynamo
checks, and the backend's compiled graphs are installed from the file without their
cache keys: so the file's header holds compile_shard's sources and pass settings
(what Inductor's cache key holds, ``passes.install``), torch's version, the rank and
the world size, and a file whose header differs is not loaded.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._inductor.custom_graph_pass import get_hash_for_files

from . import _api, _param
from ._compile_counts import autograd_cache_misses
from ._regions import _attribute_writes
from ._versions import CACHES_DYNAMO_OUTPUT

__all__ = ["load_cache_artifacts", "save_cache_artifacts"]

_FORMAT = 1


def _sources() -> tuple[str, ...]:
    """compile_shard's Python files, ordered by their names in the package, however it is installed.

    The passes are ``compile_shard/passes`` in a wheel and a folder beside the package
    in an editable install.
    """
    import compile_shard.passes

    package, passes = Path(__file__).parent, Path(compile_shard.passes.__file__).parent
    by_name = {str(path.relative_to(package)): path for path in package.rglob("*.py")}
    by_name.update({str(Path("passes") / path.relative_to(passes)): path for path in passes.rglob("*.py")})
    return tuple(str(by_name[name]) for name in sorted(by_name))


def _made_classes() -> tuple[tuple[str, dict], ...]:
    """The run-time class families, each as (kind, {what it was made from: the class})."""
    return (
        ("counts_writes", _attribute_writes._COUNTING_CLASSES),
        ("fsdp", _api._FSDP_CLASSES),
        ("managed_attributes", _param._ATTRIBUTE_CLASSES),
    )


def class_recipe(cls: type) -> tuple:
    """How ``cls`` was made: the user's class by module and name, wrapped in each step fully_shard took."""
    for kind, made in _made_classes():
        for origin, made_class in made.items():
            if made_class is cls:
                if kind == "managed_attributes":
                    base, names = origin
                    return (kind, class_recipe(base), tuple(sorted(names)))
                return (kind, class_recipe(origin))
    return ("user", cls.__module__, cls.__qualname__)


def rebuild_class(recipe: tuple) -> type:
    """The class of this process that ``recipe`` describes: fully_shard must have made it already."""
    for _, made in _made_classes():
        for made_class in made.values():
            if class_recipe(made_class) == recipe:
                return made_class
    raise RuntimeError(
        f"compile_shard: no module of this process has the class {recipe} of the saved compiled step; "
        "the model or its fully_shard calls differ from the run that saved it"
    )


def _is_made_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, nn.Module) and class_recipe(obj)[0] != "user"


def teach_guard_pickler() -> None:
    """Makes Dynamo's guard pickler reduce fully_shard's classes to their recipes (idempotent)."""
    from torch._dynamo.guards import GuardsStatePickler

    torch_reducer = GuardsStatePickler.reducer_override
    if getattr(torch_reducer, "_compile_shard", False):
        return

    def reducer_override(self, obj):
        if _is_made_class(obj):
            return rebuild_class, (class_recipe(obj),)
        return torch_reducer(self, obj)

    reducer_override._compile_shard = True
    GuardsStatePickler.reducer_override = reducer_override


class _OneLineForDroppedGuards(logging.Filter):
    """Replaces Dynamo's warning per dropped identity guard (over a hundred per compile) with one line."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "is dropped with caching_precompile" not in str(record.msg):
            return True
        if self.said:
            return False
        self.said = True
        record.msg = (
            "compile_shard.load_cache_artifacts: Dynamo keeps no guard on object identity in a saved compiled "
            "step; a restarted job that loads it must build the same model with the same script"
        )
        record.args = ()
        return True


_guards_logger_filter = _OneLineForDroppedGuards()
#: The file this process loaded its compiled step from, if it did.
_loaded: Path | None = None
#: ``_compiles()`` when it did.
_compiles_at_load = 0


def _compiles() -> int:
    """How many graphs AOTAutograd compiled in this process, not finding them in its cache (the file's)."""
    return autograd_cache_misses()


def _turn_on_dynamo_caching() -> None:
    torch._dynamo.config.caching_precompile = True
    teach_guard_pickler()
    logger = logging.getLogger("torch._dynamo.guards")
    if _guards_logger_filter not in logger.filters:
        logger.addFilter(_guards_logger_filter)


def _rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _header() -> dict:
    from compile_shard.passes import settings

    rank, world_size = _rank_and_world_size()
    return {
        "format": _FORMAT,
        "torch": torch.__version__,
        "compile_shard_sources": get_hash_for_files(_sources()).hex(),
        "pass_settings": settings.cache_key(),
        "rank": rank,
        "world_size": world_size,
    }


def _file(folder: str | os.PathLike) -> Path:
    rank, _ = _rank_and_world_size()
    return Path(folder) / f"rank{rank}.bin"


def load_cache_artifacts(folder: str | os.PathLike) -> bool:
    """Loads the compiled step an earlier run of this job saved in ``folder``, and makes this run's savable.

    Call it after ``fully_shard`` and before ``torch.compile``, on every rank; call
    ``save_cache_artifacts(folder)`` after the first step. Returns whether this rank's
    file was there and loaded: the first run finds none and compiles. A file saved by
    another torch, compile_shard, pass settings, rank or world size is not loaded,
    with a warning naming what differs. From torch 2.15 the file holds Dynamo's trace
    and AOTAutograd's and Inductor's output, and the loaded step compiles nothing;
    before 2.15 it holds the latter two, and Dynamo traces the step again.
    """
    global _loaded, _compiles_at_load
    if CACHES_DYNAMO_OUTPUT:
        _turn_on_dynamo_caching()
    path = _file(folder)
    if not path.exists():
        return False
    with open(path, "rb") as file:
        saved = json.loads(file.readline())
        artifacts = file.read()
    differs = {name: (saved.get(name), value) for name, value in _header().items() if saved.get(name) != value}
    if differs:
        described = "; ".join(f"{name}: saved {was!r}, now {now!r}" for name, (was, now) in differs.items())
        warnings.warn(
            f"compile_shard.load_cache_artifacts: {path} was saved by another setup ({described}), so it is not "
            "loaded and this run compiles; save_cache_artifacts after the first step replaces it",
            stacklevel=2,
        )
        return False
    torch.compiler.load_cache_artifacts(artifacts)
    _loaded, _compiles_at_load = path, _compiles()
    return True


def save_cache_artifacts(folder: str | os.PathLike) -> Path:
    """Saves what this process compiled into ``folder`` (one file per rank), for ``load_cache_artifacts``.

    Call it after the first training step, when the forward and the backward are
    compiled, on every rank. Returns the rank's file. A process that loaded the file
    keeps it: what it compiled beyond the file's step is not saved (a warning says so).
    """
    if CACHES_DYNAMO_OUTPUT and not torch._dynamo.config.caching_precompile:
        warnings.warn(
            "compile_shard.save_cache_artifacts: load_cache_artifacts was not called before torch.compile, so "
            "the file holds no Dynamo trace and a restarted job traces the step again",
            stacklevel=2,
        )
    path = _file(folder)
    if _loaded is not None and _loaded.resolve() == path.resolve():
        if _compiles() != _compiles_at_load:
            warnings.warn(
                f"compile_shard.save_cache_artifacts: {path} is kept as this run loaded it, although the run "
                "compiled what the file lacks (a changed model, or new input shapes); delete the file to save "
                "this run's step instead",
                stacklevel=2,
            )
        return path
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError(
            "compile_shard.save_cache_artifacts: torch has no compiled artifacts to save. Call it after the first "
            "compiled step, with torch's caches on (dumping graphs turns them off)"
        )
    artifacts, _ = saved
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as file:
        file.write(json.dumps(_header()).encode() + b"\n")
        file.write(artifacts)
    partial.replace(path)
    return path
