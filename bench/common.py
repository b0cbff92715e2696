"""Helpers shared by the benchmark scripts: documents cut to a token count, runs, result files; for the GPU parts,
random models at named shapes, step timings and the per-GPU result file with its summary.

Every benchmark writes its result file under ./out/; only with --record (`python -m bench.NAME ... --record`) does
it replace the project's reference figures in bench/results/, which bench.report publishes. A result records the
command without --record, and the machine: CPU model and threads, GPU, driver and versions."""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import transformers

from core import Engine, GenerationConfig
from core.cache import (ChunkIndex, KVCache, StreamingCache, chunks_to_keep, gather_selection, retrieval_cache,
                        select_chunks)
from core.decode import Graphs, Level, distributions
from core.events import Finished, PlanChosen, StepTiming, Verdict
from core.model import ModelArgs, TorchOps, Transformer

DOCS = Path(__file__).parent.parent / "assets" / "docs"
RESULTS = Path(__file__).parent / "results"  # the project's reference figures: written only with --record
OUT = Path("out")  # where a benchmark writes otherwise (git ignores it), under the directory it runs from
RECORD_FLAG = "--record"
# Every benchmark takes --record; it is taken off the command line here, before the benchmark's own parser reads it.
RECORD = RECORD_FLAG in sys.argv[1:]
if RECORD:
    sys.argv.remove(RECORD_FLAG)
INSTRUCTION = "Summarise what has happened so far, naming the main characters."


def document_of(engine: Engine, name: str, tokens: int) -> str:
    """The first `tokens` tokens of a bundled document, as text."""
    ids = engine.tokenizer((DOCS / name).read_text(), add_special_tokens=False)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


def finish(engine: Engine, document: str, instruction: str, cfg: GenerationConfig,
           verdicts: list[Verdict] | None = None, chosen: list[PlanChosen] | None = None,
           timings: list[StepTiming] | None = None) -> Finished:
    """Run one generation to the end and return its Finished event (its verifications appended to `verdicts`, the
    plans method auto chose, with its reasons, to `chosen`, its rounds' timings to `timings`)."""
    for event in engine.generate(document, instruction, cfg):
        if isinstance(event, Verdict) and verdicts is not None:
            verdicts.append(event)
        elif isinstance(event, PlanChosen) and chosen is not None:
            chosen.append(event)
        elif isinstance(event, StepTiming) and timings is not None:
            timings.append(event)
        elif isinstance(event, Finished):
            return event
    raise RuntimeError("no result")


def drafter_settings(spec: str) -> dict:
    """GenerationConfig fields of a drafter spec: "ngram", "model", "model:0.5" (gated at draft confidence 0.5),
    "model+3" (copying the text's continuation after 3-token matches; "model+0": never; "model": the default),
    "model-fusion" (the draft without the target's hidden states), or combinations ("model-fusion+0:0.5")."""
    drafter, _, gate = spec.partition(":")
    drafter, _, lookup = drafter.partition("+")
    drafter, no_fusion, _ = drafter.partition("-fusion")
    return {"drafter": drafter, "draft_confidence": float(gate or 0), "draft_fusion": not no_fusion,
            **({"lookup_min": int(lookup)} if lookup else {})}


def command() -> str:
    """This process's command line as typed (`python -m bench.NAME ...`, with TRIFORCE_GEMV when it is set)."""
    env = [f"TRIFORCE_GEMV={os.environ['TRIFORCE_GEMV']}"] if "TRIFORCE_GEMV" in os.environ else []
    return shlex.join([*env, "python", "-m", "bench." + Path(sys.argv[0]).stem, *sys.argv[1:]])  # '' survives


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    """The CPU's model as /proc/cpuinfo names it ("AMD EPYC 7B13"), else what the platform says: CPU figures from
    two machines differ by this, not by the thread count alone."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def machine() -> dict:
    """What a result's figures depend on besides the code: the CPU's model and threads, the GPU with its driver and
    CUDA (where there is one), the versions of Python, torch and transformers."""
    found = {"python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "machine": platform.machine(), "cpu": cpu_model(),
             "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        found |= {"gpu": torch.cuda.get_device_name(), "gpu_driver": gpu_driver(), "cuda": torch.version.cuda}
    return found


def environment() -> dict:
    return {"date": now(), "command": command(), **machine()}


def result_path(name: str) -> Path:
    """NAME.json under bench/results (with --record: the project's reference figures, which bench.report publishes;
    one stable file per benchmark, its newest result, the date inside and git keeping the earlier ones), else under
    ./out, so that measuring one's own machine never replaces them. NAME says what was measured and where (e.g.
    real-NVIDIA-H200), never when or at which commit."""
    return (RESULTS if RECORD else OUT) / f"{name}.json"


def earlier_today(path: Path) -> dict:
    """The result already in `path` when it was written today (UTC), so that a benchmark run in several commands
    gathers its parts in one file; {} otherwise: a new day's run replaces the file."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    dates = [data.get("date"), *(s.get("date") for s in data.get("sources", []))]
    return data if any(str(d or "")[:10] == now()[:10] for d in dates) else {}


