"""Imports run one way: the runtime (``_api``) above the passes, both above a small core
(``_annotation``, ``ops``). A cycle would let a change in one layer break the other at
import time, and hides which layer owns what."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it is installed as (pyproject.toml's package-dir).
PACKAGES = {"compile_shard": ROOT / "compile_shard", "compile_shard.passes": ROOT / "passes"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_module_is_part_of_an_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_passes_read_the_runtime_only_through_the_core():
    modules = _modules()
    core = {"compile_shard._annotation", "compile_shard._collectives", "compile_shard._compile_counts", "compile_shard._layout", "compile_shard.ops"} | {m for m in modules if m.startswith("compile_shard.ops.")}
    for name, path in modules.items():
        if name.startswith("compile_shard.passes"):
            outside = {m for m in _imports(name, path, modules) if not m.startswith("compile_shard.passes")}
            assert outside <= core, f"{name} imports {sorted(outside - core)}"


PRIVATE_DYNAMO = ("torch._dynamo", "torch._guards")


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private_dynamo_names(path: Path) -> set[str]:
    """Every name under torch._dynamo or torch._guards that ``path``'s code reads (docstrings aside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_DYNAMO):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Attribute) and (name := _dotted(node)) and name.startswith(PRIVATE_DYNAMO):
            names.add(name)
    # Only the longest chain of each read: ``torch._dynamo.config.x`` and not also ``torch._dynamo.config``.
    return {name for name in names if not any(other.startswith(name + ".") for other in names)}


def test_each_private_dynamo_name_is_read_in_one_module():
    readers = {}
    for name, path in _modules().items():
        for private in _private_dynamo_names(path):
            readers.setdefault(private, []).append(name)
    shared = {private: sorted(names) for private, names in readers.items() if len(names) > 1}
    assert shared == {}, "wrap each of these in one module and import it from there"
    assert "torch._dynamo.symbolic_convert.InstructionTranslator" in readers  # the check sees what it checks


def test_the_check_finds_a_private_dynamo_name_in_code_and_not_in_a_docstring(tmp_path):
    path = tmp_path / "example.py"
    path.write_text('"""torch._dynamo.reset()"""\nimport torch\ntorch._dynamo.config.x = 1\nfrom torch._guards import y\n')
    assert _private_dynamo_names(path) == {"torch._dynamo.config.x", "torch._guards.y"}


def test_only_the_regions_shim_reads_dynamos_state_and_regions_stay_below_the_runtime():
    modules = _modules()
    runtime = {"compile_shard._api", "compile_shard._state", "compile_shard._init", "compile_shard._module_settings"}
    runtime |= {name for name in modules if name.startswith("compile_shard._group")}
    for name, path in modules.items():
        if not name.startswith("compile_shard._regions"):
            continue
        if name != "compile_shard._regions._dynamo":
            assert not _private_dynamo_names(path), f"{name} reads Dynamo's private state: use _regions._dynamo"
        assert not _imports(name, path, modules) & runtime, f"{name} imports the runtime above it"
