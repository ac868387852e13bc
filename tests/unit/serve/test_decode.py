"""KV-cache decode (jaxtp.serve.decode, jaxtp.serve.generate, jaxtp.serve.sampling): cached = recomputed, on one
device and on data=2 x model=4 in both modes; the sampler's filters; the decode step's collective
census from the compiled HLO; the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtp
from jaxtp.serve import decode
from jaxtp.step import engine
from jaxtp.inspect import hlo
from jaxtp.configs.schema import ConfigError
from jaxtp.serve.generate import Generator
from jaxtp.serve.sampling import SamplerArgs, filter_logits, row_keys, sample

LAYOUTS = {
    "single": ("gspmd", 1, 1),
    "gspmd-2x4": ("gspmd", 2, 4),
    "explicit-2x4": ("explicit", 2, 4),
}
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [97, 98], [1, 2, 3, 4, 5], [200]]
N_NEW = 6


def _model(mode, data, model, **extra):
    cfg = jaxtp.config("tiny", {"parallel.mode": mode, "parallel.data": data,
                                "parallel.model": model, "model.max_seq_len": 32, **extra})
    return jaxtp.Model(cfg, seed=0, devices=jax.devices()[: data * model])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return _model(*LAYOUTS[request.param])


def _full_forward(model, seqs):
    """Logits ``[rows, S, vocab]`` of the full forward over each whole sequence (right-padded
    into one batch; the model is causal, so position i never sees the padding)."""
    width = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    return np.asarray(model.logits(batch))


def test_cached_logits_equal_full_forward(model):
    """Prefill then one-token steps, mixed prompt lengths in one batch: every step's logits are
    the full forward's over the row's prefix (<= 1e-4), and the greedy tokens agree."""
    lo, region = model.layout, model.engine.region
    rows, t, length, steps = 8, 8, 16, 4
    prompts = np.zeros((rows, t), np.int32)
    lengths = np.array([len(PROMPTS[i % 4]) for i in range(rows)], np.int32)
    for i in range(rows):
        prompts[i, : lengths[i]] = PROMPTS[i % 4]
    cache = decode.init_cache(lo, rows, length)
    logits, cache = decode.prefill_fn(lo, region)(model.params, cache, prompts, lengths)
    step = decode.step_fn(lo, region)
    seqs, cached = [list(prompts[i, : lengths[i]]) for i in range(rows)], []
    for _ in range(steps):
        cached.append(np.asarray(logits)[:, :256])
        tok = cached[-1].argmax(-1).astype(np.int32)
        pos = np.array([len(s) for s in seqs], np.int32)
        for i in range(rows):
            seqs[i].append(int(tok[i]))
        logits, cache = step(model.params, cache, jnp.asarray(tok), jnp.asarray(pos))
    full = _full_forward(model, seqs)
    for k, got in enumerate(cached):
        ref = full[np.arange(rows), lengths - 1 + k]
        assert np.abs(got - ref).max() <= 1e-4
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_generate_equals_recompute(model):
    """model.generate (cache, compiled loop) = greedy by recomputing the prefix every step,
    token-exact: each new token is the argmax of the full forward over the prefix before it
    (one full forward over the final sequences checks every step); prompts of different lengths
    in one batch give the same tokens as one at a time."""
    batch = model.generate(PROMPTS, max_new_tokens=N_NEW)
    seqs = [list(p) + [int(x) for x in t] for p, t in zip(PROMPTS, batch.tokens)]
    full = _full_forward(model, seqs)
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, batch.tokens)):
        assert len(tokens) == N_NEW
        steps = len(prompt) - 1 + np.arange(N_NEW)
        np.testing.assert_array_equal(full[i, steps].argmax(-1), tokens)
    alone = model.generate([PROMPTS[1]], max_new_tokens=N_NEW).tokens[0]
    np.testing.assert_array_equal(alone, batch.tokens[1])


@pytest.mark.parametrize("extra", [
    {"parallel.mode": "gspmd", "parallel.data": 2, "parallel.model": 4, "model.n_kv_heads": 4},
    {"parallel.mode": "explicit", "parallel.data": 1, "parallel.fsdp": 2, "parallel.model": 4,
     "parallel.zero_stage": 3, "model.tie_embeddings": True, "model.vocab_size": 250},
], ids=["gqa-gspmd", "zero3-tied-padded-vocab-explicit"])
def test_greedy_generate_other_layouts(extra):
    """Grouped-query attention (2 query heads per cached KV head), and ZeRO-3 (each layer gathered
    in the decode scan) with tied embeddings and a padded vocab (250 -> 256 rows)."""
    cfg = jaxtp.config("tiny", {**extra, "model.max_seq_len": 32})
    model = jaxtp.Model(cfg, seed=0)
    out = model.generate(PROMPTS[:3], max_new_tokens=N_NEW)
    seqs = [list(p) + [int(x) for x in t] for p, t in zip(PROMPTS, out.tokens)]
    full = _full_forward(model, seqs)
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, out.tokens)):
        assert (tokens < 250).all() or extra.get("model.vocab_size") is None
        steps = len(prompt) - 1 + np.arange(N_NEW)
        np.testing.assert_array_equal(full[i, steps].argmax(-1), tokens)


def test_generate_text_seed_and_stop():
    model = _model("gspmd", 2, 4)
    a = model.generate(["Hi", "there"], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    b = model.generate(["Hi", "there"], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    assert [list(x) for x in a.tokens] == [list(x) for x in b.tokens]
    assert all(len(x) == 8 for x in a.tokens) and all(isinstance(s, str) for s in a.text)
    assert a.prompt_tokens[0].tolist() == list(b"Hi")
    greedy = model.generate("Hi", max_new_tokens=8).tokens[0]
    stop = int(greedy[2])
    first = list(greedy).index(stop)
    stopped = model.generate("Hi", max_new_tokens=8, stop_tokens=[stop])
    assert list(stopped.tokens[0]) == list(greedy[: first + 1])  # ends at the stop token


def test_stream_equals_one_call():
    """Streaming (start, then the loop in chunks of 3 tokens) makes the same sampled tokens as
    one compiled call, in explicit mode on data=2 x model=4."""
    model = _model("explicit", 2, 4)
    sampler = SamplerArgs.make(temperature=1.0, top_k=20)
    whole = model.generate(PROMPTS, max_new_tokens=N_NEW, temperature=1.0, top_k=20, seed=5)
    gen = Generator(model.layout, model.engine.region)
    parts = list(gen.stream(model.params, PROMPTS, max_new_tokens=N_NEW, sampler=sampler,
                            seed=5, chunk=3))
    assert [len(p.tokens[0]) for p in parts] == [1, 4, 6]
    for a, b in zip(parts[-1].tokens, whole.tokens):
        np.testing.assert_array_equal(a, b)


def test_sampler_filters():
    """top-k / top-p never let an excluded id through; padded vocab ids are never sampled."""
    rng = np.random.default_rng(0)
    vocab, padded = 50, 64
    logits = jnp.asarray(rng.normal(size=(4, padded)) * 3, jnp.float32)
    logits = logits.at[:, vocab:].set(100.0)  # padding rows with the largest logits
    keys = row_keys(jax.random.PRNGKey(0), jnp.arange(4), 0)
    greedy = sample(logits, SamplerArgs.make(), keys, vocab_size=vocab)
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits)[:, :vocab], -1))
    top5 = np.argsort(-np.asarray(logits)[:, :vocab], axis=-1)[:, :5]
    probs = np.asarray(jax.nn.softmax(logits[:, :vocab]))
    ranked = -np.sort(-probs, axis=-1)
    nucleus = (np.cumsum(ranked, -1) - ranked < 0.5).sum(-1)  # ids the 0.5-nucleus keeps
    for k, p in [(5, 1.0), (0, 0.5), (3, 0.5)]:
        args = SamplerArgs.make(temperature=1.0, top_k=k, top_p=p)
        kept = np.isfinite(np.asarray(filter_logits(logits, args, vocab_size=vocab)))
        for step in range(50):
            ids = np.asarray(sample(logits, args, row_keys(jax.random.PRNGKey(1), jnp.arange(4),
                                                           step), vocab_size=vocab))
            assert (ids < vocab).all() and kept[np.arange(4), ids].all()
        if k and p == 1:
            assert kept.sum(-1).max() <= k and all(kept[r, top5[r, :k]].all() for r in range(4))
        if p < 1:
            assert (kept.sum(-1) <= np.minimum(nucleus, k or vocab)).all()
    with pytest.raises(ValueError, match="top_p"):
        SamplerArgs.make(top_p=0.0)


def _layout(mode, data, model, **extra):
    cfg = jaxtp.config("tiny", {"parallel.mode": mode, "parallel.data": data,
                                "parallel.model": model, "model.max_seq_len": 32, **extra})
    return engine.build_engine(cfg, jax.devices()[: data * model], training=False)


def _step_collectives(mode, n_layers, rows):
    """The decode step compiled from abstract inputs (nothing allocated)."""
    e = _layout(mode, 2, 4, **{"model.n_layers": n_layers})
    lo = e.layout
    m = lo.cfg.model
    cache = jax.ShapeDtypeStruct((n_layers, rows, 16, m.n_kv_heads, m.resolved_head_dim),
                                 jnp.float32, sharding=decode.cache_sharding(lo))
    tok = jax.ShapeDtypeStruct((rows,), jnp.int32)
    text = decode.step_fn(lo, e.region).lower(
        lo.abstract_params_sharded(), (cache, cache), tok, tok).compile().as_text()
    return hlo.collectives(text, lo.degrees)


@pytest.mark.parametrize("mode", ["gspmd", "explicit"])
def test_decode_step_census(mode):
    """Per layer per token exactly two all-reduces over `model` of b_local x 1 x h, and nothing
    over the batch axes (measured as the difference of 3 and 2 layers)."""
    rows, h = 8, 64
    per_layer = []
    for n in (2, 3):
        ops = _step_collectives(mode, n, rows)
        assert not [o for o in ops if set(o.axes) & {"data", "fsdp"}], ops
        per_layer.append(sorted(o.bytes // o.tensors for o in ops for _ in
                                range(o.executions * o.tensors)
                                if o.kind == "all-reduce" and o.axes == ("model",)))
    extra = list(per_layer[1])
    for b in per_layer[0]:
        extra.remove(b)
    assert extra == [(rows // 2) * 1 * h * 4] * 2


def test_errors():
    model = _model("gspmd", 1, 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate([list(range(30))], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        model.generate([""], max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab_size"):
        model.generate([[300]], max_new_tokens=4)
    for refused, word in [({"parallel.pipeline": 2, "parallel.data": 4}, "pipeline"),
                          ({"parallel.context": 2, "parallel.data": 4}, "context"),
                          ({"parallel.model": 2, "parallel.sequence_parallel": True},
                           "sequence_parallel")]:
        e = engine.build_engine(jaxtp.config("tiny", refused), training=False)
        with pytest.raises(ConfigError, match=word):
            Generator(e.layout, e.region)
