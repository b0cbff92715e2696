"""Level-2 acceptance per retrieval variant and budget, by teacher forcing. An answer is generated on the full cache
(sampled at T 0.6 / top-p 0.9 for each seed, and greedy); then, for every answer position, the level-3 distribution p
(full cache) and the level-2 distribution q (the same model reading the prompt tokens a variant keeps, and the answer
so far with the full cache's keys/values, as after Retrieval.sync) are compared. `acceptance`: mean sum_x min(p, q),
the probability that level 3 accepts a level-2 sample (the per-token acceptance a run reports); `round_acceptance`:
the accepted / proposed a run counted before, in rounds of --gamma2 tokens whose tokens after a rejection count as
proposed; `greedy_agreement`: how often the argmaxes match (on the greedy answer); `attention_recall`: the share of the
full cache's attention (level-3 queries; mean over layers, query heads and positions) on the kept tokens. Level 2 for
all positions is one masked forward per variant and budget, the same logits as gathering the chunks into a retrieval
cache (checked: the `all` row keeps every token and must accept everything).

python -m bench.retrieval_quality [--target MODEL (default: the qwen2.5-coder-0.5b preset)]
    [--documents code prose needle] [--context 8192]
    [--budgets 512 1024 2048 4096] [--budget-ratio 0.1365] [--variants sum mass+w4@4 ...] [--new-tokens 48]
    [--seeds 1] [--device cuda --dtype bfloat16] [--threads 1] [--cache-dir DIR] [--name NAME]

A variant is SCORE[+rR][+wW][+pP][+h][/cC][@N|@own]. SCORE: how a KV head's chunks are ranked from its group's query
heads: sum (q . mean key summed over the heads: the engine's scoring), mass (each head's softmax over the chunks of
q . mean key / sqrt(D), summed: estimated attention mass), max (the heads' highest score), union (each chunk's best
rank over the heads), cmax (max over mean keys centred on their mean), debias (sum without the rotated k_proj bias in
the means), oracle (the full cache's true attention mass). +rR: the R most recent prompt tokens always kept (within
the budget); +wW: the queries of the selection's row and the W - 1 before it vote; +pP: a chunk scores the best of
itself and its P - 1 predecessors; +h: a selection per query head (W = 1; not a GQA cache: it reads G times the
bytes, a ceiling for what sharing costs); /cC: chunk size C (default 8); @N: chosen again every N answer positions
from the latest position level 3 has verified (as `reselect every_verify` does after each round), @own: every
position from its own queries (a ceiling: level 2 cannot know them); default: once, from the last prompt row, as
`reselect once` (the engine's default); `reselect every_verify` is about sum@N, N a round's accepted tokens + 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import inspect
import json
import re
import statistics
import time
import typing
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import DOCS, environment, save
from bench.needle import NEEDLE
from core import Engine, GenerationConfig
from core.cache import KVCache
from core.decode import Level, distributions
from core.io import build_prompt, plain_ids
from core.model import TorchOps, rotate

DEFAULT_TARGET = "qwen2.5-coder-0.5b"  # the preset (python -m core install-models), or a .gguf / directory
INSTRUCTIONS = {"code": "Explain what this module does.", "prose": "Summarise what has happened so far.",
                "needle": "What is the pass key?"}
SAMPLED = GenerationConfig(temperature=0.6, top_p=0.9)
GREEDY = GenerationConfig(greedy=True)
DEFAULT_VARIANTS = ["sum", "mass", "max", "union", "debias", "sum+r256", "sum/c4", "sum/c16", "sum+h", "oracle",
                    "sum@4", "mass+w4@4", "mass+w8@8", "sum@1", "oracle@1", "oracle@own", "oracle+h@own"]
VARIANT = re.compile(r"(?P<score>[a-z]+)(\+r(?P<recent>\d+))?(\+w(?P<window>\d+))?(\+p(?P<pool>\d+))?"
                     r"(?P<per_head>\+h)?(/c(?P<chunk>\d+))?(@(?P<every>\d+|own))?$")
OBSERVED = 64  # prompt rows whose level-3 queries are recorded (a window's rows before the first selection)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How level 2's prompt tokens are chosen: see the module docstring."""

    score: str
    recent: int = 0
    window: int = 1  # the level-3 rows whose queries vote: the selection's row and the window - 1 before it
    pool: int = 1  # a chunk scores the best of the `pool` chunks ending at it (it and its predecessors)
    per_head: bool = False  # a selection per query head (not a GQA cache: a ceiling for what sharing costs)
    chunk: int = 8
    every: int | str = 0  # 0: once; N: every N positions; "own": every position from its own queries

    @classmethod
    def parse(cls, text: str) -> "Variant":
        m = VARIANT.match(text)
        if not m or m["score"] not in SCORES:
            raise SystemExit(f"bad variant {text!r}: SCORE[+rR][+wW][/cC][@N|@own], SCORE one of "
                             f"{', '.join(SCORES)}")
        if int(m["window"] or 1) > OBSERVED:
            raise SystemExit(f"bad variant {text!r}: a window holds at most {OBSERVED} rows")
        every = m["every"] or 0
        return cls(m["score"], int(m["recent"] or 0), int(m["window"] or 1), int(m["pool"] or 1), bool(m["per_head"]),
                   int(m["chunk"] or 8), every if every == "own" else int(every))

    @property
    def name(self) -> str:
        return (self.score + (f"+r{self.recent}" if self.recent else "") + (f"+w{self.window}" if self.window > 1
                else "") + (f"+p{self.pool}" if self.pool > 1 else "") + ("+h" if self.per_head else "")
                + (f"/c{self.chunk}" if self.chunk != 8 else "") + (f"@{self.every}" if self.every else ""))


