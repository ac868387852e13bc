"""docs/config.md is what scripts/make_config_reference.py writes from the config dataclasses, so
the reference stays current: after changing a config field, its default or its comment, run
``python scripts/make_config_reference.py`` and commit the result."""

import dataclasses
import importlib.util
from pathlib import Path

from jaxtp.configs import schema

ROOT = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_config_reference", ROOT / "scripts" / "make_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_config_reference_is_current():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == _generator().render(), (
        "docs/config.md is out of date: run python scripts/make_config_reference.py")


def test_reference_lists_every_key_and_preset():
    text = _generator().render()
    for key in schema.valid_keys(schema.Config()):
        assert f"| `{key}` |" in text, key
    for name in schema.PRESETS:
        assert f"| `{name}` |" in text, name


def test_comments_are_read_from_beside_and_above_a_field():
    comments = _generator().field_comments(schema.ModelConfig)
    assert comments["head_dim"] == "0 = d_model // n_heads"  # beside
    assert comments["vocab_pad_multiple"].startswith("The embedding rows are padded")  # above
    assert set(comments) == {f.name for f in dataclasses.fields(schema.ModelConfig)}
