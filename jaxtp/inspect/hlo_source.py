"""Where a collective came from: the Python tracebacks XLA keeps in the HLO, and names for them.

JAX records each instruction's traceback in the compiled module's ``FileNames`` /
``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables, and the instruction points into
them with its ``stack_frame_id``. :func:`tracebacks` reads those tables back into
:class:`Frame` chains, and :func:`source` turns one operand's chain (a :class:`Part`) into a name
a reader of the model knows: the module path or function of jaxtp that caused it and the
Megatron / ZeRO operator of ``collectives.py`` it went through (``blocks/attn:
reduce_from_model``, ``sync_grads``), or, for a collective XLA's partitioner inserted, the
primitive it partitions. :mod:`jaxtp.inspect.hlo` attaches the parts to each collective it finds.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from jaxtp.parallel import ExplicitOps, copy_to_model, named
from jaxtp.pipeline import weight_einsum


def _file(obj) -> str:
    """The source file of the module that defines ``obj``."""
    return os.path.abspath(sys.modules[obj.__module__].__file__)


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jaxtp/
_OPERATORS = _file(copy_to_model)  # the named Megatron / ZeRO operators
# and dispatch (weight_grad.py: the matmul wrapper ZB-H1 splits the backward at); each path is
# the module's own __file__, so a module that moves keeps its role here
_PLUMBING = tuple(_file(f) for f in (copy_to_model, ExplicitOps, named, weight_einsum))
_EINSUM = re.compile(r"[\w.]+(?:,[\w.]+)*->[\w.]*")

# Flax module class -> [(attribute path, ancestor classes nearest first)], e.g.
# {"Attention": [("blocks/attn", ("Block", "Transformer"))]} (jaxtp.inspect.placement.module_paths).
ModulePaths = dict[str, list[tuple[str, tuple[str, ...]]]]


@dataclass(frozen=True)
class Frame:
    """One Python frame of the traceback that created an instruction."""

    file: str
    function: str  # qualified name, e.g. ``Attention.__call__``
    line: int


@dataclass(frozen=True)
class Part:
    """One operand of a collective: its bytes and where it came from."""

    bytes: int  # per device, per execution (reduce-scatter: its input)
    op_name: str  # the JAX name stack
    frames: tuple[Frame, ...]  # its traceback, innermost first (empty if the HLO has none)
    lost: bool = False  # fused into an op whose result no get-tuple-element reads back
    output: int | None = None  # if lost: the index of the step output it is, if it is one


def tracebacks(hlo_text: str) -> dict[int, tuple[Frame, ...]]:
    """``stack_frame_id`` -> its traceback, innermost frame first, from the module's tables.

    Each ``StackFrames`` row is ``ID {file_location_id=L parent_frame_id=P}``; XLA prints the
    parent's id plus one, so ``P = 1`` is a root frame (checked against compiled modules in
    ``tests/unit/inspect/test_inspect.py``). Empty when the module carries no tables.
    """
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in _TABLES:
            current = tables.setdefault(line, {})
        elif current is not None:
            row = line.split(" ", 1)
            if len(row) == 2 and row[0].isdigit():
                current[int(row[0])] = row[1]
            else:
                current = None
                if len(tables) == len(_TABLES):
                    break
    if len(tables) < len(_TABLES):
        return {}

    def field(text: str, name: str) -> int:
        m = re.search(name + r"=(\d+)", text)
        return int(m.group(1)) if m else 0

    names = {i: t.strip('"') for i, t in tables["FileNames"].items()}
    funcs = {i: t.strip('"') for i, t in tables["FunctionNames"].items()}
    locations = {i: Frame(names.get(field(t, "file_name_id"), ""),
                          funcs.get(field(t, "function_name_id"), ""), field(t, " line"))
                 for i, t in tables["FileLocations"].items()}
    frames = {i: (locations.get(field(t, "file_location_id")), field(t, "parent_frame_id") - 1)
              for i, t in tables["StackFrames"].items()}
    out: dict[int, tuple[Frame, ...]] = {}
    for start in frames:
        chain, i, seen = [], start, set()
        while i in frames and i not in seen:
            seen.add(i)
            location, i = frames[i]
            if location is not None:
                chain.append(location)
        out[start] = tuple(chain)
    return out


def _fold(function: str) -> str:
    """A closure is named by the function that defines it: ``f.<locals>.g`` -> ``f``."""
    return function.split(".<locals>.")[0]


def _primitive(op_name: str) -> str:
    """The primitive at the end of a name stack; a ``dot_general`` by its einsum spec."""
    last = [t for t in re.split(r"[/():]", op_name) if t]
    if not last:
        return ""
    spec = _EINSUM.findall(op_name)
    return spec[-1] if last[-1] == "dot_general" and spec else last[-1]


def _module(frames: tuple[Frame, ...], i: int, modules: ModulePaths) -> str | None:
    """Frame ``i`` as a module path (``blocks/attn``, ``embed.attend``) if it is a method of one
    of the model's modules. A class used at several paths is told apart by the module methods
    enclosing the frame, which must agree with the path's ancestors as far as both go."""
    cls, _, method = frames[i].function.partition(".")
    if cls not in modules or not method or "." in method:
        return None
    if i + 1 < len(frames) and frames[i + 1].function == f"{cls}.__call__":
        method = "__call__"  # a helper of the module's own call (Attention.project_out) is it
    enclosing: list[str] = []
    for f in frames[i + 1:]:
        c = f.function.partition(".")[0]
        if c in modules and (not enclosing or enclosing[-1] != c):
            enclosing.append(c)
    paths = modules[cls]
    matched = [p for p, up in paths
               if up[:len(enclosing)] == tuple(enclosing[:len(up)])] or [p for p, _ in paths]
    path = "|".join(matched) or cls
    return path if method == "__call__" else f"{path}.{method}"