def document(engine: Engine, kind: str, tokens: int) -> str:
    """About `tokens` tokens of a code, prose or needle document."""
    if kind == "code":  # Python standard-library sources, one after another
        text = "".join(f"# file: {Path(m.__file__).name}\n{Path(m.__file__).read_text()}\n"
                       for m in (argparse, dataclasses, functools, typing, inspect))
    else:
        text = (DOCS / "pride_and_prejudice.txt").read_text()
    ids = plain_ids(engine.tokenizer, text)[:tokens]
    if kind == "needle":  # the pass key at 37 % depth
        depth = round(len(ids) * 0.37)
        return engine.tokenizer.decode(ids[:depth]) + "\n" + NEEDLE + engine.tokenizer.decode(ids[depth:])
    return engine.tokenizer.decode(ids)


class TeacherOps(TorchOps):
    """Attention for teacher forcing. Without masks: the full cache's forward, recording each layer's rotated queries
    [Hq, rows, D]. With masks: level 2 for every answer row at once over the full cache's keys, row t seeing the
    prompt tokens its chunk mask keeps (plus the partial tail), the answer rows before it as the full cache holds them,
    and itself (its own key/value, computed at level 2)."""

    def __init__(self, full: KVCache, prompt: int, masks: torch.Tensor | None = None, chunk: int = 8):
        self.full, self.prompt, self.masks, self.chunk = full, prompt, masks, chunk  # [L, Hkv or Hq, rows, chunks]
        self.queries: list[torch.Tensor] = []

    def attend(self, cache, layer, q, k, v, cos, sin):
        if self.masks is None:
            out, q = super().attend(cache, layer, q, k, v, cos, sin)
            self.queries.append(q)
            return out, q
        q, k = self.rope_heads(q, cos, sin), self.rope_heads(k, cos, sin)
        hq, n, d = q.shape
        keys = torch.cat([self.full.k[layer, :, :self.prompt + n], k], 1)
        values = torch.cat([self.full.v[layer, :, :self.prompt + n], v.transpose(0, 1)], 1)
        hkv, group = keys.shape[0], hq // keys.shape[0]
        heads, chunks = self.masks.shape[1], self.masks.shape[-1]  # a mask per KV head, or per query head
        mask = torch.ones(heads, n, keys.shape[1], dtype=torch.bool, device=q.device)
        mask[:, :, :chunks * self.chunk] = self.masks[layer].repeat_interleave(self.chunk, -1)
        mask[:, :, self.prompt:self.prompt + n] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        mask[:, :, self.prompt + n:] = torch.eye(n, dtype=torch.bool, device=q.device)
        # rows of one KV head: head j of its group at token t is row j * n + t
        mask = mask.repeat(1, group, 1) if heads == hkv else mask.view(hkv, group * n, -1)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, group * n, d), keys[None], values[None],
                                             attn_mask=mask[None])
        return out.view(hq, n, d), q


def forward(model, cache: KVCache, ids: list[int], ops: TeacherOps) -> torch.Tensor:
    """Float32 logits of every row of ids fed into `cache` through `ops`."""
    cache.begin(len(ids))
    return model.head(model.step(torch.tensor(ids, device=model.device), cache, ops=ops)[0])


