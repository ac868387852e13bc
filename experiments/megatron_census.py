"""Megatron-LM's communication claim, measured from compiled HLO (Shoeybi et al. 2019, sec. 3).

The paper: a tensor-parallel Transformer layer needs exactly four communication operations per
micro-batch, two all-reduces in the forward pass (``g`` after attention's row-parallel output
projection and after the MLP's down projection) and two in the backward pass (``f``'s transpose
before the two column-parallel input projections), each of ``b x s x h`` elements; and the
vocab-parallel cross-entropy exchanges ``O(b x s)`` values (max, sum of exponentials, target
logit), never the ``b x s x v`` logits.

Reproduction: the ``tiny`` preset (h=64, s=64, global batch b=8, SwiGLU, untied, fp32) with
``model.vocab_size=2048`` so that the per-device logits ``b_local x s x v/t`` are clearly larger
than any activation, on 8 simulated CPU devices as ``data = 8/t`` x ``model = t`` for
t in {1, 2, 4, 8}, in both execution modes (GSPMD and explicit ``shard_map``). Each step is compiled
ahead of time and the census is read from the optimized HLO (``jaxtp.inspect.placement.report``). Measured:

- per-layer collectives over ``model``: the census of an ``n_layers=3`` step minus that of an
  ``n_layers=2`` step, for the forward-only loss and for loss+grad. Expected: 2 and 4 all-reduces,
  each of ``b_local*s*h*4`` bytes (0 for t=1), and no other collective over ``model``;
- the non-layer forward traffic over ``model`` (embedding ``g`` + the loss), extrapolated to zero
  layers as ``bytes(L=2) - 2 x per-layer``. Expected: one ``b_local*s*h`` all-reduce for the
  vocab-parallel embedding and three ``b_local*s`` ones for the cross-entropy,
  ``(b*s*h + 3*b*s)*4``;
- the largest single tensor moved over ``model`` in the whole training step, against the per-device
  logits ``b_local*s*(v/t)*4`` (expected: an activation, ``b_local*s*h*4``, far below the logits);
- per-device parameter bytes (from the shardings) against ``4 * (P_tp / t + P_rep)``, with
  ``P_tp = 2*V*h + L*(h*hd*(2*n_heads + 2*n_kv) + 3*h*f)`` (embedding, output head, QKV, output
  projection, gate/up and down: split over ``model``) and ``P_rep = (2L + 1)*h`` (RMSNorm scales:
  replicated). ``V`` is the padded vocab (2048 is already a multiple of 128*t).

Exits non-zero if any measured value differs from its expected value.
Usage: ``python experiments/megatron_census.py [--out DIR] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402

from jaxtp.configs import schema as config  # noqa: E402
from jaxtp.step import engine  # noqa: E402
from jaxtp.inspect import placement as inspect  # noqa: E402

N_DEVICES, BYTES = 8, 4  # fp32 activations and parameters
OVERRIDES = ["model.vocab_size=2048"]
MODES = ("gspmd", "explicit")


def model_collectives(ops) -> Counter:
    """(kind, bytes per tensor) -> executions per step, for every collective over ``model``."""
    out: Counter = Counter()
    for op in ops:
        if op.axes == ("model",):
            out[(op.kind, op.bytes // op.tensors)] += op.executions * op.tensors
    return out


def measure(tp: int, mode: str) -> dict:
    def cfg(n_layers):
        return config.load("tiny", [*OVERRIDES, f"parallel.mode={mode}",
                                    f"parallel.data={N_DEVICES // tp}", f"parallel.model={tp}",
                                    f"model.n_layers={n_layers}"])

    reports = {(n, step): inspect.report(engine.build_engine(cfg(n)), step=step)
               for n in (2, 3) for step in ("loss", "grad")}
    census = {k: model_collectives(r.ops) for k, r in reports.items()}
    layer = {step: census[3, step] - census[2, step] for step in ("loss", "grad")}
    if any(census[2, s] - census[3, s] for s in ("loss", "grad")):
        raise RuntimeError(f"TP={tp} {mode}: a collective disappeared when adding a layer")
    c = cfg(3)
    m, t = c.model, c.train
    eng = engine.build_engine(c)
    b_local = t.batch_size // (N_DEVICES // tp)
    bsh = b_local * t.seq_len * m.d_model * BYTES if tp > 1 else 0
    hd, vp = m.resolved_head_dim, eng.layout.padded_vocab
    p_tp = 2 * vp * m.d_model + m.n_layers * (
        m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff)
    p_rep = (2 * m.n_layers + 1) * m.d_model

    def total(cnt):
        return sum(cnt.values()), sum(b * n for (_, b), n in cnt.items())

    fwd_n, fwd_b = total(layer["loss"])
    all_n, all_b = total(layer["grad"])
    non_layer = total(census[2, "loss"])[1] - 2 * fwd_b
    largest = max((b for (_, b) in census[3, "grad"]), default=0)
    expected_layer = Counter({("all-reduce", bsh): 4}) if tp > 1 else Counter()
    return {
        "tp": tp, "data": N_DEVICES // tp, "mode": mode,
        "fwd_n": fwd_n, "fwd_n_exp": 2 if tp > 1 else 0,
        "all_n": all_n, "all_n_exp": 4 if tp > 1 else 0,
        "layer_b": all_b, "layer_b_exp": 4 * bsh,
        "only_all_reduces": layer["grad"] == expected_layer,
        "largest": largest, "largest_exp": bsh,
        "logits": b_local * t.seq_len * (vp // tp) * BYTES,
        "non_layer": non_layer,
        "non_layer_exp": (bsh + 3 * b_local * t.seq_len * BYTES) if tp > 1 else 0,
        "params": reports[3, "grad"].per_device_bytes["params"],
        "params_exp": BYTES * (p_tp // tp + p_rep),
    }


CHECKS = [("fwd_n", "fwd_n_exp"), ("all_n", "all_n_exp"), ("layer_b", "layer_b_exp"),
          ("largest", "largest_exp"), ("non_layer", "non_layer_exp"), ("params", "params_exp")]


def failures(row: dict) -> list[str]:
    bad = [f"{k}={row[k]} != {row[e]}" for k, e in CHECKS if row[k] != row[e]]
    if not row["only_all_reduces"]:
        bad.append("per-layer collectives over `model` are not exactly 4 b*s*h all-reduces")
    if row["largest"] >= row["logits"]:
        bad.append(f"largest collective {row['largest']} >= logits {row['logits']}")
    return bad


def ratio(measured: int, expected: int) -> str:
    if expected == 0:
        return "—" if measured == 0 else "inf"
    return f"{measured / expected:.3f}"


def table(rows: list[dict]) -> str:
    head = ["TP", "data", "mode", "AR/layer fwd", "AR/layer fwd+bwd", "bytes/layer",
            "expected", "ratio", "largest `model` coll.", "logits/device", "largest ÷ logits",
            "embed+loss fwd bytes", "expected", "ratio", "params/device", "expected", "ratio",
            "ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["tp"], r["data"], r["mode"], f"{r['fwd_n']} / {r['fwd_n_exp']}",
                 f"{r['all_n']} / {r['all_n_exp']}", r["layer_b"], r["layer_b_exp"],
                 ratio(r["layer_b"], r["layer_b_exp"]), r["largest"], r["logits"],
                 f"{r['largest'] / r['logits']:.3f}", r["non_layer"], r["non_layer_exp"],
                 ratio(r["non_layer"], r["non_layer_exp"]), r["params"], r["params_exp"],
                 ratio(r["params"], r["params_exp"]), "yes" if not failures(r) else "**NO**"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({r["tp"] for r in rows})
    by = {(r["tp"], r["mode"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("all-reduces over `model` per layer", "count",
         [("fwd", "fwd_n", "fwd_n_exp"), ("fwd+bwd", "all_n", "all_n_exp")]),
        ("bytes over `model` per device", "KiB",
         [("per layer, fwd+bwd", "layer_b", "layer_b_exp"),
          ("largest tensor", "largest", "largest_exp"),
          ("embed+loss fwd", "non_layer", "non_layer_exp")]),
        ("parameter bytes per device", "KiB", [("params", "params", "params_exp")]),
    ]
    for ax, (title, unit, series) in zip(axes, panels):
        scale = 1024 if unit == "KiB" else 1
        for i, (label, key, exp) in enumerate(series):
            color = f"C{i}"
            ax.plot(tps, [by[t, MODES[0]][exp] / scale for t in tps], "-", color=color,
                    label=f"{label} (formula)")
            for mode, marker in zip(MODES, "ox"):
                ax.plot(tps, [by[t, mode][key] / scale for t in tps], marker, color=color,
                        ms=9 if marker == "o" else 7, mfc="none",
                        label=f"measured, {mode}" if i == 0 else None)
        if title.startswith("bytes"):
            ax.plot(tps, [by[t, MODES[0]]["logits"] / scale for t in tps], "--", color="k",
                    label="logits b·s·v/t (never moved)")
            ax.set_ylim(top=ax.get_ylim()[1] * 1.9)  # room for the legend
        ax.set_xscale("log", base=2)
        ax.set(title=title, xlabel="tensor-parallel degree t (data = 8/t)", ylabel=unit,
               xticks=tps, xticklabels=[str(t) for t in tps])
        ax.minorticks_off()
        ax.legend(fontsize=7, loc="upper left" if title.startswith("bytes") else "best")
    fig.suptitle("Megatron-LM census, tiny preset (h=64, s=64, b=8, v=2048), 8 CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/results", help="output directory")
    p.add_argument("--quick", action="store_true", help="only TP = 4 (for CI)")
    args = p.parse_args(argv)
    if jax.device_count() != N_DEVICES:
        print(f"need {N_DEVICES} devices, have {jax.device_count()}; unset XLA_FLAGS' "
              f"{_FLAG} or set it to 8", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = [measure(tp, mode) for tp in ((4,) if args.quick else (1, 2, 4, 8))
            for mode in MODES]
    text = table(rows)
    bad = [f"TP={r['tp']} {r['mode']}: {msg}" for r in rows for msg in failures(r)]
    elapsed = time.perf_counter() - start
    summary = (f"{len(rows)} configurations, {4 * len(rows)} compiled steps, {elapsed:.0f} s; "
               + ("all measured values equal the formula." if not bad
                  else f"{len(bad)} mismatch(es) with the formula."))
    print(text + "\n\n" + summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "megatron_census.md").write_text(
        "# Megatron-LM communication census (Shoeybi et al. 2019)\n\n"
        "Per-device bytes, fp32; `AR` = all-reduce over the `model` axis, measured / expected; "
        "per-layer values are the difference of 3- and 2-layer compiled steps; "
        "`—` = both zero.\n\n" + text + "\n\n" + summary + "\n")
    plot(rows, out / "megatron_census.png")
    for line in bad:
        print("MISMATCH", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
