"""Real weights at real long context: Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as the level-1 draft (and
the 0.5B alone with prompt lookup), on three kinds of document (this repository's Python sources, a novel, a pass
key hidden at 37 % depth in filler) at several lengths, on the GPU's memory and with the full cache offloaded.
Every TriForce run has an autoregressive run beside it in the same process, on the same prompt and seed;
acceptances at both levels; greedy runs of every method must be token-identical to greedy AR; transformers'
`generate` is the oracle for AR once, in float32.

python -m bench.real --target 1.5B.gguf --draft 0.5B.gguf [--contexts 8192 16384 30000] [--docs code prose needle]
    [--new-tokens 128] [--repeats 1] [--parts onchip offload alone oracle anatomy] [--gammas 8 12 16 20 31]
Writes bench/results/real-<gpu>.json (updated after every prompt) with summary.real and the real-pair keys
of summary.planner. `--gammas` adds sampled runs of level 2 drafting alone at each γ2, drafting ahead and not, each
beside what the planner's cost model expected of it (`bound.gammas`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import DOCS, earlier_today, environment, finish, merge_summary, model_source, result_path, save
from bench.needle import FILLER, NEEDLE
from bench.offload import h2d_gb_s
from core import Engine, GenerationConfig
from core.config import AUTO_GAMMA2
from core.decode import AUTOREGRESSIVE, Hierarchy, drafts_ahead
from core.events import Finished, PlanChosen, StepTiming
from core.plan import Regime, best, candidates, prior, rate

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = {"code": "Explain what this code does, module by module.",
                "prose": "Summarise what has happened so far, naming the main characters.",
                "needle": "What is the pass key?"}
SAMPLED = {"temperature": 0.6, "top_p": 0.9}
# (name, settings): greedy runs are checked against greedy AR token for token
GREEDY_RUNS = [("triforce-model", {"method": "triforce", "drafter": "model"}),
               ("triforce-ngram", {"method": "triforce", "drafter": "ngram"}),
               ("triforce-none", {"method": "triforce", "drafter": "none"}),
               ("triforce-streaming", {"method": "triforce", "drafter": "model", "level2_cache": "streaming"}),
               ("auto", {"method": "auto"})]
SAMPLED_RUNS = [("triforce-model", {"method": "triforce", "drafter": "model"}),
                ("triforce-ngram", {"method": "triforce", "drafter": "ngram"}), ("auto", {"method": "auto"}),
                ("auto-no-ahead", {"method": "auto", "draft_ahead": "off"}),  # (offloaded only: on chip it is auto)
                ("triforce-none", {"method": "triforce", "drafter": "none"})]  # after auto: it measures level 2 alone


def gamma_runs(gammas: Sequence[int]) -> list[tuple[str, dict]]:
    """Level 2 drafting alone at each γ2, drafting ahead (where the cache streams) and not."""
    return [(f"none-g{g}{'' if ahead else '-no-ahead'}", {"method": "triforce", "drafter": "none", "gamma2": g,
                                                          **({} if ahead else {"draft_ahead": "off"})})
            for g in gammas for ahead in (True, False)]


def text_of(kind: str, engine: Engine, tokens: int) -> str:
    """A document of about `tokens` tokens of one kind."""
    if kind == "code":
        files = sorted((ROOT / "core").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py")) + \
            sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "app").glob("*.py"))
        text = "".join(f"# file: {f.relative_to(ROOT)}\n{f.read_text()}\n" for f in files)
    elif kind == "prose":
        text = (DOCS / "pride_and_prejudice.txt").read_text()
    else:
        lines = tokens // len(engine.tokenizer(FILLER)["input_ids"])
        head = round(lines * 0.37)
        text = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                "memorise it.\n\n" + FILLER * head + NEEDLE + FILLER * (lines - head))
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


def row(fin: Finished, chosen: list[PlanChosen] = (), timings: list[StepTiming] = ()) -> dict:
    """One run's figures; given its rounds' timings, each round's milliseconds per level, tokens emitted and level-2
    forwards, and the decoding time spent outside the rounds (events, the planner's bookkeeping)."""
    s = fin.stats
    in_rounds = sum(t.level1_ms + t.level2_ms + t.level3_ms + t.selection_ms for t in timings)
    rounds = {"rounds": [[round(t.level1_ms, 2), round(t.level2_ms, 2), round(t.level3_ms, 2), t.tokens,
                          t.level2_forwards] for t in timings],
              "outside_rounds_ms": s.new_tokens / s.tokens_per_s * 1e3 - in_rounds} if timings else {}
    return {"tokens_per_s": s.tokens_per_s, "ms_per_token": 1e3 / s.tokens_per_s if s.tokens_per_s else None,
            "new_tokens": s.new_tokens, "prompt_tokens": s.prompt_tokens, "prefill_s": s.prefill_s,
            "prefill_reused": s.prefill_reused, "level1_acceptance": s.level1_acceptance,
            "level2_acceptance": s.level2_acceptance, "tokens_per_target_forward": s.tokens_per_target_forward,
            "host_link_bytes_per_token": s.host_link_bytes / max(s.new_tokens, 1), "plans": s.plans,
            "budget": s.settings.get("budget"), "drafter": s.drafter, "ahead_made": s.ahead_made,
            "ahead_kept": s.ahead_kept,
            "plan_log": [[c.round, c.plan, c.reason] for c in chosen], "warmup_s": s.warmup_s, "text": fin.text[:300],
            **rounds}


def sampled_row(engine: Engine, doc: str, instruction: str, settings: dict, repeats: int) -> dict:
    """A sampled method run `repeats` times with seeds 0, 1, ... (a 128-token sampled run's speed depends on what it
    happened to draw): the first run's row with the speed of all together (tokens over their summed decoding time)
    and each run's speed, acceptances and plans under "repeats"."""
    rows = []
    for seed in range(repeats):
        chosen: list[PlanChosen] = []
        timings: list[StepTiming] = []
        rows.append(row(finish(engine, doc, instruction, GenerationConfig(**settings, **SAMPLED, seed=seed),
                               chosen=chosen, timings=timings), chosen, timings))
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["new_tokens"] / r["tokens_per_s"] for r in rows)
    keep = ("tokens_per_s", "level1_acceptance", "level2_acceptance", "plans", "plan_log", "ahead_made", "ahead_kept",
            "rounds", "outside_rounds_ms")
    return {**rows[0], "tokens_per_s": tokens / seconds, "ms_per_token": 1e3 * seconds / tokens,
            "level1_acceptance": statistics.mean(r["level1_acceptance"] for r in rows),
            "level2_acceptance": statistics.mean(r["level2_acceptance"] for r in rows),
            "repeats": [{k: r[k] for k in keep if k in r} for r in rows]}


