import jax
import pytest

from jaxtp.configs import schema as config
from jaxtp.step import engine
from jaxtp.configs.schema import ConfigError, ParallelConfig
from jaxtp.configs import AXES
from jaxtp.parallel.mesh import build_mesh, resolve_degrees


def test_axes_order_model_innermost():
    mesh = build_mesh(ParallelConfig(data=2, model=4))
    assert mesh.axis_names == AXES and AXES[-1] == "model"
    assert dict(mesh.shape) == {"pipeline": 1, "data": 2, "fsdp": 1, "context": 1, "expert": 1,
                                "model": 4}
    # model innermost: consecutive devices form one tensor-parallel group
    ids = [[d.id for d in row] for row in mesh.devices.reshape(2, 4)]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_infer_one_degree():
    assert resolve_degrees(ParallelConfig(data=-1, model=2), 8)["data"] == 4
    assert resolve_degrees(ParallelConfig(data=2, model=-1), 8)["model"] == 4


def test_mesh_product_mismatch_names_fix():
    with pytest.raises(ConfigError, match=r"needs 12 devices but 8 are available.*parallel.data=2"):
        resolve_degrees(ParallelConfig(data=3, model=4), 8)


def test_two_inferred_degrees():
    with pytest.raises(ConfigError, match="at most one parallel degree may be -1"):
        resolve_degrees(ParallelConfig(data=-1, model=-1), 8)


def test_inferred_not_divisible():
    with pytest.raises(ConfigError, match="cannot infer parallel.data"):
        resolve_degrees(ParallelConfig(data=-1, model=3), 8)


@pytest.mark.parametrize("overrides, match", [
    (["parallel.data=1", "parallel.model=8", "model.n_heads=4", "model.n_kv_heads=4"],
     "n_heads=4 is not divisible by parallel.model=8"),
    (["parallel.data=2", "parallel.model=4", "model.n_kv_heads=2"],
     "n_kv_heads=2 is not divisible by parallel.model=4"),
    (["parallel.data=8", "train.batch_size=4"], "batch_size=4 is not divisible"),
    (["parallel.data=8", "train.batch_size=16", "train.microbatches=4"],
     "must split into train.microbatches=4"),
    (["parallel.data=1", "parallel.model=8", "train.batch_size=8"], None),
    (["parallel.data=4", "parallel.pipeline=2", "train.microbatches=1"], "microbatches=1 is fewer"),
])
def test_invalid_configs_fail_before_compile(overrides, match):
    cfg = config.load("tiny", overrides)
    if match is None:
        engine.build_engine(cfg)  # valid: builds without error
        return
    with pytest.raises(ConfigError, match=match):
        engine.build_engine(cfg)


def test_device_count_is_eight():
    assert len(jax.devices()) == 8
