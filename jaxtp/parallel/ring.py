"""Context-parallel ring attention (Liu et al. 2023, arXiv 2310.01889), with FlashAttention-2's
online softmax and backward (Dao 2023, arXiv 2307.08691).

The sequence dim is sharded over the ``context`` axis (size ``cp``). Each device keeps its query
block; the K/V blocks travel forward around the ring with ``ppermute`` (device ``r`` sends to
``r+1``), so at step ``t`` device ``r`` holds the K/V of device ``r-t``. Scores are folded in with a
running max, running denominator and output accumulator in fp32, so no device ever holds more than
two K/V blocks. The forward runs ``cp-1`` K/V exchanges. The backward (a ``custom_vjp``) saves only
``q, k, v, out`` and the log-sum-exp, rotates K/V again (``cp-1`` exchanges) and sends fp32 dK/dV
accumulators along with them; they arrive home after one more hop (``cp`` exchanges), so memory is
O(S_local) throughout.

Causal load balance: with the ``zigzag`` layout the global sequence is cut into ``2*cp`` chunks and
device ``i`` holds chunks ``i`` and ``2*cp-1-i``, so every device does the same causal work: the
local block is causal-masked, and each remote block is either (all queries x first K/V half) or
(second query half x all K/V), with no mask. With ``contiguous`` (device ``i`` holds chunk ``i``)
remote blocks are fully visible or fully masked; masked ones are skipped with ``lax.cond``.
:func:`to_layout` / :func:`from_layout` permute a global array into / out of the layout order, and
:func:`positions_for_layout` gives the global positions of that order, for RoPE.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxtp.configs import CONTEXT_LAYOUTS
from jaxtp.parallel import validation as validate

_MASKED = -1e30  # finite, so a fully masked row never turns exp(-inf - -inf) into NaN


# ---- layouts ---------------------------------------------------------------------------------

def check_sequence(seq_len: int, cp: int, layout: str) -> None:
    """Raise ``ValueError`` unless a global sequence of ``seq_len`` can be laid out over ``cp``
    (the rule lives in :func:`jaxtp.parallel.validation.check_sequence`)."""
    validate.check_sequence(seq_len, context=cp, layout=layout)


def _layout_order(seq_len: int, cp: int, layout: str) -> np.ndarray:
    """Global positions in layout order: entry ``j`` is the global position stored at slot ``j``."""
    check_sequence(seq_len, cp, layout)
    pos = np.arange(seq_len)
    if layout == "contiguous":
        return pos
    chunks = pos.reshape(2 * cp, -1)
    order = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return chunks[order].reshape(-1)


def to_layout(x: jax.Array, cp: int, layout: str, seq_axis: int = 1) -> jax.Array:
    """Permute a GLOBAL array's ``seq_axis`` into layout order.

    Sharding the result contiguously over ``context`` gives device ``i`` its chunks (for zigzag,
    chunks ``i`` and ``2*cp-1-i``). Identity for ``contiguous``.
    """
    order = _layout_order(x.shape[seq_axis], cp, layout)
    return x if layout == "contiguous" else jnp.take(x, order, axis=seq_axis)


def from_layout(x: jax.Array, cp: int, layout: str, seq_axis: int = 1) -> jax.Array:
    """Inverse of :func:`to_layout`: layout order back to global sequence order."""
    order = _layout_order(x.shape[seq_axis], cp, layout)
    return x if layout == "contiguous" else jnp.take(x, np.argsort(order), axis=seq_axis)


def positions_for_layout(seq_len: int, cp: int, layout: str) -> jax.Array:
    """Global positions ``[seq_len]`` (int32) in layout order: the RoPE positions to shard."""
    return jnp.asarray(_layout_order(seq_len, cp, layout), jnp.int32)


# ---- blockwise math (fp32 statistics; q as [B,Sq,K,G,H], k/v as [B,Sk,K,H]) --------------------

def _scores(q, k, scale, mask):
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    return s if mask is None else jnp.where(mask, s, _MASKED)             # (B, K, G, Sq, Sk)


def _first(q, k, v, scale, mask):
    """Online-softmax state of one block: running max ``m``, denominator ``l``, accumulator."""
    s = _scores(q, k, scale, mask)
    m = s.max(-1)                                                          # (B, K, G, Sq)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)                   # (B, K, G, Sq, H)
    return m, p.sum(-1), acc


def _seg_mask(qs, ks):
    """Same-document mask ``(B, 1, 1, Sq, Sk)`` of query / key segment ids, or ``None``."""
    return None if qs is None else (qs[:, None, None, :, None] == ks[:, None, None, None, :])


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _update(state, q, k, v, scale, mask=None):
    """Fold one K/V block (``mask``: its same-document mask, or ``None``) into the online
    softmax ``state``. Rows the block masks out entirely keep their state: their scores sit at
    ``_MASKED``, far below the running max, whose first value came from the diagonal block where
    every query sees at least itself."""
    m, l, acc = state
    s = _scores(q, k, scale, mask)
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    acc = alpha[..., None] * acc + jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(-1), acc


def _rows(state, lo, hi):
    m, l, acc = state
    return m[..., lo:hi], l[..., lo:hi], acc[..., lo:hi, :]


def _join(a, b):
    return tuple(jnp.concatenate([x, y], axis=x.ndim - (2 if i == 2 else 1))
                 for i, (x, y) in enumerate(zip(a, b)))


def _grads(q, k, v, do, lse, delta, scale, mask):
    """FlashAttention-2 backward of one block: fp32 (dq [B,Sq,K,G,H], dk, dv [B,Sk,K,H])."""
    s = _scores(q, k, scale, mask)
    p = jnp.exp(s - lse[..., None])                                        # masked -> 0
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _diag_mask(s_local: int, causal: bool, layout: str):
    """Mask of the local (step 0) block. Static: for zigzag the second query half (chunk
    ``2cp-1-r``) always sees the whole first K/V half (chunk ``r``) and never the reverse."""
    if not causal:
        return None
    if layout == "contiguous":
        return jnp.tril(jnp.ones((s_local, s_local), bool))
    c = s_local // 2
    tri = np.tril(np.ones((c, c), bool))
    return jnp.asarray(np.block([[tri, np.zeros((c, c), bool)], [np.ones((c, c), bool), tri]]))


# ---- the ring --------------------------------------------------------------------------------

def _varying_axes(x) -> frozenset:
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)
    if vma is None:
        vma = t.manual_axis_type.varying
    return frozenset(vma)


def _shift(x, axis: str, cp: int):
    """Send to the next device on the ring: device ``r`` receives device ``r-1``'s block."""
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % cp) for i in range(cp)])


