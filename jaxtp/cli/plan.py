"""``jaxtp plan``: the command line over :mod:`jaxtp.planner.search`, and the planner's report.

Its ``key=value`` overrides are split three ways (:func:`split_overrides`): ``parallel.<Candidate
field>`` and ``train.microbatches`` pin that choice in every layout, ``hardware.*`` change the
hardware preset, the rest change the config. The ranked layouts print as a table
(:func:`format_plan`: memory, step time, MFU, exposed communication, and "runs here": whether
this version of jaxtp trains the layout, :attr:`Estimate.supported` being ``""``) or as a JSON list, and ``--verify K``'s predicted-beside-compiled rows as a second table
(:func:`format_verify`) or under each JSON row's ``verify`` key.
"""

from __future__ import annotations

import dataclasses

from jaxtp.configs import AXES, ConfigError
from jaxtp.inspect import verify
from jaxtp.planner import Candidate, Estimate, SearchSpace, Shape, plan


def _gib(x: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size / 4:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _layout_text(lo: Candidate) -> str:
    parts = [f"{a}={getattr(lo, a)}" for a in AXES if getattr(lo, a) > 1] or ["1 device"]
    if lo.pipeline > 1:
        parts.append(lo.pipeline_schedule + (f"(v={lo.virtual_stages})"
                                             if lo.virtual_stages > 1 else ""))
    if lo.sequence_parallel:
        parts.append("SP")
    return " ".join(parts)


def format_plan(estimates: list[Estimate], *, title: str, stats: dict) -> str:
    lines = [title, f"{stats['costed']} layouts costed, {stats['fit']} fit; fastest first "
             f"(memory per device; time per step; MFU = model FLOPs / peak; exposed = "
             f"communication on the critical path / step)",
             ("runs here: yes = this version of jaxtp trains the layout; no = costed for "
              "comparison only (--json says why; --runnable lists only those that run)"), "",
             f"  {'#':>2} {'layout':<58} {'m':>4} {'zero':>4} {'remat':<9} {'memory':>11} "
             f"{'step s':>9} {'MFU':>6} {'exposed':>7}  runs here"]
    for i, est in enumerate(estimates, 1):
        lo = est.layout
        lines.append(f"  {i:>2} {_layout_text(lo):<58} {lo.microbatches:>4} {lo.zero_stage:>4} "
                     f"{lo.remat:<9} {_gib(est.memory_bytes):>11} {est.step_time_s:>9.4g} "
                     f"{est.mfu:>6.1%} {est.exposed_comm_fraction:>7.1%}  "
                     f"{'yes' if not est.supported else 'no'}")
    if not estimates:
        lines.append("  (no layout fits: more devices, more memory, or a smaller batch)")
    elif all(est.supported for est in estimates):
        lines.append("  (none of these runs in this version: add --runnable for the fastest "
                     "that do)")
    return "\n".join(lines)


def format_verify(rows: list[dict]) -> str:
    lines = ["", "predicted vs compiled: the loss-and-gradient step per device (no optimizer "
             "state in it)"]
    for row in rows:
        lines.append(f"  #{row['rank']} {_layout_text(row['layout'])}, "
                     f"zero {row['layout'].zero_stage}, remat {row['layout'].remat}, "
                     f"m={row['layout'].microbatches}")
        if "not_compilable" in row:
            lines.append(f"     not compilable in this version: {row['not_compilable']}")
            continue
        pred, comp = row["predicted"], row["compiled"]
        for key in ("arguments", "outputs", "temporaries"):
            lines.append(f"     {key:<31} predicted {_gib(pred[key]):>11}   compiled "
                         f"{_gib(comp[key]):>11}   ratio {pred[key] / max(comp[key], 1):.2f}")
        keys = sorted(set(pred["collectives"]) | set(comp["collectives"]))
        for kind, axes in keys:
            p = pred["collectives"].get((kind, axes), 0)
            c = comp["collectives"].get((kind, axes), 0)
            lines.append(f"     {kind:<18} {','.join(axes) or '-':<12} predicted {_gib(p):>11}"
                         f"   compiled {_gib(c):>11}")
    return "\n".join(lines)


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str], tuple]:
    """(config overrides, ``hardware.*`` overrides, pins): ``parallel.<Candidate field>=V`` and
    ``train.microbatches=V`` pin that field of every layout (a degree of -1 pins nothing)."""
    config, hardware, pins = [], [], []
    types = {f.name: type(f.default) for f in dataclasses.fields(Candidate)}
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.strip().lstrip("-")
        if key.startswith("hardware."):
            hardware.append(item)
            continue
        section, _, name = key.partition(".")
        if (section == "parallel" and name in types) or key == "train.microbatches":
            kind, text = types[name], text.strip()
            try:
                value = (text.lower() in ("1", "true", "yes", "on")) if kind is bool else \
                    kind(text)
            except ValueError:
                raise ConfigError(f"{key}={text!r} is not a {kind.__name__}") from None
            if value != -1:
                pins.append((name, value))
        config.append(item)
    return config, hardware, tuple(pins)


