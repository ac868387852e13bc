"""Pipeline runtime: execute a :mod:`jaxtp.pipeline.schedules` table over the ``pipeline`` mesh axis.

Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B / PipeDream-Flush, Narayanan et al. 2019;
interleaved 1F1B, Narayanan et al. 2021, sec. 2.2) cuts the model into ``p * v`` stages, stage
``k`` on pipeline rank ``k % p`` as its chunk ``k // p``, and streams ``m`` micro-batches through
them. :mod:`jaxtp.pipeline.schedules` decides the order of each rank's forward (``F``) and backward (``B``)
passes; :mod:`jaxtp.pipeline.program` packs it into ticks of at most one ``F`` and one ``B`` per
rank and compiles it to per-rank integer rows; this module runs them as one SPMD program. Per
segment of the program a ``lax.scan`` over ticks reads this rank's row, runs its branch under
``lax.switch`` (idle ticks do no math) and then ``ppermute`` s over ``pipeline`` the forward output
to rank ``r + 1`` and the input cotangent to rank ``r - 1`` (cyclic when interleaved, so the last
rank's chunk ``c`` feeds rank 0's chunk ``c + 1``). Nothing else crosses ``pipeline`` but the
scalar loss.

Memory: a rank keeps what a later pass reads in fixed-size buffers whose slots the program assigns
statically, so GPipe needs ``m`` slots and 1F1B about ``p``, whatever ``m`` — the point of 1F1B.
By default a ``F`` keeps its stage's VJP residuals (what the stage's remat policy saves; see
:func:`split_vjp`) for its ``B``, which then runs the backward only; with ``residuals=False`` it
keeps only the stage input and ``B`` recomputes the stage (GPipe sec. 2.3). Residual buffers enter
the tick's ``lax.switch`` read-only and are written after it (a buffer passed through a branch is
copied whole by XLA). Under ZB-H1 (``zb1``) the backward is two passes (:mod:`jaxtp.pipeline.weight_grad`):
``B`` computes the input cotangent and keeps what the weight gradient needs (each linear's input
and output cotangent) in a buffer until the micro-batch's ``W``, which the schedule places in the
ticks where the rank would otherwise wait. Optionally the pipeline owns the embedding
(``embed_fn`` on stage 0) and the loss head (``head_params`` of ``loss_fn`` on the last
stage), whose gradients are summed over ``pipeline`` once per step, so a whole language model
runs with only its blocks split into stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtp.configs import PIPELINE
from jaxtp.pipeline import program as col  # the columns of Program.rows
from jaxtp.pipeline import weight_grad
from jaxtp.pipeline.program import Branch, Segment, Step, compile_schedule
from jaxtp.pipeline.schedules import Schedule, ScheduleError


class PipelineGrads(NamedTuple):
    """This rank's gradients: its stage chunks', and when the pipeline also owns them the
    embedding's (stage 0) and the loss head's (last stage), summed over the pipeline axis
    (``None`` when not given)."""

    stages: Any
    embed: Any
    head: Any


def pipeline_value_and_grad(stage_fn: Callable, loss_fn: Callable, stage_params,
                            microbatches: tuple[jax.Array, jax.Array], *,
                            schedule: Schedule, axis: str = PIPELINE,
                            embed_fn: Callable | None = None, embed_params=None,
                            head_params=None, send_split: tuple[str, int] | None = None,
                            side=None, residuals: bool = True
                            ) -> tuple[jax.Array, PipelineGrads]:
    """``(loss, PipelineGrads)`` of the ``p * v``-stage model run by ``schedule``, per rank,
    inside ``jax.shard_map`` over ``axis``.

    - ``stage_params``: this rank's chunks, a pytree whose leaves are ``[v, ...]`` (``v = 1``
      unless interleaved); :func:`stages_to_ranks` lays out a stage-stacked model for
      ``P(axis)``.
    - ``stage_fn(chunk_params, x) -> y``: one stage, ``x`` and ``y`` both ``[b, s, h]`` (any
      shape, the same in and out).
    - ``loss_fn(y, target) -> scalar`` (``loss_fn(head_params, y, target)`` when ``head_params``
      is given): applied to the last stage's output of each micro-batch.
    - ``microbatches = (inputs [m, b, s, h], targets [m, ...])``: read by stage 0 / the last
      stage only (every rank may hold them; nothing is scattered over ``axis`` yet). With
      ``embed_fn``, ``inputs`` are raw (e.g. token ids ``[m, b, s]``) and stage 0 runs
      ``embed_fn(embed_params, inputs[i]) -> x [b, s, h]`` first. ``targets`` may be a pytree
      (e.g. targets and a loss mask) whose leaves lead with ``m``.
    - ``side``: per-micro-batch data every stage reads (a pytree of ``[m, ...]`` leaves, e.g. a
      packed batch's RoPE tables and segment ids); then ``stage_fn(chunk_params, x, side[i])``.
    - ``send_split = (axis_name, dim)``: activations that are replicated over ``axis_name``
      (e.g. ``model`` under plain TP) are sent as each rank's ``1/n`` slice along ``dim`` and
      all-gathered over ``axis_name`` after the transfer (Narayanan et al. 2021, sec. 4.1,
      "scatter/gather"): ``n`` times fewer bytes on the pipeline link, one all-gather on the
      fast tensor-parallel one. Manual ``axis_name``: an explicit slice and all-gather;
      automatic (GSPMD): sharding constraints, and XLA slices and gathers.
    - ``residuals``: a ``B`` reads the VJP residuals its ``F`` kept (what ``stage_fn``'s own
      remat policy saves) and runs only the backward; ``False``: it recomputes the stage from
      the stage input, the only thing kept (:mod:`jaxtp.pipeline.program`).

    Returns the mean loss over the ``m`` micro-batches (summed over ``axis``, so every rank has
    it) and this rank's gradients: ``stages`` shaped like ``stage_params``, ``embed`` / ``head``
    summed over ``axis`` (one all-reduce per step; only rank 0 / rank ``p - 1`` contribute).
    All are this rank's *local* values over the other mesh axes: parameters are cast to vary over
    the batch axes of the inputs up front, so no gradient sync happens per tick; reduce over
    ``data`` once, outside (``collectives.sync_grads`` / ``pmean``). Equal to
    ``jax.value_and_grad`` of running all stages in order on each micro-batch and averaging.
    """
    _check_inputs(schedule, microbatches, stage_params, axis=axis, embed_fn=embed_fn,
                  embed_params=embed_params)
    run = _Run(schedule, stage_fn, loss_fn, embed_fn, microbatches, axis=axis, side=side,
               residuals=residuals)
    return run(stage_params, embed_params, head_params, send_split)


def _check_inputs(s: Schedule, microbatches, stage_params, *, axis: str, embed_fn,
                  embed_params) -> None:
    if (embed_fn is None) != (embed_params is None):
        raise ValueError("embed_fn and embed_params go together: pass both or neither")
    lead = {a.shape[0] for a in jax.tree.leaves(microbatches)}
    if lead != {s.m}:
        raise ScheduleError(f"microbatches have leading dims {sorted(lead)} but the schedule was "
                            f"built for m={s.m}; reshape the batch to [{s.m}, ...] or rebuild "
                            f"the schedule")
    if jax.lax.axis_size(axis) != s.p:
        raise ScheduleError(f"schedule is for pipeline={s.p} but mesh axis {axis!r} has size "
                            f"{jax.lax.axis_size(axis)}; build it with p={jax.lax.axis_size(axis)}")
    bad = [x.shape for x in jax.tree.leaves(stage_params) if x.shape[:1] != (s.v,)]
    if bad:
        raise ScheduleError(f"stage_params leaves must have a leading chunk dim v={s.v} per rank; "
                            f"got shapes {bad[:3]} (lay them out with stages_to_ranks)")


class _Type(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any
    vma: frozenset[str]


class _Operands(NamedTuple):
    """What a tick's branch reads: the forward's and the backward's chunk, raw inputs (stage 0's
    input and the side data) and targets; the stage input ``x`` of the forward, ``xb`` of a
    recomputing backward, the output cotangent ``g``, the residual buffers and slot."""

    fc: Any
    bc: Any
    raw_f: Any
    tgt_f: Any
    raw_b: Any
    tgt_b: Any
    x: Any
    xb: Any
    g: Any
    res: list
    res_slot: Any
    wc: Any = None          # the weight-gradient pass's chunk, its input buffers and slot
    wres: Any = None
    wres_slot: Any = None


class _Run:
    """One rank's execution of a :class:`Program`: per segment a ``lax.scan`` over its ticks,
    each running one branch of a ``lax.switch`` (at most one forward and one backward pass) and
    then exchanging with the neighbours."""

    def __init__(self, schedule: Schedule, stage_fn, loss_fn, embed_fn, microbatches, *,
                 axis: str, side=None, residuals: bool = True):
        self.s, self.axis = schedule, axis
        self.prog = compile_schedule(schedule, residuals=residuals)
        self.stage_fn, self.loss_fn, self.embed_fn = stage_fn, loss_fn, embed_fn
        # Activations, cotangents and the loss vary over `axis` and the batch axes; parameters
        # also, so each tick's parameter cotangent stays local (no psum inside the loop).
        self.batch_vma = frozenset({axis}).union(
            *(varying_axes(a) for a in jax.tree.leaves((microbatches, side))))
        self.inputs, self.targets = self._local(microbatches)
        self.side = self._local(side)

    def _local(self, tree):
        return jax.tree.map(lambda a: vary_over(a, self.batch_vma), tree)

    def __call__(self, stage_params, embed_params, head_params, send_split):
        self.params = self._local(stage_params)
        self.eparams, self.hparams = self._local(embed_params), self._local(head_params)
        self.has_head = head_params is not None
        self._trace_types()
        rank = jax.lax.axis_index(self.axis)
        rows = jnp.take(jnp.asarray(self.prog.rows), rank, axis=1)  # [ticks, columns]: this rank's
        prog = self.prog
        size = prog.buffer_slots
        carry = (zeros((size("act"), *self.x_shape), self.x_dtype, self.act_vma),
                 zeros((size("grad"), *self.x_shape), self.x_dtype, self.act_vma),
                 [zeros((size("res"), *a.shape), a.dtype, a.vma) for a in self.res_types],
                 [zeros((size("wres"), *a.shape), a.dtype, a.vma) for a in self.wres_types],
                 (zeros_like(self.params), zeros_like(self.eparams),
                  zeros_like(self.hparams)), self.zero_loss)
        self.send = sender(self.axis, send_split)
        for seg in prog.segments:
            carry, _ = jax.lax.scan(self._tick_of(seg), carry, rows[seg.start:seg.stop])
        _, _, _, _, (grads, egrads, hgrads), loss = carry
        total = (lambda t: None if t is None
                 else jax.tree.map(lambda a: jax.lax.psum(a, self.axis), t))
        return jax.lax.psum(loss, self.axis), PipelineGrads(grads, total(egrads), total(hgrads))

    def _trace_types(self) -> None:
        """What a stage input, the loss and the stage's stored VJP residuals look like, their
        varying axes included (e.g. `model` when the stream is sequence-sharded, the replica axes
        of the parameters): traced once for the types; the values are dead code."""
        x0 = self._embed(self.eparams, index(self.inputs, 0))
        self.x_shape, self.x_dtype = x0.shape, x0.dtype
        self.act_vma = self.batch_vma | varying_axes(x0)
        pc0 = jax.tree.map(lambda a: a[0], self.params)
        side0 = index(self.side, 0)
        with weight_grad.splitting(self.prog.split):
            y0, vjp0 = jax.vjp(lambda pc, x: self._stage(pc, x, side0), pc0,
                               vary_over(x0, self.act_vma))
        self.recipe, stored = split_vjp(vjp0, pc0)
        self.wres_types, self.markers = [], []
        if self.prog.split:
            leaves0, vjp_def = jax.tree_util.tree_flatten(vjp0)
            # traced with the varying axes the leaves have inside a tick (`pipeline` included)
            leaves0 = [vary_over(a, varying_axes(a) | self.batch_vma) for a in leaves0]
            self.bw = weight_grad.split(
                lambda lv, g: jax.tree.leaves(jax.tree_util.tree_unflatten(vjp_def, lv)(g)),
                leaves0, vary_over(jnp.zeros_like(y0), self.act_vma), cast=vary_over)
            if self.bw.out_unknown[-1]:
                raise ValueError("zb1: the stage's input cotangent depends on a weight-gradient "
                                 "pass; the B / W split found no input-gradient part")
            self.wres_types = [_Type(a.shape, a.dtype, weight_grad.varying(a) | self.batch_vma)
                               for a in self.bw.residuals]
            self.markers = [leaves0[i] for i in self.bw.markers]
        # varying over `pipeline` too: a branch of the tick's switch (whose index does) makes them
        self.res_types = ([_Type(a.shape, a.dtype, varying_axes(a) | self.batch_vma)
                           for a in stored] if self.prog.residuals else [])
        l0 = self._loss(self.hparams, y0, index(self.targets, 0))
        self.loss_vma = self.batch_vma | varying_axes(l0)
        self.nothing = zeros(self.x_shape, self.x_dtype, self.act_vma)
        self.zero_loss = zeros((), jnp.float32, self.loss_vma)

    def _no_res(self):
        return [zeros(t.shape, t.dtype, t.vma) for t in self.res_types]

    def _embed(self, ep, raw):
        return raw if self.embed_fn is None else self.embed_fn(ep, raw)

    def _stage(self, pc, x, side):
        y = self.stage_fn(pc, x) if side is None else self.stage_fn(pc, x, side)
        if y.shape != x.shape or y.dtype != x.dtype:
            raise ValueError(f"stage_fn must map activations to the same shape and dtype: "
                             f"{x.shape} {x.dtype} -> {y.shape} {y.dtype}")
        return y

    def _loss(self, hp, y, tgt):
        return self.loss_fn(hp, y, tgt) if self.has_head else self.loss_fn(y, tgt)

    def _chunk(self, c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False),
                            self.params)

    def _branch(self, branch: Branch, seg: Segment):
        """``(operands, grads) -> (y to send on, dx to send back, loss, grads[, residuals to
        store, the loss's own output cotangent])``: the branch's forward, then its backward (the
        bracketed outputs only in a segment with forwards, when residuals are stored)."""
        fwd, bwd, fused, wgt, wfused = branch
        keeps = seg.forward and self.prog.residuals
        passes_w = seg.backward and self.prog.split  # B's outputs for W go to the buffer

        def run(ops: _Operands, acc):
            y, dx, loss, kept, own, wres = (self.nothing, self.nothing, self.zero_loss, None,
                                            self.nothing, None)
            if fwd is not None:
                y, loss, acc, kept, own = self._forward(fwd, ops, acc)
            if bwd is not None:  # B and W of one micro-batch in one tick: the joint backward
                dx, acc, wres = self._backward(bwd, ops, acc, (kept, own) if fused else None,
                                               split=wgt is None or not wfused)
            if wgt is not None and not wfused:
                acc = self._weight(ops, acc, None)
            kept = self._no_res() if kept is None else kept
            wres = self._no_wres() if wres is None else wres
            return ((y, dx, loss, acc) + ((kept, own) if keeps else ())
                    + ((wres,) if passes_w else ()))
        return run

    def _forward(self, step: Step, ops: _Operands, acc):
        """``F``: its output (the loss on the last stage), and when residuals are stored, its
        VJP residuals and (last stage) the loss's cotangent, the head's gradient added."""
        pc, raw = self._chunk(ops.fc), ops.raw_f
        x = vary_over(self._embed(self.eparams, raw[0]), self.act_vma) if step.first else ops.x
        if not self.prog.residuals:
            y = self._stage(pc, x, raw[1])
            if step.last:
                loss = self._loss(self.hparams, y, ops.tgt_f) * (1.0 / self.s.m)
                return self.nothing, vary_over(loss.astype(jnp.float32), self.loss_vma), acc, \
                    None, self.nothing
            return vary_over(y, self.act_vma), self.zero_loss, acc, None, self.nothing
        with weight_grad.splitting(self.prog.split):
            y, vjp = jax.vjp(lambda pc, x: self._stage(pc, x, raw[1]), pc, x)
        kept = [vary_over(a, t.vma) for a, t in zip(split_vjp(vjp, pc)[1], self.res_types)]
        if not step.last:
            return vary_over(y, self.act_vma), self.zero_loss, acc, kept, self.nothing
        loss, head_vjp = jax.vjp(
            lambda hp, y: self._loss(hp, y, ops.tgt_f) * (1.0 / self.s.m), self.hparams, y)
        dhp, dy = head_vjp(jnp.ones_like(loss))
        sg, eg, hg = acc
        hg = add(hg, dhp) if hg is not None else hg
        loss = vary_over(loss.astype(jnp.float32), self.loss_vma)
        return self.nothing, loss, (sg, eg, hg), kept, vary_over(dy, self.act_vma)

    def _backward(self, step: Step, ops: _Operands, acc, direct, split: bool = True):
        """``B``: the stage's backward from its stored residuals (``direct``: those of the
        forward just run, and its loss cotangent), or recomputing its forward first; for a split
        backward, only its input-gradient part and what ``W`` needs (``split=False``: with the
        weight gradients, as when ``W`` follows in the same tick)."""
        sg, eg, hg = acc
        pc, raw = self._chunk(ops.bc), ops.raw_b
        wres = None
        if self.prog.residuals:
            kept, g = direct if direct is not None else (
                [read(b, ops.res_slot) for b in ops.res], ops.g)
            if self.prog.split and split:  # B: the input cotangent; keep what W needs
                outs, wres = weight_grad.run_known(self.bw, vjp_leaves(self.recipe, pc, kept), g)
                dpc, dx = None, outs[-1]
                sg = add_chunk_leaves(sg, ops.bc, outs[:-1])
                wres = [vary_over(a, t.vma) for a, t in zip(wres, self.wres_types)]
            else:
                dpc, dx = join_vjp(self.recipe, pc, kept)(g)
            if step.first and eg is not None:  # the embedding's backward (a scatter-add)
                eg = add(eg, jax.vjp(lambda ep: self._embed(ep, raw[0]), self.eparams)[1](dx)[0])
        else:
            def run(pc, ep, hp, x):
                y = self._stage(pc, self._embed(ep, raw[0]) if step.first else x, raw[1])
                return self._loss(hp, y, ops.tgt_b) * (1.0 / self.s.m) if step.last else y
            out, vjp = jax.vjp(run, pc, self.eparams, self.hparams, ops.xb)
            dpc, dep, dhp, dx = vjp(jnp.ones_like(out) if step.last else ops.g)
            eg = add(eg, dep) if step.first and eg is not None else eg
            hg = add(hg, dhp) if step.last and hg is not None else hg
        sg = sg if dpc is None else add_chunk(sg, ops.bc, dpc)
        dx = self.nothing if step.first else vary_over(dx, self.act_vma)
        return dx, (sg, eg, hg), wres

    def _weight(self, ops: _Operands, acc, direct):
        """``W``: the stage's weight gradients from what its ``B`` kept (``direct``: the ``B``
        of this tick's)."""
        sg, eg, hg = acc
        wres = direct if direct is not None else [read(b, ops.wres_slot) for b in ops.wres]
        outs = weight_grad.run_unknown(self.bw, wres, self.markers)
        return add_chunk_leaves(sg, ops.wc, outs[:-1]), eg, hg

    def _no_wres(self):
        return [zeros(t.shape, t.dtype, t.vma) for t in self.wres_types]

    def _tick_of(self, seg: Segment):
        """The scan body of ``seg``: run this rank's branch of the tick, then send the forward
        output to rank ``r + 1`` and the input cotangent to rank ``r - 1``, and store what
        arrives, and what the forward keeps, in their slots."""
        p, keeps = self.s.p, seg.forward and self.prog.residuals
        branches = [self._branch(b, seg) for b in ((Branch(None, None, False),) + seg.branches)]
        passes_w = seg.backward and self.prog.split

        def tick(carry, row):
            acts, cots, res, wres, acc, loss = carry                 # acts: [A + 1, b, s, h]
            f_mb, b_mb = row[col.F_MB], row[col.B_MB]
            ops = _Operands(
                fc=row[col.F_CHUNK], bc=row[col.B_CHUNK],
                raw_f=(index(self.inputs, f_mb), index(self.side, f_mb)),
                tgt_f=index(self.targets, f_mb),
                raw_b=(index(self.inputs, b_mb), index(self.side, b_mb)),
                tgt_b=index(self.targets, b_mb),
                x=read(acts, row[col.ACT_SLOT]) if seg.forward else self.nothing,
                xb=(read(acts, row[col.B_ACT_SLOT]) if seg.backward and not self.prog.residuals
                    else self.nothing),
                g=read(cots, row[col.GRAD_SLOT]) if seg.backward else self.nothing,
                res=res, res_slot=row[col.RES_SLOT], wc=row[col.W_CHUNK],
                wres=wres if seg.weight else None, wres_slot=row[col.WRES_SLOT])
            out = jax.lax.switch(row[col.KIND], branches, ops, acc)
            y, dx, dloss, acc = out[:4]
            n_pairs = p if self.prog.cyclic else p - 1
            if p > 1 and seg.sends_forward:
                y = self.send(y, [(r, (r + 1) % p) for r in range(n_pairs)])   # r -> r + 1
                acts = write(acts, row[col.RECV_ACT], y)
            if p > 1 and seg.sends_backward:
                dx = self.send(dx, [((r + 1) % p, r) for r in range(n_pairs)])  # r -> r - 1
                cots = write(cots, row[col.RECV_GRAD], dx)
            if keeps:
                kept, own = out[4:6]
                cots = write(cots, row[col.OWN_GRAD], own)
                res = [write(b, row[col.WRITE_RES], a) for b, a in zip(res, kept)]
            if passes_w:
                wres = [write(b, row[col.WRITE_WRES], a) for b, a in zip(wres, out[-1])]
            return (acts, cots, res, wres, acc, loss + dloss), None
        return tick


# ----------------------------------------------------------------------------------------------
# A stage's VJP residuals: what a F keeps for its B
# ----------------------------------------------------------------------------------------------
# A stage's VJP split into the arrays a pipeline must keep and the parameters it already has.
#
# ``jax.vjp(stage, params, x)`` returns the backward as a ``jax.tree_util.Partial`` whose leaves are
# the residuals: what the stage's remat policy saved of its forward (every intermediate under no
# remat, the linear layers' outputs under selective recompute, each layer's input under full) and
# the parameters the backward multiplies by. The pipeline stores the former in a residual slot from
# a micro-batch's ``F`` to its ``B`` (so ``B`` runs only the backward, as in an unpipelined step)
# and takes the latter from the stage's parameters again at ``B``: a slot never holds weights.
# Which leaf is which is decided once per trace, by identity with the parameter leaves passed in.

class Recipe(NamedTuple):
    """How to rebuild a stage's VJP: its tree structure, and per leaf its source: ``i >= 0`` is
    parameter leaf ``i``, ``-1 - j`` is stored leaf ``j``."""

    treedef: Any
    sources: tuple[int, ...]


def split_vjp(vjp_fn, params) -> tuple[Recipe, list[jax.Array]]:
    """``vjp_fn`` (of ``params`` and the stage input) -> (its :class:`Recipe`, the leaves to
    store: those that are not one of ``params``'s leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    index = {id(a): i for i, a in enumerate(jax.tree.leaves(params))}
    sources, stored = [], []
    for a in leaves:
        if id(a) in index:
            sources.append(index[id(a)])
        else:
            sources.append(-1 - len(stored))
            stored.append(a)
    return Recipe(treedef, tuple(sources)), stored


def vjp_leaves(recipe: Recipe, params, stored: list[jax.Array]) -> list[jax.Array]:
    """The VJP function's leaves, in order, from the stored leaves and the stage's parameters."""
    p = jax.tree.leaves(params)
    return [p[s] if s >= 0 else stored[-1 - s] for s in recipe.sources]


def join_vjp(recipe: Recipe, params, stored: list[jax.Array]):
    """The VJP function again, from the stored leaves and the stage's parameters."""
    return jax.tree_util.tree_unflatten(recipe.treedef, vjp_leaves(recipe, params, stored))


# ----------------------------------------------------------------------------------------------
# The transfer: a stage output to the next rank
# ----------------------------------------------------------------------------------------------
# How a stage's output travels to the next pipeline rank: one ``ppermute`` over the pipeline
# axis, optionally of each tensor-parallel rank's ``1/n`` slice only (Narayanan et al. 2021,
# sec. 4.1, "scatter/gather": the activations are replicated over the ``model`` axis, so each rank
# sends its slice over the slow pipeline link and the receiver all-gathers them over the fast one).

def all_gather_invariant(x, axis: str, dim: int):
    """All-gather whose result is typed replicated (invariant) over ``axis``, as its input was
    before it was sliced. Public in newer JAX; jax 0.10 has it only internally."""
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis, axis=dim, tiled=True)


