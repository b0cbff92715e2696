"""What a decode step costs on a CPU, piece by piece, with the embedded model (its preset: budget 512, repetition
penalty 1.2) on an ~8K-token document: the target's forward and LM head by rows on the full cache and on level 2's
retrieval cache, repetition control, distributions (sampled and greedy) and verification by rows, keeping level 2's
cache in step, and a level-2 step over a full step as method auto measures them (level 2 checking γ1 level-1 tokens:
γ1 + 1 rows on the retrieval cache, its head, repetition control, distributions and verification; a full step: the
autoregressive step, one row on the full cache, the same after it). Each figure is taken with the projections
through MKL's GEMM (F.linear: "torch", the PyTorch operators) and through oneDNN on packed weights ("cpu",
core.model.ops.CpuOps, what a CPU engine uses), on all of torch's threads and on one; the variants are interleaved
in one process and repeated, and the minimum and median of each are printed and saved (out/cpu-steps.json; with
--record, the reference figures bench/results/cpu-steps.json).

OpenMP's idle threads are told to sleep (OMP_WAIT_POLICY=PASSIVE, unless the environment sets it) before torch
loads OpenMP, as the engine does: with OpenMP's default (--openmp-default) they spin, and on a machine whose cores
other processes keep busy, a forward on 2 threads waited for a descheduled thread at every operator.

python -m bench.cpu_steps [--document us_constitution.txt] [--tokens 7900] [--reps 9] [--rows 1 2 3 7]
                          [--random-cache] [--openmp-default] [--record]
"""

from __future__ import annotations

import os
import sys

if "--openmp-default" not in sys.argv:  # read once, when torch loads OpenMP: it must come before torch
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable, TypeVar  # noqa: E402

import torch  # noqa: E402

from bench.common import DOCS, INSTRUCTION, environment, save  # noqa: E402
from core import Engine  # noqa: E402
from core.cache import KVCache  # noqa: E402
from core.cache import Retrieval  # noqa: E402
from core.config import GenerationConfig  # noqa: E402
from core.decode import Level  # noqa: E402
from core.decode import Repetition  # noqa: E402
from core.decode import distributions, sample, speculative_verify  # noqa: E402
from core.io import build_prompt  # noqa: E402
from core.model import TORCH, TorchOps, ops_for  # noqa: E402

T = TypeVar("T")
ANSWER = 16  # answer tokens the caches hold beyond the prompt when the steps are timed


class Timings:
    """Milliseconds of each piece, by key, over repeated calls."""

    def __init__(self):
        self.samples: dict[tuple, list[float]] = {}

    def time(self, key: tuple, fn: Callable[[], T]) -> T:
        """fn(), its wall time added to `key`'s samples."""
        t0 = time.perf_counter()
        out = fn()
        self.samples.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)
        return out

    def figures(self, key: tuple) -> dict[str, float]:
        v = self.samples[key]
        return {"min_ms": round(min(v), 3), "median_ms": round(statistics.median(v), 3), "n": len(v)}


