"""Pipeline runtime: execute a :mod:`jaxtp.schedules` table over the ``pipeline`` mesh axis.

Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B / PipeDream-Flush, Narayanan et al. 2019;
interleaved 1F1B, Narayanan et al. 2021, sec. 2.2) cuts the model into ``p * v`` stages, stage
``k`` on pipeline rank ``k % p`` as its chunk ``k // p``, and streams ``m`` micro-batches through
them. :mod:`jaxtp.schedules` decides *when* each rank runs which forward (``F``) or backward
(``B``) pass; this module turns that table into one SPMD program and runs it. The table becomes,
per rank and per tick, a row of small integers (:class:`Program`): which branch to take (idle,
or ``F`` / ``B`` of a first, middle or last stage — the first may embed raw inputs, the last adds
the loss), which chunk and micro-batch, which activation-buffer slot to read, and into which
slots to write what arrives from the neighbours at the end of the tick. A ``lax.scan`` over ticks reads this rank's row, runs the pass
under ``lax.switch`` (idle ticks do no math) and then does exactly two ``ppermute``s over
``pipeline``: the forward output to rank ``r + 1`` and the input cotangent to rank ``r - 1``
(cyclic when interleaved, so the last rank's chunk ``c`` feeds rank 0's chunk ``c + 1``). Nothing
else crosses ``pipeline`` but the scalar loss.

Memory: a rank keeps each stage input it received until that micro-batch's backward, in a
fixed-size buffer whose slots are assigned statically from the table (interval colouring of
arrival-to-backward lifetimes), so GPipe needs ``m`` slots and 1F1B about ``p``, whatever ``m``
— the point of 1F1B. The backward pass recomputes its stage's forward (``jax.vjp`` at backward
time, "full recompute" per stage as in GPipe sec. 2.3): only stage inputs are stored, never the
stage's internal activations. Stage 0 reads its inputs from ``microbatches`` and stores nothing.
Optionally the pipeline owns the embedding (``embed_fn`` on stage 0) and the loss head
(``head_params`` of ``loss_fn`` on the last stage), whose gradients are summed over ``pipeline``
once per step, so a whole language model runs with only its blocks split into stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtp.axes import PIPELINE
from jaxtp.layer_order import ranks_to_stages, stages_to_ranks  # noqa: F401  (public here too)
from jaxtp.schedules import Schedule, ScheduleError, check_pipeline

# columns of Program.rows
KIND, CHUNK, MICROBATCH, ACT_SLOT, GRAD_SLOT, RECV_ACT, RECV_GRAD = range(7)


@dataclass(frozen=True)
class Program:
    """A schedule compiled to per-rank integer rows: ``rows[tick, rank, column]``.

    Columns: ``KIND`` (``lax.switch`` branch: 0 idle, ``1 + i`` for ``passes[i]``), ``CHUNK``,
    ``MICROBATCH``, ``ACT_SLOT`` (activation slot the pass reads its stage input from; -1: stage 0,
    read ``microbatches``), ``GRAD_SLOT`` (slot of the output cotangent a ``B`` reads; -1: the
    last stage, seeded by the loss), ``RECV_ACT`` /
    ``RECV_GRAD`` (slot to store what arrives from rank ``r - 1`` / ``r + 1`` at the end of the
    tick; -1: nothing arrives).
    """

    schedule: Schedule
    rows: np.ndarray        # int32 [ticks, p, 7]
    passes: tuple[tuple[str, bool, bool], ...]  # (kind, first stage?, last stage?) per branch
    act_slots: int          # activation buffer size (stage inputs held per rank)
    grad_slots: int         # cotangent buffer size

    @property
    def cyclic(self) -> bool:
        return self.schedule.v > 1


def _assign_slots(lifetimes: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Interval colouring: ``(written at end of tick a, last read at tick b, key)`` -> slot.
    A slot read for the last time at tick ``b`` can take a value written at the end of ``b``."""
    free_at: list[int] = []  # per slot, the tick of its occupant's last read
    slot_of = {}
    for a, b, key in sorted(lifetimes):
        for s, end in enumerate(free_at):
            if end <= a:
                break
        else:
            s = len(free_at)
            free_at.append(0)
        free_at[s] = b
        slot_of[key] = s
    return slot_of, len(free_at)


