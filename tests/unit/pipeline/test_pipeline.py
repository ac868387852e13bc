"""The pipeline runtime (jaxtp/pipeline/runtime.py) against a sequential single-device reference: every
schedule's loss and gradients equal ``jax.value_and_grad`` of all ``p * v`` stages applied in order
(fp32), only ``ppermute``s cross ``pipeline`` (two per tick), the data-parallel gradient sync runs
once per step, and 1F1B's compiled temporaries do not grow with the micro-batch count while
GPipe's do."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtp.parallel import collectives
from jaxtp.inspect import hlo
from jaxtp.pipeline import schedules
from jaxtp import pipeline as pl
from jaxtp.configs import PIPELINE_SCHEDULES
from jaxtp.configs.schema import ParallelConfig
from jaxtp.parallel.mesh import build_mesh
from jaxtp.pipeline.schedules import ScheduleError
from jaxtp.pipeline.weight_grad import weight_einsum

B, S, H, F = 4, 4, 16, 32  # global batch (split over `data`), seq, hidden, mlp
TOL = {"rtol": 1e-5, "atol": 1e-6}


def stage_fn(w, x):  # a residual MLP block: [b, s, h] -> [b, s, h]
    # weight_einsum: plain einsum, marked for ZB-H1's B / W split (jaxtp.pipeline.weight_grad) under zb1
    h = jnp.tanh(weight_einsum("bsh,hf->bsf", x, w["w1"]))
    return x + weight_einsum("bsf,fh->bsh", h, w["w2"])


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def _model(n_stages, m, seed=0, b=B, s=S, h=H, f=F):
    rng = np.random.default_rng(seed)
    params = {"w1": jnp.asarray(rng.normal(size=(n_stages, h, f)) / 4, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(n_stages, f, h)) / 4, jnp.float32)}
    inputs, targets = (jnp.asarray(rng.normal(size=(m, b, s, h)), jnp.float32) for _ in "xt")
    return params, inputs, targets


def _reference(params, inputs, targets):
    """All stages in order on each micro-batch, mean loss over micro-batches."""
    n = jax.tree.leaves(params)[0].shape[0]

    def loss(params):
        def one(x, t):
            for k in range(n):
                x = stage_fn(jax.tree.map(lambda a, k=k: a[k], params), x)
            return loss_fn(x, t)
        return jnp.mean(jax.vmap(one)(inputs, targets))
    return jax.value_and_grad(loss)(params)


def _pipelined(mesh, schedule, stage=stage_fn, param_spec=None):
    """Global (rank-major params, inputs, targets) -> (loss, rank-major grads); the batch is split
    over `data` and the gradients are averaged over it once, after the pipeline."""
    def local(w, x, t):
        loss, grads = pl.pipeline_value_and_grad(stage, loss_fn, w, (x, t), schedule=schedule)
        grads = grads.stages
        return jax.lax.pmean((loss, grads), "data")
    batch, param_spec = P(None, "data"), P("pipeline") if param_spec is None else param_spec
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(param_spec, batch, batch),
                                 out_specs=(P(), param_spec)))


def _mesh(p, **others):
    return build_mesh(ParallelConfig(pipeline=p, data=-1, **others))


CASES = [(name, p, m, 2 if name == "interleaved" else 1)
         for name in PIPELINE_SCHEDULES
         for p in (2, 4) for m in (p, 2 * p)]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_matches_sequential_reference_and_census(name, p, m, v):
    params, inputs, targets = _model(p * v, m)
    mesh, schedule = _mesh(p), schedules.build_schedule(name, p, m, v)
    f = _pipelined(mesh, schedule)
    w = pl.stages_to_ranks(params, p, v)
    compiled = f.lower(w, inputs, targets).compile()
    loss, grads = compiled(w, inputs, targets)
    want_loss, want = _reference(params, inputs, targets)
    chex.assert_trees_all_equal_shapes(grads, w)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    for k, g in pl.ranks_to_stages(grads, p, v).items():
        np.testing.assert_allclose(g, want[k], **TOL, err_msg=k)

    text = compiled.as_text()
    assert " conditional(" in text  # each tick runs only its own pass (idle ticks: none)
    ops = hlo.collectives(text, dict(mesh.shape))
    over_pipeline = [o for o in ops if "pipeline" in o.axes]
    permutes = sum(o.executions for o in over_pipeline if o.kind == "collective-permute")
    # activations forward, cotangents backward: one each per tick that has some to send
    assert permutes == pl.compile_schedule(schedule).transfers
    # nothing else crosses `pipeline` but the 4-byte loss: no activation gather / reduce
    assert [o.bytes for o in over_pipeline if o.kind != "collective-permute"] == [4]
    # the data-parallel gradient sync runs once per step, not once per tick or micro-batch
    assert all(o.executions == 1 for o in ops if o.axes == ("data",))


def test_tensor_parallel_inside_a_stage():
    """Megatron f / g inside ``stage_fn`` (w1 column-, w2 row-parallel over `model`): the
    activations the pipeline carries stay replicated over `model`; pipeline=2 x data=2 x model=2."""
    p, m = 2, 4
    params, inputs, targets = _model(p, m, seed=1)

    def tp_stage(w, x):
        h = jnp.tanh(collectives.copy_to_model(x) @ w["w1"])       # [b, s, F/t]
        return x + collectives.reduce_from_model(h @ w["w2"])      # [b, s, h]

    spec = {"w1": P("pipeline", None, "model"), "w2": P("pipeline", "model", None)}
    f = _pipelined(_mesh(p, model=2), schedules.build_schedule("1f1b", p, m), tp_stage, spec)
    loss, grads = f(params, inputs, targets)  # v = 1: rank-major == stage order
    want_loss, want = _reference(params, inputs, targets)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], **TOL, err_msg=k)


def test_stage_layout_round_trip():
    p, v = 4, 2
    stacked = {"w": jnp.arange(p * v)}
    ranks = pl.stages_to_ranks(stacked, p, v)["w"]
    # rank d holds [stage d, stage p + d]: chunk c of rank d is stage c * p + d
    np.testing.assert_array_equal(ranks.reshape(p, v), [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_array_equal(pl.ranks_to_stages({"w": ranks}, p, v)["w"], stacked["w"])


@pytest.mark.parametrize("m", [4, 8, 16])
def test_buffer_slots(m):
    """What a rank holds for its backwards, counted from write to last read: GPipe all m
    micro-batches, 1F1B p, whatever m; stored VJP residual sets by default, stage inputs when
    the backward recomputes (then a stage input waits for its backward, not its forward)."""
    p = 4

    def prog(name, v=1, mb=m, residuals=True):
        return pl.compile_schedule(schedules.build_schedule(name, p, mb, v), residuals=residuals)
    assert (prog("gpipe").res_slots, prog("gpipe").act_slots) == (m, 1)
    # 1F1B: 2p - 2 on rank 0 keep the lock-step ticks busy (pipeline.program.in_flight_cap)
    assert (prog("1f1b").res_slots, prog("1f1b").act_slots) == (min(2 * p - 2, m), 1)
    assert prog("gpipe", residuals=False).act_slots == m
    assert prog("1f1b", residuals=False).act_slots == min(2 * p - 3, m)  # rank 1: stage 0 reads
    assert prog("1f1b", residuals=False).res_slots == 0
    assert prog("1f1b").grad_slots == 1  # a cotangent is consumed the tick after it arrives
    assert prog("gpipe").grad_slots == m - 1  # the last stage's, from its F to its B
    if m >= 8:
        assert prog("interleaved", 2).res_slots == prog("interleaved", 2, 8).res_slots


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zb1", 1)])
def test_unused_writes_clobber_no_live_residuals(name, v):
    """Replays every rank's program on its residual buffers (F -> B residual sets; ZB-H1's B -> W
    inputs): each read finds the set its pass needs, although a tick without that pass writes
    its (dead) output into a real slot; only when every slot is live at such a write
    (m < 2p - 2) does a buffer get a scratch slot, as the planner's memory model says."""
    from jaxtp.planner import memory_model
    from jaxtp.pipeline import program as col

    for p, m in [(2, 2), (2, 4), (4, 4), (4, 5), (4, 8), (8, 8), (8, 16)]:
        if name == "interleaved" and m % p:
            continue
        prog = pl.compile_schedule(schedules.build_schedule(name, p, m, v))
        for r in range(p):
            res, wres = {}, {}
            for t, branch in enumerate(prog.executed(r)):
                row = prog.rows[t, r]
                stage = lambda c: int(c) * p + r  # noqa: E731  chunk c of rank r
                if branch is not None and branch.backward and not branch.fused:
                    assert res[row[col.RES_SLOT]] == (stage(row[col.B_CHUNK]), row[col.B_MB])
                if branch is not None and branch.weight and not branch.weight_fused:
                    assert wres[row[col.WRES_SLOT]] == (stage(row[col.W_CHUNK]), row[col.W_MB])
                writes_res = branch is not None and branch.forward and not (
                    branch.backward and branch.fused)
                res[row[col.WRITE_RES]] = ((stage(row[col.F_CHUNK]), row[col.F_MB])
                                           if writes_res else "dead")
                if prog.split:
                    writes_w = (branch is not None and branch.backward
                                and not (branch.weight and branch.weight_fused))
                    wres[row[col.WRITE_WRES]] = ((stage(row[col.B_CHUNK]), row[col.B_MB])
                                                 if writes_w else "dead")
                assert max(res, default=0) < prog.buffer_slots("res")
                assert max(wres, default=0) < max(prog.buffer_slots("wres"), 1)
        if m >= 2 * p - 2:  # some slot is dead at every write: no scratch slot
            assert prog.buffer_slots("res") == prog.res_slots
            assert prog.buffer_slots("wres") == prog.wres_slots
        if name != "interleaved":  # the planner's closed form (ZB-H1: p - 1 sets of W inputs)
            assert prog.buffer_slots("res") == memory_model.residual_buffer(p, m), (p, m)
            assert prog.buffer_slots("wres") == (p - 1 if prog.split else 0), (p, m)


