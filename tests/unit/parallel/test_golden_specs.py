"""Golden sharding files (as MaxText keeps them): every parameter's PartitionSpec for each preset
on one representative mesh, stored in tests/golden/param_specs.json. A change to the sharding
tables, the ZeRO placement or a parameter's logical names shows up here as a diff.

Regenerate after an intended change (and review the diff)::

    python tests/unit/parallel/test_golden_specs.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "param_specs.json"

# one representative mesh of 8 devices per preset: TP x ZeRO-3 inside fsdp (x EP for MoE)
MESHES = {
    "tiny-moe": ["parallel.expert=2", "parallel.fsdp=1", "parallel.data=1", "parallel.model=4"],
}
DEFAULT_MESH = ["parallel.fsdp=2", "parallel.data=1", "parallel.model=4"]


def spec_table(preset: str) -> dict[str, str]:
    import jax

    from jaxtp.configs import schema as config
    from jaxtp.step.layout import build_layout

    cfg = config.load(preset, MESHES.get(preset, DEFAULT_MESH))
    lo = build_layout(cfg, training=False)
    leaves = jax.tree_util.tree_flatten_with_path(
        lo.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): str(tuple(v))
            for k, v in leaves}


def all_tables() -> dict[str, dict[str, str]]:
    from jaxtp.configs.schema import PRESETS

    return {name: spec_table(name) for name in sorted(PRESETS)}


def test_param_specs_match_the_golden_file():
    want = json.loads(GOLDEN.read_text())
    got = all_tables()
    assert sorted(got) == sorted(want), "presets changed; regenerate: python " + __file__
    for preset in want:
        diff = {k: (want[preset].get(k), got[preset].get(k))
                for k in set(want[preset]) | set(got[preset])
                if want[preset].get(k) != got[preset].get(k)}
        assert not diff, (f"{preset}: specs changed (golden, now): {diff}; if intended, "
                          f"regenerate with: python tests/unit/parallel/test_golden_specs.py")


def test_the_golden_file_pins_tensor_parallel_and_zero():
    want = json.loads(GOLDEN.read_text())["tiny"]
    assert want["blocks.attn.w_qkv"] == "(None, 'fsdp', 'model', None, None)"
    assert want["embed.table"] == "('model', 'fsdp')"


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(all_tables(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
