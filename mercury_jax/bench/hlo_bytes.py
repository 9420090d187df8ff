"""HBM bytes a compiled program moves, counted from its optimised HLO text with every loop's trip count.

XLA's `cost_analysis()` counts a while loop's body once, and a decode chunk is loops all the way down (decode
steps, then layers), so its "bytes accessed" says little about a step. This counter walks the optimised module
(XLA's `--xla_dump_to` text; `compiled.as_text()` fails on TPU executables with async ops) and charges:

    fusion          its output (the update only, for an in-place dynamic-update-slice or scatter root) + per
                    operand what the fused code reads of it: the slices, for an operand only dynamic-sliced /
                    gathered inside, nothing for the buffer an in-place update writes into, else the whole operand
    while           (body + condition) x trip count (the condition's `compare(i, constant)` bound)
    call, conditional, async collectives' wrapped computations: their bodies (a conditional: its largest branch)
    Pallas (Mosaic) calls: the bytes their `pl.CostEstimate` declares (what the kernel's blocks read and write)
    copy, collectives, other custom calls, unfused ops: operands + output
    parameter, constant, tuple, get-tuple-element, bitcast, *-done: nothing
    arrays in another memory space (`S(1)`: XLA's prefetches into on-chip memory): nothing (their HBM side counts)

An estimate of the same kind as XLA's (what each kernel reads and writes from HBM, no cache reuse), stated here so
a figure can be traced. `entry_transfers` lists the big copies and collectives outside every loop: a decode chunk
that re-lays its cache out before or after its step loop shows them there.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
import time
from collections.abc import Callable

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "copy-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
         "async-done", "async-update", "send-done", "recv-done", "opt-barrier"}
_IN_PLACE = ("dynamic-update-slice", "scatter")  # a fusion rooted so writes into its operand 0's buffer
_TRANSFERS = ("copy", "copy-start", "all-gather", "all-gather-start", "all-reduce", "all-reduce-start",
              "collective-permute", "collective-permute-start", "reduce-scatter", "all-to-all")


def shape_bytes(text: str) -> int:
    """HBM bytes of every array shape in `text` (a shape or a tuple of shapes; arrays laid out in another memory
    space, `S(n)`, n > 0, do not count)."""
    total = 0
    for dtype, dims, layout in _SHAPE.findall(text):
        if re.search(r"S\([1-9]\)", layout):  # an on-chip memory space (a prefetch into VMEM), not HBM
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    result_bytes: int
    operands: list[str]
    attributes: str
    is_root: bool
    arguments: str = ""  # the raw text between the opcode's parentheses


@dataclasses.dataclass
class Computation:
    name: str
    instructions: list[Instruction]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _split_result(rhs: str) -> tuple[str, str]:
    """(result shape text, the rest starting at the opcode) of an instruction's right-hand side."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[:i + 1], rhs[i + 1:].lstrip()
    shape, _, rest = rhs.partition(" ")
    return shape, rest


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    root, name, rhs = match.groups()
    shape, rest = _split_result(rhs)
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    opcode = opcode_match.group(1)
    depth, start = 0, opcode_match.end() - 1
    end = start
    for end in range(start, len(rest)):
        depth += rest[end] == "("
        depth -= rest[end] == ")"
        if depth == 0:
            break
    operands = re.findall(r"%([\w.\-]+)", rest[start:end + 1])
    return Instruction(name, opcode, shape_bytes(shape), operands, rest[end + 1:], bool(root),
                       rest[start + 1:end])


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """({computation name: Computation}, the entry computation's name) of an HLO module's text."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = Computation(header.group(2), [])
            computations[current.name] = current
            if header.group(1):
                entry = current.name
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                current.instructions.append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _called(attributes: str, key: str) -> list[str]:
    match = re.search(key + r"=\{?([^},]+(?:,\s*%[\w.\-]+)*)\}?", attributes)
    return re.findall(r"%?([\w.\-]+)", match.group(1)) if match else []


class ByteCounter:
    """Bytes moved by the computations of one parsed module (`parse_module`); `constants` the integer scalar
    constants by name (`scalar_constants`), for the loops' trip counts."""

    def __init__(self, computations: dict[str, Computation], constants: dict[str, int]):
        self.computations, self.constants = computations, constants
        self._memo: dict[str, int] = {}

    def trip_count(self, condition: str) -> int:
        """The bound n of a `while` condition whose root compares the counter with `constant(n)` (1 when it does
        not)."""
        for i in self.computations[condition].instructions:
            if i.is_root and i.opcode == "compare":
                bounds = [self.constants[o] for o in i.operands if o in self.constants]
                if bounds:
                    return bounds[0]
        return 1

    def loop_trips(self, loop: Instruction) -> int:
        """A `while`'s trip count: XLA's `known_trip_count` when it states one, else `trip_count` of its
        condition."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attributes)
        return int(known.group(1)) if known else self.trip_count(_called(loop.attributes, "condition")[0])

    def computation_bytes(self, name: str) -> int:
        if name not in self._memo:
            comp = self.computations[name]
            shapes = comp.by_name()
            self._memo[name] = sum(self.instruction_bytes(i, shapes) for i in comp.instructions)
        return self._memo[name]

    def instruction_bytes(self, i: Instruction, shapes: dict[str, Instruction]) -> int:
        operand_bytes = [shapes[o].result_bytes if o in shapes else 0 for o in i.operands]
        if i.opcode in _FREE:
            return 0
        if i.opcode == "while":
            body, condition = _called(i.attributes, "body")[0], _called(i.attributes, "condition")[0]
            trips = self.loop_trips(i)
            return trips * (self.computation_bytes(body) + self.computation_bytes(condition))
        if i.opcode in ("call", "async-start"):
            return sum(self.computation_bytes(c) for c in _called(i.attributes, "to_apply")
                       + _called(i.attributes, "calls"))
        if i.opcode == "conditional":
            branches = _called(i.attributes, "branch_computations") or (
                _called(i.attributes, "true_computation") + _called(i.attributes, "false_computation"))
            return max((self.computation_bytes(b) for b in branches), default=0)
        if i.opcode == "fusion":
            return self.fusion_bytes(i, operand_bytes)
        declared = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', i.attributes)
        if i.opcode == "custom-call" and declared:  # a Pallas kernel: the bytes its CostEstimate declares
            return int(declared.group(1))
        if i.opcode == "dynamic-slice":
            return 2 * i.result_bytes
        if i.opcode == "dynamic-update-slice":
            return 2 * (operand_bytes[1] if len(operand_bytes) > 1 else i.result_bytes)
        return i.result_bytes + sum(operand_bytes)

    def fusion_bytes(self, i: Instruction, operand_bytes: list[int]) -> int:
        called = _called(i.attributes, "calls")
        if not called or called[0] not in self.computations:
            return i.result_bytes + sum(operand_bytes)
        fused = self.computations[called[0]]
        root = next((inst for inst in fused.instructions if inst.is_root), None)
        roots = [root] if root is not None and root.opcode != "tuple" else [
            fused.by_name()[o] for o in (root.operands if root is not None else [])]
        in_place = {r.operands[0] for r in roots if r.opcode in _IN_PLACE}
        written = sum(self._update_bytes(r, fused) if r.opcode in _IN_PLACE else r.result_bytes
                      for r in roots) if roots else i.result_bytes
        read = 0
        for name, index in _parameters(fused).items():
            whole = operand_bytes[index] if index < len(operand_bytes) else 0
            read += self._read_of_parameter(fused, name, whole, in_place)
        return written + read

    def _read_of_parameter(self, fused: Computation, name: str, whole: int, in_place=frozenset()) -> int:
        """Bytes a fused computation reads of its parameter `name` (`whole` bytes): the slices and gathers taken
        of it, through nested fusions; nothing when only an in-place update writes into it; else all of it."""
        uses = [(u, pos) for u in fused.instructions for pos, o in enumerate(u.operands) if o == name]
        if name in in_place and all(u.opcode in _IN_PLACE and pos == 0 for u, pos in uses):
            return 0
        read = 0
        for use, pos in uses:
            if name in in_place and use.opcode in _IN_PLACE and pos == 0:
                continue  # the buffer the update writes into: its written part counts as the fusion's output
            if use.opcode in ("dynamic-slice", "gather", "slice") and pos == 0:
                read += use.result_bytes
            elif use.opcode == "fusion" and _called(use.attributes, "calls"):
                nested = self.computations.get(_called(use.attributes, "calls")[0])
                inner = {index: inner_name for inner_name, index in _parameters(nested).items()} if nested else {}
                read += self._read_of_parameter(nested, inner[pos], whole) if pos in inner else whole
            else:
                return whole
        return min(read, whole)

    @staticmethod
    def _update_bytes(root: Instruction, fused: Computation) -> int:
        """Bytes an in-place root writes: a dynamic-update-slice its update (operand 1), a scatter its updates
        (the last operand)."""
        shapes = fused.by_name()
        update = root.operands[1] if root.opcode == "dynamic-update-slice" else root.operands[-1]
        return shapes[update].result_bytes if update in shapes else 0


def _parameters(comp: Computation) -> dict[str, int]:
    """{parameter name: its operand index} of a computation."""
    found = {}
    for inst in comp.instructions:
        if inst.opcode == "parameter":
            found[inst.name] = int(inst.arguments)
    return found


def scalar_constants(text: str) -> dict[str, int]:
    """{name: value} of the s32 scalar constants in an HLO module's text."""
    return {name: int(value) for name, value in re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((-?\d+)\)", text)}


def module_bytes(text: str) -> int:
    """Bytes moved by one run of the HLO module `text` (its entry computation, loops by their trip counts)."""
    computations, entry = parse_module(text)
    return ByteCounter(computations, scalar_constants(text)).computation_bytes(entry)


def entry_transfers(text: str, min_bytes: int) -> list[tuple[str, str, int]]:
    """(name, opcode, result bytes) of the copies and collectives of at least `min_bytes` in the entry computation
    (outside every loop) and of the fusions there that slice or gather from a loop-carried buffer."""
    computations, entry = parse_module(text)
    found = []
    for i in computations[entry].instructions:
        if i.result_bytes >= min_bytes and (i.opcode in _TRANSFERS or i.opcode == "fusion"):
            found.append((i.name, i.opcode, i.result_bytes))
    return found


_COLLECTIVES = ("all-gather", "all-gather-done", "all-reduce", "all-reduce-done", "reduce-scatter", "all-to-all",
                "ragged-all-to-all", "collective-permute", "collective-permute-done")


def collective_bytes(text: str) -> dict[str, int]:
    """{collective kind: bytes a chip receives in one run of the HLO module `text`}: each collective's output
    (per chip) times the trip counts of the loops around it; async pairs counted once, at their `-done`."""
    computations, entry = parse_module(text)
    counter = ByteCounter(computations, scalar_constants(text))
    memo: dict[str, dict[str, int]] = {}

    def walk(name: str) -> dict[str, int]:
        if name in memo:
            return memo[name]
        memo[name] = {}
        totals: dict[str, int] = {}

        def add(found: dict[str, int], times: int = 1):
            for kind, n in found.items():
                totals[kind] = totals.get(kind, 0) + times * n
        for i in computations[name].instructions:
            if i.opcode in _COLLECTIVES:
                add({i.opcode.removesuffix("-done"): i.result_bytes})
            elif i.opcode == "while":
                add(walk(_called(i.attributes, "body")[0]), counter.loop_trips(i))
            elif i.opcode in ("call", "async-start", "fusion"):
                for called in _called(i.attributes, "to_apply") + _called(i.attributes, "calls"):
                    if called in computations:
                        add(walk(called))
            elif i.opcode == "conditional":
                branches = _called(i.attributes, "branch_computations") or (
                    _called(i.attributes, "true_computation") + _called(i.attributes, "false_computation"))
                sums = [walk(b) for b in branches if b in computations]
                if sums:
                    add(max(sums, key=lambda d: sum(d.values())))
        memo[name] = totals
        return totals
    return walk(entry)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The collectives of one kind, group layout and issue in a module: `groups` the op's `replica_groups` (or a
    permute's `source_target_pairs`) as the HLO text spells it ("" where it names none: every device), `is_async`
    whether XLA issues it asynchronously (a `-start` / `-done` pair or an op inside an `async-start` computation),
    and per run of the module `ops` (loops by their trip counts) and `bytes` (their results per chip, summed)."""
    kind: str
    groups: str
    is_async: bool
    ops: int = 0
    bytes: int = 0


_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=(\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\(.*?\))? \{[^}]*\})")


def collective_traffic(text: str) -> list[Traffic]:
    """Every collective of the HLO module `text` by (kind, groups, async), with its ops and result bytes per chip in
    one run (each op's result times the trip counts of the loops around it; an async pair counted once, at its
    `-done`, with the groups of its `-start`). The same walk and the same bytes as `collective_bytes`."""
    computations, entry = parse_module(text)
    counter = ByteCounter(computations, scalar_constants(text))
    memo: dict[tuple[str, bool], dict] = {}

    def walk(name: str, inside_async: bool) -> dict:
        if (name, inside_async) not in memo:
            memo[(name, inside_async)] = {}
            memo[(name, inside_async)] = _walk_traffic(computations[name], inside_async, walk, counter)
        return memo[(name, inside_async)]
    return [Traffic(kind, groups, is_async, ops, nbytes)
            for (kind, groups, is_async), (ops, nbytes) in walk(entry, False).items()]


def _walk_traffic(comp: Computation, inside_async: bool, walk, counter: ByteCounter) -> dict:
    """{(kind, groups, async): [ops, bytes]} of one computation, the computations it calls walked by `walk`."""
    totals: dict[tuple, list[int]] = {}

    def add(found: dict, times: int = 1):
        for key, (ops, nbytes) in found.items():
            entry = totals.setdefault(key, [0, 0])
            entry[0] += times * ops
            entry[1] += times * nbytes
    shapes = comp.by_name()
    for i in comp.instructions:
        if i.opcode in _COLLECTIVES:
            start = shapes.get(i.operands[0]) if i.opcode.endswith("-done") and i.operands else None
            groups = _GROUPS.search((start or i).attributes)
            is_async = inside_async or i.opcode.endswith("-done")
            add({(i.opcode.removesuffix("-done"), groups.group(1) if groups else "", is_async): (1, i.result_bytes)})
        elif i.opcode == "while":
            add(walk(_called(i.attributes, "body")[0], inside_async), counter.loop_trips(i))
        elif i.opcode in ("call", "async-start", "fusion"):
            for called in _called(i.attributes, "to_apply") + _called(i.attributes, "calls"):
                if called in counter.computations:
                    add(walk(called, inside_async or i.opcode == "async-start"))
        elif i.opcode == "conditional":
            branches = _called(i.attributes, "branch_computations") or (
                _called(i.attributes, "true_computation") + _called(i.attributes, "false_computation"))
            sums = [walk(b, inside_async) for b in branches if b in counter.computations]
            if sums:
                add(max(sums, key=lambda d: sum(nbytes for _, nbytes in d.values())))
    return totals


def replica_groups(groups: str, devices: int) -> list[list[int]]:
    """The device ids (positions in the program's device assignment) of each group of a collective's
    `replica_groups` text: explicit (`{{0,1},{2,3}}`), iota (`[2,4]<=[4,2]T(1,0)`: iota over the bracketed dims,
    transposed, reshaped to groups x size) or mesh axes (`mesh['a'=2,'b'=4] {'b'}`: the devices along the named
    axes form a group; `name:(pre)size` a sub-axis); "" or `{}`: one group of all `devices`."""
    text = groups.strip()
    if text in ("", "{}"):
        return [list(range(devices))]
    try:
        if text.startswith("{"):
            return [[int(n) for n in re.findall(r"\d+", g)] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
        if text.startswith("["):
            shape, ids = text.split("<=", 1)
            return _iota_ids(ids).reshape([int(n) for n in shape[1:-1].split(",")]).tolist()
        return _mesh_groups(text)
    except (AttributeError, ValueError) as error:
        raise ValueError(f"replica groups {text!r} are not in a spelling hlo_bytes.replica_groups reads "
                         f"({error})") from error


def permute_pairs(pairs: str) -> list[tuple[int, int]]:
    """(source, target) device ids of a collective-permute's `source_target_pairs` text."""
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),\s*(\d+)\}", pairs)]