def test_packed_ticks():
    """The runtime's ticks hold at most one F and one B per rank: 1F1B pairs them in its steady
    state (m + 2p - 2 ticks where the table has 2 (m + p - 1)) and so takes GPipe's lock-step
    time, (m + p - 1) (F + B); GPipe's forwards and backwards stay apart (one tick fewer: the
    last stage's last F and first B share one); interleaving is faster than both."""
    for p, m in [(2, 4), (4, 8), (4, 16)]:
        one = pl.compile_schedule(schedules.build_schedule("1f1b", p, m))
        gpipe = pl.compile_schedule(schedules.build_schedule("gpipe", p, m))
        inter = pl.compile_schedule(schedules.build_schedule("interleaved", p, m, 2))
        assert one.ticks == m + 2 * p - 2
        assert one.lockstep_time(1, 2) == gpipe.lockstep_time(1, 2) == (m + p - 1) * 3
        assert inter.lockstep_time(1, 2) < gpipe.lockstep_time(1, 2)
        for rank in range(p):
            done = [b for b in one.executed(rank) if b is not None]
            assert sum(b.forward is not None for b in done) == m
            assert sum(b.backward is not None for b in done) == m
        assert pl.compile_schedule(schedules.build_schedule("gpipe", p, m)).ticks == 2 * (m + p - 1) - 1
        segments = pl.compile_schedule(schedules.build_schedule("gpipe", p, m)).segments
        assert [(s.forward, s.backward) for s in segments] == [(True, False), (True, True),
                                                                (False, True)]