def usable(runs: list[tuple[str, dict]], engine: Engine, base: dict) -> list[tuple[str, dict]]:
    """The runs an engine can make (the model drafter needs a draft model) that differ in `base`'s regime (drafting
    ahead is off on chip anyway)."""
    return [(name, c) for name, c in runs if (engine.draft is not None or c.get("drafter") != "model")
            and (base.get("offload") == "on" or "draft_ahead" not in c)]


def prompt_runs(engine: Engine, doc: str, instruction: str, base: dict, repeats: int = 1,
                extra: Sequence[tuple[str, dict]] = ()) -> dict:
    """AR greedy and sampled, then every greedy and sampled method (sampled ones `repeats` times each) and the
    `extra` sampled runs, on one prompt (the first run prefills)."""
    out: dict = {"greedy": {}, "sampled": {}}
    ar_greedy = finish(engine, doc, instruction, GenerationConfig(method="ar", greedy=True, **base))
    out["greedy"]["ar"] = row(ar_greedy)
    out["sampled"]["ar"] = sampled_row(engine, doc, instruction, dict(method="ar", **base), repeats)
    identical = {}
    for name, settings in usable(GREEDY_RUNS, engine, base):
        chosen: list[PlanChosen] = []
        fin = finish(engine, doc, instruction, GenerationConfig(greedy=True, **settings, **base), chosen=chosen)
        out["greedy"][name] = row(fin, chosen)
        identical[name] = fin.token_ids == ar_greedy.token_ids
        if not identical[name]:
            from core.decode import difference_note
            out["greedy"][name]["difference"] = difference_note(ar_greedy.token_ids, fin.token_ids,
                                                                ar_greedy.stats.near_ties)
    for name, settings in usable(SAMPLED_RUNS + list(extra), engine, base):
        out["sampled"][name] = sampled_row(engine, doc, instruction, {**settings, **base}, repeats)
    out["greedy_identical"] = identical
    out["near_ties_ar"] = len(ar_greedy.stats.near_ties)
    for sampling in ("greedy", "sampled"):
        ar = out[sampling]["ar"]["tokens_per_s"]
        for name, r in out[sampling].items():
            r["speedup"] = r["tokens_per_s"] / ar if ar and r["tokens_per_s"] else None
    return out


