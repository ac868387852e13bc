"""Autoregressive decode with a KV cache, on the training mesh, in either execution mode.

The cache holds each layer's keys (after RoPE) and values, ``[layers, B, max_len, kv_heads,
head_dim]``, stacked over ``layers`` like the parameters and sharded like K and V in training: KV
heads over ``model`` (each TP rank keeps the KV groups its ``w_qkv`` shard makes), rows over the
batch axes. A decode step is the training block with one query position: Megatron's ``f`` before
the column-parallel QKV projection, ``g`` after the row-parallel output projection and after the
MLP, so per layer per token exactly two all-reduces of ``b x 1 x h`` over ``model`` and nothing
over the batch axes (tested from the compiled HLO). The vocab-parallel logits of the one position
are gathered over ``model`` (``b x V``) so every TP rank samples the same token.

Prompts are right-padded: row ``b``'s token ``i`` sits at cache slot and RoPE position ``i``,
exactly as in a forward pass of that row alone; a query at position ``p`` sees slots ``<= p``, so
the padding slots past a row's length are never seen (its own decode steps overwrite them). The
prompt is prefilled in one call, then one token per step inside a compiled ``lax.while_loop``
whose trip count is an argument: one compile per ``(rows, prompt bucket, length bucket)``.

Pipelines (the stages would run one token at a time, idle), context parallelism (the ring runs
over a sequence that decode does not have), sequence parallelism (one position cannot be split)
and Mixture-of-Experts models are refused with a :class:`~jaxtp.configs.errors.ConfigError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtp.configs import CONTEXT, PIPELINE, ConfigError, entry_axes
from jaxtp.layers import embed_tokens, rope_tables
from jaxtp.parallel import named
from jaxtp.serve.sampling import SamplerArgs, row_keys, sample
from jaxtp.step import Layout, Region

# The cache's logical dims: [layers, batch, seq (cache slots), kv_heads, head_dim]
CACHE_NAMES = (None, "batch", "seq", "kv_heads", "head_dim")
ROW_NAMES = ("batch",)
TOKEN_NAMES = ("batch", "seq")
LOGIT_NAMES = ("batch", None)  # [B, V]: gathered over the vocab
SCALAR = ()

Cache = tuple[jax.Array, jax.Array]  # (keys, values), each [layers, B, L, K, H]


def check_decodable(layout: Layout) -> None:
    """Refuse the layouts decode does not run, naming the setting to change."""
    cfg = layout.cfg
    if layout.degrees[PIPELINE] > 1:
        raise ConfigError("decode does not run pipelines: load the model with "
                          "parallel.pipeline=1 (the checkpoint reshards)")
    if layout.degrees[CONTEXT] > 1:
        raise ConfigError("decode does not run context parallelism: load the model with "
                          "parallel.context=1")
    if cfg.parallel.sequence_parallel:
        raise ConfigError("decode does not run sequence parallelism (one position cannot be "
                          "split): load the model with parallel.sequence_parallel=false")
    if cfg.model.n_experts > 0:
        raise ConfigError("decode does not run Mixture-of-Experts models yet")


def cache_sharding(layout: Layout):
    return named(layout.mesh, layout.activation_rules.spec(CACHE_NAMES))


def init_cache(layout: Layout, rows: int, length: int) -> Cache:
    """Zeros ``[layers, rows, length, kv_heads, head_dim]`` x 2, created in their sharding."""
    return _zeros_fn(layout, rows, length)()


@lru_cache(maxsize=32)
def _zeros_fn(layout: Layout, rows: int, length: int) -> Callable:
    m = layout.cfg.model
    shape = (layout.layer_units, rows, length, m.n_kv_heads, m.resolved_head_dim)
    dtype = jnp.dtype(m.compute_dtype)
    sharding = cache_sharding(layout)
    return jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                   out_shardings=(sharding, sharding))


# ---- the cached forward (per device or global view; the model's own blocks) ------------------
def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """``q [B,T,N,H]`` over the cache ``k, v [B,L,K,H]``; a query at position ``q_pos [B,T]``
    sees the slots ``<= q_pos``. Grouped-query: each KV head serves ``N/K`` query heads."""
    b, t, n, hd = q.shape
    length, kv = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, hd).astype(jnp.float32)                  # (B, T, K, G, H)
    scores = jnp.einsum("btkgh,blkh->bkgtl", qg, k.astype(jnp.float32)) / math.sqrt(hd)
    seen = jnp.arange(length)[None, None, :] <= q_pos[:, :, None]               # (B, T, L)
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtl,blkh->btkgh", probs, v.astype(jnp.float32))
    return out.reshape(b, t, n, hd).astype(q.dtype)


def write_prefix(cache: jax.Array, new: jax.Array) -> jax.Array:
    """Prefill: ``new [B,T,K,H]`` into slots ``0 .. T-1`` of ``cache [B,L,K,H]``."""
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), 0, axis=1)


def write_at(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """Decode: ``new [B,1,K,H]`` into slot ``pos[b]`` of each row (a select, no scatter)."""
    hit = (jnp.arange(cache.shape[1])[None, :] == pos[:, None])[:, :, None, None]  # (B,L,1,1)
    return jnp.where(hit, new.astype(cache.dtype), cache)


def _layer(block, x, rope, k_cache, v_cache, positions, write, ops):
    """One dense block on ``x [B,T,D]`` with its cache slice ``[B,L,K,H]``: f, QKV, cache write,
    attention over the cache, out projection, g, then the MLP (its own f and g)."""
    q, k, v = block.attn.project_qkv(block.attn_norm(x), rope, ops)
    k_cache = ops.constrain(write(k_cache, k), *CACHE_NAMES[1:])
    v_cache = ops.constrain(write(v_cache, v), *CACHE_NAMES[1:])
    o = cached_attention(q, k_cache, v_cache, positions)                      # (B, T, N, H)
    x = x + block.attn.project_out(o, ops)
    x = ops.constrain(x, "batch", "residual_seq", "embed")
    x = x + block.mlp(block.mlp_norm(x), ops)
    return ops.constrain(x, "batch", "residual_seq", "embed"), k_cache, v_cache


def forward_cached(model, tokens: jax.Array, positions: jax.Array, cache: Cache,
                   write: Callable, ops) -> tuple[jax.Array, Cache]:
    """Final-norm hidden states ``[B,T,D]`` of ``tokens [B,T]`` at ``positions [B,T]``, writing
    their keys and values into ``cache`` with ``write`` (:func:`write_prefix` / :func:`write_at`)."""
    cfg = model.cfg
    x = embed_tokens(model.embed, tokens, ops, cfg)
    rope = rope_tables(positions, cfg)
    graphdef, stacked = nnx.split(model.blocks)

    def body(x, layer):
        params, k_cache, v_cache = layer
        block = nnx.merge(graphdef, ops.gather_layer(params))  # ZeRO-3: this layer, in time
        x, k_cache, v_cache = _layer(block, x, rope, k_cache, v_cache, positions, write, ops)
        return x, (k_cache, v_cache)

    x, cache = jax.lax.scan(body, x, (stacked, *cache))
    return model.final_norm(x), cache


def next_logits(model, h: jax.Array, ops) -> jax.Array:
    """``h [B,1,D]`` -> fp32 logits ``[B, padded_vocab]``, the same on every TP rank."""
    logits = model.logits(h, ops)[:, 0].astype(jnp.float32)                   # (B, V/t)
    return ops.gather_vocab(logits)


def prefill(model, ops, cache: Cache, prompts: jax.Array, lengths: jax.Array):
    """``prompts [B,T]`` (right-padded; row ``b`` is ``lengths[b]`` long) into the cache; the
    logits ``[B,V]`` after each row's last prompt token."""
    positions = jnp.broadcast_to(jnp.arange(prompts.shape[1], dtype=jnp.int32), prompts.shape)
    h, cache = forward_cached(model, prompts, positions, cache, write_prefix, ops)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)       # (B, 1, D)
    return next_logits(model, last, ops), cache


