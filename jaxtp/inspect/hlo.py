"""The collective census, read from optimized HLO text.

Every collective XLA will run (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
``collective-permute``, sync or async) is found in the compiled module, its replica groups are
mapped back to mesh axes, and it is multiplied by how often its computation runs: a collective in
the body of the layer scan's ``while`` loop counts ``known_trip_count`` times. Replica groups come in
three spellings, all handled: explicit lists ``{{0,1},{2,3}}``, iota form ``[2,4]<=[8]`` /
``[4,2]<=[2,4]T(1,0)``, and mesh form ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``.
Group members are partition ids, i.e. positions in the mesh's flattened device grid.

Each operand of a collective keeps where it came from: its ``op_name`` (the JAX name stack) and
its Python traceback, which JAX records in the module's ``FileNames`` / ``FunctionNames`` /
``FileLocations`` / ``StackFrames`` tables and each instruction's ``stack_frame_id``. XLA's
combiner fuses several collectives into one tuple-shaped op with the metadata of the first, but the
``get-tuple-element`` that reads each result back keeps the original's, so a fused op's operands
are attributed one by one (:attr:`CollectiveOp.parts`). Where nothing reads them back (the fused op
is the entry's result, as the gradient sync of a ``grad`` step is) only the first operand's origin
is known; the others are marked ``lost``, with the step output each one is. The tracebacks are
read, and each operand named (``blocks/attn: reduce_from_model``), by :mod:`jaxtp.inspect.hlo_source`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from jaxtp.inspect.hlo_source import Frame, ModulePaths, Part, source, tracebacks

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w\.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w\.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(body|calls|true_computation|false_computation)=%?([\w\.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_GTE = re.compile(r"get-tuple-element\(%?([\w\.\-]+)\),\s*index=(\d+)")


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled module."""

    kind: str
    axes: tuple[str, ...]  # mesh axes its groups span (size-1 axes never appear)
    group_size: int
    bytes: int  # per device, per execution: the un-split buffer (reduce-scatter: its input)
    tensors: int  # operands (XLA's combiner may fuse several tensors into one op)
    executions: int  # times it runs per step (loop trip counts multiplied in)
    computation: str
    op_name: str  # the JAX name stack from the op metadata
    parts: tuple[Part, ...] = ()  # one per operand, in operand order

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