def run_cli(*, config_name: str, n_devices: int, hardware: str, hardware_file: str | None,
            overrides: list[str], as_json: bool, verify_k: int, top: int, activations: str,
            runnable: bool = False, use_devices) -> str:
    """``jaxtp plan``: the ranked table (or JSON list) and, with ``verify_k``, the comparison
    with compiled programs on ``n_devices`` simulated devices (``use_devices(n)`` sets them up
    before JAX starts a backend)."""
    import json
    import time

    from jaxtp.configs import load
    from jaxtp.planner import load_hardware

    if n_devices < 1:
        raise ConfigError(f"--world-size {n_devices}: plan for at least one device")
    cfg_over, hw_over, pins = split_overrides(list(overrides))
    cfg = load(config_name, cfg_over)
    hw = load_hardware(hardware, hw_over, hardware_file)
    t0 = time.perf_counter()
    want = None if runnable or not top else max(top, 50 if verify_k else 0)
    estimates, stats = plan(cfg, n_devices, hw, space=SearchSpace(fixed=pins),
                            activations=activations, top=want)
    if runnable:  # only what this version of the engine runs
        estimates = [est for est in estimates if not est.supported]
    seconds = time.perf_counter() - t0
    shown = estimates[:top] if top else estimates
    if as_json:
        rows = [est.to_json() for est in shown]
        if verify_k:
            use_devices(n_devices)
            checked = {row["rank"]: row for row in verify(cfg, estimates, verify_k,
                                                          activations=activations)}
            for rank, row in checked.items():
                if rank <= len(rows):
                    rows[rank - 1]["verify"] = _json_verify(row)
        return json.dumps(rows, indent=1)
    s = Shape.of(cfg)
    title = (f"jaxtp plan: {config_name} ({s.layers} layers, h={s.d_model}, "
             f"{_count(cfg.model.param_count())} params; batch {s.batch} x {s.seq}) on "
             f"{n_devices} x {hw.name} ({hw.devices_per_node} per node, "
             f"{hw.peak_flops / 1e12:.0f} TFLOP/s, {hw.hbm_bytes / 1e9:.0f} GB, intra "
             f"{hw.intra.bandwidth / 1e9:.0f} GB/s, inter {hw.inter.bandwidth / 1e9:.0f} GB/s); "
             f"activations: {activations}; searched in {seconds:.2f} s")
    text = format_plan(shown, title=title, stats=stats)
    if verify_k:
        use_devices(n_devices)
        text += "\n" + format_verify(verify(cfg, estimates, verify_k, activations=activations))
    return text


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _json_verify(row: dict) -> dict:
    if "not_compilable" in row:
        return {"not_compilable": row["not_compilable"]}

    def flat(d):
        return {k: v for k, v in d.items() if k != "collectives"} | {
            "collectives": [{"kind": k, "axes": list(a), "bytes": b}
                            for (k, a), b in d["collectives"].items()]}
    return {"predicted": flat(row["predicted"]), "compiled": flat(row["compiled"])}
