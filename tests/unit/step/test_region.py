"""jaxtp.step.region: one Region per execution mode decides the manual axes, the operators and where
the per-device program starts; it is the only reader of ``parallel.mode``."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp.configs import schema as config
from jaxtp.parallel.execution import ExplicitOps, GSPMDOps
from jaxtp.step.layout import build_layout
from jaxtp.step.region import ExplicitRegion, GSPMDRegion, region_for
from jaxtp.parallel.sharding import Rules


def _region(*over):
    cfg = config.load("tiny", ["train.batch_size=8", "train.seq_len=32", *over])
    return region_for(build_layout(cfg))


def test_one_region_per_mode():
    assert isinstance(_region("parallel.data=2", "parallel.model=4"), GSPMDRegion)
    assert isinstance(_region("parallel.mode=explicit"), ExplicitRegion)
    lo = build_layout(config.load("tiny"))
    with pytest.raises(ValueError, match="choose gspmd or explicit"):
        region_for(dataclasses.replace(
            lo, cfg=dataclasses.replace(lo.cfg, parallel=dataclasses.replace(
                lo.cfg.parallel, mode="magic"))))


def test_manual_axes_and_token_axes():
    g = _region("parallel.data=2", "parallel.context=2", "parallel.model=2")
    assert g.token_axes == ("data", "context")  # split axes only: fsdp is 1
    assert g.manual_axes("pipeline") == ("data", "context", "pipeline")
    assert not g.global_view  # ring attention needs `context` manual
    assert _region("parallel.data=2", "parallel.model=4").global_view
    e = _region("parallel.data=2", "parallel.model=4", "parallel.mode=explicit")
    assert e.token_axes == ("data", "fsdp", "context")
    assert e.manual_axes() == ("pipeline", "data", "fsdp", "context", "expert", "model")
    sp = _region("parallel.model=4", "parallel.mode=explicit", "parallel.sequence_parallel=true")
    assert sp.replica_axes[-1] == "model"  # norm scales see only their sequence shard
    ep = _region("parallel.expert=2", "parallel.data=4", "model.n_experts=4")
    assert "expert" in ep.token_axes and ep.n_token_ranks == 8


def test_ops_per_mode():
    g = _region("parallel.data=2", "parallel.model=4")
    assert isinstance(g.ops(manual=False), GSPMDOps)
    inside = g.ops(manual=True)
    assert inside.manual_zero and inside.rules["batch"] == "fsdp"  # data is manual there
    assert isinstance(_region("parallel.mode=explicit").ops(manual=True), ExplicitOps)


def test_explicit_mode_takes_its_tp_axis_from_the_parameter_table():
    """A table that splits heads over another axis moves explicit mode's f / g there too."""
    e = _region("parallel.model=4", "parallel.mode=explicit")
    assert e.tp_axis == "model" and e.ops().tp_axis == "model"
    table = tuple((k, "expert" if v == "model" else v) for k, v in e.layout.param_rules.table)
    moved = ExplicitRegion(dataclasses.replace(e.layout, param_rules=Rules(table)))
    assert moved.tp_axis == "expert" and moved.ops().tp_axis == "expert"


def test_per_device_runs_fn_on_each_shard():
    r = _region("parallel.data=4", "parallel.model=2")
    lo = r.layout
    params = lo.init_params(0)

    def fn(params, batch):  # per device: the local rows, summed over the token axes
        return jax.lax.psum(jnp.sum(batch["inputs"]), r.token_axes)

    tok = jnp.ones((8, 32), jnp.int32)
    total = jax.jit(r.per_device(fn, out_specs=P()))(params, {"inputs": tok, "targets": tok})
    assert int(total) == 8 * 32


def test_parallel_mode_is_read_only_in_region():
    """The execution mode is decided in one place (STYLE.md): no other module reads it."""
    root = Path(__file__).resolve().parents[3] / "jaxtp"
    readers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "mode" and isinstance(
                    node.value, ast.Attribute) and node.value.attr == "parallel":
                readers.append(path.relative_to(root).as_posix())
    assert set(readers) <= {"step/region.py", "cli/commands.py"}, readers
