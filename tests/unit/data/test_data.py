import numpy as np
import pytest

from jaxtp import data
from jaxtp.configs.schema import ConfigError, DataConfig


def _loader(**kw):
    tokens = np.arange(10 * 8 + 1, dtype=np.uint16)  # exactly 10 windows of 8 (+1) tokens
    args = dict(batch_size=4, seq_len=8, seed=3) | kw
    return data.Loader(tokens, **args)


def test_batches_are_next_token_pairs():
    b = _loader().batch_at(0)
    assert b["inputs"].shape == (4, 8) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    np.testing.assert_array_equal(b["inputs"][:, 0] % 8, 0)  # windows start on the grid


def test_every_window_once_per_epoch():
    loader = _loader(batch_size=2)  # 10 windows = 5 steps per epoch
    for epoch in range(3):
        seen = np.concatenate([loader.window_ids(s) for s in range(5 * epoch, 5 * epoch + 5)])
        assert sorted(seen) == list(range(10))
    # the order differs between epochs
    assert not np.array_equal(np.concatenate([loader.window_ids(s) for s in range(5)]),
                              np.concatenate([loader.window_ids(s) for s in range(5, 10)]))


def test_epoch_boundary_inside_a_batch():
    loader = _loader(batch_size=4)  # 10 windows: step 2 straddles epochs 0 and 1
    first = np.concatenate([loader.window_ids(s) for s in range(2)] + [loader.window_ids(2)[:2]])
    assert sorted(first) == list(range(10))


def test_deterministic_and_resumable():
    a, b = _loader(), _loader()
    for _ in range(3):
        next(a)
    b.restore(a.state())
    np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    np.testing.assert_array_equal(_loader().batch_at(7)["inputs"], _loader().batch_at(7)["inputs"])


def test_processes_split_the_global_batch():
    whole = _loader(batch_size=4).batch_at(5)["inputs"]
    parts = [_loader(batch_size=4, process_index=p, process_count=2).batch_at(5)["inputs"]
             for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_corpus_too_small_and_bad_path():
    with pytest.raises(ConfigError, match="fewer than train.batch_size"):
        _loader(batch_size=11)
    with pytest.raises(ConfigError, match="does not exist"):
        data.load_tokens(DataConfig(path="/no/such/file.txt"))


def test_default_corpus_and_token_files(tmp_path):
    tokens = data.load_tokens(DataConfig())
    assert tokens.dtype == np.uint8 and len(tokens) > 1_000_000
    assert b"def " in tokens[:100_000].tobytes()
    arr = np.arange(1000, dtype=np.uint16)
    arr.tofile(tmp_path / "toks.bin")
    np.testing.assert_array_equal(data.load_tokens(DataConfig(path=str(tmp_path / "toks.bin"))),
                                  arr)
    (tmp_path / "a.txt").write_text("hello")
    assert data.load_tokens(DataConfig(path=str(tmp_path / "a.txt"))).tobytes() == b"hello"


def test_split_holds_out_the_tail():
    train, held = data.train_eval_split(np.arange(100), 0.1)
    assert len(train) == 90 and held[0] == 90


def test_bpe_tokenizer_trains_locally_and_round_trips(tmp_path):
    text = ("def add(a, b):\n    return a + b\n" * 200).encode()
    (tmp_path / "code.py").write_text(text.decode())
    cfg = DataConfig(path=str(tmp_path / "code.py"), tokenizer="bpe")
    ids = data.load_tokens(cfg, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    assert ids.max() < 300 and len(ids) < len(text) / 2  # merges compress the text
    tok = data.bpe_tokenizer(cfg, text, 300, str(tmp_path / "cache"))  # the cached one
    assert tok.decode(ids[:50].tolist()) == tok.decode(tok.encode(text.decode()).ids[:50])
    with pytest.raises(ConfigError, match="model.vocab_size"):
        data.bpe_tokenizer(DataConfig(tokenizer="bpe",
                                      tokenizer_path=str(tmp_path / "cache" / "bpe-300.json")),
                           text, 100, None)