def caches(engine: Engine, ids: list[int], cfg: GenerationConfig, random_cache: bool
           ) -> tuple[Level, Level, Retrieval, float]:
    """The target level on a full cache holding ids[:-1] (prefilled, or random keys/values: a step's time does not
    depend on them), level 2 on its retrieval cache selected from the last prompt row's queries, the prefill's s."""
    model, a = engine.target, engine.target.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, len(ids) + 4 * ANSWER, model.dtype, model.device)
    target = Level(model, full, [])
    t0 = time.perf_counter()
    if random_cache:
        full.k.normal_(), full.v.normal_()
        full.used = len(ids) - 1
        target.tokens = list(ids[:-1])
        queries = [torch.randn(a.n_kv_heads, 1, a.head_dim) for _ in range(a.n_layers)]
    else:
        for _ in target.prefill(ids[:-1], 2048, record=1):
            pass
        queries = target.queries
    prefill_s = time.perf_counter() - t0
    kept = cfg.budget + cfg.chunk_size + 4 * ANSWER  # the chunks the budget buys, a partial one, the answer
    retrieval = Retrieval(full, cfg, KVCache(a.n_layers, a.n_kv_heads, a.head_dim, kept, model.dtype, model.device),
                          model.ops)
    retrieval.select(queries, -1, 0, full.seq_len)
    level2 = Level(model, retrieval.cache, ids[:-1], drafting=True)
    return target, level2, retrieval, prefill_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--document", default="us_constitution.txt", help="a file in assets/docs")
    p.add_argument("--tokens", type=int, default=7900, help="document tokens kept (the prompt adds the template's)")
    p.add_argument("--reps", type=int, default=9, help="repetitions of every interleaved variant")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 7], help="rows of the forwards timed")
    p.add_argument("--random-cache", action="store_true", help="random keys/values instead of prefilling (faster)")
    p.add_argument("--openmp-default", action="store_true", help="leave OMP_WAIT_POLICY unset (OpenMP's default: "
                   "idle threads spin before they sleep)")
    args = p.parse_args()
    engine = Engine.load()
    model, tok = engine.target, engine.tokenizer
    cfg = engine.settings(max_new_tokens=64).resolved(False)  # the preset's: budget 512, repetition penalty 1.2
    greedy = engine.settings(max_new_tokens=64, greedy=True).resolved(False)
    text = tok.decode(tok((DOCS / args.document).read_text(), add_special_tokens=False)["input_ids"][:args.tokens])
    ids = build_prompt(tok, text, INSTRUCTION, engine.context_length, cfg.max_new_tokens, "truncate").ids
    target, level2, retrieval, prefill_s = caches(engine, ids, cfg, args.random_cache)
    print(f"{len(ids)} prompt tokens ({args.document}), prefill {prefill_s:.1f} s"
          f"{' (random keys/values)' if args.random_cache else ''}; level 2 holds {retrieval.cache.used} of them "
          f"(budget {cfg.budget}); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"{torch.get_num_threads()} threads", flush=True)

    # the answer so far: ANSWER tokens both caches hold (level 3 verified them; level 2 was kept in step)
    seq = list(ids) + ids[len(ids) // 2:len(ids) // 2 + ANSWER]
    target.states(seq, 1, len(ids) - 1)
    retrieval.copy_from_full(len(seq) - 1)
    level2.tokens = list(seq[:-1])
    generator = torch.Generator().manual_seed(0)
    rows = sorted(set(args.rows))
    gamma1 = cfg.gamma1
    variants: dict[str, TorchOps] = {"torch": TORCH, "cpu": ops_for("cpu")}
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    t = Timings()

    def forward(level: Level, n: int) -> torch.Tensor:
        """The hidden states of the last n positions of seq + n - 1 draft tokens (the cache rolls them back)."""
        return level.states(seq, n, len(seq) - 1, seq[-n:-1] if n > 1 else ())

    def step(level: Level, n: int, c: GenerationConfig) -> object:
        """What a round does with a forward of n rows: head, repetition control, distributions, then a verification
        of n - 1 drafts (a level-2 step checking level 1) or a draw (n = 1: the autoregressive step)."""
        drafts = seq[-n:-1] if n > 1 else []
        p_ = distributions(repetition(level.head(forward(level, n)), seq, drafts), c)
        return speculative_verify(drafts, None, p_, generator) if drafts else sample(p_[0], generator)

    repetition = Repetition(cfg, model.args.vocab_size, model.device, len(ids))
    for name, ops in variants.items():  # first uses: packing (cpu), kernels' one-time set-up
        model.ops = ops
        for n in rows:
            forward(target, n), forward(level2, n)
    for _ in range(args.reps):
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name, ops in variants.items():
                model.ops = ops
                for n in rows:
                    for cache, level in (("full", target), ("retrieval", level2)):
                        h = t.time(("forward", cache, name, n_threads, n), lambda: forward(level, n))
                        t.time(("head", cache, name, n_threads, n), lambda: level.head(h))
                for c, sampling in ((cfg, "sampled"), (greedy, "greedy")):
                    t.time(("full step", sampling, name, n_threads, 1), lambda: step(target, 1, c))
                    t.time(("level-2 step", sampling, name, n_threads, gamma1 + 1),
                           lambda: step(level2, gamma1 + 1, c))
        torch.set_num_threads(threads[0])
        model.ops = None
        logits = {n: level2.head(forward(level2, n)) for n in rows}
        for n in rows:
            drafts = seq[-n:-1] if n > 1 else []
            t.time(("repetition", n), lambda: repetition(logits[n], seq, drafts))
            for c, sampling in ((cfg, "sampled"), (greedy, "greedy")):
                probs = t.time(("distributions", sampling, n), lambda: distributions(logits[n], c))
                t.time(("verify", sampling, n), lambda: speculative_verify(drafts, None, probs, generator)
                       if drafts else sample(probs[0], generator))
            # keeping level 2 in step: the full cache's keys/values of n verified positions copied over
            end = len(seq) - 1
            retrieval.synced = end - n
            t.time(("copy_positions", n), lambda: retrieval.copy_from_full(end))
    model.ops = None

    results: dict = {}
    for key in t.samples:
        node = results
        for part in key[:-1]:
            node = node.setdefault(str(part), {})
        node[str(key[-1])] = t.figures(key)
    ratios = {}
    for name in variants:
        for n_threads in threads:
            for sampling in ("sampled", "greedy"):
                l2 = t.figures(("level-2 step", sampling, name, n_threads, gamma1 + 1))
                full = t.figures(("full step", sampling, name, n_threads, 1))
                ratios[f"{name}, {n_threads} thread{'s' * (n_threads > 1)}, {sampling}"] = {
                    "level2_step_ms": l2["median_ms"], "full_step_ms": full["median_ms"],
                    "ratio_of_medians": round(l2["median_ms"] / full["median_ms"], 3),
                    "ratio_of_mins": round(l2["min_ms"] / full["min_ms"], 3)}

    def row(label: str, key: Callable[[int], tuple]) -> None:
        cells = [f"{t.figures(key(n))['min_ms']:7.1f} {t.figures(key(n))['median_ms']:7.1f}" for n in rows]
        print(f"{label:<44}" + "".join(f"{c:>18}" for c in cells))

    print(f"\nmilliseconds, min and median of {args.reps}, by rows".ljust(44)
          + "".join(f"{n:>14} row{'s' * (n > 1):<3}" for n in rows))
    for n_threads in threads:
        for name in variants:
            for cache in ("full", "retrieval"):
                for piece in ("forward", "head"):
                    row(f"{piece} {cache} ({name}, {n_threads} thr)",
                        lambda n, k=(piece, cache, name, n_threads): (*k, n))
    row("repetition control", lambda n: ("repetition", n))
    for sampling in ("sampled", "greedy"):
        row(f"distributions ({sampling})", lambda n, s=sampling: ("distributions", s, n))
        row(f"verify / draw ({sampling})", lambda n, s=sampling: ("verify", s, n))
    row("copy_positions (n positions to level 2)", lambda n: ("copy_positions", n))
    print(f"\na level-2 step (γ1 {gamma1}: {gamma1 + 1} rows on {retrieval.cache.used} tokens) / a full step "
          f"(1 row on {target.cache.used}), as method auto measures them:")
    for label, r in ratios.items():
        print(f"  {label:<28} {r['level2_step_ms']:7.1f} / {r['full_step_ms']:7.1f} ms = "
              f"{r['ratio_of_medians']:.0%} (of mins {r['ratio_of_mins']:.0%})")
    most = threads[0]  # the headline figures: medians on all of torch's threads

    def medians(key: Callable[[int], tuple]) -> dict[str, float]:
        return {f"{n} row{'s' * (n > 1)}": t.figures(key(n))["median_ms"] for n in rows}

    summary = {
        "level2_step_over_full_step": {label: r["ratio_of_medians"] for label, r in ratios.items()},
        **{f"forward_ms_{cache}_{name}": medians(lambda n, k=("forward", cache, name, most): (*k, n))
           for cache in ("full", "retrieval") for name in variants},
        **{f"head_ms_{name}": medians(lambda n, k=("head", "retrieval", name, most): (*k, n)) for name in variants},
        **{f"distributions_ms_{s}": medians(lambda n, s=s: ("distributions", s, n)) for s in ("sampled", "greedy")},
        "repetition_ms": medians(lambda n: ("repetition", n)),
    }
    path = save("cpu-steps", {**environment(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                              "model": engine.info, "document": args.document, "prompt_tokens": len(ids),
                              "random_cache": args.random_cache, "prefill_s": prefill_s, "budget": cfg.budget,
                              "retrieval_tokens": retrieval.cache.used, "gamma1": gamma1, "reps": args.reps,
                              "summary": summary, "ratios": ratios, "pieces": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