def _iota_ids(text: str):
    """The ids of an iota tile assignment `[d0,d1,...]T(p0,p1,...)` (the transpose optional), as an array of the
    transposed shape."""
    match = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    dims = [int(n) for n in match.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(n) for n in match.group(2).split(",")]) if match.group(2) else ids


def _mesh_groups(text: str) -> list[list[int]]:
    """Groups of a mesh-axes replica group list (`mesh['a'=2,'b'=4], device_ids=(...) {'b','a:(1)2'}`)."""
    match = re.fullmatch(r"mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", text)
    axes = [(name, int(size)) for name, size in re.findall(r"'?([\w.\-]+)'?=(\d+)", match.group(1))]
    sizes = [size for _, size in axes]
    ids_text = (match.group(2) or "").strip()
    if ids_text.startswith("["):
        ids = _iota_ids(ids_text.split("<=", 1)[1]).reshape(sizes)
    elif ids_text:
        ids = np.array([int(n) for n in re.findall(r"\d+", ids_text)]).reshape(sizes)
    else:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    # each axis split as (major, sub-axis, minor) where a sub-axis `name:(pre)size` is grouped, else kept whole
    split, grouped = [], []
    refs = re.findall(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?(?:,|$)", match.group(3).replace(" ", ""))
    wanted = {name: (int(pre), int(size)) if size else None for name, pre, size in refs if name}
    for name, size in axes:
        if name in wanted and wanted[name] is not None:
            pre, sub = wanted[name]
            grouped.append(len(split) + 1)
            split += [size // (pre * sub), sub, pre]
        else:
            if name in wanted:
                grouped.append(len(split))
            split.append(size)
    ids = ids.reshape(split)
    others = [a for a in range(len(split)) if a not in grouped]
    group_size = math.prod(split[a] for a in grouped)
    return ids.transpose(others + grouped).reshape(-1, group_size).tolist()


# the collectives `collective_results` and `collective_ops` name (each op's synchronous or `-start` form)
COLLECTIVE_KINDS = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter",
                    "ragged-all-to-all")
_RESULT_SHAPE = re.compile(r"(bf16|f16|f32|s32|u32|s8|u8|pred|f64|s64)\[([\d,]*)\]")
_COLLECTIVE_OP = re.compile(r"\b(ragged-all-to-all|all-to-all|all-gather|all-reduce|reduce-scatter)(?:-start)?\(")


def collective_results(text: str) -> dict[str, tuple[int, int]]:
    """{collective kind: (count, bytes of their results per device)} in a compiled (per-device) HLO text of a
    program without loops (each op once: no trip counts); the `-done` halves of async pairs are not counted
    twice."""
    found: dict[str, list[int]] = {}
    for line in text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([a-z\-]+)\(", line)
        if not match:
            continue
        kind = match.group(2).removesuffix("-start")
        if kind not in COLLECTIVE_KINDS:
            continue
        shapes = _RESULT_SHAPE.findall(match.group(1))
        if match.group(2).endswith("-start"):  # (operands, results[, u32[] contexts]): the results
            shapes = [s for s in shapes if s[1]]
            shapes = shapes[len(shapes) // 2:]
        nbytes = sum(DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n) for d, dims in shapes)
        entry = found.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    return {kind: (count, nbytes) for kind, (count, nbytes) in found.items()}


def collective_ops(text: str) -> dict[str, int]:
    """{collective kind: how many ops of it} in a compiled HLO text (an async pair once, at its `-start`; the
    collective-permutes left out), whatever their sizes or loops."""
    ops: dict[str, int] = {}
    for op in _COLLECTIVE_OP.findall(text):
        ops[op] = ops.get(op, 0) + 1
    return ops


def counted_collectives(since: float) -> dict[str, int] | None:
    """`collective_bytes` of the program compiled last, None when nothing is dumped."""
    return _count_last_module(collective_bytes, since)


def counted_collective_traffic(since: float) -> list[Traffic] | None:
    """`collective_traffic` of the program compiled last, None when nothing is dumped."""
    return _count_last_module(collective_traffic, since)


def _count_last_module(count: Callable[[str], object], since: float):
    """`count` of the optimised text of the program compiled last (`optimised_module_text`), None when nothing is
    dumped (no `dump_optimised_hlo` in this process, or it came after jax started)."""
    if _dump_dir is None:
        return None
    try:
        return count(optimised_module_text(_dump_dir, since))
    except FileNotFoundError:
        return None


def optimised_module_text(dump_dir: str, since: float) -> str:
    """The text of the largest optimised HLO module XLA dumped into `dump_dir` after time `since` (the program
    just compiled; small helper modules, like a top-k, are dumped beside it)."""
    paths = [p for p in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if os.path.getmtime(p) >= since]
    if not paths:
        raise FileNotFoundError(f"no optimised HLO module was dumped into {dump_dir}; is XLA_FLAGS=--xla_dump_to "
                                f"set before jax starts?")
    return open(max(paths, key=os.path.getsize)).read()


_dump_dir: str | None = None  # where this process has XLA dump its optimised modules (`dump_optimised_hlo`)


def dump_optimised_hlo(module_re: str = ".*traced_on_mesh.*") -> str:
    """Have XLA dump the optimised HLO text of every compiled module matching `module_re` into a fresh temporary
    folder (unless XLA_FLAGS already names one), and return the folder. A bench's entry point calls it before jax
    starts its backend (XLA reads the flags then; a library import must not, or every process it starts would
    dump too)."""
    global _dump_dir
    flags = os.environ.get("XLA_FLAGS", "")
    existing = re.search(r"--xla_dump_to=(\S+)", flags)
    if existing:
        _dump_dir = existing.group(1)
        return _dump_dir
    _dump_dir = tempfile.mkdtemp(prefix="mercury_hlo_")
    os.environ["XLA_FLAGS"] = (flags + f" --xla_dump_to={_dump_dir} --xla_dump_hlo_as_text"
                               f" --xla_dump_hlo_module_re={module_re}").strip()
    return _dump_dir


def counted_bytes(since: float) -> int | None:
    """`module_bytes` of the program compiled last (`optimised_module_text`), None when nothing is dumped (no
    `dump_optimised_hlo` in this process, or it came after jax started)."""
    return _count_last_module(module_bytes, since)


def bytes_per_trip(since: float, compile_one_trip: Callable[[], object], trips: int) -> float | None:
    """Bytes one trip of a program's loop moves: the program compiled last (after `since`, with `trips` trips)
    minus the same program compiled now by `compile_one_trip` with one trip, over trips - 1; so what the program does
    once around its loop (re-layouts, the first and last steps) cancels. None when nothing is dumped."""
    whole = counted_bytes(since)
    one_trip_since = time.time()
    compile_one_trip()
    one = counted_bytes(one_trip_since)
    return None if whole is None or one is None else (whole - one) / (trips - 1)
