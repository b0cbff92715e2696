"""Method auto's regret: auto against autoregressive decoding and a grid of fixed plans, on real weights, with every
run's per-round trace; and (the random part) the paper's scale with random weights.

python -m bench.planner --target PRESET|GGUF [--draft PRESET|GGUF|none] [--regimes onchip-30k offload-30k]
    [--docs code prose needle] [--new-tokens 64 256] [--long-target qwen2.5-coder-1.5b-128k]
A regime is `onchip-<N>k` or `offload-<N>k` (one request of about N thousand prompt tokens, its full cache on the
device or streamed from CPU memory) or `batch-<B>x<N>k` (B requests decoded together), with any prefix naming where it
ran (`cpu-onchip-4k`); a regime longer than the target's context runs on --long-target (the YaRN ×4 preset). For
each document (code, prose, a needle), greedy and sampled (T 0.6, top-p 0.9), each answer length, and two questions
(the first answer, from the cost book as the engine's warm-up left it; after another, from the book as the first
question's auto run left it): AR, method auto, then levels 2 → 3 at γ2 2/4/8/16 (also drafting ahead where the cache
streams) and levels 1 → 2 → 3 with prompt lookup and with the draft model (where given), all on the one prefill of
the prompt (a shorter answer of AR and the fixed plans: the first rounds of their longest). A batch's requests each
take the next document. Writes bench/results/planner-real-<device>.json (with --record; regimes, and a regime's other
documents, run earlier the same day kept) with summary.planner_real.<regime>.{auto_over_ar, auto_over_best_fixed}: the
worst case of the regime (each case's figures under regimes.<regime>.cases).

python -m bench.planner --tokenizer TOKENIZER [--context 122880] [--new-tokens 256]
The random part: random weights at the Llama-2-7B shape (level 1: a random llama-68m shape) over a ~120K-token prompt
on the GPU's own memory, AR, TriForce and auto, sampled and greedy. TOKENIZER: a preset id (smollm2-135m), a saved
Hugging Face tokenizer directory or hub id. Merges random_7b_onchip_120k into summary.planner of
bench/results/planner.json and writes the runs to bench/results/planner-runs-<gpu>.json.
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from bench.batch import batch_run
from bench.common import (LLAMA2_7B, LLAMA_68M, earlier_today, environment, finish, merge_summary, model_source,
                          random_model, result_path, save, tokenizer_of)
from bench.offload import document, run
from bench.real import INSTRUCTIONS, row, text_of
from core import Engine, GenerationConfig
from core.events import PlanChosen, StepTiming, Verdict
from core.plan import CostBook
from core.io.presets import by_id
from core.io.prompting import build_prompt

SAMPLED = {"temperature": 0.6, "top_p": 0.9}
SAMPLINGS = {"greedy": {"greedy": True}, "sampled": SAMPLED}
# a second question on each document: its answer comes after the first's, from the cost book that answer left
AGAIN = {"code": "Which parts of this code would you test first, and why?",
         "prose": "Describe how Elizabeth's opinion of Mr. Darcy changes, scene by scene.",
         "needle": "Where in the text is the pass key, and what surrounds it?"}
ANSWERS = ("first", "after another")
GAMMAS = (2, 4, 8, 16)  # the fixed γ2s of levels 2 → 3
LONG_TARGET = "qwen2.5-coder-1.5b-128k"


@dataclass(frozen=True)
class Scenario:
    """A regime by its name: its prompt tokens, the requests decoded together, whether the full cache streams."""

    name: str
    tokens: int
    requests: int = 1
    offload: bool = False


def scenario(name: str) -> Scenario:
    """The regime a name says (`onchip-30k`, `offload-124k`, `batch-8x30k`, any prefix before them)."""
    if m := re.fullmatch(r"(?:.*-)?(onchip|offload)-(\d+)k", name):
        return Scenario(name, int(m[2]) * 1000, 1, m[1] == "offload")
    if m := re.fullmatch(r"(?:.*-)?batch-(\d+)x(\d+)k", name):
        return Scenario(name, int(m[2]) * 1000, int(m[1]))
    raise argparse.ArgumentTypeError(f"a regime is onchip-<N>k, offload-<N>k or batch-<B>x<N>k, got {name!r}")


def plans(scn: Scenario, draft: bool) -> dict[str, dict]:
    """AR, method auto and the fixed plans of a regime, by name: their settings."""
    out = {"ar": {"method": "ar"}, "auto": {"method": "auto"}}
    for g in GAMMAS:
        out[f"levels 2→3 γ2 {g}"] = {"method": "triforce", "drafter": "none", "gamma2": g, "draft_ahead": "off"}
        if scn.offload:
            out[f"levels 2→3 γ2 {g} ahead"] = {"method": "triforce", "drafter": "none", "gamma2": g,
                                              "draft_ahead": "on"}
    out["levels 1→2→3 lookup"] = {"method": "triforce", "drafter": "ngram"}
    if draft:
        out["levels 1→2→3 draft model"] = {"method": "triforce", "drafter": "model"}
    return out


def trace(engine: Engine, doc: str, question: str, cfg: GenerationConfig) -> tuple[dict, list[int]]:
    """One run to the end: its figures and rounds (bench.real.row), each round's level-3 verdict (drafted, accepted)
    and level-1 checks at level 2 (proposed, accepted); and its tokens."""
    verdicts: list[Verdict] = []
    chosen: list[PlanChosen] = []
    timings: list[StepTiming] = []
    fin = finish(engine, doc, question, cfg, verdicts, chosen, timings)
    level3 = {v.round: [len(v.proposed), v.accepted] for v in verdicts if v.level == 3}
    level1: dict[int, list[int]] = {}
    for v in verdicts:
        if v.level == 2 and v.proposed:
            got = level1.setdefault(v.round, [0, 0])
            got[0], got[1] = got[0] + len(v.proposed), got[1] + v.accepted
    out = row(fin, chosen, timings)
    del out["text"]
    out |= {"verified": [level3.get(t.round, [0, 0]) for t in timings],
            "level1_checked": [level1.get(t.round, [0, 0]) for t in timings],
            "level1_proposed": fin.stats.level1_proposed, "level1_steps": fin.stats.level1_steps,
            "gamma1": fin.stats.settings.get("gamma1"), "gamma2": fin.stats.settings.get("gamma2"),
            "greedy": cfg.is_greedy}
    return out, fin.token_ids


def batched(engine: Engine, ids: list[list[int]], cfg: GenerationConfig) -> tuple[dict, list[int]]:
    """One batch to the end (bench.batch.batch_run): its figures and the first request's tokens."""
    out = batch_run(engine, ids, cfg, len(ids))
    tokens = out.pop("token_ids")
    return out, tokens[0]