def step(model, ops, cache: Cache, tokens: jax.Array, pos: jax.Array):
    """One decode step: ``tokens [B]`` at positions ``pos [B]`` -> (logits ``[B,V]``, cache)."""
    h, cache = forward_cached(model, tokens[:, None], pos[:, None], cache,
                              partial(write_at, pos=pos), ops)
    return next_logits(model, h, ops), cache


def _emit(out, tok, at, done, n_new, stop_ids):
    """Write ``tok [B]`` at column ``at [B]`` of ``out [B,L]`` for the rows not yet stopped."""
    live = ~done
    hit = (jnp.arange(out.shape[1])[None, :] == at[:, None]) & live[:, None]
    out = jnp.where(hit, tok[:, None], out)
    return out, done | (live & jnp.isin(tok, stop_ids)), n_new + live.astype(jnp.int32)


def _vary(tree, axes: tuple[str, ...]):
    """Mark every leaf varying over the manual ``axes`` (a ``while_loop`` carry keeps one type)."""
    if not axes:
        return tree

    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def start(model, ops, cache, prompts, lengths, rows, seed_key, args: SamplerArgs, stop_ids, *,
          vocab_size: int):
    """Prefill and sample each row's first new token. Returns the loop state ``(cache, tokens
    [B,L], last token [B], stopped [B], generated [B])``: each row's prompt followed by its new
    tokens (up to and including a stop token), and how many it made."""
    logits, cache = prefill(model, ops, cache, prompts, lengths)
    tok = sample(logits, args, row_keys(seed_key, rows, 0), vocab_size=vocab_size)
    out = jnp.pad(prompts, ((0, 0), (0, cache[0].shape[2] - prompts.shape[1])))
    done, made = jnp.zeros(tok.shape, bool), jnp.zeros(tok.shape, jnp.int32)
    out, done, made = _emit(out, tok, lengths, done, made, stop_ids)
    return cache, out, tok, done, made


