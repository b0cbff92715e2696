"""Launch parameters of the decode kernels, timed on the GPU from CUDA graphs (several weight/cache copies so that
L2 does not hold them): split-K attention (splits x BLOCK_N x stages) at the real and 7B shapes against the current
core.model.kernels.num_splits choice, and the autotuned GEMV's bandwidth. Prints one line per shape.

python -m bench.kernel_sweep
"""

import itertools

import torch

from core.model import kernels as k

DEV, BF16 = "cuda", torch.bfloat16


def graph_us(fn, copies: int, n: int = 24) -> float:
    """Median microseconds per call of fn(i % copies), 24 calls captured in one CUDA graph."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i % copies)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / n)
    return round(sorted(ts)[5], 1)


# q heads, kv heads, head dim, new tokens, cached keys, copies; the last two: the real 1.5B's level-2 retrieval cache
# at a budget of 8,192 and its full cache at 30K
ATTENTION_SHAPES = ((9, 3, 64, 1, 131072, 3), (9, 3, 64, 3, 4200, 30), (32, 32, 128, 1, 122880, 1),
                    (32, 32, 128, 3, 4200, 8), (12, 2, 128, 1, 8300, 30), (12, 2, 128, 1, 30100, 10))
GEMV_SHAPES = ((4096, 4096), (4096, 11008), (12288, 4096), (960, 576), (576, 576), (3072, 576), (576, 1536),
               (2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (1152, 896), (896, 896), (9728, 896),
               (896, 4864))  # ... and the real Qwen2.5-Coder 1.5B / 0.5B pair's qkv, o, gate/up, down


def sweep_attention() -> None:
    """Every split count x BLOCK_N x stages per shape; the current choice beside the best four."""
    for hq, hkv, d, n, length, copies in ATTENTION_SHAPES:
        kcs = [torch.randn(hkv, length + 64, d, device=DEV, dtype=BF16) for _ in range(copies)]
        vcs = [torch.randn(hkv, length + 64, d, device=DEV, dtype=BF16) for _ in range(copies)]
        q = torch.randn(hq, n, d, device=DEV, dtype=BF16)
        meta = torch.tensor([0, length - n], device=DEV)
        res = []
        for splits, bn, stages in itertools.product((8, 16, 32, 64, 128, 256, 512), (64, 128), (2, 3)):
            if (length + 63) // splits >= bn:
                us = graph_us(lambda i: k.decode_attention(q, kcs[i], vcs[i], meta, splits, bn, stages), copies)
                res.append((us, splits, bn, 4, stages))
        res.sort()
        now = [r for r in res if r[1:] == (k.num_splits(hkv, length + 64), k.BLOCK_N, 4, 3)]
        mb = hkv * length * d * 4 / 1e6
        print(f"attention hq{hq} hkv{hkv} d{d} n{n} L{length} ({mb:.0f} MB): current {now} best "
              f"(us, splits, BLOCK_N, warps, stages) {res[:4]} = {mb / res[0][0]:.2f} TB/s", flush=True)


def gemv_bandwidth() -> None:
    """The autotuned decode GEMV per weight shape, 1, 3 and 24 rows (the last in the 32-row block), beside cuBLAS."""
    for n_out, kin in GEMV_SHAPES:
        copies = max(2, int(400e6 // (n_out * kin * 2)))
        ws = [torch.randn(n_out, kin, device=DEV, dtype=BF16) for _ in range(copies)]
        for m in (1, 3, 24):
            x = torch.randn(m, kin, device=DEV, dtype=BF16)
            us = graph_us(lambda i: k.gemv(x, ws[i], None, None), copies)
            cublas = graph_us(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
            print(f"gemv {n_out}x{kin} m{m}: {us} us = {n_out * kin * 2 / us / 1e6:.2f} TB/s (cuBLAS {cublas} us)",
                  flush=True)


if __name__ == "__main__":
    sweep_attention()
    gemv_bandwidth()
