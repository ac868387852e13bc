"""Real data (issue 20): documents from JSONL / Parquet / ArrayRecord / text / .bin, packed rows
with segment ids and per-document positions, weighted mixtures, ``jaxtp prepare-data``, exact
resume after kill -9 with a mixture, process-sharded rows, and one-line errors for bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxtp.cli import commands as cli
from jaxtp.configs import schema as config
from jaxtp.data import corpus
from jaxtp.data import batches as data
from jaxtp.configs.schema import ConfigError, DataConfig
from jaxtp.data.prepare_data import prepare
from jaxtp.testing import kill_when_saved, train_env

DOCS = [f"document {i}: " + "abcdefghij"[i % 10] * (3 + 7 * i % 41) for i in range(60)]


def _jsonl(path: Path, docs=DOCS, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _cfg(*overrides):
    return config.load("tiny", ["train.batch_size=4", "train.seq_len=16",
                                "data.eval_fraction=0.1", *overrides])


# ----------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------

def test_every_format_reads_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    _jsonl(tmp_path / "d.jsonl")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet")
    w = ArrayRecordWriter(str(tmp_path / "d.arrayrecord"), "group_size:1")
    for d in DOCS:
        w.write(json.dumps({"text": d}).encode())
    w.close()
    (tmp_path / "files").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "files" / f"{i:03d}.txt").write_text(d)
    want = np.concatenate([np.frombuffer(d.encode(), np.uint8).tolist() + [0] for d in DOCS])
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in DOCS])])
    for name in ("d.jsonl", "d.parquet", "d.arrayrecord", "files"):
        (_, _, stream), = corpus.open_streams(DataConfig(path=str(tmp_path / name)))
        np.testing.assert_array_equal(stream.read(0, len(stream)), want, err_msg=name)
        np.testing.assert_array_equal(stream.offsets, starts, err_msg=name)


def test_token_file_splits_documents_at_eos(tmp_path):
    toks = np.array([5, 6, 0, 7, 8, 9, 0, 4], np.uint16)
    toks.tofile(tmp_path / "t.bin")
    (_, _, stream), = corpus.open_streams(DataConfig(path=str(tmp_path / "t.bin")))
    np.testing.assert_array_equal(stream.offsets, [0, 3, 7, 8])
    (_, _, flat), = corpus.open_streams(DataConfig(path=str(tmp_path / "t.bin"), packing=False))
    assert flat.offsets is None


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------

def _loader(tmp_path, *overrides, process_index=0, process_count=1):
    cfg = _cfg(*overrides)
    train, _ = data.loaders(cfg, process_index=process_index, process_count=process_count)
    return train


def test_packed_rows_keep_document_boundaries(tmp_path):
    # document i is 3 + i tokens of value i + 1, then the end-of-document token 0
    lengths = [3 + i for i in range(40)]
    stream = np.concatenate([[i + 1] * n + [0] for i, n in enumerate(lengths)]).astype(np.uint16)
    stream.tofile(tmp_path / "t.bin")
    starts = np.concatenate([[0], np.cumsum([n + 1 for n in lengths])])
    loader = _loader(tmp_path, f"data.path={tmp_path / 't.bin'}")
    src = loader.sources[0]
    b = src.windows(np.arange(src.n_windows))
    assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    s = 16
    for w in range(src.n_windows):
        x, y, seg, pos, mask = (b[k][w] for k in ("inputs", "targets", "segment_ids",
                                                   "positions", "loss_mask"))
        # each token's document, read off the values (an EOS ends the document before it)
        first = np.searchsorted(starts, w * s, side="right") - 1
        doc = np.array([v - 1 if v else (x[i - 1] - 1 if i else first) for i, v in enumerate(x)])
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
        np.testing.assert_array_equal(np.diff(seg) == 1, np.diff(doc) != 0)
        assert pos[0] == w * s - starts[doc[0]]  # a row may open mid-document
        new = np.flatnonzero(np.diff(seg)) + 1
        np.testing.assert_array_equal(pos[new], 0)  # each further document starts at 0
        np.testing.assert_array_equal(np.diff(pos)[np.diff(seg) == 0], 1)
        # the loss counts a target of the same document (its EOS included), never the next's
        np.testing.assert_array_equal(mask, (y == 0) | (y - 1 == doc))
        assert (mask == 0).sum() == len(new) + (y[-1] != 0 and y[-1] - 1 != doc[-1])


def test_packing_false_is_the_continuous_stream(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("hello world " * 30)
    (tmp_path / "c" / "b.txt").write_text("second file " * 30)
    loader = _loader(tmp_path, f"data.path={tmp_path / 'c'}", "data.packing=false")
    joined = np.frombuffer((tmp_path / "c" / "a.txt").read_bytes() + b"\n" +
                           (tmp_path / "c" / "b.txt").read_bytes(), np.uint8)
    b = loader.batch_at(3)
    assert set(b) == {"inputs", "targets"}
    for row, w in zip(b["inputs"], loader.window_ids(3)):
        np.testing.assert_array_equal(row, joined[w * 16:w * 16 + 16])


# ----------------------------------------------------------------------------------------------
# Mixtures, resume, processes
# ----------------------------------------------------------------------------------------------

def _two_sources(tmp_path, reps=3):
    a = _jsonl(tmp_path / "a.jsonl", [d.upper() for d in DOCS] * reps)
    b = _jsonl(tmp_path / "b.jsonl", DOCS * reps)
    return f"data.mixture={a}:0.7,{b}:0.3"


def test_mixture_proportions_and_each_source_in_order(tmp_path):
    mix = _two_sources(tmp_path)
    loader = _loader(tmp_path, mix)
    a, b = loader.sources
    steps = 300
    batches = [next(loader) for _ in range(steps)]
    share = loader.log_fields()["data_mixture"]
    assert abs(share[a.name] - 0.7) < 0.03 and abs(sum(share.values()) - 1) < 1e-6
    # source j's rows, in the order drawn, are rows 0, 1, 2, ... of its own window stream
    rows = {a.name: [], b.name: []}
    for step, batch in enumerate(batches[:20]):
        choice = loader._choices(step)
        for src in (a, b):
            rows[src.name].append(batch["inputs"][choice == loader.sources.index(src)])
    for src in (a, b):
        got = np.concatenate(rows[src.name])
        np.testing.assert_array_equal(got, src.rows(np.arange(len(got)))["inputs"])
    again = _loader(tmp_path, mix)
    np.testing.assert_array_equal(again.batch_at(123)["inputs"], batches[123]["inputs"])


def test_resume_is_exact_and_a_changed_mixture_continues_each_source(tmp_path):
    mix = _two_sources(tmp_path)
    one = _loader(tmp_path, mix)
    for _ in range(9):
        next(one)
    state = json.loads(json.dumps(one.state()))  # what the checkpoint stores
    want = [next(one) for _ in range(5)]
    two = _loader(tmp_path, mix)
    assert two.restore(state) is None
    for w in want:
        got = next(two)
        assert all(np.array_equal(got[k], w[k]) for k in w)
    a, b = (p.split(":")[0] for p in mix.split("=", 1)[1].split(","))
    changed = _loader(tmp_path, f"data.mixture={a}:0.2,{b}:0.8")
    note = changed.restore(state)
    assert "mixture changed on resume at step 9" in note
    given = state["given"]
    choice = changed._choices(9)
    batch = changed.batch_at(9)
    for j, src in enumerate(changed.sources):
        n = int((choice == j).sum())
        np.testing.assert_array_equal(batch["inputs"][choice == j],
                                      src.rows(given[src.name] + np.arange(n))["inputs"])


def test_processes_read_disjoint_rows_of_the_global_batch(tmp_path):
    mix = _two_sources(tmp_path)
    whole = _loader(tmp_path, mix)
    parts = [_loader(tmp_path, mix, process_index=p, process_count=2) for p in range(2)]
    seen = set()
    for step in range(30):
        glob = whole.batch_at(step)
        mine = [p.batch_at(step) for p in parts]
        for k in glob:
            np.testing.assert_array_equal(np.concatenate([m[k] for m in mine]), glob[k])
        for p in parts:
            choice, k = p._plan(step)
            rows = set(zip(choice.tolist(), k.tolist()))
            assert not rows & seen
            seen |= rows
    assert len(seen) == 30 * 4


# ----------------------------------------------------------------------------------------------
# prepare-data
# ----------------------------------------------------------------------------------------------

def test_prepared_set_reads_as_the_raw_documents(tmp_path):
    raw = _jsonl(tmp_path / "d.jsonl", DOCS * 2)
    m = prepare([str(raw)], str(tmp_path / "prep"), progress=False, shard_tokens=500)
    assert m["documents"] == 120 and len(m["shards"]) > 1
    assert m["tokens"] == sum(len(d) + 1 for d in DOCS * 2) and m["tokenizer_hash"] == "byte"
    want, got = (_loader(tmp_path, f"data.path={p}") for p in (raw, tmp_path / "prep"))
    for step in range(12):
        w, g = want.batch_at(step), got.batch_at(step)
        assert all(np.array_equal(w[k], g[k]) for k in w)


def test_prepared_bpe_set_trains_with_its_tokenizer(tmp_path):
    raw = _jsonl(tmp_path / "d.jsonl", DOCS * 4)
    m = prepare([str(raw)], str(tmp_path / "prep"), tokenizer="bpe", vocab_size=300,
                progress=False)
    tok = m["tokenizer_path"]
    assert m["tokenizer"] == "bpe" and Path(tok).is_file() and m["max_token"] < 300
    common = ["model.vocab_size=300", "data.tokenizer=bpe", f"data.tokenizer_path={tok}"]
    want = _loader(tmp_path, f"data.path={raw}", *common).batch_at(2)
    got = _loader(tmp_path, f"data.path={tmp_path / 'prep'}", *common).batch_at(2)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    with pytest.raises(ConfigError, match="was prepared with tokenizer bpe-"):
        _loader(tmp_path, f"data.path={tmp_path / 'prep'}", "model.vocab_size=300")


# ----------------------------------------------------------------------------------------------
# Bad input: one line each, before anything compiles
# ----------------------------------------------------------------------------------------------

def _bad_case(tmp_path, case):
    if case == "missing field":
        return [f"data.path={_jsonl(tmp_path / 'd.jsonl', field='body')}"], "data.text_field"
    if case == "empty shard":
        _jsonl(tmp_path / "s0.jsonl")
        (tmp_path / "s1.jsonl").write_text("")
        return [f"data.path={tmp_path}/s*.jsonl"], "holds no documents"
    if case == "token id >= vocab":
        np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
        return [f"data.path={tmp_path / 't.bin'}"], "token id 999 >= model.vocab_size=256"
    if case == "mismatched tokenizer":
        prepare([str(_jsonl(tmp_path / "d.jsonl", DOCS * 4))], str(tmp_path / "p"),
                tokenizer="bpe", vocab_size=300, progress=False)
        return [f"data.path={tmp_path / 'p'}"], "was prepared with tokenizer bpe-"
    if case == "bad mixture":
        return [f"data.mixture={_jsonl(tmp_path / 'd.jsonl')}:0"], "positive weight"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing field", "empty shard", "token id >= vocab",
                                  "mismatched tokenizer", "bad mixture"])
def test_bad_data_is_a_one_line_error(tmp_path, capsys, case):
    overrides, needle = _bad_case(tmp_path, case)
    rc = cli.main(["train", f"train.out_dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("jaxtp: error: "), err
    assert needle in lines[0] and "Traceback" not in err


def test_prepare_data_cli(tmp_path, capsys):
    raw = _jsonl(tmp_path / "d.jsonl")
    assert cli.main(["prepare-data", str(raw), "--out", str(tmp_path / "p")]) == 0
    assert f"train on it with data.path={tmp_path / 'p'}" in capsys.readouterr().out
    assert cli.main(["prepare-data", str(raw), "--out", str(tmp_path / "p")]) == 2
    assert "already holds a prepared set" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# kill -9 mid-epoch with a mixture: the resumed run's losses are the uninterrupted run's
# ----------------------------------------------------------------------------------------------

def _cmd(out, *overrides):
    return [sys.executable, "-m", "jaxtp", "train", "--devices", "1", "--config", "tiny",
            f"train.out_dir={out}", "train.log_every=5", "train.eval_every=1000",
            "train.eval_batches=1", *overrides]


def test_exact_resume_after_kill_9_with_a_mixture(tmp_path):
    mix = _two_sources(tmp_path, reps=30)
    steps = ["train.steps=30", "train.checkpoint_every=10", mix]
    env = train_env()
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cmd(full, *steps), env=env, check=True, capture_output=True, timeout=300)
    kill_when_saved(_cmd(killed, *steps), env, killed / "checkpoints" / "20")
    r = subprocess.run(_cmd(killed, *steps), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming from step" in r.stdout
    records = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert {x["step"]: x["loss"] for x in records} == {x["step"]: x["loss"] for x in want}
    assert records[-1]["data_mixture"] == want[-1]["data_mixture"]
    windows = min(s.n_windows for s in data.loaders(config.load("tiny", [mix]))[0].sources)
    assert windows > 30 * 8  # no source finished an epoch: the kill was mid-epoch