def extend(model, ops, cache, out, tok, done, made, lengths, rows, first, last, seed_key,
           args: SamplerArgs, stop_ids, *, vocab_size: int, row_axes: tuple[str, ...]):
    """New tokens ``first .. last - 1`` (token 0 is :func:`start` 's), one decode step each,
    in one ``while_loop``; the loop state in and out."""
    def body(carry):
        i, cache, out, tok, done, made = carry
        pos = lengths + i - 1                                       # where `tok` sits
        logits, cache = step(model, ops, cache, tok, pos)
        tok = sample(logits, args, row_keys(seed_key, rows, i), vocab_size=vocab_size)
        out, done, made = _emit(out, tok, pos + 1, done, made, stop_ids)
        return (i + 1, *_vary((cache, out, tok, done, made), row_axes))

    init = (jnp.asarray(first, jnp.int32), *_vary((cache, out, tok, done, made), row_axes))
    return jax.lax.while_loop(lambda c: c[0] < last, body, init)[1:]


def generate(model, ops, cache, prompts, lengths, rows, n_new, seed_key, args: SamplerArgs,
             stop_ids, *, vocab_size: int, row_axes: tuple[str, ...]):
    """:func:`start`, then ``n_new - 1`` decode steps: ``(tokens [B,L], generated [B])``."""
    state = start(model, ops, cache, prompts, lengths, rows, seed_key, args, stop_ids,
                  vocab_size=vocab_size)
    _, out, _, _, made = extend(model, ops, *state, lengths, rows, 1, n_new, seed_key, args,
                                stop_ids, vocab_size=vocab_size, row_axes=row_axes)
    return out, made