def sender(axis: str, split: tuple[str, int] | None) -> Callable:
    """``send(x, perm)``: ``ppermute`` over ``axis``, of ``1/n`` slices when ``split`` is set."""
    if split is None:
        return lambda x, perm: jax.lax.ppermute(x, axis, perm)
    name, dim = split
    mesh = jax.sharding.get_abstract_mesh()
    if name in mesh.manual_axes:
        n = jax.lax.axis_size(name)

        def send(x, perm):
            size = x.shape[dim] // n
            part = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(name) * size, size, dim)
            return all_gather_invariant(jax.lax.ppermute(part, axis, perm), name, dim)
        return send

    def spec(*entries):
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))

    def send(x, perm):  # GSPMD: a nested manual region over `name` sends each device's shard
        sliced = jax.sharding.PartitionSpec(*[None] * dim, name)
        moved = jax.shard_map(lambda part: jax.lax.ppermute(part, axis, perm), mesh=mesh,
                              in_specs=sliced, out_specs=sliced, axis_names=frozenset({name}))
        # replicated on both sides, or the propagation pulls the sliced layout into the stages
        x = jax.lax.with_sharding_constraint(x, spec())
        return jax.lax.with_sharding_constraint(moved(x), spec())
    return send


# ----------------------------------------------------------------------------------------------
# Buffers: zeros with a varying-axes type, accumulation, slot reads and writes
# ----------------------------------------------------------------------------------------------
# Small array helpers of the pipeline runtime (:mod:`jaxtp.pipeline.runtime`): zero buffers with a
# given varying-axes type, gradient accumulation into a chunk, and slot reads and writes.