def figures(runs: dict[str, dict]) -> dict:
    """A case's ratios: auto over AR and over the fastest fixed plan, which that was."""
    speed = {name: r["tokens_per_s"] for name, r in runs.items()}
    fixed = {name: s for name, s in speed.items() if name not in ("ar", "auto")}
    top = max(fixed, key=fixed.get)
    return {"ar_tokens_per_s": speed["ar"], "auto_tokens_per_s": speed["auto"],
            "auto_over_ar": speed["auto"] / speed["ar"], "best_fixed": top,
            "best_fixed_over_ar": fixed[top] / speed["ar"], "auto_over_best_fixed": speed["auto"] / fixed[top],
            "auto_plans": runs["auto"]["plans"]}


def worst(cases: list[dict]) -> dict:
    """A regime's summary: the worst case of each ratio, and where it was."""
    out: dict = {"cases": len(cases)}
    for key in ("auto_over_ar", "auto_over_best_fixed"):
        low = min(cases, key=lambda c: c[key])
        out[key], out[f"{key}_where"] = low[key], f"{low['doc']}, {low['sampling']}, {low['new_tokens']} tokens, " \
                                                  f"{low['answer']}"
    return out


def prefix(run: dict, tokens: int) -> dict:
    """A single run's figures over its first rounds up to `tokens` tokens: what a run of a fixed plan or AR asked for
    that many gives (its rounds do not depend on the answer's length; the round that reaches it is counted whole),
    the time outside the rounds shared by rounds; acceptances stay the whole run's."""
    if run["new_tokens"] <= tokens:
        return run
    done, k = 0, 0
    while done < tokens:
        done, k = done + run["rounds"][k][3], k + 1
    total_ms = run["new_tokens"] / run["tokens_per_s"] * 1e3
    in_rounds = [l1 + l2 + l3 for l1, l2, l3, *_ in run["rounds"]]
    ms = sum(in_rounds[:k]) + (total_ms - sum(in_rounds)) * k / len(in_rounds)
    return {**run, "tokens_per_s": done * 1e3 / ms, "ms_per_token": ms / done, "new_tokens": done, "prefix_of":
            run["new_tokens"], **{key: run[key][:k] for key in ("rounds", "verified", "level1_checked")}}


