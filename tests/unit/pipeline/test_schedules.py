"""Pipeline schedule tables (jaxtp/pipeline/schedules.py): the textbook tick counts, bubbles and activation
memory come out of simulating each schedule's per-device order against the data dependencies.
Expected values are the papers' closed forms, not the code's own output."""

import itertools

import pytest

from jaxtp.pipeline import schedules
from jaxtp.pipeline.schedules import ScheduleError, build_schedule, textbook_bubble

CASES = [(p, m) for p, m in itertools.product((2, 4, 8), (1, 2, 4, 8, 16))]


def _valid(s):
    """Every pass exactly once; each device runs at most one pass per tick; dependencies hold."""
    n_stages = s.p * s.v
    ran = {(t.kind, t.stage, t.microbatch): t for t in s.table}
    assert len(ran) == len(s.table) == (3 if s.split_backward else 2) * s.m * n_stages
    assert len({(t.device, t.tick) for t in s.table}) == len(s.table)
    for t in s.table:
        assert t.device == t.stage % s.p and t.chunk == t.stage // s.p
        if t.kind == "F" and t.stage:
            assert ran[("F", t.stage - 1, t.microbatch)].tick < t.tick
        if t.kind == "B":
            assert ran[("F", t.stage, t.microbatch)].tick < t.tick
            if t.stage < n_stages - 1:
                assert ran[("B", t.stage + 1, t.microbatch)].tick < t.tick
        if t.kind == "W":
            assert ran[("B", t.stage, t.microbatch)].tick < t.tick


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", CASES)
def test_gpipe_and_1f1b_textbook(name, p, m):
    s = build_schedule(name, p, m)
    _valid(s)
    assert s.ticks == 2 * (m + p - 1)
    assert s.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert s.bubble_fraction == pytest.approx(textbook_bubble(p, m))
    if name == "gpipe":  # every micro-batch's activations are held until the backward starts
        assert [s.in_flight(d) for d in range(p)] == [m] * p
    else:  # 1F1B: stage s holds at most p - s, independent of m
        assert [s.in_flight(d) for d in range(p)] == [min(p - d, m) for d in range(p)]


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 4, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2),
                                     (4, 16, 4), (8, 8, 2), (8, 16, 3)])
def test_interleaved_textbook(p, m, v):
    s = build_schedule("interleaved", p, m, v)
    _valid(s)
    # passes are 1/v of a stage: the bubble shrinks by v (Narayanan et al. 2021, sec. 2.2)
    assert s.ticks == 2 * (v * m + p - 1)
    assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert s.bubble_fraction < build_schedule("1f1b", p, m).bubble_fraction
    # activation memory on the first device, in chunks of 1/v of a stage: Megatron-LM's warm-up
    # of 2 (p - 1) + (v - 1) p forwards plus the steady state's one, whatever m (all m v chunks
    # when m is too small to reach the steady state)
    assert s.in_flight(0) == min(2 * (p - 1) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in CASES if m >= p] + [(3, 5), (4, 7)])
def test_zero_bubble_h1(p, m):
    """ZB-H1 (Qi et al. 2023): B and W one tick each, 3 m + p - 1 ticks, bubble
    (p - 1)(T_F + T_B - T_W) = (p - 1) / (3 m + p - 1) of the step, a third of 1F1B's in pass
    times; every stage holds at most p micro-batches (1F1B's peak, stage 0's) from F to W."""
    s = build_schedule("zb1", p, m)
    _valid(s)
    assert s.split_backward and not build_schedule("1f1b", p, m).split_backward
    assert s.ticks == 3 * m + p - 1
    assert s.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert s.bubble_fraction == pytest.approx(schedules.formula_bubble("zb1", p, m))
    assert [s.in_flight(d) for d in range(p)] == [p] * p
    # idle device-ticks: (p - 1) per device against 1F1B's 2 (p - 1)
    assert s.ticks * p - len(s.table) == p * (p - 1)
    # with B + W = 1F1B's backward, each pass half of it, the step is shorter than 1F1B's
    if p > 1:
        assert s.lockstep_time(1, 1, 1) < build_schedule("1f1b", p, m).lockstep_time(1, 2)