def bound(engine: Engine, prompt_tokens: int, offloaded: bool, sampled: dict, gammas: Sequence[int] = ()) -> dict:
    """What the planner's own cost model says the best plan could reach on this prompt: the step costs the engine's
    cost book holds for sampled runs of this kind (measured by the runs just made) and the acceptances the sampled
    fixed-TriForce runs saw, with each drafter, every candidate weighed; beside the costs it used, and what it expects
    of each run of level 2 drafting alone at a fixed γ2 (`gamma_runs`) given that run's acceptance, beside what the
    run measured."""
    runs = {name: sampled[f"triforce-{name}"] for name in ("model", "ngram") if f"triforce-{name}" in sampled}
    e = engine.costs.estimates(Regime.of(offloaded, prompt_tokens, False), runs["model"]["budget"], list(runs))
    e.a2 = prior(runs["model"]["level2_acceptance"])
    for name, run in runs.items():  # the fixed runs' acceptance at level 2 stands for a1 and a13 alike
        e.level1[name].a1, e.level1[name].a13 = prior(run["level1_acceptance"]), None
    f = e.figures()
    ar = rate(AUTOREGRESSIVE, f)
    ahead = drafts_ahead(GenerationConfig().draft_ahead, offloaded, engine.target.device)
    gamma1 = GenerationConfig().gamma1
    top = best(candidates(list(runs), gamma1, AUTO_GAMMA2, ahead=ahead), f)
    expected = {}
    for name, settings in gamma_runs(gammas):
        if name in sampled:  # the planner's figures with this run's own level-2 acceptance
            h = Hierarchy("", True, 0, settings["gamma2"], ahead and "draft_ahead" not in settings)
            own = replace(f, a2=sampled[name]["level2_acceptance"])
            expected[name] = {"expected": rate(h, own) / ar if ar else None, "measured": sampled[name]["speedup"]}
    checking, alone = f.level2_step(gamma1 + 1, alone=False), f.level2_step(1, alone=True)
    level3 = e.curves["level3"].samples
    return {"level1_ms": {name: d.ms for name, d in e.level1.items()},
            "offered": {name: d.offered.rate for name, d in e.level1.items()},
            "level2_ms": checking[0] and checking[0](gamma1 + 1),
            "level2_ahead_ms": checking[1] and checking[1](gamma1 + 1),
            "level2_alone_ms": alone[0] and alone[0](1), "level2_alone_ahead_ms": alone[1] and alone[1](1),
            "overhead_ms": f.overhead,
            "level3_ms": {str(k): statistics.median_low(v) for k, v in sorted(level3.items())},
            "a1": {name: run["level1_acceptance"] for name, run in runs.items()},
            "a2": runs["model"]["level2_acceptance"], "best_plan": top[0].name if top else None,
            "expected_speedup": top[1] / ar if top and ar else None, "gammas": expected}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def anatomy(engine: Engine, doc: str, instruction: str, bw: float | None) -> dict:
    """Where an offloaded AR step's time goes: the step (from CUDA graphs; with their captures, one per 256 tokens,
    counted too), the same copies without compute (stream_layers over the whole cache), and the step's bytes over
    the measured link bandwidth."""
    fin = finish(engine, doc, instruction, GenerationConfig(method="ar", greedy=True, offload="on", max_new_tokens=64))
    full = engine.memory.kept.cache
    length = full.seq_len
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in full.stream_layers(length):
            pass
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    kv = full.k[:, :, :length].nbytes * 2
    s = fin.stats
    return {"ar_ms_per_token": 1e3 / s.tokens_per_s, "copies_only_ms": statistics.median(times),
            "ar_ms_per_token_with_captures": 1e3 * (s.decode_s + s.warmup_s) / s.new_tokens,
            "roofline_ms": kv / bw / 1e6 if bw else None, "kv_gb": kv / 1e9, "layers": engine.target.args.n_layers}