@dataclasses.dataclass
class Index:
    """One chunk size's chunk-mean keys [L, Hkv, C, D] (float32) and the part of them that is the rotated k_proj
    bias (Qwen2's keys carry a constant bias, rotated by RoPE to each position; None without one)."""

    mean: torch.Tensor
    bias: torch.Tensor | None


def build_index(model, full: KVCache, length: int, cs: int) -> Index:
    """Chunk means of the first `length` cached keys."""
    n = length // cs
    keys = full.k[:, :, :n * cs].float()
    layers, hkv, _, d = keys.shape
    bias = None
    if model.layers[0].self_attn.k_proj.bias is not None:
        cos, sin = model.rotary.cos_sin(torch.arange(n * cs, device=full.device), torch.float32)
        b = torch.stack([blk.self_attn.k_proj.bias.detach().float().view(hkv, 1, d) for blk in model.layers])
        bias = rotate(b.expand(layers, hkv, n * cs, d), cos, sin).reshape(layers, hkv, n, cs, d).mean(3)
    return Index(keys.reshape(layers, hkv, n, cs, d).mean(3), bias)


def voters(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[R, W, L, Hq, X] per selection, window row and query head -> [R, L, Hkv, W * G, X]: each KV head's voters
    (its group's query heads at each of the window's rows)."""
    r, w, layers, hq, rest = x.shape
    return x.view(r, w, layers, hkv, hq // hkv, rest).permute(0, 2, 3, 1, 4, 5).reshape(r, layers, hkv, -1, rest)


def head_scores(mean: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """q . mean key of every voter: queries [R, W, L, Hq, D], mean [L, Hkv, C, D] -> [R, L, Hkv, W * G, C]."""
    return torch.einsum("rlhvd,lhcd->rlhvc", voters(queries.float(), mean.shape[1]), mean)


def best_rank(s: torch.Tensor) -> torch.Tensor:
    """Minus each chunk's best rank over a group's heads (s [..., G, C]): the union of the heads' top-k lists."""
    order = s.argsort(-1, descending=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return -ranks.amin(-2).float()


# score(index, queries [R, W, L, Hq, D], true attention mass summed over the voters [R, L, Hkv, C]) -> [R, L, Hkv, C]
SCORES = {
    "sum": lambda ix, q, mass: head_scores(ix.mean, q).sum(3),
    "max": lambda ix, q, mass: head_scores(ix.mean, q).amax(3),
    "union": lambda ix, q, mass: best_rank(head_scores(ix.mean, q)),
    "mass": lambda ix, q, mass: (head_scores(ix.mean, q) / q.shape[-1] ** 0.5).softmax(-1).sum(3),
    "cmax": lambda ix, q, mass: head_scores(ix.mean - ix.mean.mean(2, keepdim=True), q).amax(3),
    "debias": lambda ix, q, mass: head_scores(ix.mean - (ix.bias if ix.bias is not None else 0), q).sum(3),
    "oracle": lambda ix, q, mass: mass,
}


def attention_mass(full: KVCache, queries: list[torch.Tensor], length: int, cs: int, first: int
                   ) -> tuple[torch.Tensor, ...]:
    """The full cache's attention of each level-3 row r (at position first + r): the mass on each full chunk of the
    first `length` tokens [rows, L, Hq, C], and on everything else (partial tail, answer) [rows, L, Hq]."""
    n = length // cs
    chunk_mass, rest = [], []
    for layer, q in enumerate(queries):  # q [Hq, rows, D]
        hq, rows, d = q.shape
        hkv = full.k.shape[1]
        keys = full.k[layer, :, :first + rows].float()
        logits = torch.einsum("hgrd,hkd->hgrk", q.float().view(hkv, hq // hkv, rows, d), keys) / d ** 0.5
        pos = torch.arange(keys.shape[1], device=q.device)
        visible = pos[None] <= first + torch.arange(rows, device=q.device)[:, None]
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).view(hq, rows, -1)
        chunked = probs[..., :n * cs].reshape(hq, rows, n, cs).sum(-1)
        chunk_mass.append(chunked.transpose(0, 1))
        rest.append(1 - chunked.sum(-1).transpose(0, 1))
    return torch.stack(chunk_mass, 1), torch.stack(rest, 1)


def chunk_masks(v: Variant, index: Index, queries: torch.Tensor, mass: torch.Tensor, n_select: int, answer: int,
                base: int) -> torch.Tensor:
    """Which full prompt chunks each level-2 row keeps [L, Hkv, answer, C]. queries [rows, L, Hq, D] and the true
    chunk mass [rows, L, Hq, C] are the level-3 rows'; row `base` is the last prompt position the prefill saw, so
    level-2 row t's previous position is row base + t, its own row base + t + 1."""
    last = [base] if v.every == 0 else [base + t + 1 for t in range(answer)] if v.every == "own" else \
        [base + t for t in range(0, answer, v.every)]  # the row each selection is made at
    which = torch.zeros(answer, dtype=torch.long) if v.every == 0 else torch.arange(answer) if v.every == "own" \
        else torch.arange(answer) // v.every  # the selection each level-2 row reads
    rows = torch.tensor(last)[:, None] - torch.arange(v.window - 1, -1, -1)  # [R, W]: the window ending there
    hkv = index.mean.shape[1]
    if v.per_head:  # each query head its own KV head
        hq = queries.shape[2]
        index = Index(index.mean.repeat_interleave(hq // hkv, 1), None if index.bias is None else
                      index.bias.repeat_interleave(hq // hkv, 1))
        hkv = hq
    scores = SCORES[v.score](index, queries[rows], voters(mass[rows], hkv).sum(3))
    c = scores.shape[-1]
    if v.pool > 1:  # the best score among the chunk and its pool - 1 predecessors
        scores = F.max_pool1d(F.pad(scores.flatten(0, -2), (v.pool - 1, 0), value=float("-inf")), v.pool, 1
                              ).view(scores.shape)
    scores[..., 0] = float("inf")  # the attention sink
    if v.recent:
        scores[..., c - -(-v.recent // v.chunk):] = float("inf")
    ids = scores.topk(n_select, dim=-1).indices
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
    return kept[which.to(kept.device)].permute(1, 2, 0, 3)


def generate(model, full: KVCache, ids: list[int], cfg: GenerationConfig, n: int, seed: int) -> list[int]:
    """n answer tokens on the full cache (which holds the prefill, and is left so)."""
    body = full.seq_len
    level = Level(model, full, ids[:body])
    generator = torch.Generator(model.device).manual_seed(seed)
    seq = list(ids)
    for _ in range(n):
        p = distributions(level.logits(seq, 1, len(seq) - 1), cfg)
        seq.append(int(torch.multinomial(p[0], 1, generator=generator)))
    full.truncate(body)
    return seq[len(ids):]


def prefilled(model, ids: list[int], capacity: int, cache_dir: Path | None, name: str) -> KVCache:
    """A full cache holding the prompt but for its last OBSERVED + 1 tokens (loaded from cache_dir when an earlier
    run saved it)."""
    a = model.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, model.dtype, model.device)
    key = hashlib.sha256(json.dumps([name, str(model.dtype), OBSERVED, ids]).encode()).hexdigest()[:16]
    path = cache_dir / f"prefill-{key}.pt" if cache_dir else None
    body = ids[:-(OBSERVED + 1)]
    if path and path.exists():
        k, v = torch.load(path)
        full.k[:, :, :len(body)], full.v[:, :, :len(body)] = k.to(full.device), v.to(full.device)
        full.used = len(body)
        return full
    t0 = time.perf_counter()
    list(Level(model, full, []).prefill(body, 2048))
    print(f"  prefill {len(body)} tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    if path:
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save((full.k[:, :, :len(body)].cpu(), full.v[:, :, :len(body)].cpu()), path)
    return full


def key_bias_share(index: Index, queries: torch.Tensor) -> list[float]:
    """Per layer, the share of the variance over chunks of the group-summed score that the rotated key bias's part
    of the mean keys accounts for (its variance over the total's)."""
    if index.bias is None:
        return []
    total = head_scores(index.mean, queries).sum(3)  # queries [R, W, L, Hq, D]
    bias = head_scores(index.bias, queries).sum(3)
    return (bias.var(-1) / total.var(-1)).mean((0, 2)).tolist()


def round_acceptance(accept: list[float], gamma: int) -> float:
    """Level-2 acceptance as a run counts it (accepted / proposed, in rounds of up to gamma tokens whose tokens after
    a rejection are proposed but not accepted) if answer token t is accepted with probability accept[t]: expected
    counts over the rounds' possible starts."""
    n = len(accept)
    start = [1.0] + [0.0] * n  # probability that a round starts at each position
    accepted = proposed = 0.0
    for s in range(n):
        w, alive = start[s], 1.0
        g = min(gamma, n - s)
        proposed += w * g
        for k in range(g):  # tokens s .. s+k-1 accepted, then s+k rejected: level 3's token there, next round after
            start[s + k + 1] += w * alive * (1 - accept[s + k])
            alive *= accept[s + k]
            accepted += w * alive
        start[min(n, s + g + 1)] += w * alive  # all accepted, then level 3's bonus token
    return accepted / proposed


def evaluate(model, full: KVCache, ids: list[int], answer: list[int], variants: list[Variant], budgets: list[int],
             gamma2: int) -> tuple[list[dict], list[float]]:
    """Teacher-forced level-2 acceptance of every variant at every budget on one answer (first row: every prompt
    token kept, which must accept all), and the key bias's share of the scores."""
    length, n = len(ids) - 1, len(answer)  # the retrieval cache chunks the full cache's first `length` tokens
    first, base = full.seq_len, OBSERVED - 1  # level-3 row r is at position first + r; row base at length - 1
    level3 = TeacherOps(full, length)
    logits3 = forward(model, full, ids[first:] + answer[:-1], level3)
    p_sampled, p_greedy = distributions(logits3[base + 1:], SAMPLED), logits3[base + 1:].argmax(-1)
    queries = torch.stack(level3.queries).permute(2, 0, 1, 3)  # [rows, L, Hq, D]
    fed = ids[-1:] + answer[:-1]

    def level2(masks: torch.Tensor, cs: int) -> dict:
        dummy = KVCache(*full.k.shape[:2], full.k.shape[-1], n, full.k.dtype, full.device, start=length)
        logits2 = forward(model, dummy, fed, TeacherOps(full, length, masks, cs))
        accept = torch.minimum(p_sampled, distributions(logits2, SAMPLED)).sum(-1).tolist()
        agree = (logits2.argmax(-1) == p_greedy).float().tolist()
        return {"acceptance": sum(accept) / n, "greedy_agreement": sum(agree) / n,
                "round_acceptance": round_acceptance(accept, gamma2), "round_greedy": round_acceptance(agree, gamma2)}

    layers, hkv = full.k.shape[:2]
    everything = torch.ones(layers, hkv, n, length // 8, dtype=torch.bool, device=full.device)
    rows = [{"variant": "all", "budget": length, **level2(everything, 8), "attention_recall": 1.0}]
    indexes, masses = {}, {}
    for v in variants:
        if v.chunk not in indexes:
            indexes[v.chunk] = build_index(model, full, length, v.chunk)
            masses[v.chunk] = attention_mass(full, level3.queries, length, v.chunk, first)
        index, (mass, rest) = indexes[v.chunk], masses[v.chunk]
        for budget in budgets:
            n_select = min(budget // v.chunk, index.mean.shape[2])
            masks = chunk_masks(v, index, queries, mass, n_select, n, base)
            g = mass.shape[2] // masks.shape[1]  # recall: level-2 row t against level-3 row base + 1 + t
            kept = masks.permute(2, 0, 1, 3).repeat_interleave(g, 2)
            recall = float(((mass[base + 1:] * kept).sum(-1) + rest[base + 1:]).mean())
            rows.append({"variant": v.name, "budget": budget, **level2(masks, v.chunk),
                         "attention_recall": recall})
    key = key_bias_share(indexes.get(8) or build_index(model, full, length, 8), queries[base:base + 1, None])
    full.truncate(first)
    return rows, key


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--documents", nargs="+", default=list(INSTRUCTIONS), choices=list(INSTRUCTIONS))
    p.add_argument("--context", type=int, default=8192, help="prompt tokens, about")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--budget-ratio", type=float, default=4096 / 30000,
                   help="also the budget that keeps this share of the prompt (the GPU runs' 4096 of 30K)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--gamma2", type=int, default=6, help="level-2 tokens per round, for round_acceptance")
    p.add_argument("--seed", type=int, default=0, help="the first sampled answer's seed (and the greedy one's)")
    p.add_argument("--seeds", type=int, default=1, help="sampled answers per document")
    p.add_argument("--greedy", type=int, default=1, choices=(0, 1), help="also a greedy answer per document")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--cache-dir", type=Path, default=None, help="keep prefilled caches here for later runs")
    p.add_argument("--name", default="retrieval-quality", help="results file name (bench/results/NAME.json)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [Variant.parse(t) for t in args.variants]
    started = time.perf_counter()
    engine = Engine.load(args.target, "", args.device, args.dtype)
    model = engine.target
    rows, runs = [], []
    with torch.no_grad():
        for kind in args.documents:
            doc = document(engine, kind, args.context - 64)
            ids = build_prompt(engine.tokenizer, doc, INSTRUCTIONS[kind], engine.context_length, args.new_tokens,
                               "truncate").ids
            ratio_budget = max(16, round(args.budget_ratio * len(ids) / 16) * 16)
            budgets = sorted({*args.budgets, ratio_budget})
            full = prefilled(model, ids, len(ids) + args.new_tokens + 2, args.cache_dir, args.target)
            answers = [("sampled", SAMPLED, seed) for seed in range(args.seed, args.seed + args.seeds)]
            for answer_kind, cfg, seed in answers + [("greedy", GREEDY, args.seed)] * args.greedy:
                t0 = time.perf_counter()
                answer = generate(model, full, ids, cfg, args.new_tokens, seed)
                found, key = evaluate(model, full, ids, answer, variants, budgets, args.gamma2)
                text = engine.tokenizer.decode(answer)
                runs.append({"document": kind, "answer_kind": answer_kind, "seed": seed, "prompt_tokens": len(ids),
                             "answer": text, "key_bias_share_by_layer": key})
                print(f"{kind} {answer_kind} ({len(ids)} tokens, {time.perf_counter() - t0:.0f} s): {text[:80]!r}\n"
                      f"  key bias share of score variance, mean over layers: {sum(key) / max(1, len(key)):.2f}",
                      flush=True)
                for r in found:
                    r.update(document=kind, answer_kind=answer_kind, seed=seed, prompt_tokens=len(ids),
                             budget_label="ratio" if r["budget"] == ratio_budget else str(r["budget"]))
                    print(f"  {r['variant']:<14} {r['budget']:>6} acc {r['acceptance']:.3f} (round "
                          f"{r['round_acceptance']:.3f}) greedy {r['greedy_agreement']:.3f} (round "
                          f"{r['round_greedy']:.3f}) recall {r['attention_recall']:.3f}", flush=True)
                rows += found
    table = summary(rows)
    path = save(args.name, {**environment(), "model": engine.info, "context": args.context,
                            "new_tokens": args.new_tokens, "budget_ratio": args.budget_ratio, "gamma2": args.gamma2,
                            "instructions": INSTRUCTIONS, "summary": table, "runs": runs, "rows": rows})
    labels = [b for b in dict.fromkeys(r["budget_label"] for r in table) if b != "all"]
    for key, what in (("acceptance", "acceptance on the sampled answers"),
                      ("round_acceptance", f"accepted / proposed in rounds of {args.gamma2}, sampled answers"),
                      ("greedy_agreement", "greedy agreement on the greedy answers")):
        print(f"\n{what}, mean over answers; budgets {', '.join(labels)} (ratio: {args.budget_ratio:.4f} of the "
              f"prompt)")
        for variant in dict.fromkeys(r["variant"] for r in table if r["variant"] != "all"):
            cells = {r["budget_label"]: r[key] for r in table if r["variant"] == variant}
            print(f"  {variant:<16}" + "".join(f" {cells[b]:6.3f}" if b in cells else " " * 7 for b in labels))
    print(f"{time.perf_counter() - started:.0f} s in all")
    print(f"saved {path}")


def mean(rows: list[dict], key: str) -> float:
    """The mean of rows' key (nan when there are none)."""
    return statistics.fmean(r[key] for r in rows) if rows else float("nan")


def summary(rows: list[dict]) -> list[dict]:
    """Per variant and budget label, means over the answers: acceptance and round acceptance on the sampled ones,
    greedy agreement on the greedy ones, attention recall on all."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], "all" if r["variant"] == "all" else r["budget_label"]), []).append(r)
    table = []
    for (variant, label), rs in groups.items():
        sampled = [r for r in rs if r["answer_kind"] == "sampled"]
        greedy = [r for r in rs if r["answer_kind"] == "greedy"]
        table.append({"variant": variant, "budget_label": label, "answers": len(rs),
                      **{k: mean(sampled, k) for k in ("acceptance", "round_acceptance")},
                      **{k: mean(greedy, k) for k in ("greedy_agreement", "round_greedy")},
                      "attention_recall": mean(rs, "attention_recall")})
    return table


if __name__ == "__main__":
    main()