def source(part: Part, modules: ModulePaths | None = None,
           outputs: list[str] | None = None) -> str:
    """Where a collective operand comes from, as ``WHERE: WHAT`` (one of them when they agree or
    the other is unknown), with `` (backward)`` when its name stack shows a transpose: it runs in
    the backward pass (a transposed op, or a forward op recomputed there).

    WHERE is the innermost frame of jaxtp outside the operator plumbing (``collectives.py``,
    ``execution.py``, ``sharding.py``, ``weight_grad.py``) and module-private helpers
    (``_name``): a method of a model module, by its attribute path (``blocks/attn``,
    ``embed.attend`` for a method other than ``__call__``), or a function, closures folded into
    the function defining them (``sync_grads``, ``Trainer.step_fn``).
    WHAT is the innermost operator of ``collectives.py`` (``reduce_from_model``,
    ``copy_to_model``, ``gather_shard``); else the library function called below WHERE: the
    innermost closure there (optax's ``clip_by_global_norm``), or the outermost library frame
    (``tree_norm``); else, for a collective XLA's partitioner inserted (GSPMD mode), the
    primitive it partitions, a dot by its einsum spec (``bsnh,nhd->bsd``). An operand whose
    origin XLA dropped (``lost``) is named by the step output it is, from ``outputs`` (the
    step's flat output names), if it is one.
    """
    if part.lost:
        if outputs and part.output is not None and part.output < len(outputs):
            return f"(fused) output: {outputs[part.output]}"
        return "(fused, origin lost)"
    modules = modules or {}
    frames = part.frames
    ours = [i for i, f in enumerate(frames) if f.file.startswith(_PACKAGE)]
    w = next((i for i in ours if frames[i].file not in _PLUMBING
              and not frames[i].function.startswith("_")), len(frames))
    where = ""
    if w < len(frames):
        where = _module(frames, w, modules) or _fold(frames[w].function)
    what = next((frames[i].function for i in ours if frames[i].file == _OPERATORS), "")
    if not what:
        library = [f.function for f in frames[:w] if not f.file.startswith(_PACKAGE)]
        closures = [f for f in library if ".<locals>." in f]
        what = _fold(closures[0] if closures else library[-1]) if library else \
            _primitive(part.op_name)
    text = where if what in ("", where) else f"{where}: {what}" if where else what
    return (text or "(unknown)") + (" (backward)" if "transpose(" in part.op_name else "")