def oracle(target: str, draft: str, doc: str, instruction: str, new_tokens: int) -> dict:
    """Float32 on the GPU: our greedy AR and TriForce against transformers' greedy generate on the same prompt."""
    from transformers import AutoModelForCausalLM

    from core.io.loading import _cache_dir, resolve
    engine = Engine.load(target, draft, dtype="float32")
    engine.target.eos_ids = set()
    base = dict(greedy=True, max_new_tokens=new_tokens)
    ar = finish(engine, doc, instruction, GenerationConfig(method="ar", **base))
    tf = finish(engine, doc, instruction, GenerationConfig(method="triforce", **base))
    auto = finish(engine, doc, instruction, GenerationConfig(method="auto", **base))
    dev = engine.target.device
    hf = AutoModelForCausalLM.from_pretrained(_cache_dir(resolve(target)), dtype=torch.float32).to(dev).eval()
    with torch.inference_mode():
        ids = torch.tensor([ar.prompt_ids], device=dev)
        out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf_ids = out[0, len(ar.prompt_ids):].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(hf_ids, ar.token_ids)) if a != b), len(ar.token_ids))
    del hf, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"prompt_tokens": len(ar.prompt_ids), "triforce_equals_ar": tf.token_ids == ar.token_ids,
            "auto_equals_ar": auto.token_ids == ar.token_ids, "transformers_agrees_for": agree,
            "transformers_equals_ar": hf_ids == ar.token_ids, "new_tokens": new_tokens}