def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which ``x`` varies (its type's ``vma``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary_over(x, axes):
    """``pcast`` to varying over those of ``axes`` that ``x`` does not already vary over."""
    missing = tuple(a for a in sorted(axes) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros(shape, dtype, vma):
    return vary_over(jnp.zeros(shape, dtype), vma)


def zeros_like(tree):
    return jax.tree.map(lambda a: zeros(a.shape, a.dtype, varying_axes(a)), tree)


def add(acc, d):
    return jax.tree.map(jnp.add, acc, d)


def add_chunk(grads, c, d):
    """``grads[c] += d`` on every leaf (``c`` traced)."""
    return jax.tree.map(lambda g, x: jax.lax.dynamic_update_index_in_dim(
        g, jax.lax.dynamic_index_in_dim(g, c, 0, keepdims=False) + x, c, 0), grads, d)


def add_chunk_leaves(grads, c, d: list):
    """``grads[c] += d`` for the leaves of ``grads`` whose entry in the flat list ``d`` is not
    ``None`` (a split backward's ``B`` or ``W`` part)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    return jax.tree_util.tree_unflatten(treedef, [
        g if x is None else jax.lax.dynamic_update_index_in_dim(
            g, jax.lax.dynamic_index_in_dim(g, c, 0, keepdims=False) + x.astype(g.dtype), c, 0)
        for g, x in zip(leaves, d)])


def index(tree, i):
    """Micro-batch ``i`` (traced) of every leaf of ``tree``."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def read(buf, slot):
    return jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


def write(buf, slot, value):  # an unused write goes to a dead or the scratch slot
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, 0)
