"""The placement report beyond the census: the train step's bytes, each collective's source and
the link class it crosses.

Expected bytes are worked out from the tiny preset's shapes here, not by the code under test.
"""

import json
import os

import pytest

import jaxtp

from jaxtp.cli import commands as cli
from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.inspect import hlo
from jaxtp.inspect import hlo_source
from jaxtp.inspect import placement as inspect
from jaxtp.configs.schema import ConfigError, ParallelConfig
from jaxtp.parallel.mesh import mesh_shape

DATA, MODEL = 2, 4
TP_MESH = [f"parallel.data={DATA}", f"parallel.model={MODEL}"]
F32 = 4


def _param_counts(cfg, tp: int) -> tuple[int, int]:
    """(elements split over ``model``, elements replicated) of the tiny model, from its shapes:
    QKV / output / MLP weights and the vocab dims are tensor-parallel, norm scales are not."""
    m = cfg.model
    d, f, L, hd = m.d_model, m.d_ff, m.n_layers, m.resolved_head_dim
    vocab = m.padded_vocab_size(tp)
    qkv = d * m.n_kv_heads * (m.n_heads // m.n_kv_heads + 2) * hd
    out = m.n_heads * hd * d
    mlp = (3 if m.activation == "swiglu" else 2) * d * f
    split = L * (qkv + out + mlp) + vocab * d * (1 if m.tie_embeddings else 2)
    return split, 2 * L * d + d


@pytest.fixture(scope="module", params=["gspmd", "explicit"])
def train_report(request):
    """The train step of tiny on (data=2, model=4), ``data`` simulated across 2 hosts."""
    cfg = config.load("tiny", [f"parallel.mode={request.param}", *TP_MESH,
                               "parallel.dcn_data=2"])
    eng = engine.build_engine(cfg)
    return cfg, eng, inspect.report(eng, step="train")


def test_tensor_parallel_all_reduces_come_from_attention_and_mlp(train_report):
    """Per layer, each block's forward ``g`` and backward ``f`` all-reduce is attributed to it."""
    cfg, eng, r = train_report
    in_loop = [op for op in r.ops if op.axes == ("model",) and op.executions == cfg.model.n_layers]
    assert [op.tensors for op in in_loop] == [1] * 4  # the Megatron census: 2 forward, 2 backward
    modules = inspect.module_paths(eng)
    sources = sorted(hlo_source.source(op.parts[0], modules) for op in in_loop)
    if cfg.parallel.mode == "explicit":
        assert sources == [
            "blocks/attn: copy_to_model (backward)", "blocks/attn: reduce_from_model",
            "blocks/mlp: copy_to_model (backward)", "blocks/mlp: reduce_from_model"]
        return
    # GSPMD: XLA places them at the partitioned matmuls, named by their einsum (from op_name,
    # independent of the traceback): attention's have the head dim h, the MLP's the hidden dim f.
    block = {"h": "blocks/attn", "f": "blocks/mlp"}
    expected = []
    for op in in_loop:
        spec = op.parts[0].op_name.split("/")[-2].removeprefix("transpose(jvp(").rstrip(")")
        (dim,) = {"h", "f"} & set(spec)
        backward = " (backward)" if "transpose(" in op.parts[0].op_name else ""
        expected.append(f"{block[dim]}: {spec}{backward}")
    assert sources == sorted(expected)
    assert [s.split(":")[0] for s in sources] == ["blocks/attn"] * 2 + ["blocks/mlp"] * 2


def test_gradient_sync_attributed_to_sync_grads(train_report):
    cfg, _, r = train_report
    split, replicated = _param_counts(cfg, MODEL)
    params = F32 * (split // MODEL + replicated)
    data = [row for row in r.collectives_by_source if row["axes"] == ["data"]]
    sync = [row for row in data if row["source"] == "sync_grads"]
    # every local gradient byte once; the rest over `data` is the loss scalar
    assert sum(row["bytes"] for row in sync) == params
    assert sum(row["bytes"] for row in data) - params <= 8


def test_fused_operands_are_attributed_one_by_one(train_report):
    *_, r = train_report
    fused = [op for op in r.ops if op.tensors > 1]
    assert fused
    for op in r.ops:
        assert len(op.parts) == op.tensors and sum(p.bytes for p in op.parts) == op.bytes
    # XLA fuses the gradient sync with the loss psum: two sources in one op
    assert any(len({hlo_source.source(p) for p in op.parts}) > 1 for op in fused)


def test_train_step_bytes_adam_fp32(train_report):
    """Adam holds two fp32 moments per parameter, in the parameters' shardings (ZeRO 0), plus
    step counters; the donated state is aliased in and out."""
    cfg, _, r = train_report
    split, replicated = _param_counts(cfg, MODEL)
    params = F32 * (split // MODEL + replicated)
    b = r.per_device_bytes
    assert b["params"] == params and b["grads"] == params
    assert 2 * params <= b["optimizer"] <= 2 * params + 16  # + the int32 step counters
    assert b["aliased"] >= b["params"] + b["optimizer"]
    assert b["peak"] == b["arguments"] + b["outputs"] + b["temporaries"] - b["aliased"]


def test_zero1_shards_the_optimizer_state():
    """ZeRO-1 on data=8: parameters replicated, each moment split eight ways."""
    cfg = config.load("tiny", ["parallel.data=8", "parallel.zero_stage=1"])
    r = inspect.report(cfg, step="train")
    split, replicated = _param_counts(cfg, 1)
    n = split + replicated
    b = r.per_device_bytes
    assert b["params"] == F32 * n
    assert 2 * F32 * n // 8 <= b["optimizer"] <= 2 * F32 * n // 8 + 16


def test_link_class_from_dcn_degrees(train_report):
    *_, r = train_report
    assert r.hosts_per_axis["data"] == 2 and r.hosts_per_axis["model"] == 1
    for row in r.collectives + r.collectives_by_source:
        assert row["link"] == ("DCN" if "data" in row["axes"] else "ICI"), row
    assert {row["link"] for row in r.collectives} == {"DCN", "ICI"}


def test_hosts_per_axis_and_link():
    degrees = {"pipeline": 2, "data": 4, "fsdp": 1, "context": 1, "expert": 1, "model": 8}
    # one process: the config's DCN degrees stand for simulated hosts
    hosts = inspect.hosts_per_axis(ParallelConfig(dcn_pipeline=2), degrees)
    assert hosts["pipeline"] == 2 and hosts["data"] == 1
    assert inspect.link(("pipeline",), hosts) == "DCN"
    assert inspect.link(("data", "model"), hosts) == "ICI"
    # several processes and no dcn_* given: the hosts go on `data`
    hosts = inspect.hosts_per_axis(ParallelConfig(), degrees, n_processes=4)
    assert inspect.link(("data", "model"), hosts) == "DCN"
    assert inspect.link(("model",), hosts) == "ICI"
    with pytest.raises(ConfigError, match="dcn_data"):
        inspect.hosts_per_axis(ParallelConfig(dcn_data=3), degrees)


PKG = os.path.dirname(jaxtp.__file__)  # paths below are the modules' own


def _frame(file, function):
    return hlo_source.Frame(os.path.join(PKG, file) if file else "/lib/optax/x.py", function, 1)


MODULES = {"Attention": [("blocks/attn", ("MoEBlock", "Transformer")),
                         ("blocks/dense/attn", ("Block", "MoEBlock", "Transformer"))],
           "Block": [("blocks/dense", ("MoEBlock", "Transformer"))],
           "MoEBlock": [("blocks", ("Transformer",))], "Transformer": [("", ())],
           "VocabParallelEmbedding": [("embed", ("Transformer",))]}


@pytest.mark.parametrize("frames, op_name, expected", [
    # a Megatron operator inside a module used at two paths: its enclosing modules decide
    ([("parallel/collectives.py", "reduce_from_model"), ("parallel/execution.py", "ExplicitOps.reduce_from_model"),
      ("layers/attention.py", "Attention.__call__"), ("layers/transformer.py", "Block.__call__"),
      ("layers/transformer.py", "MoEBlock.__call__"), ("layers/transformer.py", "Transformer.hidden")],
     "jit(f)/while/body/psum_invariant", "blocks/dense/attn: reduce_from_model"),
    ([("parallel/collectives.py", "copy_to_model"), ("layers/attention.py", "Attention.__call__"),
      ("layers/transformer.py", "MoEBlock.__call__")],
     "jit(f)/transpose(jvp())/psum_invariant", "blocks/attn: copy_to_model (backward)"),
    # a method other than __call__; GSPMD: the einsum XLA partitioned
    ([("layers/embedding.py", "VocabParallelEmbedding.attend"), ("layers/transformer.py", "Transformer.f")],
     "jit(f)/transpose(jvp(bsd,vd->bsv))/dot_general", "embed.attend: bsd,vd->bsv (backward)"),
    # a closure is named by its function; operator and function alike are said once
    ([("parallel/collectives.py", "sync_grads"), ("step/engine.py", "sync_grads.<locals>.one"),
      ("step/engine.py", "Engine.value_and_grad_fn.<locals>.local")], "psum", "sync_grads"),
    # a module-private helper gives way to its caller
    ([("pipeline/runtime.py", "_sender.<locals>.send"), ("pipeline/runtime.py", "pipeline_value_and_grad")],
     "jit(f)/while/body/ppermute", "pipeline_value_and_grad: ppermute"),
    # a library's transformation closure, else the library function jaxtp called
    ([("", "tree_sum"), ("", "clip_by_global_norm.<locals>.update_fn"),
      ("", "chain.<locals>.update_fn"), ("train/trainer.py", "Trainer.step_fn.<locals>.step")],
     "jit(step)/reduce_sum", "Trainer.step_fn: clip_by_global_norm"),
    ([("", "tree_sum"), ("", "tree_norm"), ("train/trainer.py", "Trainer.step_fn.<locals>.step")],
     "jit(step)/reduce_sum", "Trainer.step_fn: tree_norm"),
    # no traceback in the module: the primitive alone
    ([], "jit(f)/all_gather", "all_gather"),
])
def test_source_rule(frames, op_name, expected):
    part = hlo_source.Part(8, op_name, tuple(_frame(*f) for f in frames))
    assert hlo_source.source(part, MODULES) == expected


def test_tracebacks_reach_the_caller():
    """XLA's StackFrames table is read with the right parent convention: a collective's traceback
    runs from its operator out to this test."""
    eng = engine.build_engine(config.load("tiny", ["parallel.mode=explicit", *TP_MESH]))
    text = inspect.compile_step(eng, "loss").as_text()
    ops = hlo.collectives(text, mesh_shape(eng.layout.mesh))
    # the embedding's g: the one [b_local, s, d] all-reduce outside the layer loop
    (embed,) = [op for op in ops if op.executions == 1 and op.bytes == 4 * 64 * 64 * F32]
    frames = embed.parts[0].frames
    assert frames[0].function == "reduce_from_model"
    assert "VocabParallelEmbedding.__call__" in [f.function for f in frames]
    assert any(f.file == __file__ for f in frames)


def test_cli_inspect_train_json(capsys):
    assert cli.main(["inspect", "--step", "train", "--json", "parallel.data=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == "train"
    assert report["per_device_bytes"]["optimizer"] >= 2 * report["per_device_bytes"]["params"]
    assert {"source", "kind", "axes", "link", "count", "bytes"} <= set(
        report["collectives_by_source"][0])
    assert all(c["link"] == "ICI" for c in report["collectives"])


def test_unknown_step_names_the_choices():
    with pytest.raises(ValueError, match="grad, loss, train"):
        inspect.report(config.load("tiny", ["parallel.data=8"]), step="update")


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_grad_step_sync_named_by_its_output(mode):
    """In the grad step XLA fuses the sync into the step's result and drops the gradients'
    origins; they are named by the output they are."""
    cfg = config.load("tiny", [f"parallel.mode={mode}", *TP_MESH])
    r = inspect.report(cfg, step="grad")
    split, replicated = _param_counts(cfg, MODEL)
    data = {row["source"]: row["bytes"] for row in r.collectives_by_source
            if row["axes"] == ["data"]}
    grads = data.pop("(fused) output: gradients", 0) + data.pop("sync_grads", 0)
    assert grads == F32 * (split // MODEL + replicated)
    assert sum(data.values()) == F32  # the loss scalar, first in the fused op, keeps its origin