def summarise(data: dict, contexts: list[int]) -> dict:
    """summary.real and the real-pair keys of summary.planner from the runs at the longest context."""
    longest = str(max(contexts))

    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    at = {regime: [p for key, p in data.get(regime, {}).items() if key.endswith(f"@{longest}")]
          for regime in ("onchip", "offload")}
    identical = [all(p["greedy_identical"].values()) for regime in ("onchip", "offload")
                 for p in data.get(regime, {}).values()]
    real = {"onchip_speedup_30k": mean([p["sampled"]["auto"]["speedup"] for p in at["onchip"]]),
            "offload_speedup_30k": mean([p["sampled"]["auto"]["speedup"] for p in at["offload"]]),
            "offload_no_ahead_speedup_30k": mean([p["sampled"].get("auto-no-ahead", {}).get("speedup")
                                                  for p in at["offload"]]),
            "l2_acceptance_30k": mean([p["sampled"]["triforce-model"]["level2_acceptance"] for p in at["onchip"]]),
            "l1_acceptance_30k": mean([p["sampled"]["triforce-model"]["level1_acceptance"] for p in at["onchip"]]),
            "offload_ar_over_roofline": mean([a["ar_ms_per_token"] / a["roofline_ms"]
                                              for a in data.get("anatomy", {}).values() if a["roofline_ms"]]),
            "greedy_identical_bf16": all(identical) if identical else None,
            "greedy_identical_fp32": data["oracle"]["triforce_equals_ar"] and data["oracle"]["auto_equals_ar"]
            if "oracle" in data else None}
    # only what this run measured: a part it left out keeps an earlier run's figure in summary.planner
    speedups = {"real_onchip_30k": real["onchip_speedup_30k"], "real_offload_30k": real["offload_speedup_30k"]}
    planner = {**{key: value for key, value in speedups.items() if value is not None},
               "choices": {f"real {regime} {key}": p["sampled"]["auto"]["plans"] for regime in at
                           for key, p in data.get(regime, {}).items() if key.endswith(f"@{longest}")}}
    return {"real": real, "planner": planner}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the 1.5B target: a preset id (qwen2.5-coder-1.5b), .gguf or directory")
    p.add_argument("--draft", required=True, help="the 0.5B draft, also run alone with prompt lookup: a preset id "
                   "(qwen2.5-coder-0.5b), .gguf or directory")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 30000])
    p.add_argument("--docs", nargs="+", default=list(INSTRUCTIONS), choices=list(INSTRUCTIONS))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--parts", nargs="+", default=["onchip", "offload", "alone", "oracle", "anatomy"],
                   choices=["onchip", "offload", "alone", "oracle", "anatomy"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each sampled method (seeds 0, 1, ...): its speed is "
                   "that of all of them together")
    p.add_argument("--gammas", type=int, nargs="*", default=[], help="γ2s at which to run level 2 drafting alone, "
                   "drafting ahead and not, beside what the planner expects of each")
    p.add_argument("--name", default="real")
    args = p.parse_args()
    args.target, args.draft = model_source(args.target), model_source(args.draft)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # a CPU: a smoke test of the script
    name = f"{args.name}-{gpu.replace(' ', '-')}"
    data: dict = earlier_today(result_path(name))  # parts run by earlier commands today
    env = environment()
    data.update({**env, "commands": data.get("commands", []) + [env["command"]], "gpu": gpu, "target": args.target,
                 "draft": args.draft, "new_tokens": args.new_tokens})
    bw = h2d_gb_s() if torch.cuda.is_available() else None
    data["h2d_gb_s"] = bw
    engine = Engine.load(args.target, args.draft)
    engine.target.eos_ids = set()  # a benchmark: every run generates new_tokens tokens
    data["model"] = engine.info
    t0 = time.perf_counter()
    engine.warm_up()  # the app's: kernels for every step shape method auto may use, the cost book filled
    data["warm_up_s"] = time.perf_counter() - t0
    for regime in ("onchip", "offload"):
        if regime not in args.parts:
            continue
        for ctx in args.contexts:
            for kind in args.docs:
                doc = text_of(kind, engine, ctx)
                base = dict(max_new_tokens=args.new_tokens, offload="on" if regime == "offload" else "off")
                result = prompt_runs(engine, doc, INSTRUCTIONS[kind], base, args.repeats, gamma_runs(args.gammas))
                result["bound"] = bound(engine, result["sampled"]["ar"]["prompt_tokens"], regime == "offload",
                                        result["sampled"], args.gammas)
                data.setdefault(regime, {})[f"{kind}@{ctx}"] = result
                s = result["sampled"]
                print(f"{regime} {kind}@{ctx}: AR {s['ar']['ms_per_token']:.2f} ms/token; sampled "
                      + ", ".join(f"{n} {r['speedup']:.2f}x" for n, r in s.items() if n != "ar")
                      + f"; L1 {s['triforce-model']['level1_acceptance']:.2f} L2 "
                      f"{s['triforce-model']['level2_acceptance']:.2f}; auto {s['auto']['plans']}; greedy "
                      f"identical {result['greedy_identical']}; model bound {result['bound']}", flush=True)
                data["summary"] = summarise(data, args.contexts)
                save(name, data)
            if regime == "offload" and "anatomy" in args.parts:
                data.setdefault("anatomy", {})[str(ctx)] = anatomy(engine, text_of("prose", engine, ctx), "Go on.", bw)
                print(f"anatomy @{ctx}: {data['anatomy'][str(ctx)]}", flush=True)
        engine.release()
    if "alone" in args.parts:  # the 0.5B by itself: levels 2 and 3 are the 0.5B, level 1 prompt lookup
        gc.collect()
        alone = Engine.load(args.draft, "")
        alone.target.eos_ids = set()
        for kind in args.docs:
            doc = text_of(kind, alone, max(args.contexts))
            result = prompt_runs(alone, doc, INSTRUCTIONS[kind], dict(max_new_tokens=args.new_tokens))
            data.setdefault("alone", {})[f"{kind}@{max(args.contexts)}"] = result
            save(name, data)
            print(f"0.5B alone {kind}: " + ", ".join(f"{n} {r['speedup']:.2f}x L2 {r['level2_acceptance']:.2f}"
                                                    for n, r in result["sampled"].items() if n != "ar"), flush=True)
        alone.release()
    if "oracle" in args.parts:
        eng = Engine.load(args.target, args.draft)
        try:
            data["oracle"] = oracle(args.target, args.draft, text_of("code", eng, 8192), INSTRUCTIONS["code"], 64)
        finally:
            save(name, data)
        print(f"oracle (float32): {data['oracle']}", flush=True)
    data["summary"] = summarise(data, args.contexts)
    print(data["summary"])
    print(f"saved {save(name, data)}")
    print(f"planner figures merged into {merge_summary('planner', 'planner', data['summary']['planner'])}")


if __name__ == "__main__":
    main()
