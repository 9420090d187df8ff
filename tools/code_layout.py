"""Measure how the non-test code is laid out: rooms, arrows, circles, floors, import walls, function sizes, and the
path `config` takes from each pipeline's entry.

    python tools/code_layout.py [--root DIR] [--git REV] [--entry MODULE:FUNCTION:PARAM ...] [--json] [--trace]

Everything is read from the syntax tree (`ast`); nothing is imported. The measured code is the packages
mercury_jax, models and mercury_kernels under the root (tests/, experiments/ and tools/ are not measured, except
that the `noqa: E402` count is also given for every .py file of the tree). `--git REV` measures a revision instead
of the working tree: it runs `git archive REV | tar -x` into a temporary directory.

Definitions:
- A *room* is a package: a folder with an `__init__.py`, or a namespace package (a folder of .py files without one,
  such as mercury_jax/envs/browse). Its modules are the .py files directly in it. Its *lines* are their physical
  lines; its *code lines* are the lines that hold a token other than a comment or a docstring.
- An *arrow* is a pair (importing module, imported first-party module) between modules of two rooms, from every
  `import` statement at any depth, as tests/test_import_graph.py reads them; `from a.b import c` points at a.b.c
  when that is a module, else at a.b. Arrows inside a room are counted separately. *Hubs* are the modules with the
  most (modules importing them) x (modules they import).
- *Circles* are the strongly connected components of more than one node, of the room graph and of the module graph.
- *Floors*: the room graph without the arrows that close a circle (back edges of a depth-first search in name order)
  is ordered bottom-up; floor 0 imports no other room, floor n imports rooms up to floor n-1. An *arrow that points
  up* is a module-level import (not inside a function) from a room on a lower floor into one on a higher floor; with
  no circles there are none. Floors inside a room are the same, over its modules.
- *Longest function* is `end_lineno - lineno + 1` of a def (nested defs count on their own); *most parameters*
  counts every parameter but a method's `self`/`cls` (the rule of tests/test_code_shape.py).
- *The path of `config`* is an approximation from the syntax tree. It starts at an entry function and one of its
  parameters and follows, depth-first in source order, every call that passes the parameter: the name itself, an
  attribute or subscript of it (`config.sao`, `config["sao"]`) or its `.get(...)`, as a positional or keyword
  argument. The callee must be defined in the measured tree: a function of the same module, a name bound by the
  module's imports (`from a.b import f`, `import a.b as m` then `m.f(...)`, re-exports through `__init__.py`), a
  method of the same class called on `self`/`cls`, a method called on an imported or local class
  (`Cadence.from_config(...)`), or a class constructed with it (`Foo(config)` enters `Foo.__init__`). The argument
  binds to the callee's parameter by position or keyword (else to its `*args`/`**kwargs`), and the walk goes on with
  that parameter. Each (function, parameter) is visited once; `funcs` counts them. Calls on other objects (an
  instance held in a variable), inherited methods and calls through data structures are not followed. The default
  entries are `run` (or, before the restructuring, `run_<module>`) of train/sao.py, grpo.py and group_baseline.py
  with `config`; `--entry mercury_jax/train/sao.py:run_sao:config` (or the dotted module) sets others, and
  `--trace` prints each walk.
  *Modules entered* counts the followed calls whose callee lives in another module than the caller; *returns*
  counts those same calls coming back out to the caller's module (every followed call returns, so on this tree the
  two are equal: both count cross-module calls). *Back into the stack* counts the crossings into a module that
  is already on the call stack (A -> B -> A), and the table names the module entered most often.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import tempfile
import tokenize
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("mercury_jax", "models", "mercury_kernels")
ENTRY_MODULES = ("mercury_jax.train.sao", "mercury_jax.train.grpo", "mercury_jax.train.group_baseline")
SKIPPED_DIRS = {"__pycache__", "node_modules"}
SKIPPED_TOP_DIRS = {"runs", "build", "dist", "venv"}  # run outputs and build trees at the root, not code
NOQA = re.compile(r"#\s*noqa\s*:\s*([A-Z0-9, ]+)")
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Module:
    """One measured module: its dotted name, room (package), source and syntax tree."""
    name: str
    room: str
    path: Path
    source: str
    tree: ast.Module


@dataclass
class Names:
    """What a module's names refer to: its functions and methods by qualified name, its classes, and the dotted
    targets its import statements bind."""
    functions: dict[str, ast.AST] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)


# -- reading the tree --

def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(folder: Path, skipped_top: set[str] = frozenset()):
    """The .py files under `folder`, skipping hidden folders, caches and the top-level folders `skipped_top`."""
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).parts[:-1]
        if not any(part.startswith(".") or part in SKIPPED_DIRS for part in rel) and rel[:1] not in {
                (top,) for top in skipped_top}:
            yield path


def load_modules(root: Path) -> dict[str, Module]:
    """The measured modules: every .py file under the folders of PACKAGES; its room is the folder it sits in."""
    modules = {}
    for package in PACKAGES:
        for path in python_files(root / package):
            name, room = module_name(root, path), ".".join(path.parent.relative_to(root).parts)
            source = path.read_text(encoding="utf-8")
            modules[name] = Module(name, room, path, source, ast.parse(source, str(path)))
    return modules


def docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def code_lines(source: str, tree: ast.Module) -> int:
    """Lines holding a token that is not a comment, a blank or a docstring."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstring_lines(tree))