def regime_cases(engine: Engine, scn: Scenario, docs: list[str], lengths: list[int]) -> Iterator[dict]:
    """Every case of one regime as it is measured: documents (a batch: one case, its requests each the next
    document), samplings, the two questions and the answer lengths, each with every plan's run. One request: AR and
    the fixed plans run once at the longest length (a shorter answer is their prefix), after AR method auto at each
    length from the cost book the case starts from (the first answer: as the warm-up left it; after another: as the
    first question's auto run of that length left it). A batch runs every plan at every length."""
    texts = {kind: text_of(kind, engine, scn.tokens) for kind in docs}
    warm = copy.deepcopy(engine.costs)
    after: dict[tuple, CostBook] = {}
    grid = plans(scn, engine.draft is not None)
    groups = [[kind] for kind in docs] if scn.requests == 1 else [[docs[i % len(docs)] for i in range(scn.requests)]]
    longest = max(lengths)
    for kinds in groups:
        for answer, questions in zip(ANSWERS, (INSTRUCTIONS, AGAIN)):
            for sampling, settings in SAMPLINGS.items():
                t0 = time.perf_counter()

                def measure(name: str, length: int) -> tuple[dict, list[int]]:
                    cfg = engine.settings(**{**grid[name], **settings, "max_new_tokens": length,
                                             "offload": "on" if scn.offload else "off"}).validate()
                    if scn.requests == 1:
                        return trace(engine, texts[kinds[0]], questions[kinds[0]], cfg)
                    ids = [build_prompt(engine.tokenizer, texts[k], questions[k], engine.context_length, length,
                                        "truncate").ids for k in kinds]
                    return batched(engine, ids, cfg)

                if answer == "first":
                    engine.costs = copy.deepcopy(warm)
                once = {"ar": measure("ar", longest)} if scn.requests == 1 else {}  # the Compare click's AR
                before = copy.deepcopy(engine.costs)
                autos = {}
                for length in lengths:
                    key = (tuple(kinds), sampling, length)
                    engine.costs = copy.deepcopy(before if answer == "first" else after[key])
                    autos[length] = measure("auto", length)
                    if answer == "first":
                        after[key] = copy.deepcopy(engine.costs)
                if scn.requests == 1:
                    once |= {name: measure(name, longest) for name in grid if name not in once and name != "auto"}
                for length in lengths:
                    measured = {name: measure(name, length) for name in grid if name != "auto"} if not once else \
                        {name: (prefix(run, length), tokens[:length]) for name, (run, tokens) in once.items()}
                    runs = {name: run for name, (run, _) in {**measured, "auto": autos[length]}.items()}
                    reference = measured["ar"][1]
                    identical = {name: tokens[:len(reference)] == reference for name, (_, tokens) in
                                 {**measured, "auto": autos[length]}.items() if name != "ar"} \
                        if sampling == "greedy" else {}
                    yield {"doc": "+".join(kinds), "sampling": sampling, "new_tokens": length, "answer": answer,
                           **figures(runs), "greedy_identical": identical, "wall_s": time.perf_counter() - t0,
                           "runs": runs}


def real(args: argparse.Namespace) -> None:
    """The regret benchmark: each regime's cases into one results file per device, saved after every case."""
    device = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    name = f"planner-real-{device}"
    data: dict = earlier_today(result_path(name))  # regimes run by earlier commands today
    env = environment()
    data.update({**env, "commands": data.get("commands", []) + [env["command"]], "device": device,
                 "target": args.target, "draft": args.draft, "long_target": args.long_target})
    data.setdefault("regimes", {})
    draft = "none" if args.draft == "none" else model_source(args.draft)
    engines: dict[str, tuple[Engine, float]] = {}

    def engine_for(scn: Scenario) -> tuple[Engine, float]:
        """The target's engine, or the long target's where the regime outgrows its context, loaded and warmed up
        once, and the seconds that took."""
        for target, rope in ((args.target, None), (args.long_target, dict(by_id(LONG_TARGET).rope_scaling))):
            if target not in engines:
                t0 = time.perf_counter()
                engine = Engine.load(target, draft, rope_scaling=rope)
                engine.target.eos_ids = set()  # a benchmark: every run generates its new tokens
                engine.warm_up()  # kernels compiled, the cost book filled, as in the app before a first request
                engines[target] = engine, time.perf_counter() - t0
            if scn.tokens + max(args.new_tokens) + 512 <= engines[target][0].context_length:
                return engines[target]
        raise SystemExit(f"{scn.name}: {scn.tokens} tokens outgrow {args.long_target}'s context too")

    def progress(scn: Scenario, case: dict) -> None:
        print(f"{scn.name} {case['doc']} {case['sampling']} {case['new_tokens']} tokens, {case['answer']}: AR "
              f"{case['ar_tokens_per_s']:.1f} tokens/s, auto {case['auto_over_ar']:.2f}x AR, "
              f"{case['auto_over_best_fixed']:.2f}x best fixed ({case['best_fixed']}, "
              f"{case['best_fixed_over_ar']:.2f}x); auto ran {case['auto_plans']}; {case['wall_s']:.0f} s so far",
              flush=True)

    for regime in args.regimes:
        scn = scenario(regime)
        engine, loaded_s = engine_for(scn)
        earlier = [c for c in data["regimes"].get(regime, {}).get("cases", [])  # other documents' cases, today
                   if scn.requests == 1 and c["doc"] not in args.docs]
        entry = data["regimes"][regime] = {"scenario": vars(scn), "model": engine.info, "load_and_warm_up_s": loaded_s,
                                           "cases": earlier}
        for case in regime_cases(engine, scn, args.docs, args.new_tokens):
            progress(scn, case)
            entry["cases"].append(case)
            data["summary"] = {"planner_real": {r: worst(v["cases"]) for r, v in data["regimes"].items()
                                                if v["cases"]}}
            save(name, data)
        engine.release()
    print(data["summary"])
    print(f"saved {result_path(name)}")


