"""The devices, the mesh and what runs on it: simulated CPU devices and the line a run prints
about its devices, mesh building (ICI x DCN), the sharding tables (the only code that writes
PartitionSpecs), the Megatron collectives, the two execution modes' operators, ring attention,
the data-parallel gradient sync, multi-process start-up, and the validation of a config on a
mesh."""

from jaxtp.parallel import distributed
from jaxtp.parallel.collectives import combine_from_experts, copy_to_model, dispatch_to_experts
from jaxtp.parallel.devices import (cpu_fallback_warning, cpu_pool_threads, describe_devices,
                                    prepare_cpu_runtime, use_cpu_devices)
from jaxtp.parallel.execution import TP_REDUCED, ExplicitOps, GSPMDOps, LocalOps, gather_params
from jaxtp.parallel.grad_sync import mark_data_parallel, sync_grads
from jaxtp.parallel.mesh import build_mesh, dcn_degrees, describe_mesh, mesh_shape, resolve_degrees
from jaxtp.parallel.ring import from_layout, positions_for_layout, to_layout
from jaxtp.parallel.sharding import (
    Rules,
    ZeroLayout,
    activation_rules,
    batch_spec,
    named,
    param_rules,
    param_specs,
    restrict,
    zero_layout,
    zero_specs,
)
from jaxtp.parallel.validation import (
    batch_shards,
    check_experts,
    check_sequence,
    padded_seq_len,
    validate,
)

__all__ = [
    "ExplicitOps", "GSPMDOps", "LocalOps", "Rules", "TP_REDUCED", "ZeroLayout", "activation_rules",
    "batch_shards", "batch_spec", "build_mesh", "check_experts", "check_sequence",
    "combine_from_experts", "copy_to_model", "cpu_fallback_warning", "cpu_pool_threads", "dcn_degrees", "describe_devices", "describe_mesh", "dispatch_to_experts", "distributed", "from_layout", "gather_params", "mark_data_parallel", "mesh_shape", "named", "padded_seq_len", "param_rules", "param_specs", "positions_for_layout", "prepare_cpu_runtime", "resolve_degrees", "restrict", "sync_grads", "to_layout", "use_cpu_devices", "validate", "zero_layout", "zero_specs"
]