def _halves(x, c):
    """``(x[:, :c], x[:, c:])`` along the sequence, or ``(None, None)``."""
    return (None, None) if x is None else (x[:, :c], x[:, c:])


def _ring_forward(q, k, v, seg, axis, causal, layout, scale):
    cp = jax.lax.axis_size(axis)
    b, s_local, n, hd = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, s_local, kh, n // kh, hd)                            # (B, S, K, G, H)
    c = s_local // 2
    r = jax.lax.axis_index(axis)

    def step(t, kv, ks, state):
        kt, vt = kv[0], kv[1]
        if not causal:
            return _update(state, qg, kt, vt, scale, _seg_mask(seg, ks))
        # t <= r: the block came from device r-t < r, before us (no wrap); else it wrapped, after us
        if layout == "contiguous":  # before: fully visible; after: fully masked, skipped
            return jax.lax.cond(t <= r, lambda st: _update(st, qg, kt, vt, scale,
                                                           _seg_mask(seg, ks)),
                                lambda st: st, state)
        # zigzag: src < r -> all queries x first K/V half; src > r -> second query half x all K/V
        q_hi, k_lo = _halves(seg, c)[1], _halves(ks, c)[0]
        early = lambda st: _update(st, qg, kt[:, :c], vt[:, :c], scale, _seg_mask(seg, k_lo))
        late = lambda st: _join(_rows(st, 0, c),
                                _update(_rows(st, c, s_local), qg[:, c:], kt, vt, scale,
                                        _seg_mask(q_hi, ks)))
        return jax.lax.cond(t <= r, early, late, state)

    kv = jnp.stack([k, v])                                                 # (2, B, S, K, H)
    state = _first(qg, k, v, scale, _both(_diag_mask(s_local, causal, layout),
                                          _seg_mask(seg, seg)))
    if cp > 1:
        # a packed batch's key segment ids travel around the ring with their K/V block
        nxt = _shift((kv, seg), axis, cp)

        def body(carry, t):
            (kv, ks), state = carry
            return (_shift((kv, ks), axis, cp), step(t, kv, ks, state)), None  # send, compute

        if cp > 2:
            (nxt, state), _ = jax.lax.scan(body, (nxt, state), jnp.arange(1, cp - 1))
        state = step(cp - 1, *nxt, state)
    m, l, acc = state
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, s_local, n, hd)
    return out.astype(q.dtype), m + jnp.log(l)                             # (B,S,N,H), (B,K,G,S)


