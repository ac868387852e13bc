"""The placement report: per-device bytes, the collective census and FLOPs, from compiled HLO.

The step is compiled ahead of time from abstract inputs (ShapeDtypeStructs carrying shardings), so
a mesh far larger than the machine can be inspected on simulated CPU devices without allocating a
single parameter. Every number comes from the executable XLA built: ``memory_analysis`` for bytes,
the optimized HLO text for the census and the matmul FLOPs (:mod:`jaxtp.hlo`; XLA's own
``cost_analysis`` counts a loop body once, so it cannot be used for a scanned model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax

from jaxtp import hlo
from jaxtp.engine import Engine
from jaxtp.mesh import mesh_shape


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

    def to_json(self) -> dict:
        return {"mesh": self.mesh, "per_device_bytes": self.per_device_bytes,
                "collectives": self.collectives, "flops_per_step": self.flops_per_step,
                "flops_per_device": self.flops_per_device,
                "analytic_flops_per_step": self.analytic_flops_per_step}


def local_bytes(engine: Engine, shardings) -> int:
    """Bytes one device holds of a parameter-shaped state in ``shardings`` (largest shard of
    each tensor)."""
    total = 0
    for v, s in zip(jax.tree.leaves(engine.abstract_params), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(v.shape)) * v.dtype.itemsize
    return total


def local_param_bytes(engine: Engine) -> int:
    """Bytes of parameters one device holds, from the shardings."""
    return local_bytes(engine, engine.param_shardings)


def analytic_flops(engine: Engine) -> float:
    """Training FLOPs per step: 6 N T for the matmuls plus 12 L s d T for attention scores.

    N counts the non-embedding parameters plus the output head (Kaplan et al. 2020; the attention
    term is Narayanan et al. 2021 eq. 3 without the causal halving), T the tokens per step.
    """
    m, t = engine.cfg.model, engine.cfg.train
    tokens = t.batch_size * t.seq_len
    # The input lookup is no matmul; the output projection is one, tied or not.
    n = m.param_count() - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return 6.0 * n * tokens + 12.0 * m.n_layers * t.seq_len * m.n_heads * m.resolved_head_dim \
        * tokens


def compile_step(engine: Engine, step: str = "grad"):
    """Compile ``loss`` (forward only) or ``grad`` (loss and gradients) from abstract inputs."""
    params, batch = engine.abstract_inputs()
    fn = engine.loss_and_grad() if step == "grad" else engine.loss()
    return fn.lower(params, batch).compile()


def report(engine: Engine, step: str = "grad") -> Report:
    compiled = compile_step(engine, step)
    text = compiled.as_text()
    shape = mesh_shape(engine.mesh)
    ops = hlo.collectives(text, shape)
    mem = compiled.memory_analysis()
    params = local_param_bytes(engine)
    per_device = {
        "params": params,
        "grads": local_bytes(engine, engine.grad_shardings) if step == "grad" else 0,
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
    }
    per_device["peak"] = (per_device["arguments"] + per_device["outputs"]
                          + per_device["temporaries"] - per_device["aliased"])
    # Matmul FLOPs counted from the HLO with loop trip counts (XLA's cost_analysis counts a while
    # body once, so it undercounts a scanned model by about the number of layers).
    flops_device = hlo.dot_flops(text)
    n_dev = math.prod(shape.values())
    analytic = analytic_flops(engine) / (3.0 if step == "loss" else 1.0)
    return Report(mesh=shape, per_device_bytes=per_device, collectives=hlo.census(ops),
                  flops_per_step=flops_device * n_dev, flops_per_device=flops_device,
                  analytic_flops_per_step=analytic, ops=ops, hlo_text=text)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_report(r: Report, title: str = "") -> str:
    mesh = " x ".join(f"{a}={s}" for a, s in r.mesh.items() if s > 1) or "1 device"
    lines = [f"jaxtp placement report{(' — ' + title) if title else ''}",
             f"mesh: {mesh}  ({math.prod(r.mesh.values())} devices; axes "
             + ", ".join(f"{a}={s}" for a, s in r.mesh.items()) + ")", "",
             "per-device bytes"]
    for k, v in r.per_device_bytes.items():
        lines.append(f"  {k:<12} {_human(v):>12}")
    lines += ["", "collective census (per step, per device; loop trip counts included)",
              f"  {'kind':<20} {'axes':<16} {'count':>7} {'tensors':>8} {'bytes':>14}"]
    for c in r.collectives:
        axes = ",".join(c["axes"]) or "-"
        lines.append(f"  {c['kind']:<20} {axes:<16} {c['count']:>7} {c['tensors']:>8} "
                     f"{_human(c['bytes']):>14}")
    if not r.collectives:
        lines.append("  (none)")
    lines += ["", f"FLOPs per step: {r.flops_per_step:.4g} compiled "
              f"({r.flops_per_device:.4g} per device); {r.analytic_flops_per_step:.4g} analytic "
              f"(6NT + attention, unpadded vocab)"]
    return "\n".join(lines)

