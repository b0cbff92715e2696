"""Triton kernels for CUDA decoding: split-K (flash-decoding) attention over a static cache read in place, a GEMV
for the few rows of a decode step (and one for a drafting level's one-token steps, with RMSNorm or SwiGLU folded in),
RMSNorm, RoPE (+ cache store), SwiGLU and the chunk gather, in one launch each.
Imported lazily by core.model.ops.ops_for: CPU machines never need Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from core.config import DECODE_TOKENS

BLOCK_N = 64
TARGET_PROGRAMS = 2 * 132  # two per SM of an H100/H200: more, shorter splits measured slower (bench.kernel_sweep)


# Batch invariance: row i of a step over k new tokens is computed with exactly the arithmetic of a one-token step at
# that position, so greedy TriForce (level 3 verifies k tokens at once) emits what autoregressive decoding (one at a
# time) does, bit for bit. Each kernel below is compiled once for every step size (tile sizes are constants, counts
# are runtime values), a row's reduction order never depends on the other rows, and the key range is split at
# boundaries fixed by the cache, not by the number of new tokens: a key a row must not see (a later new token) only
# adds exact zeros to its sums.
TILE_ROWS = 16  # query rows one attention program computes (a step's rows are tiled: 16 x tiles)


@triton.jit
def _split_kernel(Q, K, V, Meta, Part, Lse, split_len, scale,
                  stride_qh, stride_kh, stride_kn, stride_ph, stride_ps, stride_pm, stride_lh, stride_ls,
                  N_NEW, ROWS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One (row tile, split, KV head): online softmax of BLOCK_M of the group's query rows over keys [start, start +
    split_len). The tiles of one split are neighbouring programs, so they read its keys from L2 after the first."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    base = tl.load(Meta + 1)  # slot of the first new token; keys [0, base + N_NEW) are valid
    length = base + N_NEW
    start = s * split_len
    end = tl.minimum(start + split_len, length)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    row_ok = rows < ROWS
    limit = base + rows % N_NEW  # causal: new token i sees keys up to its own slot
    q = tl.load(Q + h * stride_qh + rows[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for kb in range(start, end, BLOCK_N):
        offs = kb + tl.arange(0, BLOCK_N)
        ok = offs < end
        k = tl.load(K + h * stride_kh + offs[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + h * stride_kh + offs[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        x = tl.dot(q, tl.trans(k)) * scale
        x = tl.where(ok[None, :] & (offs[None, :] <= limit[:, None]), x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        p = tl.exp2(x - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(Part + h * stride_ph + s * stride_ps + rows[:, None] * stride_pm + dims[None, :], out)
    tl.store(Lse + h * stride_lh + s * stride_ls + rows, tl.where(l > 0, m + tl.log2(l), float("-inf")))


@triton.jit
def _reduce_kernel(Part, Lse, Out, stride_ph, stride_ps, stride_pm, stride_lh, stride_ls, stride_on, stride_oh,
                   N_NEW, GROUP: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr):
    """Combine the splits of one (KV head, query row) and write it as out[token, query head]."""
    h = tl.program_id(0)
    r = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, D)
    lse = tl.load(Lse + h * stride_lh + splits * stride_ls + r)
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(Part + h * stride_ph + splits[:, None] * stride_ps + r * stride_pm + dims[None, :])
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    token, g = r % N_NEW, r // N_NEW
    tl.store(Out + token * stride_on + (h * GROUP + g) * stride_oh + dims, out.to(Out.dtype.element_ty))


def num_splits(n_kv_heads: int, capacity: int) -> int:
    """Splits of the key range per KV head: enough programs to fill the GPU, a power of two, >= 4 blocks each."""
    want = triton.next_power_of_2(max(1, TARGET_PROGRAMS // n_kv_heads))
    most = triton.next_power_of_2(max(1, triton.cdiv(capacity, 4 * BLOCK_N)))
    return max(1, min(want, most))


def split_length(splits: int, capacity: int, block_n: int) -> int:
    """Keys per split: the capacity rounded up to a power of two, cut in `splits` (whole blocks), so that caches of
    nearby capacities split the same positions alike."""
    return triton.cdiv(triton.cdiv(triton.next_power_of_2(capacity), splits), block_n) * block_n


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, splits: int | None = None,
                     block_n: int = BLOCK_N, stages: int = 3) -> torch.Tensor:
    """Causal GQA attention of n new queries q [Hq, n, D] over one layer's cache k, v [Hkv, capacity, D] whose
    new keys are already stored at slots meta[1] ... meta[1] + n - 1 (meta on the device: graph-safe).
    Returns [Hq, n, D] (a transposed view of a [n, Hq, D] buffer). The launch parameters default to the tuned ones
    (bench.kernel_sweep passes others)."""
    hq, n, d = q.shape
    hkv, capacity, _ = k.shape
    group = hq // hkv
    rows = group * n
    tiles = triton.cdiv(rows, TILE_ROWS)
    splits = splits or num_splits(hkv, triton.next_power_of_2(capacity))
    split_len = split_length(splits, capacity, block_n)
    part = torch.empty(hkv, splits, tiles * TILE_ROWS, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(hkv, splits, tiles * TILE_ROWS, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    scale = d ** -0.5 * 1.4426950408889634  # exp2 domain
    _split_kernel[(tiles, splits, hkv)](q, k, v, meta, part, lse, split_len, scale,
                                        rows * d, k.stride(0), k.stride(1), part.stride(0), part.stride(1),
                                        part.stride(2), lse.stride(0), lse.stride(1), N_NEW=n, ROWS=rows,
                                        BLOCK_M=TILE_ROWS, BLOCK_N=block_n, D=d, num_warps=4, num_stages=stages)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    _reduce_kernel[(hkv, rows)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                                lse.stride(1), out.stride(0), out.stride(1), N_NEW=n, GROUP=group, SPLITS=splits,
                                D=d, num_warps=4)
    return out.transpose(0, 1)


@triton.jit
def _rms_norm_kernel(X, W, Y, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """One row: w * (x * rsqrt(mean(x^2) + eps)) computed in float32, rounded to x's dtype before the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Y + row * N + cols, (w * y).to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] in one launch (same rounding as core.model.transformer.RMSNorm)."""
    x = x.contiguous()
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(x.numel() // n,)](x, weight, y, eps, N=n, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return y


@triton.jit
def _rope_kernel(X, Cos, Sin, Y, stride_xn, stride_xh, H: tl.constexpr, HALF: tl.constexpr):
    """One (token, head): y = x * cos + rotate_half(x) * sin, written head-major."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, HALF)
    x1 = tl.load(X + t * stride_xn + h * stride_xh + i).to(tl.float32)
    x2 = tl.load(X + t * stride_xn + h * stride_xh + HALF + i).to(tl.float32)
    c1 = tl.load(Cos + t * 2 * HALF + i).to(tl.float32)
    c2 = tl.load(Cos + t * 2 * HALF + HALF + i).to(tl.float32)
    s1 = tl.load(Sin + t * 2 * HALF + i).to(tl.float32)
    s2 = tl.load(Sin + t * 2 * HALF + HALF + i).to(tl.float32)
    n = tl.num_programs(0)
    out = Y + h * n * 2 * HALF + t * 2 * HALF
    tl.store(out + i, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty))
    tl.store(out + HALF + i, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [n, heads, D] (last dim contiguous) with cos/sin [n, D]; returns [heads, n, D] contiguous."""
    n, h, d = x.shape
    y = torch.empty(h, n, d, dtype=x.dtype, device=x.device)
    _rope_kernel[(n, h)](x, cos.contiguous(), sin.contiguous(), y, x.stride(0), x.stride(1), H=h, HALF=d // 2,
                         num_warps=1)
    return y


@triton.jit
def _rope_store_kernel(Q, K, V, Cos, Sin, Qout, Kc, Vc, Meta, stride_qn, stride_qh, stride_kn, stride_kh,
                       stride_vn, stride_vh, stride_ch, stride_cn, HQ: tl.constexpr, HALF: tl.constexpr):
    """One (token, head): a query head is rotated into Qout [Hq, n, D]; a KV head's key is rotated and stored with
    its value at cache slot Meta[1] + token."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.num_programs(0)
    i = tl.arange(0, HALF)
    c1 = tl.load(Cos + t * 2 * HALF + i).to(tl.float32)
    c2 = tl.load(Cos + t * 2 * HALF + HALF + i).to(tl.float32)
    s1 = tl.load(Sin + t * 2 * HALF + i).to(tl.float32)
    s2 = tl.load(Sin + t * 2 * HALF + HALF + i).to(tl.float32)
    if h < HQ:
        src = Q + t * stride_qn + h * stride_qh
        dst = Qout + h * n * 2 * HALF + t * 2 * HALF
    else:
        hk = h - HQ
        src = K + t * stride_kn + hk * stride_kh
        dst = Kc + hk * stride_ch + (tl.load(Meta + 1) + t) * stride_cn
        vsrc = V + t * stride_vn + hk * stride_vh
        tl.store(Vc + hk * stride_ch + (tl.load(Meta + 1) + t) * stride_cn + tl.arange(0, 2 * HALF),
                 tl.load(vsrc + tl.arange(0, 2 * HALF)))
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    tl.store(dst + i, (x1 * c1 - x2 * s1).to(Qout.dtype.element_ty))
    tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(Qout.dtype.element_ty))


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """RoPE of q, k [n, heads, D] in one launch; k and v [n, Hkv, D] go into k_cache/v_cache [Hkv, capacity, D] at
    slots meta[1] + i. Returns the rotated queries [Hq, n, D]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(hq, n, d, dtype=q.dtype, device=q.device)
    _rope_store_kernel[(n, hq + hkv)](q, k, v, cos.contiguous(), sin.contiguous(), q_out, k_cache, v_cache, meta,
                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                      k_cache.stride(0), k_cache.stride(1), HQ=hq, HALF=d // 2, num_warps=1)
    return q_out


@triton.jit
def _silu_mul_kernel(X, Y, I: tl.constexpr, BLOCK: tl.constexpr):
    """silu(gate) * up for one row block of X = [gate | up]."""
    row = tl.program_id(0).to(tl.int64)  # n * 2I passes 2^31 for long prefill chunks
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(X + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * I + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of gate_up [n, 2I] (gate first) in one launch: [n, I]."""
    n, two_i = gate_up.shape
    i = two_i // 2
    y = torch.empty(n, i, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(n, triton.cdiv(i, 1024))](gate_up.contiguous(), y, I=i, BLOCK=1024, num_warps=4)
    return y


GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in ((16, 64, 4, 4), (32, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 4),
                                     (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 256, 4, 5),
                                     (32, 512, 4, 4), (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 8, 3))]


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, ADD_TO_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Y[m, n] (+)= sum_k X[m, k] W[n, k] (+ B[n]) for the few rows of a decode step: each program streams BLOCK_N
    rows of W once for all rows of X, accumulating in float32; ADD_TO_Y adds the result to Y in place."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(X + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = Y + rows[:, None] * stride_ym + cols[None, :]
    if ADD_TO_Y:
        acc += tl.load(out, mask=ok, other=0.0).to(tl.float32)
    tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)


def _graph_bench(fn, quantiles=None):
    """Time autotuning candidates replayed from a CUDA graph: a decode GEMV lasts a few microseconds, less than a
    Python launch, so timing eager launches would rank the launch overhead rather than the kernels."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=quantiles)


# tuned once per weight shape: every m <= BLOCK_M rows is one block of the same work, so the best launch does not
# depend on m (keyed on it, each new step size met mid-run would pay a tuning of every projection)
_gemv_tuned = triton.autotune(GEMV_CONFIGS, key=["N", "K"], restore_value=["Y"], do_bench=_graph_bench)(_gemv_kernel)


# The rows one GEMV launch computes: the smallest of these blocks that holds the step. A row's arithmetic is the same
# in either (its reduction over K runs alike), so a 20-token verification reproduces one-token steps bit for bit while
# a one-token step computes a block of 16, not 32.
GEMV_BLOCKS = (16, DECODE_TOKENS)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
         accumulate: bool = True) -> torch.Tensor:
    """x [m, K] @ weight[N, K].T (+ bias) for m <= DECODE_TOKENS (a batch's more: in pieces of that many), as one kernel
    computing a block of rows that depends on m alone (GEMV_BLOCKS), into a new [m, N] tensor of x's dtype or into
    `out` [m, N], to which it is added (a residual connection without a separate add or split-K reduction) unless not
    `accumulate`; returns the result."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m > DECODE_TOKENS:  # a batch's step: pieces of DECODE_TOKENS rows, each row computed as a one-row step
        for a in range(0, m, DECODE_TOKENS):
            gemv(x[a:a + DECODE_TOKENS], weight, bias, y[a:a + DECODE_TOKENS], accumulate and out is not None)
        return y
    args = (x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    rows = next(b for b in GEMV_BLOCKS if m <= b)
    flags = dict(HAS_BIAS=bias is not None, ADD_TO_Y=out is not None and accumulate, BLOCK_M=rows)
    _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    return y


@triton.jit
def _gemv_one_kernel(X, W, B, G, Y, N, K, stride_wn, eps, HAS_BIAS: tl.constexpr, ADD_TO_Y: tl.constexpr,
                     NORM: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] (+)= sum_k x[k] W[n, k] (+ B[n]) for one row x, on the CUDA cores (no tensor-core tile to pad to 16
    rows), so that work on x is done once, not for 16 rows: NORM RMS-norms x on the way in (weight G; the scale
    1 / rms(x), the same for every k, is applied once at the end), SWIGLU takes x as [gate | up] of 2K and
    multiplies by silu(gate) * up. A drafting level's one-token steps: its result need not match a many-token step's."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(X + kk, mask=kk < K, other=0.0).to(tl.float32)
        if SWIGLU:
            x = x * tl.sigmoid(x) * tl.load(X + K + kk, mask=kk < K, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(W + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, 1)
    if NORM:
        y *= tl.rsqrt(tl.sum(squares, 0) / K + eps)
    ok = cols < N
    if HAS_BIAS:
        y += tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD_TO_Y:
        y += tl.load(Y + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=ok)


GEMV_ONE_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                    for bn, bk, w, s in ((4, 256, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3),
                                         (16, 128, 4, 4), (4, 512, 4, 3), (8, 1024, 8, 2), (16, 512, 8, 3),
                                         (32, 256, 8, 3), (2, 1024, 4, 3))]
_gemv_one_tuned = triton.autotune(GEMV_ONE_CONFIGS, key=["N", "K", "NORM", "SWIGLU"], restore_value=["Y"],
                                  do_bench=_graph_bench)(_gemv_one_kernel)


def gemv_one(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False
             ) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) on the CUDA cores, into a new [1, N] tensor or added into `out` [1, N]:
    `norm` (weight, eps) RMS-norms x first, `swiglu` takes x [1, 2K] as [gate | up]."""
    k = x.shape[-1] // (2 if swiglu else 1)
    n = weight.shape[0]
    x = x.contiguous()
    y = out if out is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    _gemv_one_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, norm_weight, y, n, k, weight.stride(0), eps,
        HAS_BIAS=bias is not None, ADD_TO_Y=out is not None, NORM=norm is not None, SWIGLU=swiglu)
    return y


@triton.jit(do_not_specialize=["n_select"])  # one compile for every budget/prompt pair (not one per n % 16)
def _gather_chunks_kernel(K, V, Kout, Vout, Ids, n_select, stride_l, stride_h, out_l, out_h,
                          H: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One (layer x KV head, j): copy chunk Ids[., j] (ROW = chunk_size x head_dim contiguous elements) of K and V
    to chunk slot j of Kout and Vout."""
    lh = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    layer, head = (lh // H).to(tl.int64), (lh % H).to(tl.int64)
    chunk = tl.load(Ids + lh * n_select + j).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    src = layer * stride_l + head * stride_h + chunk * ROW + offs
    dst = layer * out_l + head * out_h + j * ROW + offs
    tl.store(Kout + dst, tl.load(K + src, mask=ok), mask=ok)
    tl.store(Vout + dst, tl.load(V + src, mask=ok), mask=ok)


def gather_chunks(k: torch.Tensor, v: torch.Tensor, chunk_ids: torch.Tensor, chunk_size: int, k_out: torch.Tensor,
                  v_out: torch.Tensor) -> None:
    """k_out/v_out[l, h, j*cs:(j+1)*cs] = k/v[l, h, id*cs:(id+1)*cs] for id = chunk_ids[l, h, j], caches
    [layers, kv_heads, capacity, D]: one pass, each chunk a contiguous block (no index tensor per element)."""
    layers, heads, _, d = k.shape
    n_select = chunk_ids.shape[-1]
    row = chunk_size * d
    _gather_chunks_kernel[(layers * heads, n_select)](k, v, k_out, v_out, chunk_ids.contiguous(), n_select,
                                                      k.stride(0), k.stride(1), k_out.stride(0), k_out.stride(1),
                                                      H=heads, ROW=row, BLOCK=triton.next_power_of_2(row),
                                                      num_warps=4)
