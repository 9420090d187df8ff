"""The import structure: no circles between modules and no arrow back up the layers.

Every `import` statement counts, including those inside functions (a deferred import hides a circle from the
interpreter, not from the design). Layers, bottom to top:
    mercury_kernels  <  mercury_jax.parallel  <  models  <  mercury_jax (chat, rl, envs, rollout, evaluation, ...)
and `mercury_jax.bench` (benchmark scripts) is a leaf on top: nothing outside it imports it.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mercury_jax", "models", "mercury_kernels", "experiments")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported_modules(source: str, name: str, modules, *, is_package: bool = False) -> set[str]:
    """The project modules that module `name` (text `source`) imports, at any depth of the code: `from a.b import c`
    counts as a.b.c when that is a module, else as a.b."""
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(path.read_text(), name, modules, is_package=path.name == "__init__.py")
            for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module are import circles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_package_edge(a: str, b: str) -> bool:
    """A package's `__init__` re-exporting its own submodules is not a circle through the package."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circles():
    graph = import_graph()
    graph = {a: {b for b in bs if not is_package_edge(a, b)} for a, bs in graph.items()}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles, "import circles (break them by moving the shared piece into its own module): " + "; ".join(
        " <-> ".join(c) for c in circles)


LAYER_ALLOWED = {
    "mercury_kernels": ("mercury_kernels",),
    "mercury_jax.parallel": ("mercury_jax.parallel",),
    "models": ("models", "mercury_kernels", "mercury_jax.parallel"),
}


def layer_of(name: str) -> str | None:
    for layer in LAYER_ALLOWED:
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def test_no_arrow_back_up_the_layers():
    bad = []
    for source, targets in import_graph().items():
        layer = layer_of(source)
        for target in targets:
            if layer is not None and not any(target == a or target.startswith(a + ".") for a in LAYER_ALLOWED[layer]):
                bad.append(f"{source} -> {target}")
            if target.startswith("mercury_jax.bench") and not source.startswith("mercury_jax.bench"):
                bad.append(f"{source} -> {target} (only benchmark scripts import mercury_jax.bench)")
    assert not bad, "imports against the layering (mercury_kernels < parallel < models < mercury_jax; bench on top):" \
        + "\n" + "\n".join(sorted(bad))


def test_the_checks_see_a_circle_a_deferred_import_and_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    modules = {"p", "p.x", "p.y", "p.y.z", "q"}
    deferred = "import os\n\ndef f():\n    from p.y import z\n    import q\n"
    assert imported_modules(deferred, "p.x", modules) == {"p.y.z", "q"}
    relative = "from . import y\nfrom .y import z\nfrom ..q import thing\n"
    assert imported_modules(relative, "p.x", modules) == {"p.y", "p.y.z", "q"}
    assert imported_modules("from .x import f\n", "p", modules, is_package=True) == {"p.x"}


# The trainer's three rooms, bottom to top: the config rules, the run directory and its I/O, the algorithms and the
# loop. A room imports only rooms below it (and anything outside these three).
TRAINER_ROOMS = ("mercury_jax.config", "mercury_jax.runs", "mercury_jax.train")


def test_config_below_runs_below_train():
    bad = []
    for source, targets in import_graph().items():
        room = next((r for r in TRAINER_ROOMS if source == r or source.startswith(r + ".")), None)
        if room is None:
            continue
        above = TRAINER_ROOMS[TRAINER_ROOMS.index(room) + 1:]
        bad += [f"{source} -> {t}" for t in targets if any(t == a or t.startswith(a + ".") for a in above)]
    assert not bad, "config < runs < train, and an arrow points up:\n" + "\n".join(sorted(bad))