def noqa_e402(source: str) -> int:
    """The `# noqa: E402` comments in one file (comments only: a string that spells it does not count)."""
    count = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        match = NOQA.search(token.string) if token.type == tokenize.COMMENT else None
        count += bool(match and "E402" in match.group(1))
    return count


# -- imports and graphs --

def import_targets(node: ast.AST, module: Module, modules: dict) -> list[str]:
    """The measured modules one import statement points at (nearest enclosing module of each name)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = absolute_base(node, module)
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = []
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module.name:
            found.append(target)
    return found


def absolute_base(node: ast.ImportFrom, module: Module) -> str:
    """The absolute module a `from ... import` reads from, relative levels resolved."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = module.name.split(".") if module.path.name == "__init__.py" else module.name.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([base] if base else []))


def import_nodes(tree: ast.AST, in_function: bool = False):
    """(import statement, whether it sits inside a function) for every import of a module."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        else:
            yield from import_nodes(child, in_function or isinstance(child, (*FUNCTIONS, ast.Lambda)))


def module_edges(modules: dict[str, Module]) -> dict[tuple[str, str], bool]:
    """Module import arrows (importer, imported) -> whether at least one of them is at module level."""
    edges: dict[tuple[str, str], bool] = {}
    for module in modules.values():
        for node, deferred in import_nodes(module.tree):
            for target in import_targets(node, module, modules):
                edges[module.name, target] = edges.get((module.name, target), False) or not deferred
    return edges


def graph_of(nodes, pairs) -> dict[str, set[str]]:
    graph = {node: set() for node in nodes}
    for source, target in pairs:
        if source != target:
            graph[source].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (recursive; the graphs have a few hundred nodes); each component sorted."""
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
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    return sorted(c for c in strongly_connected(graph) if len(c) > 1)


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Floor of each node: the longest path down to a node that imports nothing, over the graph without the arrows
    that close a circle (back edges of a depth-first search in name order)."""
    floor: dict[str, int] = {}
    on_stack: set[str] = set()

    def visit(v):
        on_stack.add(v)
        height = 0
        for w in sorted(graph[v]):
            if w in on_stack:
                continue  # closes a circle: this arrow will point up
            if w not in floor:
                visit(w)
            height = max(height, floor[w] + 1)
        on_stack.discard(v)
        floor[v] = height

    for v in sorted(graph):
        if v not in floor:
            visit(v)
    return floor


# -- the import graph, measured --

def arrows_report(modules: dict[str, Module]) -> dict:
    """Rooms' arrows (counted per pair of rooms), circles, floors and arrows that point up."""
    edges = module_edges(modules)
    room_of = {name: module.room for name, module in modules.items()}
    rooms = sorted(set(room_of.values()))
    between = Counter((room_of[a], room_of[b]) for a, b in edges if room_of[a] != room_of[b])
    room_graph = graph_of(rooms, between)
    room_floor = floors(room_graph)
    up = [f"{a} -> {b}" for (a, b), top_level in sorted(edges.items())
          if top_level and room_floor[room_of[a]] < room_floor[room_of[b]]]
    return {"arrows": sum(between.values()), "arrows_inside": sum(room_of[a] == room_of[b] for a, b in edges),
            "room_pairs": {f"{a} -> {b}": n for (a, b), n in sorted(between.items(), key=lambda kv: (-kv[1], kv[0]))},
            "room_circles": circles(room_graph), "module_circles": circles(graph_of(modules, edges)),
            "floors": max(room_floor.values(), default=-1) + 1, "room_floor": room_floor,
            "arrows_up": len(up), "arrows_up_list": up, "hubs": hubs(edges)}