def test_1f1b_memory_flat_in_m_gpipe_grows():
    gpipe = [build_schedule("gpipe", 4, m).in_flight(0) for m in (4, 8, 16)]
    onef = [build_schedule("1f1b", 4, m).in_flight(0) for m in (4, 8, 16)]
    assert gpipe == [4, 8, 16] and onef == [4, 4, 4]


def test_grid_labels():
    g = build_schedule("1f1b", 2, 2).grid()
    assert g == [["F0", "F1", ".", "B0", ".", "B1"], [".", "F0", "B0", "F1", "B1", "."]]


@pytest.mark.parametrize("args, match", [
    (("interleaved", 4, 6, 2), "multiple of pipeline=4"),
    (("interleaved", 4, 2, 2), "multiple of pipeline=4"),  # m < p
    (("1f1b", 4, 8, 2), "virtual_stages=2 needs pipeline_schedule=interleaved"),
    (("zigzag", 4, 8, 1), "expected one of"),
    (("zb1", 4, 8, 2), "virtual_stages=2 needs pipeline_schedule=interleaved"),
    (("gpipe", 0, 8, 1), "must be >= 1"),
])
def test_errors(args, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule(*args)


def test_a_deadlocking_order_is_reported():
    orders = schedules.device_orders("gpipe", 2, 2)
    orders[1] = orders[1][::-1]  # backward before its forward
    with pytest.raises(ScheduleError, match="deadlock"):
        schedules.simulate("gpipe", orders, 2, 2)


def test_lockstep_time():
    """jaxtp's runtime waits for the slowest pass of each tick. GPipe's ticks are all-F or all-B:
    (m + p - 1)(f + b), the textbook bubble. 1F1B at p=2, m=2 (grid F0 F1 . B0 . B1 over
    . F0 B0 F1 B1 .): ticks F, F, B, B+F, B, B = 1 + 1 + 3 + 3 + 3 + 3 = 14 against GPipe's 12."""
    for p, m in [(2, 2), (4, 8)]:
        assert schedules.build_schedule("gpipe", p, m).lockstep_time(1, 3) == (m + p - 1) * 4
        s = schedules.build_schedule("1f1b", p, m)
        assert s.lockstep_time(1, 1) == s.ticks
    assert schedules.build_schedule("1f1b", 2, 2).lockstep_time(1, 3) == 14


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                     ("interleaved", 3), ("zb1", 1)])
def test_lockstep_ticks_closed_form_equals_the_simulated_tables(name, v):
    """The planner's closed form for the forward-only / backward-carrying ticks (no table built)
    counted from the simulated tables, and the lockstep factor it gives; 1F1B tends to 1.5 at
    B = 3F, GPipe stays at the textbook (m + p - 1) / m."""
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 3 * p + 3):
            try:
                s = schedules.build_schedule(name, p, m, v)
            except schedules.ScheduleError:
                continue
            kinds = {}
            for t in s.table:
                kinds.setdefault(t.tick, set()).add(t.kind)
            backward = sum(k != {"F"} for k in kinds.values())
            assert schedules.lockstep_ticks(name, p, m, v) == (len(kinds) - backward, backward)
            b = 1.5 if name == "zb1" else 3  # ZB-H1: B and W half of the backward each
            assert schedules.lockstep_factor(name, p, m, v) == pytest.approx(
                s.lockstep_time(1, b) / (4 * m))
    assert schedules.lockstep_factor("gpipe", 4, 8) == pytest.approx(11 / 8)
    assert 1.5 < schedules.lockstep_factor("1f1b", 4, 512) < 1.51  # 1.5 + (4p - 6) / 4m