def save(name: str, payload: dict) -> Path:
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def merge_summary(name: str, section: str, figures: dict) -> Path:
    """Add `figures` to summary[section] of the results file `name` (several benchmarks each add theirs, on whatever
    day: each key keeps the command and date of the source that wrote it last, and a source goes once later ones
    replaced all its keys), and save it."""
    path = result_path(name)
    data = json.loads(path.read_text()) if path.exists() else {"summary": {}, "sources": []}
    merged = data["summary"].setdefault(section, {})
    for key, value in figures.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    data["sources"] = [s for s in data["sources"] if set(s.get("keys", [])) - set(figures)]
    data["sources"].append({**environment(), "keys": sorted(figures)})
    return save(name, data)


def model_source(spec: str | None) -> str | None:
    """A benchmark's model argument: a preset id (`python -m core generate --help` lists them; smollm2-135m is the
    embedded model) stands for its target model's file or hub id, refused in one line where its file is not
    installed; anything else (a .gguf, a directory, a hub id) is itself."""
    from core.io import PRESETS

    preset = next((p for p in PRESETS if p.id == spec), None)
    if preset is None:
        return spec
    if message := preset.missing(with_draft=False):
        raise SystemExit(message)
    return preset.sources()[0]


def tokenizer_of(spec: str | None):
    """The tokenizer of a model argument (a preset id, .gguf, directory or hub id; see model_source), or a saved
    tokenizer directory (no model config: one travels to a GPU machine where a model cannot)."""
    from core.io import load_tokenizer

    if spec and Path(spec).is_dir() and not (Path(spec) / "config.json").exists():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(spec)
    return load_tokenizer(model_source(spec))


# --- GPU benchmarks: model shapes with random weights ---------------------------------------------------------------

def _shape(vocab: int, dim: int, inter: int, layers: int, heads: int, kv_heads: int, rope: dict, tie: bool,
           **extra) -> dict:
    """LlamaConfig arguments of a decoder shape (131072 positions)."""
    return dict(vocab_size=vocab, hidden_size=dim, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=131072,
                rope_parameters=rope, tie_word_embeddings=tie, **extra)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA2_7B = _shape(32000, 4096, 11008, 32, 32, 32, {"rope_type": "default", "rope_theta": 10000.0}, False)
SMOLLM2_135M = _shape(49152, 576, 1536, 30, 9, 3, {"rope_type": "default", "rope_theta": 100000.0}, True)
LLAMA_68M = _shape(32000, 768, 3072, 2, 12, 12, {"rope_type": "default", "rope_theta": 10000.0}, False)
LLAMA31_8B = _shape(128256, 4096, 14336, 32, 32, 8, {**LLAMA3_ROPE, "factor": 8.0}, False, rms_norm_eps=1e-5)
LLAMA32_1B = _shape(128256, 2048, 8192, 16, 32, 8, {**LLAMA3_ROPE, "factor": 32.0}, True, head_dim=64,
                    rms_norm_eps=1e-5)
QWEN25_15B = _shape(151936, 1536, 8960, 28, 12, 2, {"rope_type": "default", "rope_theta": 1000000.0}, True,
                    rms_norm_eps=1e-6)  # Qwen2.5-1.5B (without its q/k/v biases: they do not change the timing)