def _temp_bytes(name, p, m, b, s, h, f):
    mesh = _mesh(p)
    x = jax.ShapeDtypeStruct((m, b, s, h), jnp.float32)
    w = {"w1": jax.ShapeDtypeStruct((p, h, f), jnp.float32),
         "w2": jax.ShapeDtypeStruct((p, f, h), jnp.float32)}
    compiled = _pipelined(mesh, schedules.build_schedule(name, p, m)).lower(w, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_memory_flat_in_m_gpipe_grows():
    """Compiled temporaries at p=4 (data=2): GPipe holds one more micro-batch's residuals per
    extra micro-batch; 1F1B's grow only by the per-tick program rows (52 bytes a tick) from
    m = 2p on (at m = p its steady state, and so its switch's branches, is shorter)."""
    p, b, s, h, f = 4, 8, 32, 64, 128
    slot = (b // 2) * s * h * 4  # one local stage input, bytes
    ms = (4, 8, 16)
    gpipe = [_temp_bytes("gpipe", p, m, b, s, h, f) for m in ms]
    onef = [_temp_bytes("1f1b", p, m, b, s, h, f) for m in ms]
    for m, g, o in zip(ms, gpipe, onef):
        assert g - gpipe[0] >= (m - ms[0]) * slot, (gpipe, onef)
        assert abs(o - onef[1]) < slot / 8 or m < 2 * p, (gpipe, onef)
    assert onef[0] < onef[1] + slot / 8


def test_errors():
    with pytest.raises(ScheduleError, match="fewer than pipeline=4"):
        pl.compile_schedule(schedules.build_schedule("1f1b", 4, 2))
    with pytest.raises(ScheduleError, match="multiple of pipeline=4"):
        pl.check_pipeline("interleaved", 4, 6, 2)
    pl.check_pipeline("gpipe", 4, 2)  # GPipe runs (badly) with m < p

    p, m = 2, 4
    params, inputs, targets = _model(p, m)
    mesh = _mesh(p)
    with pytest.raises(ScheduleError, match="fewer than pipeline=2"):  # before any compile
        _pipelined(mesh, schedules.build_schedule("1f1b", p, 1))(params, inputs[:1], targets[:1])
    with pytest.raises(ScheduleError, match="built for m=2"):
        _pipelined(mesh, schedules.build_schedule("1f1b", p, 2))(params, inputs, targets)
    with pytest.raises(ScheduleError, match="schedule is for pipeline=4"):
        _pipelined(mesh, schedules.build_schedule("1f1b", 4, m))(params, inputs, targets)
    with pytest.raises(ScheduleError, match="leading chunk dim v=2"):
        _pipelined(mesh, schedules.build_schedule("interleaved", p, m, 2))(params, inputs, targets)
    with pytest.raises(ValueError, match="same shape and dtype"):
        _pipelined(mesh, schedules.build_schedule("gpipe", p, m), lambda w, x: x[..., :2])(
            params, inputs, targets)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 2, 4, 1), ("interleaved", 2, 2, 2)])
