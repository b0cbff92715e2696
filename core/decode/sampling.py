"""Token distributions and exact speculative sampling."""

from __future__ import annotations

from typing import Callable

import torch

from core.config import GenerationConfig
from core.model.parallel import agree


def distributions(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """Probabilities [n, V] after temperature, top-k and top-p; one-hot on the argmax when greedy."""
    if cfg.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # softmax as separate reductions: a GPU's softmax kernel gives a row one thread block (63 µs on the H200 for one
    # row of a 152K-token vocabulary, which every drafted token pays), where a reduction spreads it over the device
    # (a sampled draft step's distributions went from 0.15 to 0.11 ms: bench.gpu_profile --parts profile_draft)
    probs = (logits - logits.amax(-1, keepdim=True)).exp()
    probs = probs / probs.sum(-1, keepdim=True)
    if cfg.top_p < 1.0:
        probs = nucleus(probs, cfg.top_p)
    return probs


def nucleus(probs: torch.Tensor, top_p: float, heads: tuple[int, ...] = (256, 4096)) -> torch.Tensor:
    """Keep the smallest set of most likely tokens holding top_p of the mass (a token stays while the mass strictly
    before it is < top_p), renormalised. On a CPU a partial sort of the `heads` most likely tokens replaces the full
    sort whenever they already hold top_p (the same set: every later token has >= top_p before it)."""
    sorted_p = None
    for head in heads if probs.device.type == "cpu" else ():
        if head >= probs.shape[-1]:
            break
        sorted_p, order = probs.topk(head, dim=-1)
        if bool((sorted_p.sum(-1) >= top_p).all()):
            break
        sorted_p = None
    if sorted_p is None:
        sorted_p, order = probs.sort(dim=-1, descending=True)
    before = row_cumsum(sorted_p) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1) of x [rows, V]. Several rows are scanned as one flattened row in float64, each row's start then
    subtracted: a GPU scans one long row in microseconds, but took ~0.2 ms for the few rows of a verification over a
    150K-token vocabulary scanned along the last dimension (the H200, torch 2.11)."""
    if x.shape[0] == 1:
        return x.cumsum(-1)
    flat = x.double().reshape(-1).cumsum(0).view(x.shape)
    before = torch.cat([flat.new_zeros(1), flat[:-1, -1]])  # the mass of the rows above each row
    return (flat - before[:, None]).to(x.dtype)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from probs [V] (under tensor parallelism: rank 0's draw, on every rank)."""
    return agree(_draw(probs, generator))[0]


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id drawn from probs [V], as a tensor [1] on probs' device (nothing waits for it), by inverting the
    CDF at one uniform draw (float64: a zero-probability token is never drawn; much cheaper than multinomial's
    exponential draw per token on a CPU)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """draw's token id, on the host."""
    return int(draw(probs, generator))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)): where a rejected draft's probability mass goes."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_verify(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator,
                       residual: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual_distribution,
                       ) -> tuple[int, int]:
    """Verify draft tokens proposed from q [k, V] (None: deterministic proposals) against p [k + 1, V].

    Returns (accepted count, next token): a sample from the residual after the first rejection, else a bonus
    token from p's last row. The accepted tokens followed by the next token are distributed exactly as p. Given p
    of k rows, the last draft stands in for the bonus token: accepted, it is the next token (k - 1 accepted before
    it). Under tensor parallelism every rank returns rank 0's verdict.
    """
    pxs, qxs, us = [], [], []
    if draft:  # one device sync for the whole draft: p(x), q(x) and a uniform per token, read back together
        rows = list(range(len(draft)))
        px_all = p[rows, draft]
        qx_all = q[rows, draft] if q is not None else torch.ones_like(px_all)
        u = torch.rand(len(draft), generator=generator, device=p.device, dtype=px_all.dtype)
        pxs, qxs, us = torch.stack([px_all, qx_all, u]).tolist()
    for i, (x, px, qx, u) in enumerate(zip(draft, pxs, qxs, us)):
        if px >= qx or u * qx < px:  # accepted with probability min(1, p(x) / q(x))
            continue
        qi = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(x, device=p.device),
                                                                     p.shape[-1]).float()
        return agree(i, _draw(residual(p[i], qi), generator))
    if len(p) == len(draft):
        return agree(len(draft) - 1, draft[-1])
    return agree(len(draft), _draw(p[len(draft)], generator))
