"""Pipeline schedules as data: which device runs which micro-batch's forward or backward at each tick.

A schedule is built in two steps. ``device_orders`` writes down, per pipeline device, the order
in which it runs its forward (``F``) and backward (``B``) passes: the part that distinguishes
GPipe (Huang et al. 2019: all forwards, then all backwards), 1F1B (Narayanan et al. 2019,
PipeDream-Flush: ``p - s - 1`` warm-up forwards on stage ``s``, then one forward / one backward,
then the cool-down backwards) and interleaved 1F1B (Narayanan et al. 2021: each device holds
``v`` model chunks, stage ``k`` of ``p * v`` living on device ``k % p``). ``simulate`` then runs
those orders against the data dependencies — ``F(k, i)`` needs ``F(k - 1, i)``, ``B(k, i)`` needs
``B(k + 1, i)`` and ``F(k, i)`` — one pass per device per tick, every pass one tick long, a result
usable on the next tick. The result is the table the runtime executes and that tests and plots
read: the bubble, the tick count and the activations in flight are measured from it, not assumed.

With every pass one tick, GPipe and 1F1B take ``2 (m + p - 1)`` ticks for ``m`` micro-batches on
``p`` stages (bubble fraction ``(p - 1) / (m + p - 1)``), interleaving ``2 (v m + p - 1)`` ticks of
``1/v``-sized passes (bubble ``(p - 1) / (v m + p - 1)``). 1F1B keeps at most ``p - s``
micro-batches of activations in flight on stage ``s``, GPipe all ``m``.

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3) splits each backward into the
input-gradient pass ``B`` (needed upstream at once) and the weight-gradient pass ``W`` (needed only
by the optimizer), three one-tick passes per micro-batch and stage. ``W(k, i)`` needs
``B(k, i)``. Stage ``s`` warms up with ``p - s`` forwards, then repeats ``B, W, F`` with its first
``s`` ``W`` s deferred to the cool-down, where they fill 1F1B's drain bubble: ``3 m + p - 1``
ticks, bubble ``(p - 1) / (3 m + p - 1)`` (the paper's ``(p - 1)(T_F + T_B - T_W)`` at equal
pass times), at most ``p`` micro-batches in flight on every stage (1F1B's peak, on stage 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtp.configs import PIPELINE_SCHEDULES


class ScheduleError(ValueError):
    """A schedule that cannot run with the given stages / micro-batches / virtual stages."""


@dataclass(frozen=True)
class Pass:
    """One forward or backward pass of one micro-batch through one model stage."""

    kind: str        # "F", "B" (input gradient, or the whole backward) or "W" (weight gradient)
    stage: int       # model stage, 0 .. p * v - 1
    microbatch: int


@dataclass(frozen=True)
class Tick:
    """A row of the schedule table: ``device`` runs ``kind`` of ``microbatch`` on its ``chunk``."""

    tick: int
    device: int      # pipeline rank
    chunk: int       # virtual stage on this device (0 unless interleaved)
    stage: int       # model stage = chunk * p + device
    microbatch: int
    kind: str        # "F", "B" or "W"


@dataclass(frozen=True)
class Schedule:
    name: str
    p: int
    m: int
    v: int
    table: tuple[Tick, ...]

    @property
    def ticks(self) -> int:
        return 1 + max(t.tick for t in self.table)

    @property
    def bubble_fraction(self) -> float:
        """Idle device-ticks over all device-ticks, from the table."""
        return 1.0 - len(self.table) / (self.ticks * self.p)

    @property
    def split_backward(self) -> bool:
        """Whether the backward is two passes, ``B`` (input gradient) and ``W`` (weight
        gradient), as in ZB-H1."""
        return any(t.kind == "W" for t in self.table)

    def in_flight(self, device: int) -> int:
        """Most micro-batch chunks whose forward ran on ``device`` and whose backward (its ``W``
        when split) did not yet: the activations the device must hold at its peak."""
        last = "W" if self.split_backward else "B"
        live = peak = 0
        for t in sorted((t for t in self.table if t.device == device), key=lambda t: t.tick):
            live += {"F": 1, last: -1}.get(t.kind, 0)
            peak = max(peak, live)
        return peak

    def lockstep_time(self, forward: float = 1.0, backward: float = 3.0,
                      weight: float | None = None) -> float:
        """Step time when every tick of this table (one pass per rank) lasts as long as its
        slowest pass: a tick costs ``backward`` if any rank runs a B in it, ``forward`` if only
        F s, per chunk (``/ v``). jaxtp's runtime packs the table into ticks of one F and one
        B per rank instead: ``jaxtp.pipeline.program.Program.lockstep_time``. The default
        1 : 3 is a B that recomputes the stage forward.
        Compare ``m * (forward + backward)``, one rank's busy time: GPipe's ticks
        are all-F or all-B and meet the textbook bubble; 1F1B's steady state mixes F on some
        ranks with B on others, so most of its ticks cost a B. ZB-H1's ``W`` costs ``weight``
        (default ``backward``)."""
        cost = {"F": forward, "B": backward, "W": backward if weight is None else weight}
        ticks: dict[int, float] = {}
        for t in self.table:
            ticks[t.tick] = max(ticks.get(t.tick, 0.0), cost[t.kind])
        return sum(ticks.values()) / self.v

    def grid(self) -> list[list[str]]:
        """``[device][tick]`` labels (``F3``, ``B0``, ``.`` idle; interleaved adds the chunk,
        ``F3.1``), for printing and plots."""
        rows = [["."] * self.ticks for _ in range(self.p)]
        for t in self.table:
            label = f"{t.kind}{t.microbatch}" + (f".{t.chunk}" if self.v > 1 else "")
            rows[t.device][t.tick] = label
        return rows


def textbook_bubble(p: int, m: int, v: int = 1) -> float:
    """Narayanan et al. 2021: bubble time / ideal time = (p - 1) / (v m); as a fraction of the
    whole step, (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def zero_bubble_h1_bubble(p: int, m: int) -> float:
    """Qi et al. 2023: ZB-H1's bubble ``(p - 1)(T_F + T_B - T_W)`` at ``T_F = T_B = T_W``, as a
    fraction of the whole step of ``3 m + p - 1`` pass times: ``(p - 1) / (3 m + p - 1)``."""
    return (p - 1) / (3 * m + p - 1)


def formula_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The papers' bubble fraction of schedule ``name``."""
    return zero_bubble_h1_bubble(p, m) if name == "zb1" else textbook_bubble(p, m, v)


def lockstep_ticks(name: str, p: int, m: int, v: int = 1) -> tuple[int, int]:
    """(ticks in which only forward passes run, ticks in which some rank runs a backward: a
    ``B``, or ZB-H1's ``W``) of
    :func:`build_schedule`'s table, in closed form (``tests/unit/pipeline/test_schedules.py`` checks it against the
    simulated tables): GPipe ``m + p - 1`` of each; 1F1B and interleaved ``2 (v m + p - 1)`` ticks
    of which the first ``v p`` are forward-only (the warm-up: after it every tick carries a
    backward on some rank), for ``p >= 2``; ZB-H1 ``3 m + p - 1`` of which the first ``p``.
    ``Schedule.lockstep_time(F, B) == (nf * F + nb * B) / v``."""
    check(name, p, m, v)
    if name == "gpipe":
        return m + p - 1, m + p - 1
    if name == "zb1":
        return (m, 2 * m) if p == 1 else (p, 3 * m - 1)
    if p == 1:  # one stage: its forwards and backwards alternate, one per tick
        return v * m, v * m
    ticks = 2 * (v * m + p - 1)
    return min(v * p, ticks), max(ticks - v * p, 0)


def lockstep_factor(name: str, p: int, m: int, v: int = 1, backward: float = 3.0) -> float:
    """The one-pass-per-tick table's lock-step time over one rank's busy time, ``m (F + B)``
    (jaxtp's planner uses it as an upper bound for interleaved pipelines), ``B = backward * F``:
    ``(m + p - 1) / m`` for GPipe (the textbook bubble), more for 1F1B and interleaved, whose
    steady-state ticks last a backward on every rank (1.5 for 1F1B as m grows, at B = 3F).
    ZB-H1 runs the backward as two passes, each taken as ``backward / 2``."""
    nf, nb = lockstep_ticks(name, p, m, v)
    per_tick = backward / 2 if name == "zb1" else backward
    return (nf + per_tick * nb) / v / (m * (1.0 + backward))


def check(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError for a combination the schedule cannot run."""
    if name not in PIPELINE_SCHEDULES:
        raise ScheduleError(f"pipeline_schedule={name!r}: expected one of "
                            f"{', '.join(PIPELINE_SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"pipeline={p}, microbatches={m}, virtual_stages={v}: must be >= 1")
    if name != "interleaved" and v != 1:
        raise ScheduleError(f"virtual_stages={v} needs pipeline_schedule=interleaved (got {name})")
    if name == "zb1" and m < p:
        raise ScheduleError(f"zb1 schedule: microbatches={m} is fewer than pipeline={p} stages; "
                            f"use microbatches >= {p} (or pipeline_schedule=gpipe)")
    if name == "interleaved" and m % p:
        raise ScheduleError(f"interleaved schedule: microbatches={m} must be a multiple of "
                            f"pipeline={p} (micro-batches go through the chunks in groups of p)")


def device_orders(name: str, p: int, m: int, v: int = 1) -> list[list[Pass]]:
    """Per device, the order in which it runs its passes."""
    check(name, p, m, v)
    if name == "gpipe":
        return [[Pass("F", s, i) for i in range(m)] + [Pass("B", s, i) for i in range(m)]
                for s in range(p)]
    if name == "1f1b":
        orders = []
        for s in range(p):
            warm = min(p - s - 1, m)
            order = [Pass("F", s, i) for i in range(warm)]
            for j in range(m - warm):
                order += [Pass("F", s, warm + j), Pass("B", s, j)]
            order += [Pass("B", s, j) for j in range(m - warm, m)]
            orders.append(order)
        return orders
    if name == "zb1":
        return _zb1_orders(p, m)
    # interleaved: the device's n = m * v forward units go micro-batch group by group (p at a
    # time), chunk 0 .. v-1 within a group; backward units the same with the chunks reversed.
    orders = []
    n = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:  # k-th unit -> (chunk, micro-batch)
        group, r = divmod(k, p * v)
        chunk, i = divmod(r, p)
        return (v - 1 - chunk if backward else chunk), group * p + i

    for d in range(p):
        warm = min((p - d - 1) * 2 + (v - 1) * p, n)
        order = []
        for k in range(warm):
            c, i = unit(k, False)
            order.append(Pass("F", c * p + d, i))
        for j in range(n - warm):
            c, i = unit(warm + j, False)
            order.append(Pass("F", c * p + d, i))
            c, i = unit(j, True)
            order.append(Pass("B", c * p + d, i))
        for j in range(n - warm, n):
            c, i = unit(j, True)
            order.append(Pass("B", c * p + d, i))
        orders.append(order)
    return orders


def _zb1_orders(p: int, m: int) -> list[list[Pass]]:
    """ZB-H1: stage ``s`` runs ``p - s`` warm-up forwards, then per micro-batch ``j`` its input
    gradient ``B(j)``, a weight gradient (``W(j - s)``: the first ``s`` are deferred to the
    cool-down) and the next forward; the deferred ``W`` s last. In flight: ``p`` on every stage."""
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order = [Pass("F", s, i) for i in range(warm)]
        for j in range(m):
            order.append(Pass("B", s, j))
            if j >= s:
                order.append(Pass("W", s, j - s))
            if warm + j < m:
                order.append(Pass("F", s, warm + j))
        order += [Pass("W", s, j) for j in range(max(m - s, 0), m)]
        orders.append(order)
    return orders


def dependencies(op: Pass, n_stages: int) -> list[Pass]:
    """The passes ``op`` reads the results of: ``F(k - 1, i)`` for a forward; ``F(k, i)`` and
    ``B(k + 1, i)`` for a backward; ``B(k, i)`` for a weight gradient."""
    if op.kind == "F":
        return [Pass("F", op.stage - 1, op.microbatch)] if op.stage else []
    if op.kind == "W":
        return [Pass("B", op.stage, op.microbatch)]
    deps = [Pass("F", op.stage, op.microbatch)]
    if op.stage < n_stages - 1:
        deps.append(Pass("B", op.stage + 1, op.microbatch))
    return deps


def simulate(name: str, orders: list[list[Pass]], p: int, m: int, v: int = 1) -> Schedule:
    """Run per-device orders against the pipeline's dependencies, one pass per device per tick."""
    n_stages = p * v
    done: dict[Pass, int] = {}  # pass -> tick it ran
    pos = [0] * p
    table: list[Tick] = []
    tick = 0
    total = sum(len(o) for o in orders)
    while len(table) < total:
        ran = []
        for d in range(p):
            if pos[d] == len(orders[d]):
                continue
            op = orders[d][pos[d]]
            if all(done.get(x, tick) < tick for x in dependencies(op, n_stages)):
                ran.append((d, op))
        if not ran:  # nothing new becomes ready later either: the orders deadlock
            raise ScheduleError(f"{name}: the device orders deadlock at tick {tick}")
        for d, op in ran:
            done[op] = tick
            pos[d] += 1
            table.append(Tick(tick=tick, device=d, chunk=op.stage // p, stage=op.stage,
                              microbatch=op.microbatch, kind=op.kind))
        tick += 1
    return Schedule(name=name, p=p, m=m, v=v, table=tuple(table))


def check_pipeline(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise :class:`ScheduleError` (a ``ValueError``) for a combination the runtime does not run:
    the schedule's own checks, plus 1F1B / interleaved with fewer micro-batches than stages."""
    check(name, p, m, v)
    if name in ("1f1b", "interleaved", "zb1") and m < p:
        raise ScheduleError(f"{name} schedule: microbatches={m} is fewer than pipeline={p} stages, "
                            f"so the pipeline never reaches its steady state; use microbatches "
                            f">= {p} (or pipeline_schedule=gpipe)")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule table for ``name`` on ``p`` pipeline devices, ``m`` micro-batches and ``v``
    virtual stages per device."""
    return simulate(name, device_orders(name, p, m, v), p, m, v)


def format_grid(s: Schedule) -> str:
    grid = s.grid()
    width = max(len(c) for row in grid for c in row)
    lines = [f"{s.name}: p={s.p} m={s.m} v={s.v}, {s.ticks} ticks, bubble "
             f"{s.bubble_fraction:.3f} (formula {formula_bubble(s.name, s.p, s.m, s.v):.3f})"]
    lines += [f"dev {d}: " + " ".join(c.rjust(width) for c in row) for d, row in enumerate(grid)]
    return "\n".join(lines)