def _shape_bytes(text: str) -> list[int]:
    return [_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
            for d, dims in _SHAPE.findall(text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(-1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Replica groups of one instruction's attribute text, in any of XLA's three spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}",
                  attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2):
            im = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip())
            ids = _iota(_ints(im.group(1)), _ints(im.group(2)) if im.group(2) else None)
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        reduced = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        kept = [i for i in range(len(names)) if i not in reduced]
        grid = grid.transpose(kept + reduced).reshape(
            math.prod(sizes[i] for i in kept), math.prod(sizes[i] for i in reduced))
        return [list(map(int, g)) for g in grid]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return [list(map(int, g)) for g in ids.reshape(shape[0], -1)]
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        groups = [g for g in groups if g]
        if groups:
            return groups
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return [_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    return [list(range(n_devices))]  # empty groups: every device


def groups_to_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the members of each group differ."""
    names = list(mesh_shape)
    shape = [mesh_shape[a] for a in names]
    varying: set[str] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g), shape)).T  # (members, axes)
        for i, a in enumerate(names):
            if len(set(coords[:, i])) > 1:
                varying.add(a)
    return tuple(a for a in names if a in varying)


def _split_computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h and "=" not in line.split("(")[0]:
                current = h.group(2)
                comps[current] = []
                if h.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


# Branch weights: {number of branches: executions of each branch per run of the conditional's
# computation, as fractions}. A conditional whose branch index is data (the pipeline schedule's
# per-tick lax.switch) runs one branch per execution, which the HLO cannot say; without a weight
# every branch is counted as running every time (an upper bound).
BranchWeights = dict[int, tuple[float, ...]]


def _executions(comps: dict[str, list[str]], entry: str,
                branches: BranchWeights | None = None) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    callees: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                factor = int(trip.group(1)) if role == "body" and trip else 1
                callees[name].append((callee, factor))
            b = _BRANCHES.search(line)
            if b:
                targets = re.findall(r"%?([\w\.\-]+)", b.group(1))
                weights = (branches or {}).get(len(targets), (1,) * len(targets))
                for callee, w in zip(targets, weights):
                    callees[name].append((callee, w))
    runs: dict[str, float] = defaultdict(float)

    def visit(name: str, times: float, depth: int = 0):
        runs[name] += times
        if depth < 64:
            for callee, factor in callees.get(name, ()):
                visit(callee, times * factor, depth + 1)

    visit(entry, 1)
    return {k: int(round(v)) for k, v in runs.items()}


def collectives(hlo_text: str, mesh_shape: dict[str, int],
                branches: BranchWeights | None = None) -> list[CollectiveOp]:
    """Every collective in ``hlo_text``, with mesh axes and per-step execution counts."""
    n_devices = math.prod(mesh_shape.values())
    comps, entry = _split_computations(hlo_text)
    runs = _executions(comps, entry, branches)
    traces = tracebacks(hlo_text)

    def origin(text: str) -> tuple[str, tuple[Frame, ...]]:
        name, frame = _OP_NAME.search(text), _FRAME_ID.search(text)
        return (name.group(1) if name else "",
                traces.get(int(frame.group(1)), ()) if frame else ())

    ops: list[CollectiveOp] = []
    for comp, lines in comps.items():
        if not runs.get(comp):
            continue
        done: dict[str, tuple[str, str]] = {}  # async start -> (its done, the done's shape)
        element_origin: dict[tuple[str, int], str] = {}  # (tuple op, index) -> GTE's metadata
        root = None  # the instruction whose value is the step's outputs
        for line in lines:
            m = _INSTR.match(line)
            if m and comp == entry and line.lstrip().startswith("ROOT"):
                root = m.group(1)
            if m and m.group(3).endswith("-done"):
                operand = re.match(r"\s*%?([\w\.\-]+)", m.group(4))
                if operand:
                    done[operand.group(1)] = (m.group(1), m.group(2))
            elif m and m.group(3) == "get-tuple-element":
                g = _GTE.search(line)
                if g:
                    element_origin[(g.group(1), int(g.group(2)))] = m.group(4)
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, shape_text, opcode, rest = m.groups()
            kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
            if kind not in KINDS:
                continue
            result = name
            if opcode.endswith("-start"):
                result, shape_text = done.get(name, (name, shape_text))
            sizes = _shape_bytes(shape_text)
            groups = parse_replica_groups(rest, n_devices)
            group_size = 2 if kind == "collective-permute" else len(groups[0])
            if group_size == 1:  # e.g. a psum over a size-1 axis: XLA keeps it, nothing moves
                continue
            if kind == "reduce-scatter":
                sizes = [b * group_size for b in sizes]
            own = origin(rest)
            parts = []
            for i, b in enumerate(sizes):
                element = element_origin.get((result, i))
                if element is not None and len(sizes) > 1 and "metadata=" in element:
                    parts.append(Part(b, *origin(element)))
                elif element is None and i > 0:  # fused into the step's outputs: nothing kept
                    parts.append(Part(b, "", (), lost=True, output=i if result == root else None))
                else:  # the op's own, which XLA takes from its first operand; or an op XLA split
                    parts.append(Part(b, *own))
            ops.append(CollectiveOp(
                kind=kind, axes=groups_to_axes(groups, mesh_shape), group_size=group_size,
                bytes=sum(sizes), tensors=len(sizes), executions=runs[comp], computation=comp,
                op_name=own[0], parts=tuple(parts)))
    return ops



def census_by_source(ops: list[CollectiveOp], modules: ModulePaths | None = None,
                     outputs: list[str] | None = None) -> list[dict]:
    """Aggregate operands by (:func:`source`, kind, mesh axes), largest bytes first: ops per step
    (a fused op counts once for each source among its operands), tensors and bytes per device."""
    table: dict[tuple[str, str, tuple[str, ...]], dict] = {}
    for op in ops:
        seen = set()
        for part in op.parts:
            key = (source(part, modules, outputs), op.kind, op.axes)
            row = table.setdefault(key, {"source": key[0], "kind": op.kind,
                                         "axes": list(op.axes), "count": 0, "tensors": 0,
                                         "bytes": 0})
            if key not in seen:
                row["count"] += op.executions
                seen.add(key)
            row["tensors"] += op.executions
            row["bytes"] += part.bytes * op.executions
    return sorted(table.values(), key=lambda r: (-r["bytes"], r["source"]))


def census(ops: list[CollectiveOp]) -> list[dict]:
    """Aggregate by (kind, mesh axes): ops per step, tensors per step and bytes per device."""
    table: dict[tuple[str, tuple[str, ...]], dict] = {}
    for op in ops:
        row = table.setdefault((op.kind, op.axes), {"kind": op.kind, "axes": list(op.axes),
                                                    "count": 0, "tensors": 0, "bytes": 0})
        row["count"] += op.executions
        row["tensors"] += op.executions * op.tensors
        row["bytes"] += op.total_bytes
    return sorted(table.values(), key=lambda r: (KINDS.index(r["kind"]), r["axes"]))


_DOT = re.compile(r"\bdot\(%?([\w\.\-]+),\s*%?([\w\.\-]+)\)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(shape_text: str) -> list[int] | None:
    m = _SHAPE.search(shape_text)
    return [int(x) for x in m.group(2).split(",") if x] if m else None


def dot_flops(hlo_text: str, branches: BranchWeights | None = None) -> float:
    """Matmul FLOPs per step per device: ``2 x |result| x |contracted|`` for every ``dot``,
    multiplied by how often its computation runs (XLA's own cost analysis counts a ``while`` body
    once, whatever its trip count)."""
    comps, entry = _split_computations(hlo_text)
    runs = _executions(comps, entry, branches)
    total = 0.0
    for comp, lines in comps.items():
        if not runs.get(comp):
            continue
        shapes = {}
        for line in lines:
            m = _INSTR.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3) != "dot":
                continue
            d = _DOT.search(line)
            lhs = _dims(shapes.get(d.group(1), "")) if d else None
            out = _dims(m.group(2))
            c = _CONTRACT.search(line)
            if lhs is None or out is None or c is None:
                continue
            contracted = math.prod(lhs[i] for i in _ints(c.group(1)))
            total += 2.0 * math.prod(out) * contracted * runs[comp]
    return total
