"""The engine: loaded models plus `generate`, which turns a document and an instruction into an event stream."""

from __future__ import annotations

import gc
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import transformers

from core.autoregressive import autoregressive
from core.config import GenerationConfig
from core.cuda_graphs import Graphs
from core.drafters import DraftContext, Drafter, ModelDrafter, make_drafter
from core.events import Acceptance, Event, Finished, Loading, PrefillProgress, PromptReady, Stats
from core.kvcache import CachePool, KVCache, reusable
from core.levels import Level, Stopped
from core.loading import default_draft, device_and_dtype, load_draft, load_model
from core.model import Transformer
from core.offload import OffloadedKVCache
from core.output import Output
from core.parallel import TensorParallel, parallelize
from core.placement import GiB, device_budget, plan
from core.prompting import build_prompt, plain_ids
from core.samples import warm_up_text
from core.triforce import TriForce

_LOADED: dict[tuple, "Engine"] = {}


def default_prefill_chunk(model: Transformer, budget: int | None = None) -> int:
    """Tokens per prefill forward: 2048 on a CPU (a progress event each); on a GPU as many as half the free memory
    (within `budget` bytes for this process, if given) holds the activations of (a long prompt in one forward: plain
    causal attention is the fastest there)."""
    if model.device.type != "cuda":
        return 2048
    a = model.args
    width = 4 * a.dim + (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + 4 * a.intermediate_size
    per_token = model.dtype.itemsize * width
    free, _ = torch.cuda.mem_get_info(model.device)
    if budget is not None:
        free = min(free, budget - torch.cuda.memory_reserved(model.device))
    return max(2048, free // 2 // per_token)


def step_weight_bytes(model: Transformer) -> int:
    """Bytes of the weights one decode forward reads: every parameter but the embedding table (of which it reads a
    row a token), unless that table is also the LM head."""
    embedding = model.embed_tokens.weight
    total = sum(p.nbytes for p in model.parameters())
    return total if model.lm_head.weight is embedding else total - embedding.nbytes


@dataclass
class Engine:
    """A target model (and optionally a level-1 draft model) with their tokenizer, ready to generate."""

    target: Transformer
    tokenizer: object
    target_name: str
    draft: Transformer | None = None
    draft_name: str | None = None
    context_length: int = 0
    info: dict = field(default_factory=dict)
    _prefilled: tuple | None = None  # (prompt ids, full cache, its last prefill queries): reused by the next run
    pool: CachePool = field(default_factory=CachePool)  # retrieval/draft caches (and their CUDA graphs) kept
    graphs: Graphs | None = None  # CUDA graphs of decode steps (None: launched eagerly)
    budget: int | None = None  # device memory bytes a run may plan on (None: a CPU)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, device: str | None = None,
             dtype: str | None = None, context_length: int | None = None, rope_scaling: dict | None = None,
             progress=None, cuda_graphs: bool = True, gpu_memory_gib: float | None = None,
             tp: TensorParallel | None = None) -> "Engine":
        """Load (once per process for the same arguments) target and draft; None target = the embedded default,
        whose draft defaults to the one shipped in assets/draft ("" or "none": no draft model). `cuda_graphs`: replay
        decode steps on a GPU from CUDA graphs (off: launch them eagerly). `gpu_memory_gib`: the GPU memory runs may
        use (enforced; default: all of it); a full KV cache beyond it is offloaded to CPU memory (offload=auto).
        `tp`: this process is a rank of a tensor-parallel group: the models are loaded in CPU memory, the target cut
        to this rank's shard and both moved to tp.device (`device` is ignored; no CUDA graphs)."""
        key = (target, draft, device, dtype, context_length, repr(rope_scaling), cuda_graphs, gpu_memory_gib,
               tp and tp.world)
        if key in _LOADED:
            return _LOADED[key]
        dev, dt = (tp.device, device_and_dtype(None, dtype)[1]) if tp else device_and_dtype(device, dtype)
        home = torch.device("cpu") if tp else dev  # where the models are loaded
        if progress:
            progress(Loading("target", 0.0))
        model, tok, src = load_model(target, home, dt, rope_scaling)
        draft_model, draft_name = None, None
        draft = default_draft(target) if draft is None else None if draft in ("", "none") else draft
        if draft:
            if progress:
                progress(Loading("draft", 0.5))
            draft_model, draft_name = load_draft(draft, model, tok, src.name, home, dt)
        if tp:
            parallelize(model, draft_model, tp)
        engine = cls.from_models(model, tok, src.name, draft_model, draft_name, context_length,
                                 cuda_graphs and not tp, gpu_memory_gib)
        if progress:
            progress(Loading("ready", 1.0))
        _LOADED[key] = engine
        return engine

    @classmethod
    def from_models(cls, model: Transformer, tokenizer, name: str, draft: Transformer | None = None,
                    draft_name: str | None = None, context_length: int | None = None, cuda_graphs: bool = True,
                    gpu_memory_gib: float | None = None) -> "Engine":
        """An engine over models already built (e.g. random weights at a real shape, for benchmarks); the arguments
        mean what Engine.load's do."""
        ctx = context_length or model.args.max_position
        if model.args.attention_window:  # within the window full attention is exact; beyond it would not be
            ctx = min(ctx, model.args.attention_window)
        dev = model.device
        engine = cls(model, tokenizer, name, draft, draft_name, ctx,
                     graphs=Graphs() if cuda_graphs and dev.type == "cuda" else None,
                     budget=device_budget(dev, gpu_memory_gib))
        engine.info = {
            "target": name, "draft": draft_name, "device": str(dev), "dtype": str(model.dtype).removeprefix("torch."),
            "context_length": ctx, "attention_window": model.args.attention_window,
            "gpu_memory_budget_gib": engine.budget / GiB if engine.budget else None,
            "target_params": sum(p.numel() for p in model.parameters()),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
        }
        return engine

    def count_tokens(self, text: str) -> int:
        """Tokens of user text, tokenised as a prompt holds it (special-token strings as plain text)."""
        return len(plain_ids(self.tokenizer, text))

    def drafter(self, cfg: GenerationConfig, prompt: list[int], generator: torch.Generator) -> Drafter:
        """The level-1 drafter cfg.drafter names, for this prompt."""
        return make_drafter(cfg.drafter, DraftContext(self.draft, cfg, prompt, self.target.args.vocab_size,
                                                      generator, self.pool, self.graphs))

    def generate(self, document: str, instruction: str, config: GenerationConfig | None = None,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        """Events of one generation (TriForce or autoregressive, per config.method); bad input raises TriForceError
        before anything is computed. Closing the iterator stops it at its next event; setting `stop` also stops a
        prefill between two layers (the stream then ends without Finished)."""
        cfg = (config or GenerationConfig()).validate()
        prompt = build_prompt(self.tokenizer, document, instruction, self.context_length, cfg.max_new_tokens,
                              cfg.overflow)
        return self._run(prompt, cfg, stop)

    def warm_up(self, new_tokens: int = 128) -> list[Stats]:
        """Run AR, greedy TriForce and sampled TriForce once on a short sample text, so that the kernels a GPU compiles
        on first use (Triton, cuBLAS) are ready before a first request; its caches are released after."""
        document, question = warm_up_text()
        stats = []
        for settings in ({"method": "ar", "greedy": True}, {"greedy": True}, {}):
            cfg = GenerationConfig(max_new_tokens=new_tokens, overflow="truncate", **settings)
            stats += [e.stats for e in self.generate(document, question, cfg) if isinstance(e, Finished)]
        self.release()
        return stats

    def release(self) -> None:
        """Give back the caches kept for a next run to reuse, and on a GPU the memory they (and the CUDA graphs
        captured on them) held: after a warm-up on a prompt unlike the next, that memory is better free."""
        self._prefilled = None
        self.pool.clear()
        if self.target.device.type == "cuda":
            gc.collect()  # caches caught in reference cycles, then their graphs (held by weak reference)
            torch.cuda.empty_cache()

    @property
    def _kept_cache(self) -> KVCache | None:
        """The full cache the previous run filled, kept for the next to reuse (or give back before allocating)."""
        return self._prefilled[1] if self._prefilled else None

    def _run(self, prompt, cfg: GenerationConfig, stop: threading.Event | None = None) -> Iterator[Event]:
        """The events of one run; when it ends, the pool keeps only the caches it used."""
        return self.pool.during(self._events(prompt, cfg, stop))

    def _events(self, prompt, cfg: GenerationConfig, stop: threading.Event | None) -> Iterator[Event]:
        ids = prompt.ids
        model = self.target
        capacity = len(ids) + cfg.max_new_tokens + (cfg.gamma2 or 12) + 2
        kept = self._kept_cache
        held = kept.nbytes if isinstance(kept, OffloadedKVCache) else 0
        placement, cfg = plan(model, self.draft, capacity, len(ids), cfg, self.budget, held)
        cs = cfg.chunk_size
        yield PromptReady(len(ids), prompt.document_tokens, prompt.dropped_tokens, self.context_length,
                          cfg.max_new_tokens, cs,
                          [self.tokenizer.decode(ids[i:i + cs]) for i in range(0, len(ids), cs)],
                          placement.offloaded, placement.describe())
        target = Level(model, self._full_cache(capacity, cfg, placement.offloaded), [], self.graphs)
        generator = torch.Generator(model.device).manual_seed(cfg.seed)
        t0 = time.perf_counter()
        try:
            for progress in self._prefill(target, ids, cfg, t0, stop):
                yield progress
        except Stopped:  # the half-filled cache is dropped once copies in flight to or from it are done
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            return
        out = Output(self.tokenizer, cfg, model.eos_ids)
        run = None
        if cfg.method == "ar":
            loop = autoregressive(target, ids, cfg, generator, out)
        else:
            drafter = self.drafter(cfg, ids, generator)
            index_device = model.device if placement.index_on_device else torch.device("cpu")
            run = TriForce(target, ids, self._prefilled[2], drafter, cfg, generator, out, self.pool, self.graphs,
                           index_device)
            loop = run.run()
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        forwards_before = target.forwards
        moved_before = getattr(target.cache, "moved", 0)
        captured_before = self.graphs.capture_s if self.graphs else 0.0
        yield from loop
        warmup_s = (self.graphs.capture_s if self.graphs else 0.0) - captured_before
        decode_s = time.perf_counter() - t1 - warmup_s  # capturing graphs (first use of a shape) is not decoding
        n = len(out.ids)
        forwards = target.forwards - forwards_before
        counts = run.counts if run else Acceptance()
        draft = run.drafter.level if run and isinstance(run.drafter, ModelDrafter) else None
        stats = Stats(
            method=cfg.method, new_tokens=n, prompt_tokens=len(ids), dropped_tokens=prompt.dropped_tokens,
            prefill_s=prefill_s, prefill_reused=progress.reused, decode_s=decode_s, warmup_s=warmup_s,
            tokens_per_s=n / decode_s if decode_s > 0 else 0.0,
            time_to_first_token_s=(out.first_token_at or t1) - t0, target_forwards=forwards,
            tokens_per_target_forward=n / forwards if forwards else 0.0,
            level1_steps=run.drafter.steps if run else 0, drafter=run.drafter.name if run else "",
            level1_proposed=counts.level1_proposed, level1_accepted=counts.level1_accepted,
            level2_proposed=counts.level2_proposed, level2_accepted=counts.level2_accepted,
            cache_bytes=target.cache.nbytes, retrieval_cache_bytes=run.retrieval.cache.nbytes if run else 0,
            level1_cache_bytes=draft.cache.nbytes if draft else 0, target_weight_bytes=step_weight_bytes(model),
            level1_weight_bytes=step_weight_bytes(draft.model) if draft else 0,
            stop_reason=out.stop_reason, device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
            settings=cfg.to_dict(), offloaded=placement.offloaded,
            host_link_bytes=getattr(target.cache, "moved", 0) - moved_before)
        yield Finished(out.text, out.ids, ids, stats)

    def _full_cache(self, capacity: int, cfg: GenerationConfig, offloaded: bool) -> KVCache:
        """A full cache with room for `capacity` tokens, in CPU memory when `offloaded`; the previous run's when it is
        of that kind and fits without being more than twice the size (a larger one is given back; page-locking tens of
        GiB takes seconds, so an offloaded one is kept across runs)."""
        a = self.target.args
        old = self._kept_cache
        if old is not None and isinstance(old, OffloadedKVCache) == offloaded and reusable(old.capacity, capacity):
            return old
        self._prefilled = old = None  # freed before the new one is allocated
        make = OffloadedKVCache if offloaded else KVCache
        return make(a.n_layers, a.n_kv_heads, a.head_dim, capacity, self.target.dtype, self.target.device)

    def _prefill(self, target: Level, ids: list[int], cfg: GenerationConfig, t0: float,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        """Fill the full cache with ids[:-1] in chunks, recording the last row's queries (retrieval's first
        selection); the same prompt as the previous run's reuses its cache."""
        full, body = target.cache, ids[:-1]
        if self._prefilled and self._prefilled[1] is full and self._prefilled[0] == ids:
            full.truncate(len(body))
            target.tokens = list(body)
            yield PrefillProgress(len(body), len(body), time.perf_counter() - t0, full.nbytes, reused=True)
            return
        self._prefilled = None
        full.truncate(0)
        chunk = cfg.prefill_chunk or default_prefill_chunk(self.target, self.budget)
        for done in target.prefill(body, chunk, record=1, stop=stop):
            yield PrefillProgress(done, len(body), time.perf_counter() - t0, full.nbytes)
        self._prefilled = (list(ids), full, target.queries)