# ---- on the mesh --------------------------------------------------------------------------------
def on_mesh(layout: Layout, region: Region, body: Callable, in_names, out_names) -> Callable:
    """``(params, *args) -> body(model, ops, *args)``, jitted, in the region's mode: the global
    view (GSPMD) or per device under ``jax.shard_map`` (explicit), with ``args`` and the outputs
    sharded by the logical names ``in_names`` / ``out_names`` (one tuple per array; a pytree
    argument takes one tuple for all its leaves)."""
    check_decodable(layout)
    manual = not region.global_view
    ops = region.ops(manual=manual)

    def fn(params, *args):
        params = region.gather_outer(params) if manual else ops.gather(params, layout.outer_specs)
        return body(nnx.merge(layout.graphdef, params), ops, *args)

    if not manual:
        return jax.jit(fn)
    axes = region.manual_axes()
    spec = layout.activation_rules.spec
    in_specs = (layout.param_specs, *(spec(n) for n in in_names))
    out_specs = tuple(spec(n) for n in out_names)
    return jax.jit(jax.shard_map(fn, mesh=layout.mesh, in_specs=region.specs_in(in_specs, axes),
                                 out_specs=region.specs_in(out_specs, axes),
                                 axis_names=frozenset(axes)))


def prefill_fn(layout: Layout, region: Region) -> Callable:
    """``(params, cache, prompts [B,T], lengths [B]) -> (logits [B,V], cache)``."""
    return on_mesh(layout, region, prefill, (CACHE_NAMES, TOKEN_NAMES, ROW_NAMES),
                   (LOGIT_NAMES, CACHE_NAMES))


def step_fn(layout: Layout, region: Region) -> Callable:
    """``(params, cache, tokens [B], pos [B]) -> (logits [B,V], cache)``: one decode step."""
    return on_mesh(layout, region, step, (CACHE_NAMES, ROW_NAMES, ROW_NAMES),
                   (LOGIT_NAMES, CACHE_NAMES))


def _row_axes(layout: Layout, region: Region) -> tuple[str, ...]:
    """The manual axes rows are split over: what a per-row carry of the loop varies over."""
    return () if region.global_view else entry_axes(layout.activation_rules["batch"])


STATE_NAMES = (CACHE_NAMES, TOKEN_NAMES, ROW_NAMES, ROW_NAMES, ROW_NAMES)


def start_fn(layout: Layout, region: Region) -> Callable:
    """``(params, cache, prompts, lengths, rows, seed_key, SamplerArgs, stop_ids) -> state``:
    see :func:`start`."""
    body = partial(start, vocab_size=layout.cfg.model.vocab_size)
    return on_mesh(layout, region, body, (CACHE_NAMES, TOKEN_NAMES, ROW_NAMES, ROW_NAMES,
                                          SCALAR, SCALAR, SCALAR), STATE_NAMES)


def extend_fn(layout: Layout, region: Region) -> Callable:
    """``(params, *state, lengths, rows, first, last, seed_key, SamplerArgs, stop_ids) ->
    state``: see :func:`extend` (streaming runs it once per chunk of tokens)."""
    body = partial(extend, vocab_size=layout.cfg.model.vocab_size,
                   row_axes=_row_axes(layout, region))
    return on_mesh(layout, region, body, (*STATE_NAMES, ROW_NAMES, ROW_NAMES, SCALAR, SCALAR,
                                          SCALAR, SCALAR, SCALAR), STATE_NAMES)


def generate_fn(layout: Layout, region: Region) -> Callable:
    """``(params, cache, prompts [B,T], lengths [B], rows [B], n_new, seed_key, SamplerArgs,
    stop_ids [S]) -> (tokens [B,L], generated [B])``: see :func:`generate`."""
    body = partial(generate, vocab_size=layout.cfg.model.vocab_size,
                   row_axes=_row_axes(layout, region))
    return on_mesh(layout, region, body,
                   (CACHE_NAMES, TOKEN_NAMES, ROW_NAMES, ROW_NAMES, SCALAR, SCALAR, SCALAR,
                    SCALAR), (TOKEN_NAMES, ROW_NAMES))