def test_embedding_on_stage_0_and_loss_head_on_the_last(name, p, m, v):
    """A whole language model: token ids -> embedding (stage 0) -> p * v blocks -> output
    projection + cross-entropy (last stage); embedding and head gradients summed over
    `pipeline` once."""
    vocab = 11
    params, _, _ = _model(p * v, m, seed=2)
    rng = np.random.default_rng(3)
    tokens, labels = (jnp.asarray(rng.integers(0, vocab, (m, B, S)), jnp.int32) for _ in "xt")
    emb = jnp.asarray(rng.normal(size=(vocab, H)), jnp.float32)
    head = {"w": jnp.asarray(rng.normal(size=(H, vocab)) / 4, jnp.float32)}

    def embed_fn(e, ids):                                            # [b, s] -> [b, s, h]
        return e[ids]

    def head_loss(hp, y, t):                                         # [b, s, h], [b, s]
        logp = jax.nn.log_softmax(y @ hp["w"])
        return -jnp.mean(jnp.take_along_axis(logp, t[..., None], -1))

    def reference(params, emb, head):
        def one(ids, t):
            x = embed_fn(emb, ids)
            for k in range(p * v):
                x = stage_fn(jax.tree.map(lambda a, k=k: a[k], params), x)
            return head_loss(head, x, t)
        return jnp.mean(jax.vmap(one)(tokens, labels))

    want_loss, want = jax.value_and_grad(reference, argnums=(0, 1, 2))(params, emb, head)
    schedule = schedules.build_schedule(name, p, m, v)

    def local(w, e, hp, x, t):
        loss, g = pl.pipeline_value_and_grad(stage_fn, head_loss, w, (x, t), schedule=schedule,
                                             embed_fn=embed_fn, embed_params=e, head_params=hp)
        return jax.lax.pmean((loss, g.stages, g.embed, g.head), "data")

    batch = P(None, "data")
    f = jax.jit(jax.shard_map(local, mesh=_mesh(p), in_specs=(P("pipeline"), P(), P(), batch,
                                                              batch),
                              out_specs=(P(), P("pipeline"), P(), P())))
    loss, grads, d_emb, d_head = f(pl.stages_to_ranks(params, p, v), emb, head, tokens, labels)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    for k, g in pl.ranks_to_stages(grads, p, v).items():
        np.testing.assert_allclose(g, want[0][k], **TOL, err_msg=k)
    np.testing.assert_allclose(d_emb, want[1], **TOL)
    np.testing.assert_allclose(d_head["w"], want[2]["w"], **TOL)


def test_zero_bubble_packs_w_into_the_bubble():
    """ZB-H1's packed program: every rank runs its m F, B and W; ticks carry F + B + W in the
    steady state and the deferred W s share the cool-down's ticks, so at F = B = W its lock-step
    time is 1F1B's (at B = 2F) less (p - 1) F, in as many ticks; it needs stored residuals."""
    for p, m in ((2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (8, 16), (8, 32)):  # p = 8, m >= 2p:
        # the middle ranks stalled with 1F1B's in-flight cap
        zb = pl.compile_schedule(schedules.build_schedule("zb1", p, m))
        one = pl.compile_schedule(schedules.build_schedule("1f1b", p, m))
        for r in range(p):
            ran = [b for b in zb.executed(r) if b is not None]
            assert [sum(getattr(b, k) is not None for b in ran)
                    for k in ("forward", "backward", "weight")] == [m, m, m]
        assert zb.ticks == one.ticks
        assert zb.lockstep_time(1, 1, 1) == one.lockstep_time(1, 2) - (p - 1)
        assert zb.wres_slots == p - 1 and zb.res_slots == one.res_slots
    with pytest.raises(ScheduleError, match="residuals=True"):
        pl.compile_schedule(schedules.build_schedule("zb1", 2, 4), residuals=False)