def random_7b(args: argparse.Namespace) -> None:
    """The random part: the Llama-2-7B shape at ~120K tokens on the GPU's memory."""
    tok = tokenizer_of(args.tokenizer)
    models = []
    for shape in (LLAMA2_7B, LLAMA_68M):
        models.append(random_model({**shape, "vocab_size": max(shape["vocab_size"], len(tok))}))
        models[-1].eos_ids = set()
    engine = Engine.from_models(models[0], tok, "random 7b shape", models[1], "random 68m shape",
                                args.context + args.new_tokens[0] + 1024)
    short = document(tok, 3000)  # kernels compiled and graphs captured outside the timed runs
    for method in ("ar", "triforce", "auto"):
        run(engine, short, GenerationConfig(method=method, max_new_tokens=32, **SAMPLED))
    engine.release()
    doc = document(tok, args.context - 200)
    runs = {}
    for sampling, settings in (("sampled", SAMPLED), ("greedy", {"greedy": True})):
        for method in ("ar", "triforce", "auto"):
            runs[f"{method} {sampling}"] = run(engine, doc, GenerationConfig(method=method,
                                                                             max_new_tokens=args.new_tokens[0],
                                                                             **settings))
    greedy_ids = {name: r.pop("token_ids") for name, r in runs.items() if name.endswith("greedy")}
    for r in runs.values():
        r.pop("token_ids", None)
    summary = {"random_7b_onchip_120k": runs["ar sampled"]["ms_per_token"] / runs["auto sampled"]["ms_per_token"],
               "choices": {"random 7b on-chip 120K": runs["auto sampled"]["plans"]}}
    out = {**environment(), "gpu": torch.cuda.get_device_name(), "context": args.context, "runs": runs,
           "speedup_triforce_sampled": runs["ar sampled"]["ms_per_token"] / runs["triforce sampled"]["ms_per_token"],
           "speedup_auto_greedy": runs["ar greedy"]["ms_per_token"] / runs["auto greedy"]["ms_per_token"],
           "greedy_identical": len({tuple(ids) for ids in greedy_ids.values()}) == 1, "summary": summary}
    print({k: v for k, v in out.items() if k != "runs"})
    print(f"saved {save('planner-runs-' + torch.cuda.get_device_name().replace(' ', '-'), out)}")
    print(f"planner figures merged into {merge_summary('planner', 'planner', summary)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", help="the real target: a preset id (qwen2.5-coder-1.5b, smollm2-135m) or .gguf")
    which.add_argument("--tokenizer", help="the random part's tokenizer: a preset id, directory or hub id")
    p.add_argument("--draft", default="none", help="level 1's draft model: a preset id, .gguf or none")
    p.add_argument("--long-target", default=LONG_TARGET, help="the target of regimes beyond --target's context: a "
                   "preset id or .gguf, loaded with the YaRN ×4 preset's RoPE scaling")
    p.add_argument("--regimes", nargs="+", default=["onchip-30k", "offload-30k"], type=str)
    p.add_argument("--docs", nargs="+", default=list(INSTRUCTIONS), choices=list(INSTRUCTIONS))
    p.add_argument("--new-tokens", type=int, nargs="+", default=None, help="answer lengths (default 64 256; the "
                   "random part: one, default 256)")
    p.add_argument("--context", type=int, default=122880, help="the random part's prompt tokens")
    args = p.parse_args()
    for regime in args.regimes:
        scenario(regime)  # a bad name fails before anything loads
    if args.tokenizer:
        args.new_tokens = args.new_tokens or [256]
        random_7b(args)
    else:
        args.new_tokens = args.new_tokens or [64, 256]
        real(args)


if __name__ == "__main__":
    main()