def _ring_backward(q, k, v, seg, out, lse, do, axis, causal, layout, scale):
    cp = jax.lax.axis_size(axis)
    b, s_local, n, hd = q.shape
    kh = k.shape[2]
    group = lambda x: x.reshape(b, s_local, kh, n // kh, hd)
    qg, dog = group(q), group(do.astype(q.dtype))
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", group(out).astype(jnp.float32),
                       dog.astype(jnp.float32))                            # (B, K, G, S)
    c = s_local // 2
    r = jax.lax.axis_index(axis)

    def step(t, kv, ks):
        """(dq, dkv) contributions of the block held at step ``t`` (key segment ids ``ks``)."""
        kt, vt = kv[0], kv[1]

        def full(kt, vt):
            dq, dk, dv = _grads(qg, kt, vt, dog, lse, delta, scale, _seg_mask(seg, ks))
            return dq, jnp.stack([dk, dv])

        if not causal:
            return full(kt, vt)
        if layout == "contiguous":
            def skip(kt, vt):  # zeros as varying as what `full` would return
                axes = tuple(sorted(_varying_axes(qg) | _varying_axes(kv)))
                zero = lambda shape: jax.lax.pcast(jnp.zeros(shape, jnp.float32), axes,
                                                   to="varying")
                return zero(qg.shape), zero(kv.shape)
            return jax.lax.cond(t <= r, full, skip, kt, vt)

        q_hi, k_lo = _halves(seg, c)[1], _halves(ks, c)[0]

        def early(kt, vt):
            dq, dk, dv = _grads(qg, kt[:, :c], vt[:, :c], dog, lse, delta, scale,
                                _seg_mask(seg, k_lo))
            dkv = jnp.stack([dk, dv])
            return dq, jnp.concatenate([dkv, jnp.zeros_like(dkv)], axis=2)

        def late(kt, vt):
            dq, dk, dv = _grads(qg[:, c:], kt, vt, dog[:, c:], lse[..., c:], delta[..., c:],
                                scale, _seg_mask(q_hi, ks))
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), jnp.stack([dk, dv])
        return jax.lax.cond(t <= r, early, late, kt, vt)

    kv = jnp.stack([k, v])
    dq, dk, dv = _grads(qg, k, v, dog, lse, delta, scale,
                        _both(_diag_mask(s_local, causal, layout), _seg_mask(seg, seg)))
    dkv = jnp.stack([dk, dv])                                              # (2, B, S, K, H) fp32
    if cp > 1:
        nxt = _shift((kv, seg), axis, cp)

        def body(carry, t):
            (kv, ks), dkv, dq = carry
            recv = _shift(dkv, axis, cp)     # the accumulator of the block we hold arrives...
            ddq, ddkv = step(t, kv, ks)      # ...while we compute our share of it
            return (_shift((kv, ks), axis, cp), recv + ddkv, dq + ddq), None

        if cp > 2:
            (nxt, dkv, dq), _ = jax.lax.scan(body, (nxt, dkv, dq), jnp.arange(1, cp - 1))
        ddq, ddkv = step(cp - 1, *nxt)
        dq, dkv = dq + ddq, _shift(dkv, axis, cp) + ddkv
        dkv = _shift(dkv, axis, cp)                                        # home: the cp-th hop
    return dq.reshape(q.shape), dkv[0], dkv[1]


def _like(ct, primal):
    """Cast a cotangent to its primal's dtype, summing over mesh axes the primal is invariant on
    (e.g. K/V replicated over ``model`` while the query heads are sharded over it)."""
    extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return ct.astype(primal.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, seg, axis, causal, layout, scale):
    return _ring_forward(q, k, v, seg, axis, causal, layout, scale)[0]


def _ring_fwd(q, k, v, seg, axis, causal, layout, scale):
    out, lse = _ring_forward(q, k, v, seg, axis, causal, layout, scale)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(axis, causal, layout, scale, res, do):
    q, k, v, seg, out, lse = res
    dq, dk, dv = _ring_backward(q, k, v, seg, out, lse, do, axis, causal, layout, scale)
    return _like(dq, q), _like(dk, k), _like(dv, v), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = "context",
                   causal: bool = True, layout: str = "zigzag",
                   scale: float | None = None, segment_ids: jax.Array | None = None
                   ) -> jax.Array:
    """Attention over a sequence sharded over mesh axis ``axis``; call per device in ``shard_map``.

    ``q [B,S_local,N,H]``, ``k, v [B,S_local,K,H]`` with ``N`` a multiple of ``K`` (GQA: query head
    ``n`` uses K/V head ``n // (N/K)``, as ``jax.nn.dot_product_attention``; K/V are never
    repeated) -> ``[B,S_local,N,H]`` in ``q.dtype``. The local blocks must be in ``layout`` order
    (see :func:`to_layout`). Forward: ``cp-1`` ppermutes of the stacked K/V over ``axis``.
    Backward: ``cp-1`` K/V ppermutes and ``cp`` fp32 dK/dV ppermutes. ``segment_ids
    [B,S_local]`` (a packed batch's documents, in the same layout order): a query sees only keys
    of its own segment; the key segment ids travel with their K/V block (one more small
    ppermute per exchange). Other manual axes (batch
    over ``data``, heads over ``model``) pass through untouched.
    """
    if layout not in CONTEXT_LAYOUTS:
        raise ValueError(f"ring attention layout must be one of {CONTEXT_LAYOUTS}, "
                         f"got {layout!r}")
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"ring attention wants q [B,S,N,H] and k, v [B,S,K,H]; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k/v {k.shape} must agree on batch, seq and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]}) for grouped-query attention")
    if causal and layout == "zigzag" and q.shape[1] % 2:
        cp = jax.lax.axis_size(axis)
        raise ValueError(f"the zigzag layout holds two chunks per device, so the local sequence "
                         f"({q.shape[1]}) must be even, i.e. the sequence divisible by 2*cp="
                         f"{2 * cp}; pad it or use layout='contiguous'")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B,S_local] = {q.shape[:2]}")
    return _ring(q, k, v, segment_ids, axis, causal, layout, scale)
