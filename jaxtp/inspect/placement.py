"""The placement report: per-device bytes, the collective census and FLOPs, from compiled HLO.

The step is compiled ahead of time from abstract inputs (ShapeDtypeStructs carrying shardings), so
a mesh far larger than the machine can be inspected on simulated CPU devices without allocating a
single parameter. Every number comes from the executable XLA built: ``memory_analysis`` for bytes,
the optimized HLO text for the census and the matmul FLOPs (:mod:`jaxtp.inspect.hlo`; XLA's own
``cost_analysis`` counts a loop body once, so it cannot be used for a scanned model). Three steps
can be compiled: ``loss`` (forward), ``grad`` (loss and gradients) and ``train`` (the whole
:class:`jaxtp.train.trainer.Trainer` step, optimizer update included, state donated).

Each collective is attributed to the code that caused it (:func:`jaxtp.inspect.hlo.source`, from the
tracebacks XLA keeps in the HLO: ``blocks/attn: reduce_from_model``, ``sync_grads``) and to the
link it crosses: DCN (between hosts) when one of its mesh axes spans hosts, else ICI (NVLink /
the TPU interconnect inside a host or slice).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import jax
from flax import nnx

from jaxtp.configs import Config, ParallelConfig
from jaxtp.inspect import hlo
from jaxtp.parallel import dcn_degrees, mesh_shape
from jaxtp.step import Engine, branch_weights, build_engine, forward_branch_weights
from jaxtp.train import Trainer, model_flops

STEPS = ("grad", "loss", "train")


@dataclass(frozen=True)
class Report:
    mesh: dict[str, int]
    per_device_bytes: dict[str, int]
    collectives: list[dict]
    flops_per_step: float
    flops_per_device: float
    analytic_flops_per_step: float
    ops: list[hlo.CollectiveOp]
    hlo_text: str
    param_table: tuple[dict, ...] = ()
    collectives_by_source: list[dict] = field(default_factory=list)
    hosts_per_axis: dict[str, int] = field(default_factory=dict)  # the DCN degree of each axis
    step: str = "grad"

    def to_json(self) -> dict:
        return {"step": self.step, "mesh": self.mesh, "hosts_per_axis": self.hosts_per_axis,
                "per_device_bytes": self.per_device_bytes,
                "collectives": self.collectives,
                "collectives_by_source": self.collectives_by_source,
                "flops_per_step": self.flops_per_step,
                "flops_per_device": self.flops_per_device,
                "param_table": list(self.param_table),
                "analytic_flops_per_step": self.analytic_flops_per_step}


def local_bytes(engine: Engine, shardings) -> int:
    """Bytes one device holds of a parameter-shaped state in ``shardings`` (largest shard of
    each tensor)."""
    total = 0
    for v, s in zip(jax.tree.leaves(engine.layout.abstract_params), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(v.shape)) * v.dtype.itemsize
    return total


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def local_param_bytes(engine: Engine) -> int:
    """Bytes of parameters one device holds, from the shardings."""
    return local_bytes(engine, engine.layout.param_shardings)


FLAG_FRACTION = 0.01  # a tensor wasting more than this share of a device's parameter bytes


def _path(keys) -> str:
    parts = (str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keys)
    return ".".join(x for x in parts if x not in ("", "value"))


def param_table(engine: Engine, specs=None) -> list[dict]:
    """Per parameter: its sharding, the bytes one device holds and the ideal (its total bytes over
    the devices that hold parameter shards at all: the mesh axes some parameter is split over),
    sorted by waste (held - ideal). ``flagged`` marks a tensor whose waste exceeds
    ``FLAG_FRACTION`` of the device's parameter bytes: replicated where it could be split.
    ``specs`` (default: the engine's parameter specs) lets a caller check another layout."""
    specs = engine.layout.param_specs if specs is None else specs
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(engine.layout.abstract_params)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    shape = mesh_shape(engine.layout.mesh)
    split_axes = {a for sp in spec_leaves for entry in sp if entry is not None
                  for a in ((entry,) if isinstance(entry, str) else entry)}
    split_devices = math.prod(shape[a] for a in split_axes)
    rows = []
    for (keys, a), spec in zip(leaves, spec_leaves):
        sharding = jax.sharding.NamedSharding(engine.layout.mesh, spec)
        held = math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize
        total = math.prod(a.shape) * a.dtype.itemsize
        rows.append({"param": _path(keys), "shape": list(a.shape), "spec": str(spec),
                     "bytes": held, "ideal_bytes": total / split_devices,
                     "waste_bytes": held - total / split_devices})
    device_bytes = sum(r["bytes"] for r in rows)
    for r in rows:
        r["flagged"] = r["waste_bytes"] > FLAG_FRACTION * device_bytes
    return sorted(rows, key=lambda r: -r["waste_bytes"])


def analytic_flops(engine: Engine) -> float:
    """Training FLOPs per step of the engine's model and batch (:func:`jaxtp.train.flops.model_flops`)."""
    t = engine.layout.cfg.train
    return model_flops(engine.layout.cfg.model, batch_size=t.batch_size, seq_len=t.seq_len)


def hosts_per_axis(parallel: ParallelConfig, degrees: dict[str, int],
                   n_processes: int = 1) -> dict[str, int]:
    """How many hosts each mesh axis spans: :func:`jaxtp.parallel.mesh.dcn_degrees` of a multi-process
    run; on one process the config's ``parallel.dcn_*`` (the hosts are simulated), so a one-machine
    inspect of a multi-host layout shows which collectives would cross DCN."""
    if n_processes == 1:
        n_processes = parallel.dcn_pipeline * parallel.dcn_data * parallel.dcn_fsdp
    return dcn_degrees(parallel, degrees, n_processes)


def link(axes, hosts: dict[str, int]) -> str:
    """``DCN`` if one of ``axes`` spans hosts, else ``ICI``: the slowest link the collective
    crosses (a ring over an axis of 8 spanning 2 hosts still has 2 of its hops on DCN)."""
    return "DCN" if any(hosts.get(a, 1) > 1 for a in axes) else "ICI"


def module_paths(engine: Engine) -> hlo.ModulePaths:
    """Each Flax module class of the model -> its attribute paths and their ancestors' classes
    (nearest first), the map :func:`jaxtp.inspect.hlo.source` names modules by."""
    model = nnx.merge(engine.layout.graphdef, engine.layout.abstract_params)
    classes = {path: type(node).__name__ for path, node in nnx.iter_graph(model)
               if isinstance(node, nnx.Module)}
    out: hlo.ModulePaths = defaultdict(list)
    for path, cls in sorted(classes.items()):
        up = tuple(classes[path[:i]] for i in range(len(path) - 1, -1, -1) if path[:i] in classes)
        out[cls].append(("/".join(map(str, path)), up))
    return dict(out)


def _lower_train(target: Engine | Config):
    """The :class:`jaxtp.train.trainer.Trainer` step lowered from abstract state and batch, with the
    trainer and the abstract state."""
    if isinstance(target, Engine):
        trainer = Trainer(target.layout.cfg, list(target.layout.mesh.devices.flat))
    else:
        trainer = Trainer(target)
    state = trainer.abstract_state()
    batch = trainer.engine.abstract_inputs()[1]
    return trainer, state, trainer.step_fn(state).lower(state, batch)


def _check_step(step: str) -> None:
    if step not in STEPS:
        raise ValueError(f"step={step!r}: choose one of {', '.join(STEPS)}")


def compile_step(engine: Engine, step: str = "grad"):
    """Compile ``loss`` (forward only), ``grad`` (loss and gradients) or ``train`` (the train
    step, optimizer included) from abstract inputs."""
    _check_step(step)
    if step == "train":
        return _lower_train(engine)[2].compile()
    params, batch = engine.abstract_inputs()
    fn = engine.loss_and_grad() if step == "grad" else engine.loss()
    return fn.lower(params, batch).compile()


def report(target: Engine | Config, step: str = "grad") -> Report:
    """The placement report of ``step`` (``grad``, ``loss`` or ``train``) for an engine, or for a
    config on the current devices."""
    _check_step(step)
    optimizer = None
    if step == "train":
        trainer, state, lowered = _lower_train(target)
        engine, compiled = trainer.engine, lowered.compile()
        optimizer = shard_bytes(state.opt_state)
    else:
        engine = target if isinstance(target, Engine) else build_engine(target)
        compiled = compile_step(engine, step)
    text = compiled.as_text()
    shape = mesh_shape(engine.layout.mesh)
    # a pipeline rank runs one pass per tick: count its stages' collectives as it runs them
    # (the view of pipeline rank 0)
    branches = None
    if shape["pipeline"] > 1:
        branches = (forward_branch_weights(engine.layout) if step == "loss"
                    else branch_weights(engine.layout))
    ops = hlo.collectives(text, shape, branches)
    mem = compiled.memory_analysis()
    params = local_param_bytes(engine)
    per_device = {"params": params}
    if optimizer is not None:
        per_device["optimizer"] = optimizer
    per_device |= {
        "grads": local_bytes(engine, engine.layout.grad_shardings) if step != "loss" else 0,
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
    }
    per_device["peak"] = (per_device["arguments"] + per_device["outputs"]
                          + per_device["temporaries"] - per_device["aliased"])
    # Matmul FLOPs counted from the HLO with loop trip counts (XLA's cost_analysis counts a while
    # body once, so it undercounts a scanned model by about the number of layers).
    flops_device = hlo.dot_flops(text, branches)
    n_dev = math.prod(shape.values())
    analytic = analytic_flops(engine) / (3.0 if step == "loss" else 1.0)
    hosts = hosts_per_axis(engine.layout.cfg.parallel, shape, jax.process_count())
    census = hlo.census(ops)
    # the grad step's flat outputs: what a fused collective whose origins XLA dropped produces
    outputs = ["loss"] + ["gradients"] * len(jax.tree.leaves(engine.layout.abstract_params)) \
        if step == "grad" else None
    by_source = hlo.census_by_source(ops, module_paths(engine), outputs)
    for row in census + by_source:
        row["link"] = link(row["axes"], hosts)
    return Report(mesh=shape, per_device_bytes=per_device, collectives=census,
                  flops_per_step=flops_device * n_dev, flops_per_device=flops_device,
                  analytic_flops_per_step=analytic, ops=ops, hlo_text=text,
                  param_table=tuple(param_table(engine)), collectives_by_source=by_source,
                  hosts_per_axis=hosts, step=step)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


SOURCE_ROWS = 16  # rows of the by-source table in the text report


def format_report(r: Report, title: str = "") -> str:
    mesh = " x ".join(f"{a}={s}" for a, s in r.mesh.items() if s > 1) or "1 device"
    lines = [f"jaxtp placement report{(' — ' + title) if title else ''}",
             f"mesh: {mesh}  ({math.prod(r.mesh.values())} devices; axes "
             + ", ".join(f"{a}={s}" for a, s in r.mesh.items()) + ")"]
    dcn = [f"{a}={h}" for a, h in r.hosts_per_axis.items() if h > 1]
    if dcn:
        lines.append(f"across hosts (DCN): {' x '.join(dcn)}; the rest of each axis inside a host")
    lines += ["", "per-device bytes"]
    for k, v in r.per_device_bytes.items():
        lines.append(f"  {k:<12} {_human(v):>12}")
    header = (f"  {'kind':<20} {'axes':<16} {'link':<5} {'count':>7} {'tensors':>8} "
              f"{'bytes':>14}")
    lines += ["", "collective census (per step, per device; loop trip counts included)", header]
    for c in r.collectives:
        axes = ",".join(c["axes"]) or "-"
        lines.append(f"  {c['kind']:<20} {axes:<16} {c['link']:<5} {c['count']:>7} "
                     f"{c['tensors']:>8} {_human(c['bytes']):>14}")
    if not r.collectives:
        lines.append("  (none)")
    shown = r.collectives_by_source[:SOURCE_ROWS]
    if shown:
        width = max(len(c["source"]) for c in shown)
        axes_width = max(4, *(len(",".join(c["axes"])) for c in shown))
        header = (f"  {'source':<{width}} {'kind':<18} {'axes':<{axes_width}} {'link':<5} "
                  f"{'count':>6} {'bytes':>12}")
        lines += ["", "collectives by source (largest first; WHERE: WHAT, see jaxtp.inspect.hlo.source)",
                  header]
        for c in shown:
            axes = ",".join(c["axes"]) or "-"
            lines.append(f"  {c['source']:<{width}} {c['kind']:<18} {axes:<{axes_width}} "
                         f"{c['link']:<5} {c['count']:>6} {_human(c['bytes']):>12}")
        if len(r.collectives_by_source) > SOURCE_ROWS:
            lines.append(f"  ... {len(r.collectives_by_source) - SOURCE_ROWS} more "
                         f"(--json has all)")
    if r.param_table:
        lines += ["", "parameters by waste (held per device - total / devices holding shards)",
                  f"  {'param':<28} {'spec':<36} {'held':>11} {'ideal':>11}"]
        for row in r.param_table[:8]:
            flag = "  <- replicated, could be split" if row["flagged"] else ""
            lines.append(f"  {row['param']:<28} {row['spec']:<36} {_human(row['bytes']):>11} "
                         f"{_human(row['ideal_bytes']):>11}{flag}")
        if len(r.param_table) > 8:
            lines.append(f"  ... {len(r.param_table) - 8} more (--json has all)")
    lines += ["", f"FLOPs per step: {r.flops_per_step:.4g} compiled "
              f"({r.flops_per_device:.4g} per device); {r.analytic_flops_per_step:.4g} analytic "
              f"(6NT + attention, unpadded vocab)"]
    return "\n".join(lines)

