"""Mixture-of-Experts with expert parallelism, measured (GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021).

Three claims, each measured beside its formula:

1. Communication. An expert-parallel MoE layer runs 2 all-to-alls over `expert` forward (dispatch,
   combine) and 2 backward (their transposes), nothing else of its size (DESIGN.md's census
   contract). Each all-to-all carries the device's dispatched slots: for each of its G_local
   groups (batch rows), E experts x C slots x d_model values, so E x C x d_model x dtype bytes
   per group and G_local x that per device. The census reports the op's per-device buffer; of it,
   the 1/ep chunk for the device's own experts stays local, so the link moves (ep-1)/ep of it.
   Measured from compiled HLO, per device, in both execution modes (explicit: `jax.shard_map`
   with `jax.lax.all_to_all`; GSPMD: sharding constraints on the dispatched tensor), for a
   forward compile and a forward+backward compile.
2. Token dropping vs capacity factor. Expert capacity C = ceil(k x S x capacity_factor / E)
   per group (Switch for k = 1, GShard for k = 2). With a random router on random tokens the
   drop rate falls with the factor; beside it the same for uniformly random routing (i.i.d.
   logits), the exact expectation for uniformly random top-1 routing, E[max(0, n - C)] / (S/E)
   with n ~ Binomial(S, 1/E), and the perfectly balanced bound max(0, 1 - capacity_factor).
3. The Switch load-balancing loss alpha x E x sum_i f_i P_i is alpha for uniform routing
   (f_i = P_i = 1/E) and alpha x E when every token goes to one expert with probability ~1.

Exits non-zero if a census count or byte size differs from the formula, if the uniform-random
top-1 drop rate is more than 0.03 from the binomial expectation, or if the aux loss is off.
Usage: ``python experiments/moe.py [--out DIR] [--quick]``
(full: d_model 256, S 128, meshes (expert=8), (data=2, expert=4), (expert=4, model=2), five
capacity factors, E in {4, 8, 16} for the aux loss; --quick: d_model 64, S 64, the
(data=2, expert=4) mesh, three capacity factors, E = 8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxtp.inspect import hlo  # noqa: E402
from jaxtp.parallel.execution import ExplicitOps, GSPMDOps  # noqa: E402
from jaxtp.layers import moe  # noqa: E402
from jaxtp.configs import AXES  # noqa: E402
from jaxtp.parallel.sharding import Rules, param_specs  # noqa: E402

FACTORS = (0.5, 1.0, 1.25, 1.5, 2.0)
ALPHA = 0.01
DROP_TOL = 0.03
PARAM_RULES = Rules((("experts", "expert"), ("mlp", "model")))
GSPMD_RULES = Rules((("batch", ("data", "expert")), ("batch_no_expert", "data"),
                     ("experts", "expert"), ("mlp", "model")))
TOKENS = P(("data", "expert"))


def layer_cfg(d: int, *, top_k: int = 2, capacity_factor: float = 1.25, n_experts: int = 8):
    return types.SimpleNamespace(
        d_model=d, d_ff=2 * d, activation="swiglu", init_std=0.02, n_layers=2,
        param_dtype="float32", compute_dtype="float32", n_experts=n_experts, top_k=top_k,
        capacity_factor=capacity_factor, moe_every=1, router_aux_loss_coef=ALPHA,
        router_z_loss_coef=0.0)


def make_mesh(degrees: dict[str, int]) -> Mesh:
    shape = tuple(degrees.get(a, 1) for a in AXES)
    devices = np.asarray(jax.devices()[:math.prod(shape)]).reshape(shape)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# ---- 1. the census -------------------------------------------------------------------------------

def measure_census(degrees: dict[str, int], mode: str, *, batch: int, seq: int, d: int) -> dict:
    cfg = layer_cfg(d)
    settings = moe.MoESettings.of(cfg)
    graphdef, state = nnx.split(moe.MoE(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, seq, d)), jnp.float32)
    mesh = make_mesh(degrees)

    def apply(ops):
        return lambda s, x: nnx.merge(graphdef, s)(x, ops)

    if mode == "explicit":
        fn = jax.shard_map(apply(ExplicitOps()), mesh=mesh,
                           in_specs=(param_specs(state, PARAM_RULES), TOKENS),
                           out_specs=(TOKENS, P()))
    else:
        fn = apply(GSPMDOps(mesh, GSPMD_RULES))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                 param_specs(state, PARAM_RULES),
                                 is_leaf=lambda z: isinstance(z, P))
        state = jax.device_put(state, shardings)
        x = jax.device_put(x, NamedSharding(mesh, TOKENS))

    def loss(s, x):
        out, aux = fn(s, x)
        return jnp.sum(out) + aux["aux_loss"]

    t0 = time.perf_counter()
    texts = {"forward": jax.jit(fn).lower(state, x).compile().as_text(),
             "forward+backward": jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
             .lower(state, x).compile().as_text()}
    compile_s = time.perf_counter() - t0
    ep = degrees.get("expert", 1)
    token_shards = degrees.get("data", 1) * ep
    c = moe.expert_capacity(seq, settings)
    g_local = batch // token_shards
    expected = settings.n_experts * c * d * 4 * g_local
    row = {"mesh": " x ".join(f"{a}={n}" for a, n in degrees.items()), "mode": mode,
           "ep": ep, "capacity": c, "g_local": g_local, "expected_bytes": expected,
           "wire_bytes": expected * (ep - 1) // ep, "compile_s": compile_s}
    for step, text in texts.items():
        ops = hlo.collectives(text, dict(mesh.shape))
        a2a = [o for o in ops if o.kind == "all-to-all"]
        row[step] = {
            "all_to_all": sum(o.executions for o in a2a),
            "all_to_all_axes": sorted({",".join(o.axes) for o in a2a}),
            "bytes": sorted({o.bytes for o in a2a}),
            "other": [{k: c_[k] for k in ("kind", "axes", "count", "bytes")}
                      for c_ in hlo.census(ops) if c_["kind"] != "all-to-all"],
        }
    return row


# ---- 2. token drops vs capacity factor -----------------------------------------------------------

def binomial_drop(s: int, e: int, c: int) -> float:
    """E[max(0, n - C)] / (S / E) for n ~ Binomial(S, 1/E): uniformly random top-1 routing."""
    p = 1.0 / e
    excess = sum(math.comb(s, n) * p**n * (1 - p)**(s - n) * (n - c) for n in range(c + 1, s + 1))
    return excess / (s / e)


def measure_drops(*, groups: int, seq: int, d: int, n_experts: int = 8,
                  factors=FACTORS) -> list[dict]:
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(groups, seq, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, n_experts)) / math.sqrt(d), jnp.float32)
    router_logits = x @ w                                     # a random linear router
    iid_logits = jnp.asarray(rng.normal(size=(groups, seq, n_experts)), jnp.float32)
    route = jax.jit(moe.route, static_argnums=(1, 2))
    rows = []
    for k in (1, 2):
        for cf in factors:
            settings = moe.MoESettings(n_experts=n_experts, top_k=k, capacity_factor=cf)
            c = moe.expert_capacity(seq, settings)
            row = {"top_k": k, "capacity_factor": cf, "capacity": c,
                   "balanced_bound": max(0.0, 1.0 - cf)}
            for name, logits in (("router", router_logits), ("uniform", iid_logits)):
                row[name] = float(route(logits, settings, c)[2]["dropped_fraction"])
            row["binomial"] = binomial_drop(seq, n_experts, c) if k == 1 else None
            rows.append(row)
    return rows


# ---- 3. the aux loss -----------------------------------------------------------------------------

def _lb_loss(logits, settings, capacity):
    return moe.router_aux(moe.route(logits, settings, capacity)[2], settings)[
        "load_balancing_loss"]


def measure_aux(*, seq: int, experts=(4, 8, 16)) -> list[dict]:
    lb_loss = jax.jit(_lb_loss, static_argnums=(1, 2))
    rows = []
    for e in experts:
        settings = moe.MoESettings(n_experts=e, top_k=1, capacity_factor=1.0,
                                   router_aux_loss_coef=ALPHA)
        c = moe.expert_capacity(seq, settings)
        # token s carries logit 2 on expert s mod E: f_i = 1/E, and P_i = 1/E by symmetry
        uniform = jnp.eye(e)[jnp.arange(seq) % e][None] * 2.0                   # (1, S, E)
        collapsed = jnp.zeros((1, seq, e)).at[..., 0].set(30.0)
        rng = np.random.default_rng(e)
        random = jnp.asarray(rng.normal(size=(1, seq, e)), jnp.float32)
        row = {"n_experts": e, "uniform_formula": ALPHA, "collapsed_formula": ALPHA * e}
        for name, logits in (("uniform", uniform), ("collapsed", collapsed), ("random", random)):
            row[name] = float(lb_loss(logits, settings, c))
        rows.append(row)
    return rows


# ---- report --------------------------------------------------------------------------------------

def to_markdown(census: list[dict], drops: list[dict], aux: list[dict], shapes: dict,
                command: str) -> str:
    out = ["# Mixture-of-Experts with expert parallelism, measured", "",
           f"`{command}`; jax {jax.__version__}, {jax.device_count()} simulated CPU devices; fp32.",
           "", "## All-to-all census per MoE layer (per device, from compiled HLO)", "",
           f"Layer: d_model = {shapes['d']}, d_ff = {2 * shapes['d']}, E = 8 experts, top-2, "
           f"capacity factor 1.25; global batch {shapes['batch']} rows x S = {shapes['seq']} "
           "tokens, one group per row; tokens over (data, expert), experts over `expert`, "
           "d_ff over `model`.", "",
           "| mesh | mode | C | G_local | all-to-all fwd | fwd+bwd | bytes / op (census) "
           "| expected E x C x d x 4 x G_local | on the wire (ep-1)/ep | other collectives "
           "(fwd+bwd) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in census:
        other = "; ".join(f"{o['count']} {o['kind']} over {','.join(o['axes'])} "
                          f"({o['bytes']:,} B)" for o in r["forward+backward"]["other"]) or "-"
        got = ", ".join(f"{b:,}" for b in r["forward+backward"]["bytes"])
        out.append(f"| {r['mesh']} | {r['mode']} | {r['capacity']} | {r['g_local']} | "
                   f"{r['forward']['all_to_all']} | {r['forward+backward']['all_to_all']} | "
                   f"{got} | {r['expected_bytes']:,} | {r['wire_bytes']:,} | {other} |")
    out += ["", "The census counts an op's whole per-device buffer [E, G_local, C, d]; the "
            "device's own experts' 1/ep of it never leaves the device, so the link traffic per "
            "all-to-all is (ep-1)/ep of it. XLA lowers the tiled all-to-all as one op with ep "
            "operands (one per peer). The small all-reduces are the router statistics (f, P, "
            "the z-loss term, drop rate, load: a few hundred bytes), the router's gradient, and "
            "the expert weights' gradients over `data` (replicated there). With experts also "
            "tensor-parallel over `model`, the explicit path puts Megatron's f / g at the block "
            "input / output (one all-reduce of b x s x h each way, as the dense MLP); GSPMD "
            "instead all-reduces the expert outputs on the [E, G, C, d] slots, k x capacity "
            "factor times larger, because a sharding constraint cannot keep a partial sum "
            "through the combine all-to-all.", "",
            "## Token drop rate vs capacity factor", "",
            f"{shapes['groups']} groups x S = {shapes['seq_drop']} tokens, E = 8, "
            "C = ceil(k x S x capacity_factor / E). `router`: a random linear router on random "
            "tokens; `uniform`: i.i.d. logits (uniformly random routing); `binomial`: the exact "
            "expectation for uniformly random top-1 routing; `balanced`: the perfectly balanced "
            "bound max(0, 1 - capacity factor).", "",
            "| top-k | capacity factor | C | router | uniform | binomial | balanced |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in drops:
        b = "-" if r["binomial"] is None else f"{r['binomial']:.3f}"
        out.append(f"| {r['top_k']} | {r['capacity_factor']} | {r['capacity']} | "
                   f"{r['router']:.3f} | {r['uniform']:.3f} | {b} | {r['balanced_bound']:.3f} |")
    out += ["", "## Switch load-balancing loss alpha x E x sum_i f_i P_i (alpha = 0.01)", "",
            "| E | uniform | formula alpha | collapsed | formula alpha x E | random router |",
            "|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['n_experts']} | {r['uniform']:.5f} | {r['uniform_formula']:.5f} | "
            f"{r['collapsed']:.5f} | {r['collapsed_formula']:.5f} | {r['random']:.5f} |"
            for r in aux]
    out += ["", "Uniform: f_i = P_i = 1/E exactly (token s to expert s mod E; every expert's "
            "mean probability is 1/E by symmetry). Collapsed: all logits but one at 0, one at "
            "30: f_0 = 1, P_0 = 1 - (E-1) e^-30."]
    return "\n".join(out) + "\n"


def plot(census: list[dict], drops: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, style in ((1, "-"), (2, "--")):
        rs = [r for r in drops if r["top_k"] == k]
        cf = [r["capacity_factor"] for r in rs]
        a0.plot(cf, [r["router"] for r in rs], "o" + style, label=f"top-{k} random router")
        a0.plot(cf, [r["uniform"] for r in rs], "s" + style, label=f"top-{k} uniform routing")
    top1 = [r for r in drops if r["top_k"] == 1]
    a0.plot([r["capacity_factor"] for r in top1], [r["binomial"] for r in top1], "k:",
            label="top-1 binomial expectation")
    a0.plot([r["capacity_factor"] for r in top1], [r["balanced_bound"] for r in top1], "k-.",
            label="balanced bound")
    a0.set(xlabel="capacity factor", ylabel="fraction of assignments dropped",
           title="token drops vs capacity")
    a0.legend(fontsize=7)
    labels = [r["mesh"].replace(" x ", "\n") + f"\n{r['mode']}" for r in census]
    xs = np.arange(len(census))
    a1.bar(xs - 0.2, [max(r["forward+backward"]["bytes"], default=0) / 1024 for r in census],
           0.4, label="census bytes / all-to-all")
    a1.bar(xs + 0.2, [r["expected_bytes"] / 1024 for r in census], 0.4,
           label="E x C x d x 4 x G_local")
    for x_, r in zip(xs, census):
        a1.text(x_, 0, f"{r['forward']['all_to_all']}+"
                f"{r['forward+backward']['all_to_all'] - r['forward']['all_to_all']}",
                ha="center", va="bottom", fontsize=8)
    a1.set_xticks(xs, labels, fontsize=7)
    a1.set(ylabel="KiB per device", title="all-to-all per MoE layer (count fwd+bwd)")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        meshes = [{"data": 2, "expert": 4}]
        shapes = {"batch": 8, "seq": 64, "d": 64, "groups": 16, "seq_drop": 128}
    else:
        meshes = [{"expert": 8}, {"data": 2, "expert": 4}, {"expert": 4, "model": 2}]
        shapes = {"batch": 16, "seq": 128, "d": 256, "groups": 64, "seq_drop": 256}
    census = []
    for degrees in meshes:
        for mode in ("explicit", "gspmd"):
            r = measure_census(degrees, mode, batch=shapes["batch"], seq=shapes["seq"],
                               d=shapes["d"])
            census.append(r)
            print(f"{r['mesh']} {mode}: all-to-all fwd {r['forward']['all_to_all']}, fwd+bwd "
                  f"{r['forward+backward']['all_to_all']}, bytes "
                  f"{r['forward+backward']['bytes']} (expected {r['expected_bytes']}), "
                  f"compile {r['compile_s']:.1f} s", flush=True)
    drops = measure_drops(groups=shapes["groups"], seq=shapes["seq_drop"], d=shapes["d"],
                          factors=(0.5, 1.0, 2.0) if args.quick else FACTORS)
    aux = measure_aux(seq=shapes["seq_drop"], experts=(8,) if args.quick else (4, 8, 16))
    command = "python experiments/moe.py" + (" --quick" if args.quick else "")
    text = to_markdown(census, drops, aux, shapes, command)
    print(text)
    name = "moe_quick" if args.quick else "moe"
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(
        {"census": census, "drops": drops, "aux": aux, "shapes": shapes}, indent=1))
    plot(census, drops, out / f"{name}.png")
    bad = []
    for r in census:
        tag = f"{r['mesh']} {r['mode']}"
        if (r["forward"]["all_to_all"], r["forward+backward"]["all_to_all"]) != (2, 4):
            bad.append(f"{tag} all-to-all count")
        if r["forward+backward"]["bytes"] != [r["expected_bytes"]]:
            bad.append(f"{tag} all-to-all bytes")
        if r["forward+backward"]["all_to_all_axes"] != ["expert"]:
            bad.append(f"{tag} all-to-all axes")
    for r in drops:
        if r["binomial"] is not None and abs(r["uniform"] - r["binomial"]) > DROP_TOL:
            bad.append(f"top-1 cf={r['capacity_factor']} uniform drop vs binomial")
    for r in aux:
        if abs(r["uniform"] / r["uniform_formula"] - 1) > 1e-4:
            bad.append(f"E={r['n_experts']} uniform aux loss")
        if abs(r["collapsed"] / r["collapsed_formula"] - 1) > 1e-4:
            bad.append(f"E={r['n_experts']} collapsed aux loss")
    if bad:
        print("MISMATCH:", ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