TINY_49K = _shape(49152, 64, 256, 2, 4, 2, {"rope_type": "default", "rope_theta": 100000.0}, True)  # CPU proxies
SHAPES = {"llama2_7b": LLAMA2_7B, "qwen25_15b": QWEN25_15B, "llama31_8b": LLAMA31_8B, "llama32_1b": LLAMA32_1B,
          "smollm2_135m": SMOLLM2_135M,
          "llama_68m": LLAMA_68M, "tiny_49k": TINY_49K}
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def shape_key(key: str, shape: str) -> str:
    """Result key of a part at a shape: the Llama-2-7B one keeps its historical key (e.g. synthetic_7b)."""
    return key if shape == "llama2_7b" else f"{key.removesuffix('_7b')}_{shape}"


def random_model(shape: dict, device: torch.device = DEV, dtype: torch.dtype = BF16) -> Transformer:
    """Our Transformer at a config shape with random weights (bf16 on the GPU by default), fused for decoding; built
    in its dtype (a float32 copy converted afterwards leaves the allocator's segments half used: ~6 GiB lost at the
    7B shape, which a run held to a 24 GiB budget cannot spare)."""
    from transformers import LlamaConfig
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(LlamaConfig(**shape)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    model.fuse_projections()
    return model


def random_hf_pair(shape: dict) -> tuple[torch.nn.Module, Transformer]:
    """HF LlamaForCausalLM (random bf16, SDPA) on the GPU and our Transformer sharing its weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=BF16, attn_implementation="sdpa").eval()
    with torch.device("meta"):
        ours = Transformer(hf.config)
    ours.load_hf_state_dict(hf.state_dict())
    ours.fuse_projections()  # its own fused copies of q/k/v and gate/up: HF keeps the separate weights
    return hf, ours.eval()


def full_cache(model: Transformer, capacity: int) -> KVCache:
    a = model.args
    return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, model.dtype, model.device)


def draft_level(draft: Transformer, graphs: Graphs | None) -> Level:
    """Level 1 as the paper runs it: a draft model over a StreamingLLM cache of 16 sink + 240 recent tokens."""
    d = draft.args
    cache = StreamingCache(d.n_layers, d.n_kv_heads, d.head_dim, 272, 16, 240, draft.rotary, draft.dtype, draft.device)
    return Level(draft, cache, [], graphs)


def fill_random(cache: KVCache, length: int) -> None:
    """Pretend `length` prompt tokens are cached: random keys/values (latency does not depend on values)."""
    for layer in range(cache.k.shape[0]):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    cache.used = cache.head + length


def random_dynamic_cache(args: ModelArgs, length: int):
    """An HF DynamicCache holding `length` random keys/values per layer (HF's latency does not depend on them)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    shape = (1, args.n_kv_heads, length, args.head_dim)
    with torch.inference_mode():
        for layer in range(args.n_layers):
            cache.update(torch.randn(shape, device=DEV, dtype=BF16), torch.randn(shape, device=DEV, dtype=BF16),
                         layer)
    return cache


def random_retrieval(full: KVCache, ctx: int, ops: TorchOps, extra: int = 2048, budget: int = 4096
                     ) -> tuple[ChunkIndex, KVCache]:
    """A level-2 cache at `budget` (chunk 8) over the first ctx cached tokens, selected by a random query."""
    index = ChunkIndex.build(full, ctx, 8)
    rcache = retrieval_cache(full, index, budget, extra)
    queries = torch.randn(full.k.shape[0], full.k.shape[1], full.k.shape[-1], device=DEV)
    kept = chunks_to_keep(index.num_chunks, budget, index.chunk_size)
    gather_selection(full, index, select_chunks(index, queries, kept), rcache, ops)
    return index, rcache


# --- GPU benchmarks: timing ------------------------------------------------------------------------------------------

def sync_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronising after each call (every decode step syncs anyway)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    from triton.testing import do_bench
    a = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def ar_step_ms(level: Level, base: list[int], reps: int = 20) -> float:
    """Median latency of one AR step (forward of one token, argmax to the host); the context stays fixed (the token
    is passed apart, as the engine does: no copy of the long sequence)."""
    token = [0]

    def step() -> None:
        token[0] = int(level.logits(base, 1, len(base), extra=[token[0] % 1000])[0].argmax())
    return sync_ms(step, reps)


def verify_step_ms(level: Level, base: list[int], n: int, reps: int = 20) -> float:
    """Median latency of a level verification: forward of n tokens, distributions of all n rows to the host."""
    cfg = GenerationConfig(temperature=0.6, top_p=0.9)

    def step() -> None:
        p = distributions(level.logits(base, n, len(base), extra=range(n)), cfg)
        p[:, 0].tolist()
    return sync_ms(step, reps)


def hf_ar_ms(hf, cache, reps: int = 8) -> float:
    """HF transformers: one token through LlamaForCausalLM with a DynamicCache, growing as in generate()."""
    ids = torch.tensor([[1]], device=DEV)

    def step() -> None:
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
        ids.fill_(int(out.logits[0, -1].argmax()) % 1000)
    with torch.inference_mode():
        return sync_ms(step, reps, warmup=2)


# --- GPU benchmarks: the result file and the command line -----------------------------------------------------------

class GpuResults:
    """bench/results/<gpu>.json (or --out): the parts run earlier the same day kept, each run listed under "runs", the
    headline figures merged into "summary"; written after every part."""

    def __init__(self, out: str | None, parts: list[str]):
        name = torch.cuda.get_device_name()
        self.path = Path(out) if out else result_path(name.replace(" ", "-"))
        self.data = earlier_today(self.path)
        cmd, date = command(), now()
        self.data.update({"command": cmd, **machine(), "date": date})
        self.data.setdefault("runs", []).append({"command": cmd, "date": date, "parts": parts})
        self.summary: dict = self.data.setdefault("summary", {})
        self._bandwidth: float | None = None

    def bandwidth(self) -> float:
        """Copy bandwidth in bytes/s, measured once per run (stored as copy_bandwidth_tb_s): the rooflines' divisor."""
        if self._bandwidth is None:
            self._bandwidth = copy_bandwidth()
            self.data["copy_bandwidth_tb_s"] = self._bandwidth / 1e12
        return self._bandwidth

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


Part = Callable[[argparse.Namespace, GpuResults], None]


def gpu_parser(description: str, parts: list[str], default: list[str]) -> argparse.ArgumentParser:
    """The options of every GPU part (parts share contexts, the real model's settings and the result file)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=parts, default=default)
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 122880],
                   help="contexts of the random-weight parts (prefill, profile and replay use the last)")
    p.add_argument("--shape", choices=[s for s in SHAPES if s not in ("smollm2_135m", "llama_68m")],
                   default="llama2_7b", help="model shape of synthetic, prefill, profile and replay (results of a "
                   "shape other than llama2_7b go under their own keys and leave the summary alone)")
    p.add_argument("--real-contexts", type=int, nargs="+", default=[32768, 65536, 131072],
                   help="contexts of the real model (sweep and profile_small use the last)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer of the parts that run the engine on random "
                   "weights: a preset id or a saved tokenizer directory (which travels where a model cannot)")
    p.add_argument("--gguf", default=None, help="target of the real parts: a GGUF file, directory or hub id "
                   "(default: the embedded SmolLM2-135M-Instruct GGUF, core.io.loading.embedded_source)")
    p.add_argument("--rope", default='{"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192}')
    p.add_argument("--no-hf-real", action="store_true")
    p.add_argument("--draft", default=None, help="level-1 draft for the real parts (e.g. assets/draft; default: none)")
    p.add_argument("--budget", type=int, default=4096, help="retrieval budget of the real part")
    p.add_argument("--reselect", default="once", help="re-selection of the real part: once, every_verify or N")
    p.add_argument("--out", default=None, help="result file (default out/<gpu>.json; with --record "
                   "bench/results/<gpu>.json)")
    return p


def gpu_main(description: str, modules: list[ModuleType], default: list[str] | None = None) -> None:
    """Run the chosen parts of these modules (each has PARTS: name -> function(args, results)) in their order."""
    parts: dict[str, Part] = {name: fn for m in modules for name, fn in m.PARTS.items()}
    args = gpu_parser(description, list(parts), default or list(parts)).parse_args()
    results = GpuResults(args.out, args.parts)
    for name, fn in parts.items():
        if name in args.parts:
            fn(args, results)
            results.save()
    print(json.dumps(results.summary, indent=1))
    print(f"wrote {results.path}")

