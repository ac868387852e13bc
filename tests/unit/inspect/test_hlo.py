"""The census parser on each of XLA's replica-group spellings (expected groups worked by hand)."""

from jaxtp.inspect import hlo

MESH_2x4 = {"pipeline": 1, "data": 2, "fsdp": 1, "context": 1, "expert": 1, "model": 4}
MODEL_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]
DATA_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]


def _sorted(groups):
    return sorted(sorted(g) for g in groups)


def test_explicit_lists():
    g = hlo.parse_replica_groups("replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add", 8)
    assert g == DATA_GROUPS
    assert hlo.groups_to_axes(g, MESH_2x4) == ("data",)


def test_iota_form():
    assert hlo.parse_replica_groups("replica_groups=[2,4]<=[8], x", 8) == MODEL_GROUPS
    g = hlo.parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8)
    assert g == DATA_GROUPS
    assert hlo.groups_to_axes(g, MESH_2x4) == ("data",)


def test_mesh_form():
    g = hlo.parse_replica_groups(
        "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}, x", 8)
    assert _sorted(g) == MODEL_GROUPS
    g = hlo.parse_replica_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, use_global_device_ids=true", 8)
    # device grid [[0,4],[1,5],[2,6],[3,7]]; reducing over axis_0 groups each column
    assert _sorted(g) == MODEL_GROUPS
    g = hlo.parse_replica_groups(
        "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, x", 8)
    assert _sorted(g) == DATA_GROUPS
    assert hlo.groups_to_axes(g, MESH_2x4) == ("data",)


def test_permute_pairs_and_all_devices():
    pairs = hlo.parse_replica_groups("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", 8)
    assert hlo.groups_to_axes(pairs, MESH_2x4) == ("model",)
    everyone = hlo.parse_replica_groups("replica_groups={}, to_apply=%add", 8)
    assert hlo.groups_to_axes(everyone, MESH_2x4) == ("data", "model")


HLO = """HloModule m, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %v = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%v, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[4,8]{1,0} all-reduce(%d), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[4,8]) tuple(%z, %a)
  %w = (s32[], f32[4,8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %g = f32[4,8]{1,0} get-tuple-element(%w), index=1
  %ags = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%g), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  ROOT %rs = f32[1,8]{1,0} reduce-scatter(%g), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}
"""


def test_loop_trip_counts_async_and_bytes():
    ops = {op.kind: op for op in hlo.collectives(HLO, MESH_2x4)}
    ar, ag, rs = ops["all-reduce"], ops["all-gather"], ops["reduce-scatter"]
    assert (ar.axes, ar.executions, ar.bytes) == (("model",), 5, 4 * 8 * 4)
    assert (ag.axes, ag.executions, ag.bytes) == (("data",), 1, 8 * 8 * 4)  # the -done's shape
    assert (rs.axes, rs.bytes) == (("model",), 1 * 8 * 4 * 4)  # reduce-scatter: its input
    rows = {r["kind"]: r for r in hlo.census(list(ops.values()))}
    assert rows["all-reduce"]["count"] == 5 and rows["all-reduce"]["bytes"] == 5 * 128
    # matmul FLOPs: 2 x (4 x 8) x 8 per trip, 5 trips
    assert hlo.dot_flops(HLO) == 2 * 4 * 8 * 8 * 5