def hubs(edges, top: int = 5) -> list[dict]:
    """The modules with the most (importers x imports), as importers and imports counts."""
    importers, imports = Counter(b for _, b in edges), Counter(a for a, _ in edges)
    ranked = sorted(set(importers) & set(imports), key=lambda m: (-importers[m] * imports[m], m))
    return [{"module": m, "imported_by": importers[m], "imports": imports[m]} for m in ranked[:top]]


def room_inside(modules: dict[str, Module], edges, room: str) -> tuple[int, int]:
    """(arrows, floors) among the modules of one room."""
    members = {name for name, module in modules.items() if module.room == room}
    pairs = [(a, b) for a, b in edges if a in members and b in members]
    return len(pairs), max(floors(graph_of(members, pairs)).values(), default=-1) + 1


# -- functions --

def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, def node) for every def, nested ones included (as Outer.inner)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (*FUNCTIONS, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if isinstance(child, FUNCTIONS):
                yield name, child
            yield from functions(child, f"{name}.")
        else:
            yield from functions(child, prefix)


def parameter_count(node) -> int:
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    return count - bool(args.args and args.args[0].arg in ("self", "cls"))


def function_lines(node) -> int:
    return node.end_lineno - node.lineno + 1


def rooms_report(modules: dict[str, Module]) -> list[dict]:
    """Per room: modules, lines, code lines, arrows and floors inside, E402 comments, longest function, most
    parameters."""
    edges = module_edges(modules)
    rows = []
    for room in sorted({module.room for module in modules.values()}):
        members = [module for module in modules.values() if module.room == room]
        arrows, room_floors = room_inside(modules, edges, room)
        rows.append({"room": room, "modules": len(members), "lines": sum(len(m.source.splitlines()) for m in members),
                     "code_lines": sum(code_lines(m.source, m.tree) for m in members),
                     "arrows_inside": arrows, "floors_inside": room_floors,
                     "e402": sum(noqa_e402(m.source) for m in members), **largest_functions(members, room)})
    return rows


def largest_functions(members: list[Module], room: str) -> dict:
    """The longest function and the one with the most parameters among a room's modules, as [module:name, size]."""
    defs = [(f"{m.name.rpartition('.')[2] if m.name != room else '__init__'}:{qualname}", node)
            for m in members for qualname, node in functions(m.tree)]
    if not defs:
        return {"longest_function": ["-", 0], "most_parameters": ["-", 0]}
    longest = max(defs, key=lambda d: function_lines(d[1]))
    widest = max(defs, key=lambda d: parameter_count(d[1]))
    return {"longest_function": [longest[0], function_lines(longest[1])],
            "most_parameters": [widest[0], parameter_count(widest[1])]}


# -- the path of config --

def module_names(module: Module, modules: dict) -> Names:
    """Functions, methods and classes a module defines, and the names its imports bind (at any depth)."""
    names = Names()
    for qualname, node in functions(module.tree):
        names.functions[qualname] = node
    for node in module.tree.body:
        if isinstance(node, ast.ClassDef):
            names.classes.add(node.name)
    for node, _ in import_nodes(module.tree):
        for alias in node.names:
            if isinstance(node, ast.Import):
                bound = alias.asname or alias.name.partition(".")[0]
                names.imports[bound] = alias.name if alias.asname else bound
            else:
                names.imports[alias.asname or alias.name] = f"{absolute_base(node, module)}.{alias.name}"
    return names


def resolve_dotted(dotted: str, index: dict[str, Names], depth: int = 0) -> tuple[str, str] | None:
    """(module, qualified name) a dotted path names, following re-exports; None outside the measured tree."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module, rest = ".".join(parts[:cut]), parts[cut:]
        if module in index:
            return resolve_local(module, rest, index, depth)
    return None


def resolve_local(module: str, parts: list[str], index: dict[str, Names], depth: int = 0):
    names = index[module]
    if parts[0] in names.classes or parts[0] in names.functions:
        return module, ".".join(parts)
    if parts[0] in names.imports and depth < 10:
        return resolve_dotted(".".join([names.imports[parts[0]], *parts[1:]]), index, depth + 1)
    return None


def dotted_name(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def callee(call: ast.Call, module: str, qualname: str, index: dict[str, Names]):
    """(module, function qualified name, whether it is a method) that a call enters, or None."""
    parts = dotted_name(call.func)
    if not parts:
        return None
    cls = qualname.rpartition(".")[0]
    if parts[0] in ("self", "cls") and len(parts) == 2 and cls in index[module].classes:
        target = module, f"{cls}.{parts[1]}"
    else:
        target = resolve_local(module, parts, index)
    if target is None:
        return None
    target_module, target_name = target
    names = index[target_module]
    if target_name in names.classes:
        target_name = f"{target_name}.__init__"
    if target_name not in names.functions:
        return None
    return target_module, target_name, target_name.partition(".")[0] in names.classes


def passes(node: ast.AST, param: str) -> bool:
    """Whether an argument is the parameter, an attribute or subscript of it, or its .get(...)."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            node = node.func.value
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        else:
            return isinstance(node, ast.Name) and node.id == param


def bound_parameters(call: ast.Call, param: str, target, is_method: bool) -> list[str]:
    """The callee's parameters that receive the tracked parameter in this call."""
    args = target.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    if is_method and not any(dotted_name(d) == ["staticmethod"] for d in target.decorator_list):
        positional = positional[1:]
    named = set(positional) | {a.arg for a in args.kwonlyargs}
    bound = []
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            break
        if passes(arg, param) and i < len(positional):
            bound.append(positional[i])
        elif passes(arg, param) and args.vararg:
            bound.append(args.vararg.arg)
    for keyword in call.keywords:
        if not passes(keyword.value, param):
            continue
        if keyword.arg in named:
            bound.append(keyword.arg)
        elif args.kwarg:
            bound.append(args.kwarg.arg)
    return bound


@dataclass
class ConfigPath:
    """The walk of one parameter through the calls (see the module docstring)."""
    entry: str
    visited: int = 0
    entered: int = 0
    returns: int = 0
    back_into_stack: int = 0
    entries: Counter = field(default_factory=Counter)
    steps: list[str] = field(default_factory=list)


def followed_calls(module: str, qualname: str, param: str, index: dict[str, Names]):
    """(callee module, callee qualname, callee parameter) for each call of the function passing `param`, in
    source order."""
    node = index[module].functions[qualname]
    calls = sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        target = callee(call, module, qualname, index)
        if target is None:
            continue
        target_module, target_name, is_method = target
        function = index[target_module].functions[target_name]
        for bound in bound_parameters(call, param, function, is_method):
            yield target_module, target_name, bound


def walk_config(path: ConfigPath, index: dict[str, Names], start: tuple[str, str, str]) -> ConfigPath:
    """Depth-first over the followed calls from `start` = (module, function, parameter); each (function, parameter)
    once."""
    seen = {start}
    module_stack = [start[0]]

    def visit(module: str, qualname: str, param: str):
        path.visited += 1
        path.steps.append(f"{'  ' * (len(module_stack) - 1)}{module}:{qualname}({param})")
        for step in followed_calls(module, qualname, param, index):
            if step in seen:
                continue
            seen.add(step)
            crossing = step[0] != module
            if crossing:
                path.entered += 1
                path.entries[step[0]] += 1
                path.back_into_stack += step[0] in module_stack
            module_stack.append(step[0])
            visit(*step)
            module_stack.pop()
            path.returns += crossing

    visit(*start)
    return path


def default_entries(index: dict[str, Names]) -> list[str]:
    """`run` of each pipeline module (or `run_<module>`, the name before the restructuring)."""
    entries = []
    for module in ENTRY_MODULES:
        stem = module.rpartition(".")[2]
        names = index.get(module, Names())
        function = next((f for f in ("run", f"run_{stem}") if f in names.functions), "run")
        entries.append(f"{module}:{function}:config")
    return entries


def config_paths(modules: dict[str, Module], entries: list[str] | None) -> list[dict]:
    index = {name: module_names(module, modules) for name, module in modules.items()}
    rows = []
    for entry in entries or default_entries(index):
        module, function, param = entry.split(":")
        module = module.removesuffix(".py").replace("/", ".")
        if module not in index or function not in index[module].functions:
            rows.append({"entry": entry, "missing": True})
            continue
        path = walk_config(ConfigPath(entry), index, (module, function, param))
        most = path.entries.most_common(1)
        rows.append({"entry": entry, "functions": path.visited, "modules_entered": path.entered,
                     "returns": path.returns, "distinct_modules": len(path.entries),
                     "back_into_stack": path.back_into_stack,
                     "most_entered": [most[0][0], most[0][1]] if most else ["-", 0], "steps": path.steps})
    return rows


# -- the whole report --

def measure(root: Path, entries: list[str] | None = None) -> dict:
    modules = load_modules(root)
    rooms = rooms_report(modules)
    largest = max(rooms, key=lambda r: (r["modules"], r["code_lines"]), default={"room": "-"})
    tree_e402 = sum(noqa_e402(p.read_text(encoding="utf-8")) for p in python_files(root, SKIPPED_TOP_DIRS))
    return {"modules": len(modules), "lines": sum(r["lines"] for r in rooms),
            "code_lines": sum(r["code_lines"] for r in rooms), "rooms": rooms,
            "largest_room": largest["room"], **arrows_report(modules),
            "e402": sum(r["e402"] for r in rooms), "e402_tree": tree_e402,
            "config_paths": config_paths(modules, entries)}


def print_table(report: dict, trace: bool = False) -> None:
    """The report as text: totals, one row per room, the arrows between rooms, and the config paths."""
    print(f"{report['modules']} modules, {report['lines']} lines ({report['code_lines']} code lines), "
          f"{len(report['rooms'])} rooms; largest room: {report['largest_room']}")
    print(f"noqa: E402: {report['e402']} in the measured packages, {report['e402_tree']} in every .py of the tree\n")
    print(f"{'room':32} {'mods':>4} {'lines':>6} {'code':>6} {'in':>4} {'fl':>3} {'E402':>4}  {'longest function':52} "
          f"most parameters")
    for r in report["rooms"]:
        (lname, lines), (pname, params) = r["longest_function"], r["most_parameters"]
        print(f"{r['room']:32} {r['modules']:4} {r['lines']:6} {r['code_lines']:6} {r['arrows_inside']:4} "
              f"{r['floors_inside']:3} {r['e402']:4}  {f'{lname} ({lines})':52} {pname} ({params})")
    print("  (code: code lines; in: arrows between modules of the room; fl: floors inside the room)\n")
    print_arrows(report)
    print_paths(report["config_paths"], trace)


def print_arrows(report: dict) -> None:
    print(f"arrows between rooms: {report['arrows']} (inside rooms: {report['arrows_inside']}); "
          f"floors: {report['floors']}; arrows that point up: {report['arrows_up']}")
    print(f"circles between rooms: {len(report['room_circles'])} {report['room_circles'] or ''}")
    print(f"circles between modules: {len(report['module_circles'])} {report['module_circles'] or ''}")
    for arrow in report["arrows_up_list"]:
        print(f"  up: {arrow}")
    print("hubs (imported by x imports): " + ", ".join(f"{h['module']} ({h['imported_by']} x {h['imports']})"
                                                     for h in report["hubs"]))
    for pair, count in report["room_pairs"].items():
        print(f"  {count:4}  {pair}")
    print()


def print_paths(paths: list[dict], trace: bool) -> None:
    print(f"{'config path from':58} {'funcs':>5} {'entered':>7} {'returns':>7} {'modules':>7} {'back':>4}  "
          f"most entered")
    for p in paths:
        if p.get("missing"):
            print(f"{p['entry']:58} (not found)")
            continue
        print(f"{p['entry']:58} {p['functions']:5} {p['modules_entered']:7} {p['returns']:7} "
              f"{p['distinct_modules']:7} {p['back_into_stack']:4}  {p['most_entered'][0]} ({p['most_entered'][1]})")
        if trace:
            print("\n".join(f"    {step}" for step in p["steps"]))


def measure_revision(repo: Path, rev: str, entries: list[str] | None) -> dict:
    """Measure a git revision of `repo`, extracted with `git archive REV | tar -x` into a temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        return measure(Path(tmp), entries)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--git", metavar="REV", help="measure this revision of the repository at --root")
    parser.add_argument("--entry", action="append", metavar="MODULE:FUNCTION:PARAM",
                        help="where the config path starts (repeatable); default: each pipeline's run, config")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--trace", action="store_true", help="print each config path's calls, indented by depth")
    args = parser.parse_args(argv)
    report = measure_revision(args.root, args.git, args.entry) if args.git else measure(args.root, args.entry)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report, args.trace)


if __name__ == "__main__":
    main()