def compile_schedule(schedule: Schedule) -> Program:
    """The per-rank program of ``schedule``: branch and buffer slots for every (tick, rank)."""
    s = schedule
    check_pipeline(s.name, s.p, s.m, s.v)
    split = sorted({t.kind for t in s.table} - {"F", "B"})
    if split:  # ZB-H1's weight-gradient passes: a table to simulate, not yet a runtime
        raise ScheduleError(f"pipeline_schedule={s.name}: the runtime runs F and B passes only, "
                            f"not {', '.join(split)} (a split backward); use gpipe, 1f1b or "
                            f"interleaved")
    p, n_stages = s.p, s.p * s.v
    at = {(t.kind, t.stage, t.microbatch): t.tick for t in s.table}
    acts = [[] for _ in range(p)]   # per rank: lifetimes of received stage inputs
    grads = [[] for _ in range(p)]  # per rank: lifetimes of received output cotangents
    for t in s.table:
        if t.kind == "F" and t.stage + 1 < n_stages:
            k = t.stage + 1
            acts[k % p].append((t.tick, at[("B", k, t.microbatch)], (k, t.microbatch)))
        if t.kind == "B" and t.stage > 0:
            k = t.stage - 1
            grads[k % p].append((t.tick, at[("B", k, t.microbatch)], (k, t.microbatch)))
    act_slot, grad_slot, n_act, n_grad = {}, {}, 1, 1
    for r in range(p):
        slots, n = _assign_slots(acts[r])
        act_slot.update(slots)
        n_act = max(n_act, n)
        slots, n = _assign_slots(grads[r])
        grad_slot.update(slots)
        n_grad = max(n_grad, n)
    rows = np.full((s.ticks, p, 7), -1, np.int32)
    rows[:, :, KIND] = rows[:, :, CHUNK] = rows[:, :, MICROBATCH] = 0
    passes = sorted({(t.kind, t.stage == 0, t.stage == n_stages - 1) for t in s.table})
    for t in s.table:
        first, last = t.stage == 0, t.stage == n_stages - 1
        key = (t.stage, t.microbatch)
        row = rows[t.tick, t.device]
        row[KIND] = 1 + passes.index((t.kind, first, last))
        row[CHUNK], row[MICROBATCH] = t.chunk, t.microbatch
        if not first:
            row[ACT_SLOT] = act_slot[key]
        if t.kind == "B" and not last:
            row[GRAD_SLOT] = grad_slot[key]
        if t.kind == "F" and not last:  # arrives at the next rank at the end of this tick
            rows[t.tick, (t.stage + 1) % p, RECV_ACT] = act_slot[(t.stage + 1, t.microbatch)]
        if t.kind == "B" and not first:
            rows[t.tick, (t.stage - 1) % p, RECV_GRAD] = grad_slot[(t.stage - 1, t.microbatch)]
    return Program(schedule=s, rows=rows, passes=tuple(passes), act_slots=n_act,
                   grad_slots=n_grad)


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which ``x`` varies (its type's ``vma``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary_over(x, axes):
    """``pcast`` to varying over those of ``axes`` that ``x`` does not already vary over."""
    missing = tuple(a for a in sorted(axes) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _all_gather_invariant(x, axis: str, dim: int):
    """All-gather whose result is typed replicated (invariant) over ``axis``, as its input was
    before it was sliced. Public in newer JAX; jax 0.10 has it only internally."""
    gather = getattr(jax.lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis, axis=dim, tiled=True)


def _sender(axis: str, split: tuple[str, int] | None) -> Callable:
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
            return _all_gather_invariant(jax.lax.ppermute(part, axis, perm), name, dim)
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
                            side=None) -> tuple[jax.Array, PipelineGrads]:
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
    run = _Run(schedule, stage_fn, loss_fn, embed_fn, microbatches, axis=axis, side=side)
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


def _zeros(shape, dtype, vma):
    return vary_over(jnp.zeros(shape, dtype), vma)


def _zeros_like(tree):
    return jax.tree.map(lambda a: _zeros(a.shape, a.dtype, varying_axes(a)), tree)


def _add(acc, d):
    return jax.tree.map(jnp.add, acc, d)


def _add_chunk(grads, c, d):
    """``grads[c] += d`` on every leaf (``c`` traced)."""
    return jax.tree.map(lambda g, x: jax.lax.dynamic_update_index_in_dim(
        g, jax.lax.dynamic_index_in_dim(g, c, 0, keepdims=False) + x, c, 0), grads, d)


def _index(tree, i):
    """Micro-batch ``i`` (traced) of every leaf of ``tree``."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _read(buf, slot):
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(slot, 0), 0, keepdims=False)


def _write(buf, slot, value):  # slot -1: keep the buffer as it is
    i = jnp.maximum(slot, 0)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, _read(buf, i)),
                                               i, 0)


class _Run:
    """One rank's execution of a :class:`Program`: the passes as ``lax.switch`` branches and the
    tick that runs one of them and exchanges with the neighbours."""

    def __init__(self, schedule: Schedule, stage_fn, loss_fn, embed_fn, microbatches, *,
                 axis: str, side=None):
        self.s, self.prog, self.axis = schedule, compile_schedule(schedule), axis
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
        rows = jnp.take(jnp.asarray(self.prog.rows), rank, axis=1)       # [ticks, 7]: this rank's
        carry = (_zeros((self.prog.act_slots, *self.x_shape), self.x_dtype, self.act_vma),
                 _zeros((self.prog.grad_slots, *self.x_shape), self.x_dtype, self.act_vma),
                 (_zeros_like(self.params), _zeros_like(self.eparams),
                  _zeros_like(self.hparams)), self.zero_loss)
        self.send = _sender(self.axis, send_split)
        (_, _, (grads, egrads, hgrads), loss), _ = jax.lax.scan(self._tick, carry, rows)
        total = (lambda t: None if t is None
                 else jax.tree.map(lambda a: jax.lax.psum(a, self.axis), t))
        return jax.lax.psum(loss, self.axis), PipelineGrads(grads, total(egrads), total(hgrads))

    def _trace_types(self) -> None:
        """What a stage input and the loss look like, their varying axes included (e.g. `model`
        when the stream is sequence-sharded, the replica axes of the parameters): traced once
        for the types; the values are dead code."""
        x0 = self._embed(self.eparams, _index(self.inputs, 0))
        self.x_shape, self.x_dtype = x0.shape, x0.dtype
        self.act_vma = self.batch_vma | varying_axes(x0)
        y0 = self._stage(jax.tree.map(lambda a: a[0], self.params), vary_over(x0, self.act_vma),
                         _index(self.side, 0))
        l0 = self._loss(self.hparams, y0, _index(self.targets, 0))
        self.loss_vma = self.batch_vma | varying_axes(l0)
        self.nothing = _zeros(self.x_shape, self.x_dtype, self.act_vma)
        self.zero_loss = _zeros((), jnp.float32, self.loss_vma)

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

    def _pass(self, kind: str, first: bool, last: bool):
        """One branch: ``(chunk, raw input, stage input, output cotangent, target, grads) ->
        (y to send on, dx to send back, loss, grads)``. ``B`` recomputes the stage forward."""
        def run(pc, ep, hp, x, raw, tgt):  # raw: (stage 0's input, the side data)
            y = self._stage(pc, self._embed(ep, raw[0]) if first else x, raw[1])
            return self._loss(hp, y, tgt) * (1.0 / self.s.m) if last else y

        def forward(c, raw, x, g, tgt, acc):
            out = run(self._chunk(c), self.eparams, self.hparams, x, raw, tgt)
            if last:
                loss = vary_over(out.astype(jnp.float32), self.loss_vma)
                return self.nothing, self.nothing, loss, acc
            return vary_over(out, self.act_vma), self.nothing, self.zero_loss, acc

        def backward(c, raw, x, g, tgt, acc):
            sg, eg, hg = acc
            out, vjp = jax.vjp(lambda pc, ep, hp, x: run(pc, ep, hp, x, raw, tgt),
                               self._chunk(c), self.eparams, self.hparams, x)
            dpc, dep, dhp, dx = vjp(jnp.ones_like(out) if last else g)
            sg = _add_chunk(sg, c, dpc)
            eg = _add(eg, dep) if first and eg is not None else eg
            hg = _add(hg, dhp) if last and hg is not None else hg
            dx = self.nothing if first else vary_over(dx, self.act_vma)
            return self.nothing, dx, self.zero_loss, (sg, eg, hg)
        return forward if kind == "F" else backward

    def _idle(self, c, raw, x, g, tgt, acc):
        return self.nothing, self.nothing, self.zero_loss, acc

    def _tick(self, carry, row):
        """Run this rank's pass of the tick, then send the forward output to rank ``r + 1`` and
        the input cotangent to rank ``r - 1`` and store what arrives in its slots."""
        acts, cots, acc, loss = carry                                # acts: [A, b, s, h]
        p = self.s.p
        mb = row[MICROBATCH]
        raw = (_index(self.inputs, mb), _index(self.side, mb))  # stage 0's input, every stage's
        tgt = _index(self.targets, mb)
        x, g = _read(acts, row[ACT_SLOT]), _read(cots, row[GRAD_SLOT])     # [b, s, h] each
        branches = [self._idle] + [self._pass(*k) for k in self.prog.passes]
        y, dx, dloss, acc = jax.lax.switch(row[KIND], branches, row[CHUNK], raw, x, g, tgt, acc)
        if p > 1:
            n_pairs = p if self.prog.cyclic else p - 1
            y = self.send(y, [(r, (r + 1) % p) for r in range(n_pairs)])       # r -> r + 1
            dx = self.send(dx, [((r + 1) % p, r) for r in range(n_pairs)])     # r -> r - 1
        acts = _write(acts, row[RECV_ACT], y)
        cots = _write(cots, row[RECV_GRAD], dx)
        return (acts, cots, acc, loss + dloss), None
