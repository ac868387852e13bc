"""A pipeline schedule compiled to per-rank integer rows: what :mod:`jaxtp.pipeline.runtime` executes.

:mod:`jaxtp.pipeline.schedules` says in which order each rank runs its forward (``F``) and backward
(``B``) passes, one pass per tick. The runtime packs that order into *ticks of work*: a rank runs
at most one ``F`` and then at most one ``B`` per tick, so 1F1B's steady state pairs a forward with
a backward on every rank and a tick lasts ``F + B`` everywhere, as GPipe's ticks do, in about half
the ticks (Narayanan et al. 2021 count 1F1B's time this way). A pass keeps its rank's order; a
``B`` may use the ``F`` of the same tick on the same rank (the last stage's ``F`` then ``B``), any
other result is usable from the next tick on. Each packed tick becomes, per rank, a row of small
integers (:class:`Program`): which branch of the tick's ``lax.switch`` to take (a combination of
at most one ``F`` and one ``B`` pass kind), which chunks and micro-batches, which buffer slots the
passes read, and into which slots what they keep and what arrives is written. Slots are assigned
statically (interval colouring of write-to-last-read lifetimes), so a buffer holds as many entries
as the schedule keeps alive at once on one rank: GPipe ``m``, 1F1B about ``p``, whatever ``m``.
Runs of ticks in which no rank runs a ``F`` (or no rank a ``B``) are :class:`Segment` s, each its
own ``lax.scan`` with only the work it needs (GPipe: a forward scan, then a backward one).

Two ways to run a backward (``residuals``):

- stored residuals (the default): ``F`` runs ``jax.vjp`` of its stage and keeps the VJP's
  residuals (what the stage's remat policy saves: everything under no remat) in a residual slot
  until the micro-batch's ``B``, which only runs the backward: 3F of work per micro-batch, as
  without a pipeline. A stage input is held only from its arrival to its ``F``; the last stage's
  ``F`` also runs the loss and its backward (and, when its ``B`` is in the same tick, passes the
  residuals on directly instead of storing them).
- recompute: ``B`` reruns its stage's forward from the stage input (held from arrival to ``B``)
  before the backward, GPipe's per-stage full recompute (Huang et al. 2019, sec. 2.3): only stage
  inputs are stored, 4F of work per micro-batch.

Every write is unconditional: a column with nothing to write names a slot whose content is dead
at that moment (its occupant read for the last time, its next one not written yet), and only a
buffer with a moment when every slot is live gets one slot more, a scratch slot (its last). The
residual buffers, a whole stage's VJP residuals per slot, need none once ``m >= 2p - 2`` (with
fewer, a rank meets a tick that keeps nothing while all its sets are live); the one-slot
activation and cotangent buffers always do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jaxtp.pipeline.schedules import (
    Pass,
    Schedule,
    ScheduleError,
    Tick,
    check_pipeline,
    dependencies,
)

# columns of Program.rows
(KIND, F_CHUNK, F_MB, B_CHUNK, B_MB, ACT_SLOT, B_ACT_SLOT, GRAD_SLOT, RES_SLOT, WRITE_RES,
 OWN_GRAD, RECV_ACT, RECV_GRAD, W_CHUNK, W_MB, WRES_SLOT, WRITE_WRES) = range(17)
N_COLUMNS = 17


class Step(NamedTuple):
    """One pass kind of a branch: ``kind`` of a ``first`` / ``last`` stage (``last``: it runs
    the loss)."""

    kind: str
    first: bool
    last: bool


class Branch(NamedTuple):
    """A rank's work in one tick: a forward, a backward (either may be ``None``), whether
    the backward is the same micro-batch's, right after its forward (the last stage), and under
    a split backward (ZB-H1) a weight-gradient pass ``weight``, last, and whether it is the
    micro-batch of the tick's backward (``weight_fused``: it takes the backward's output
    directly)."""

    forward: Step | None
    backward: Step | None
    fused: bool
    weight: Step | None = None
    weight_fused: bool = False


@dataclass(frozen=True)
class Segment:
    """Ticks ``[start, stop)``, run by one ``lax.scan`` whose ``lax.switch`` has ``branches``
    (``KIND`` indexes them; 0 is idle); ``forward`` / ``backward``: whether any rank runs one;
    ``sends_forward`` / ``sends_backward``: whether one of them has a next (previous) stage to send
    its output (input cotangent) to."""

    start: int
    stop: int
    forward: bool
    backward: bool
    branches: tuple[Branch, ...]
    sends_forward: bool
    sends_backward: bool
    weight: bool = False   # whether any rank runs a weight-gradient pass (split backward)


@dataclass(frozen=True)
class Program:
    """A schedule compiled to per-rank integer rows: ``rows[tick, rank, column]``.

    Columns: ``KIND`` (branch of the tick's segment), ``F_CHUNK`` / ``F_MB`` and ``B_CHUNK`` /
    ``B_MB`` (chunk and micro-batch of the forward and the backward); the slots the passes read:
    ``ACT_SLOT`` (the forward's stage input; stage 0 reads ``microbatches``), ``B_ACT_SLOT`` (the
    backward's, when it recomputes), ``GRAD_SLOT`` (the output cotangent), ``RES_SLOT`` (the
    residuals); the slots written: ``WRITE_RES`` and ``OWN_GRAD`` (the forward's residuals and the
    last stage's loss cotangent, before the tick's backward), ``RECV_ACT`` / ``RECV_GRAD`` (what
    arrives from rank ``r - 1`` / ``r + 1`` at the end of the tick). A column with nothing to read
    holds slot 0; one with nothing to write, a slot that is dead then, or the buffer's scratch
    slot (``*_slots``) if it has one (``scratch``: the buffers that do, of ``act``, ``grad``,
    ``res``, ``wres``; :meth:`buffer_slots` is a buffer's size).
    """

    schedule: Schedule
    rows: np.ndarray        # int32 [ticks, p, N_COLUMNS]
    segments: tuple[Segment, ...]
    residuals: bool         # B reads stored VJP residuals (else recomputes its stage)
    act_slots: int          # stage inputs held per rank (arrival -> F, or -> B when recomputing)
    grad_slots: int         # output cotangents held per rank
    res_slots: int          # VJP residual sets held per rank (F -> B; 0 when recomputing)
    wres_slots: int = 0     # weight-gradient inputs held per rank (B -> W; split backward only)
    scratch: frozenset[str] = frozenset({"act", "grad", "res", "wres"})

    def buffer_slots(self, name: str) -> int:
        """Entries of buffer ``name`` (``act``, ``grad``, ``res``, ``wres``): its slots, and its
        scratch slot if it needs one."""
        n = {"act": self.act_slots, "grad": self.grad_slots, "res": self.res_slots,
             "wres": self.wres_slots}[name]
        return n + (name in self.scratch)

    @property
    def split(self) -> bool:
        """Whether the backward runs as two passes, ``B`` then ``W`` (ZB-H1)."""
        return self.schedule.split_backward

    @property
    def cyclic(self) -> bool:
        return self.schedule.v > 1

    @property
    def ticks(self) -> int:
        return len(self.rows)

    @property
    def stash_slots(self) -> int:
        """Micro-batches whose backward state a rank holds at its peak: residual sets, or the
        stage inputs when ``B`` recomputes."""
        return self.res_slots if self.residuals else self.act_slots

    @property
    def transfers(self) -> int:
        """``ppermute`` s over the pipeline axis per step: activations in ticks of a segment with
        forwards, cotangents in ticks of one with backwards (none for one stage)."""
        if self.schedule.p == 1:
            return 0
        return sum((s.stop - s.start) * (s.sends_forward + s.sends_backward)
                   for s in self.segments)

    def branch_weights(self, rank: int) -> dict[int, tuple[float, ...]]:
        """How often ``rank`` takes each branch of each segment's ``lax.switch``, as fractions
        of the segment's ticks, keyed by the branch count (:data:`jaxtp.inspect.hlo.BranchWeights`; the
        segments' counts differ, see :func:`compile_schedule`)."""
        out = {}
        for seg in self.segments:
            kinds = self.rows[seg.start:seg.stop, rank, KIND]
            n = len(seg.branches) + 1
            out[n] = tuple(float((kinds == k).sum()) / len(kinds) for k in range(n))
        return out

    def lockstep_time(self, forward: float = 1.0, backward: float = 2.0,
                      weight: float | None = None) -> float:
        """Step time when every tick lasts as long as its busiest rank's work (``forward`` for
        its ``F``, ``backward`` for its ``B``, ``weight`` for a split backward's ``W``; a
        chunk's pass is ``1 / v`` of that). The default 1 : 2 is a backward from stored
        residuals; split, ``B`` and ``W`` default to half of it each."""
        if self.split:
            backward, weight = (backward / 2, backward / 2) if weight is None else (backward,
                                                                                   weight)
        weight = 0.0 if weight is None else weight
        per_rank = [self.executed(r) for r in range(self.schedule.p)]
        return sum(max(((b.forward is not None) * forward + (b.backward is not None) * backward
                        + (b.weight is not None) * weight)
                       for b in tick if b is not None)
                   for tick in zip(*per_rank) if any(tick)) / self.schedule.v

    def executed(self, rank: int) -> list[Branch | None]:
        """Per tick, the branch ``rank`` runs (``None``: idle)."""
        out = []
        for seg in self.segments:
            for k in self.rows[seg.start:seg.stop, rank, KIND]:
                out.append(seg.branches[k - 1] if k else None)
        return out


def stores_residuals(schedule: str, remat: str) -> bool:
    """Whether jaxtp's pipelined model keeps VJP residuals (else recomputes each stage in its
    backward): not under ``remat=full``, which asks to keep stage inputs only, and not for GPipe,
    which holds every micro-batch until its backwards start: GPipe's own answer is to keep only
    stage inputs and recompute (Huang et al. 2019, sec. 2.3); m whole residual sets made the
    step slower on the simulated CPU mesh (1.2x at 16 layers, p=2, m=8), memory-bound.
    ZB-H1 always does: its ``B`` / ``W`` split is a split of the stored VJP (under
    ``remat=full`` the residuals are the layer inputs)."""
    return schedule == "zb1" or (remat != "full" and schedule != "gpipe")


def _assign_slots(lifetimes: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Interval colouring: ``(written at time a, last read at time b, key)`` -> slot; a slot
    takes a new value written after its occupant's last read."""
    free_at: list[int] = []  # per slot, the time of its occupant's last read
    slot_of = {}
    for a, b, key in sorted(lifetimes):
        for s, end in enumerate(free_at):
            if end < a:
                break
        else:
            s = len(free_at)
            free_at.append(0)
        free_at[s] = b
        slot_of[key] = s
    return slot_of, len(free_at)


def _dead_slots(lifetimes: list[tuple[int, int, Any]], slot_of: dict, n: int,
                at_time: int) -> list[int]:
    """The slots of one rank's buffer whose content is dead at ``at_time`` (a write time): no
    occupant written at or before it is read after it."""
    live = {slot_of[key] for a, b, key in lifetimes if a <= at_time < b}
    return [s for s in range(n) if s not in live]


def _colour(per_rank: list[list]) -> tuple[dict, int]:
    """Slots for every rank's lifetimes; the size is the busiest rank's (at least 1)."""
    slot, n = {}, 1
    for lifetimes in per_rank:
        s, k = _assign_slots(lifetimes)
        slot.update(s)
        n = max(n, k)
    return slot, n


# Times inside tick t, for slot lifetimes: the forward reads at 4t, the backward at 4t + 2, and
# what the forward keeps and what arrives are written at 4t + 3, after the tick's passes (a
# backward that needs its own tick's forward takes it directly, not from a slot).
def _lifetimes(s: Schedule, table: list[Tick], residuals: bool, fused: set,
               weight_fused: set) -> tuple:
    """Per rank: (written, last read, (stage, micro-batch)) of stage inputs, output cotangents,
    residual sets and (split backward) weight-gradient inputs."""
    p, n_stages = s.p, s.p * s.v
    at = {(t.kind, t.stage, t.microbatch): t.tick for t in table}
    acts, grads, res, wres = ([[] for _ in range(p)] for _ in range(4))
    for t in table:
        key = (t.stage, t.microbatch)
        if t.kind == "F" and t.stage + 1 < n_stages:
            k = t.stage + 1
            read = (4 * at[("F", k, t.microbatch)] if residuals
                    else 4 * at[("B", k, t.microbatch)] + 2)
            acts[k % p].append((4 * t.tick + 3, read, (k, t.microbatch)))
        if t.kind == "F" and residuals and key not in fused:
            res[t.device].append((4 * t.tick + 3, 4 * at[("B", *key)] + 2, key))
            if t.stage == n_stages - 1:  # the loss's cotangent, kept for this stage's B
                grads[t.device].append((4 * t.tick + 3, 4 * at[("B", *key)] + 2, key))
        if t.kind == "B" and t.stage > 0:
            k = t.stage - 1
            grads[k % p].append((4 * t.tick + 3, 4 * at[("B", k, t.microbatch)] + 2,
                                 (k, t.microbatch)))
        if t.kind == "W" and key not in weight_fused:
            wres[t.device].append((4 * at[("B", *key)] + 3, 4 * t.tick + 2, key))
    return acts, grads, res, wres


def _segments(rows: np.ndarray, work: dict) -> tuple[Segment, ...]:
    """Runs of ticks with the same (any forward?, any backward?); each gets the branches its
    ticks use, and a branch count different from every other segment's (padded with idle
    branches) so that the census can weight each segment's switch by its own frequencies."""
    ticks = len(rows)
    flags = [(any(b.forward for b in work[t].values()),
              any(b.backward or b.weight for b in work[t].values())) for t in range(ticks)]
    segs, start, counts = [], 0, set()
    for t in range(1, ticks + 1):
        if t < ticks and flags[t] == flags[start]:
            continue
        used = sorted({b for u in range(start, t) for b in work[u].values()}, key=str)
        n = len(used)
        while n + 1 in counts:
            n += 1
        counts.add(n + 1)
        branches = tuple(used) + (Branch(None, None, False),) * (n - len(used))
        for u in range(start, t):
            for d, b in work[u].items():
                rows[u, d, KIND] = 1 + branches.index(b)
        segs.append(Segment(start, t, *flags[start], branches,
                            any(b.forward and not b.forward.last for b in used),
                            any(b.backward and not b.backward.first for b in used),
                            any(b.weight for b in used)))
        start = t
    return tuple(segs)


def compile_schedule(schedule: Schedule, *, residuals: bool = True) -> Program:
    """The per-rank program of ``schedule``: branch and buffer slots for every (tick, rank)."""
    s = schedule
    check_pipeline(s.name, s.p, s.m, s.v)
    if s.split_backward and not residuals:
        raise ScheduleError(f"pipeline_schedule={s.name}: a split backward (B, then W) splits "
                            f"the stored VJP; compile it with residuals=True")
    p, n_stages = s.p, s.p * s.v
    table = pack(s)
    ticks = 1 + max(t.tick for t in table)
    at = {(t.kind, t.stage, t.microbatch): t.tick for t in table}
    fused = {(t.stage, t.microbatch) for t in table if t.kind == "F" and residuals
             and at[("B", t.stage, t.microbatch)] == t.tick}
    weight_fused = {(t.stage, t.microbatch) for t in table
                    if t.kind == "W" and at[("B", t.stage, t.microbatch)] == t.tick}
    acts, grads, res, wres = _lifetimes(s, table, residuals, fused, weight_fused)
    (act_slot, n_act), (grad_slot, n_grad) = _colour(acts), _colour(grads)
    res_slot, n_res = _colour(res) if residuals else ({}, 0)
    wres_slot, n_wres = _colour(wres) if s.split_backward else ({}, 0)
    rows = np.zeros((ticks, p, N_COLUMNS), np.int32)
    for col, n in ((ACT_SLOT, n_act), (B_ACT_SLOT, n_act), (RECV_ACT, n_act), (GRAD_SLOT, n_grad),
                   (RECV_GRAD, n_grad), (OWN_GRAD, n_grad)):
        rows[:, :, col] = n  # the scratch slot
    rows[:, :, [RES_SLOT, WRITE_RES, WRES_SLOT, WRITE_WRES]] = -1  # unused: filled in at the end
    work: dict[int, dict[int, Branch]] = {t: {} for t in range(ticks)}
    for t in table:
        first, last = t.stage == 0, t.stage == n_stages - 1
        key = (t.stage, t.microbatch)
        row = rows[t.tick, t.device]
        fwd, bwd, fuse, wgt, wfuse = work[t.tick].get(t.device, Branch(None, None, False))
        if t.kind == "W":
            wgt, wfuse = Step("W", first, last), key in weight_fused
            row[W_CHUNK], row[W_MB] = t.chunk, t.microbatch
            if not wfuse:
                row[WRES_SLOT] = wres_slot[key]
        elif t.kind == "F":
            fwd = Step("F", first, last)
            row[F_CHUNK], row[F_MB] = t.chunk, t.microbatch
            if not first:
                row[ACT_SLOT] = act_slot[key]
            if residuals and key not in fused:
                row[WRITE_RES] = res_slot[key]
                if last:
                    row[OWN_GRAD] = grad_slot[key]
            if not last:  # arrives at the next rank at the end of this tick
                rows[t.tick, (t.stage + 1) % p, RECV_ACT] = act_slot[(t.stage + 1, t.microbatch)]
        else:
            bwd = Step("B", first, last and not residuals)  # stored: the loss ran in F
            fuse = key in fused
            row[B_CHUNK], row[B_MB] = t.chunk, t.microbatch
            if not first and not residuals:
                row[B_ACT_SLOT] = act_slot[key]
            if not fuse and (not last or residuals):
                row[GRAD_SLOT] = grad_slot[key]
            if residuals and not fuse:
                row[RES_SLOT] = res_slot[key]
            if s.split_backward and key not in weight_fused:
                row[WRITE_WRES] = wres_slot[key]
            if not first:
                rows[t.tick, (t.stage - 1) % p, RECV_GRAD] = grad_slot[(t.stage - 1, t.microbatch)]
        work[t.tick][t.device] = Branch(fwd, bwd, fuse, wgt, wfuse)
    scratch = {"act", "grad"}
    for name, cols, lifetimes, slot_of, n in (("res", (RES_SLOT, WRITE_RES), res, res_slot, n_res),
                                              ("wres", (WRES_SLOT, WRITE_WRES), wres, wres_slot,
                                               n_wres)):
        if _fill_unused(rows, *cols, lifetimes, slot_of, n):
            scratch.add(name)
    segments = _segments(rows, work)
    return Program(schedule=s, rows=rows, segments=segments, residuals=residuals,
                   act_slots=n_act, grad_slots=n_grad, res_slots=n_res, wres_slots=n_wres,
                   scratch=frozenset(scratch))


def _fill_unused(rows: np.ndarray, read_col: int, write_col: int, lifetimes: list[list],
                 slot_of: dict, n: int) -> bool:
    """Point a residual buffer's unused reads (``-1``) at slot 0 and each unused write at a slot
    whose content is dead at that tick's write time (``4 t + 3``), or at the scratch slot ``n``
    when every slot is live; ``True`` if some write needs the scratch slot."""
    reads = rows[:, :, read_col]
    reads[reads < 0] = 0
    needs_scratch = False
    for t, r in zip(*np.nonzero(rows[:, :, write_col] < 0)):
        dead = _dead_slots(lifetimes[r], slot_of, n, 4 * int(t) + 3) if n else [0]
        rows[t, r, write_col] = dead[0] if dead else n
        needs_scratch |= not dead
    return needs_scratch


# ----------------------------------------------------------------------------------------------
# Packing: the schedule table in ticks of work (at most one F, one B and, for a split backward,
# one W per rank per tick), which compile_schedule turns into rows
# ----------------------------------------------------------------------------------------------

def in_flight_cap(s: Schedule, device: int) -> int:
    """Micro-batches (chunk passes) ``device`` may hold in the packed program: the table's own
    peak, except 1F1B's. In lock-step ticks of ``F + B`` a micro-batch's trip from stage ``d``
    to the last stage and back takes ``2 (p - 1 - d) + 1`` ticks, so with the table's ``p - d``
    in flight the rank would idle the rest of the trip and the step take 1.1-1.5x GPipe's; with
    ``2 (p - d) - 1`` every steady-state tick pairs a forward with a backward and the step takes
    GPipe's ``(m + p - 1) (F + B)`` -- still independent of ``m``. ZB-H1 holds a micro-batch
    until its ``W``, and stage ``d`` defers ``d`` of them, so its cap is ``d`` more,
    ``2 p - d - 1`` (with 1F1B's cap the middle ranks of p = 8 stalled: 1.12x 1F1B's lock-step
    time at m = 16): its ticks then carry ``F + B + W`` in the steady state, and the
    cool-down's deferred ``W`` s share ticks with the last ``B`` s, ``(p - 1) F`` less than
    1F1B's step at ``W = B = F``, holding 1F1B's residual sets plus ``p - 1`` of ``W`` inputs."""
    if s.name == "1f1b":
        return min(max(2 * (s.p - device) - 1, s.in_flight(device)), s.m)
    if s.name == "zb1":
        return min(max(2 * s.p - device - 1, s.in_flight(device)), s.m)
    return s.in_flight(device)


def pack(s: Schedule) -> list[Tick]:
    """The schedule in ticks of at most one ``F``, then one ``B``, then (split backward) one
    ``W`` per rank. A rank runs its backwards in the table's order, each after the forwards the
    table puts before it; its weight-gradient passes in order, each after the backwards the
    table puts before it (ZB-H1 defers the first ``s`` of stage ``s`` to the cool-down, where
    they fill the bubble); its forwards in order too, each as soon as its input is ready and the
    rank holds fewer than :func:`in_flight_cap` micro-batches (so a forward may run ahead of the
    table's ticks). A ``B`` may use the ``F`` just run on its rank in the same tick (the last
    stage's), a ``W`` the ``B``."""
    n_stages = s.p * s.v
    split = s.split_backward
    order: list[list[Tick]] = [[] for _ in range(s.p)]
    for t in sorted(s.table, key=lambda t: t.tick):
        order[t.device].append(t)
    fwd = [[t for t in o if t.kind == "F"] for o in order]
    bwd = [[t for t in o if t.kind == "B"] for o in order]
    wgt = [[t for t in o if t.kind == "W"] for o in order]

    def counts_before(kind_counted: str, kind_at: str) -> list[list[int]]:
        """Per rank, per pass of ``kind_at``: how many of ``kind_counted`` its order puts first."""
        out = []
        for o in order:
            n, row = 0, []
            for t in o:
                n += t.kind == kind_counted
                if t.kind == kind_at:
                    row.append(n)
            out.append(row)
        return out
    before_b = counts_before("F", "B")  # per backward, the forwards its rank's table runs first
    before_w = counts_before("B", "W")  # per weight pass, the backwards
    caps = [in_flight_cap(s, d) for d in range(s.p)]
    done: dict[Pass, int] = {}
    nf, nb, nw, out, tick = [0] * s.p, [0] * s.p, [0] * s.p, [], 0

    def ready(t: Tick, *also: Tick | None) -> bool:
        ok = {Pass(a.kind, a.stage, a.microbatch) for a in also if a is not None}
        return all(done.get(x, tick) < tick or x in ok
                   for x in dependencies(Pass(t.kind, t.stage, t.microbatch), n_stages))

    def choose(d: int, forward: bool):
        f = (fwd[d][nf[d]] if forward and nf[d] < len(fwd[d]) and ready(fwd[d][nf[d]])
             else None)
        b = bwd[d][nb[d]] if nb[d] < len(bwd[d]) else None
        if b is not None and not (before_b[d][nb[d]] <= nf[d] + (f is not None)
                                  and ready(b, f)):
            b = None
        w = wgt[d][nw[d]] if nw[d] < len(wgt[d]) else None
        if w is not None and not (before_w[d][nw[d]] <= nb[d] + (b is not None)
                                  and ready(w, b)):
            w = None
        return f, b, w

    while any(nb[d] < len(bwd[d]) or nw[d] < len(wgt[d]) for d in range(s.p)):
        ran = []
        for d in range(s.p):
            f, b, w = choose(d, True)
            freed = (nw[d] + (w is not None)) if split else (nb[d] + (b is not None))
            if f is not None and nf[d] + 1 - freed > caps[d]:
                f, b, w = choose(d, False)
            nf[d] += f is not None
            nb[d] += b is not None
            nw[d] += w is not None
            ran += [t for t in (f, b, w) if t is not None]
        if not ran:
            raise ScheduleError(f"{s.name}: the packed orders deadlock at tick {tick}")
        for t in ran:
            done[Pass(t.kind, t.stage, t.microbatch)] = tick
            out.append(Tick(tick=tick, device=t.device, chunk=t.chunk, stage=t.stage,
                            microbatch=t.microbatch, kind=t.kind))
        tick += 1
    return out
