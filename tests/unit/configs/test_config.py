import pytest

from jaxtp.configs import schema as config
from jaxtp.configs.schema import ConfigError


def test_presets_exist_and_validate():
    for name in ("tiny", "gpt2-small", "gpt3-1.3b", "llama2-7b", "gpt3-175b"):
        cfg = config.load(name)
        assert cfg.model.n_layers > 0


def test_param_counts_match_published_sizes():
    # GPT-2 small is "124M", Llama 2 7B is 6.74B, GPT-3 175B is 175B: our formula must land there.
    assert config.load("gpt2-small").model.param_count() == pytest.approx(124e6, rel=0.02)
    assert config.load("llama2-7b").model.param_count() == pytest.approx(6.74e9, rel=0.01)
    assert config.load("gpt3-175b").model.param_count() == pytest.approx(175e9, rel=0.01)


def test_overrides_parse_types():
    cfg = config.load("tiny", ["parallel.model=4", "parallel.mode=explicit",
                               "model.tie_embeddings=true", "train.lr=1e-4"])
    assert cfg.parallel.model == 4 and cfg.parallel.mode == "explicit"
    assert cfg.model.tie_embeddings is True and cfg.train.lr == 1e-4


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="parallel.model"):
        config.load("tiny", ["parallel.modle=4"])
    with pytest.raises(ConfigError, match="valid keys are"):
        config.load("tiny", ["nosuch.field=1"])


@pytest.mark.parametrize("override, match", [
    ("parallel.model=four", "not an integer"),
    ("parallel.mode=magic", r"choose one of \['gspmd', 'explicit'\]"),
    ("model.tie_embeddings=maybe", "not a boolean"),
    ("train.lr=fast", "not a number"),
    ("parallel.model", "section.field=value"),
])
def test_bad_values_are_clear_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        config.load("tiny", [override])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="presets are"):
        config.load("gpt5")


def test_model_consistency_errors():
    with pytest.raises(ConfigError, match="multiple of model.n_kv_heads"):
        config.load("tiny", ["model.n_heads=8", "model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match="must be positive"):
        config.load("tiny", ["model.n_layers=0"])


def test_padded_vocab():
    m = config.load("gpt2-small").model
    assert m.padded_vocab_size(1) == 50304
    assert m.padded_vocab_size(8) % (128 * 8) == 0 and m.padded_vocab_size(8) >= 50257


def test_attention_impl_xla_equals_default_and_cudnn_needs_a_gpu():
    import numpy as np

    from jaxtp import testing
    from jaxtp.step import engine

    batch = testing.random_batch(config.load("tiny"))
    losses = []
    for impl in ("default", "xla"):
        cfg = config.load("tiny", [f"model.attention_impl={impl}", "parallel.data=4",
                                   "parallel.model=2"])
        eng = engine.build_engine(cfg)
        params = eng.layout.shard_params(testing.pad_params(engine.reference_params(cfg), eng))
        losses.append(float(eng.loss()(params, eng.layout.shard_batch(batch))))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    with pytest.raises(ConfigError, match="attention_impl=cudnn needs NVIDIA GPUs"):
        engine.build_engine(config.load("tiny", ["model.attention_impl=cudnn"]))
    with pytest.raises(ConfigError, match="attention_impl"):
        config.load("tiny", ["model.attention_impl=flash"])
