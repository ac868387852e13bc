"""Packing a schedule table into ticks of work: at most one ``F``, one ``B`` and (split backward)
one ``W`` per rank per tick; :mod:`jaxtp.pipeline.program` compiles the result to per-rank rows."""

from __future__ import annotations

from jaxtp.pipeline.schedules import Pass, Schedule, ScheduleError, Tick, dependencies


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
