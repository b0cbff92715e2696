"""The engine: loaded models plus `generate`, which turns a document and an instruction into an event stream."""

from __future__ import annotations

import gc
import platform
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Protocol

import torch
import transformers

from core.batching import BatchRun, Request, Tagged
from core.decode.autoregressive import Autoregressive
from core.config import AUTO_GAMMA2, SEATS, GenerationConfig
from core.decode.graphs import Graphs
from core.decode.drafters import DraftContext, Drafter, drafter_names, make_drafters
from core.events import Event, Finished, Footprint, Loading, PrefillProgress, Stats
from core.decode.levels import Level, Stopped
from core.io.loading import default_draft, device_and_dtype, load_draft, load_model
from core.cache.memory import GiB, Memory, Plan, Prefilled, device_limit, working_bytes
from core.model.transformer import Transformer
from core.model.parallel import TensorParallel, parallelize
from core.plan.estimate import CostBook, Estimates, Regime
from core.plan.policy import Auto, Fixed
from core.io.presets import Preset, preset_config, resolve_preset
from core.io.prompting import Prompt, build_prompt, ids_prompt, plain_ids
from core.io.samples import warm_up_text
from core.decode.ahead import drafts_ahead
from core.decode.round import Hierarchy
from core.decode.request import RequestState, chains
from core.decode.triforce import TriForce
from core.lifecycle import Clock, announce, begin, finish

_LOADED: dict[tuple, "Engine"] = {}


def default_prefill_chunk(model: Transformer, limit: int | None = None) -> int:
    """Tokens per prefill forward: 2048 on a CPU (a progress event each); on a GPU as many as the run's working
    memory holds the activations of (a long prompt in few forwards: plain causal attention is the fastest there).
    It depends on the model and the device limit only, never on what happens to be free: the same prompt is then
    always prefilled in the same pieces, into the same keys and values."""
    if model.device.type != "cuda":
        return 2048
    a = model.args
    width = 4 * a.dim + (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + 4 * a.intermediate_size
    limit = limit or torch.cuda.get_device_properties(model.device).total_memory
    return max(2048, working_bytes(limit) // (model.dtype.itemsize * width))


class Decoder(Protocol):
    """A decoding method over a prefilled target level: the events of filling its other caches, its events until
    the answer is done, then what it adds to the run's figures."""

    def prepare(self) -> Iterator[Event]: ...

    def run(self) -> Iterator[Event]: ...

    def footprint(self) -> Footprint: ...


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
    memory: Memory | None = None  # the runs' caches (None: a new Memory with no device limit, as on a CPU)
    graphs: Graphs | None = None  # CUDA graphs of decode steps (None: launched eagerly)
    costs: CostBook = field(default_factory=CostBook)  # what earlier runs measured (method auto starts from it)
    preset: Preset | None = None  # the model preset (core/io/presets.py): generate() starts from its settings

    def __post_init__(self):
        if self.memory is None:
            self.memory = Memory(self.target, self.draft, None)

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
        to this rank's shard and both moved to tp.device (`device` is ignored; no CUDA graphs). `target` may be a
        preset id (core/io/presets.py): its models, its RoPE scaling (unless `rope_scaling` is given; a draft model
        is scaled alike) and its settings as the defaults of generate()."""
        preset, target, draft = resolve_preset(target, draft)
        rope_scaling = rope_scaling or (dict(preset.rope_scaling) if preset and preset.rope_scaling else None)
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
            draft_model, draft_name = load_draft(draft, model, tok, src.name, home, dt, rope_scaling)
        if tp:
            parallelize(model, draft_model, tp)
        engine = cls.from_models(model, tok, src.name, draft_model, draft_name, context_length,
                                 cuda_graphs and not tp, gpu_memory_gib)
        engine.preset = preset
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
        limit = device_limit(dev, gpu_memory_gib)
        engine = cls(model, tokenizer, name, draft, draft_name, ctx, memory=Memory(model, draft, limit),
                     graphs=Graphs() if cuda_graphs and dev.type == "cuda" else None)
        engine.info = {
            "target": name, "draft": draft_name, "device": str(dev), "dtype": str(model.dtype).removeprefix("torch."),
            "context_length": ctx, "attention_window": model.args.attention_window,
            "gpu_memory_limit_gib": limit / GiB if limit else None,
            "target_params": sum(p.numel() for p in model.parameters()),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
        }
        return engine

    def count_tokens(self, text: str) -> int:
        """Tokens of user text, tokenised as a prompt holds it (special-token strings as plain text)."""
        return len(plain_ids(self.tokenizer, text))

    def drafters(self, plan: Plan, prompt: list[int], generator: torch.Generator) -> dict[str, Drafter]:
        """The level-1 drafters the plan's settings name (drafter_names), for this prompt."""
        return make_drafters(self._drafter_names(plan.cfg), DraftContext(
            self.draft, plan.cfg, prompt, self.target.args.vocab_size, generator,
            lambda: self.memory.streaming_cache(plan, self.draft), self.graphs))

    def settings(self, **changes) -> GenerationConfig:
        """The generation settings of this engine's preset (none: GenerationConfig's defaults), `changes` on top."""
        return preset_config(self.preset, **changes)

    def generate(self, document: str, instruction: str, config: GenerationConfig | None = None,
                 stop: threading.Event | None = None) -> Iterator[Event]:
        """Events of one generation (TriForce or autoregressive, per config.method; no config: `self.settings()`, the
        preset's); bad input raises TriForceError before anything is computed. Closing the iterator stops it at its
        next event; setting `stop` also stops a prefill between two layers (the stream then ends without Finished)."""
        cfg = (config or self.settings()).validate()
        prompt = build_prompt(self.tokenizer, document, instruction, self.context_length, cfg.max_new_tokens,
                              cfg.overflow)
        return self.memory.during(self._events(prompt, cfg, stop))

    def generate_ids(self, ids: list[int], config: GenerationConfig | None = None,
                     stop: threading.Event | None = None) -> Iterator[Event]:
        """Events of one generation continuing the token ids `ids` as they are (no chat template, no truncation):
        what `generate` runs once it has built its prompt."""
        cfg = (config or self.settings()).validate()
        prompt = ids_prompt(ids, self.target.args.vocab_size, self.context_length, cfg.max_new_tokens)
        return self.memory.during(self._events(prompt, cfg, stop))

    def generate_many(self, requests: Iterable[Request], slots: int = SEATS) -> Iterator[Tagged]:
        """Events of several generations decoded together in one batch of at most `slots` (core.batching), each
        tagged with its request's key and each request's answer what it would be alone (greedy: the same tokens);
        bad input in any request raises TriForceError before anything is computed. Requests wait in line for a
        seat and for device memory."""
        run = BatchRun(self, slots)
        for request in requests:
            run.submit(request)
        return self._batched(run)

    @staticmethod
    def _batched(run: BatchRun) -> Iterator[Tagged]:
        while run.busy:
            yield from run.step()

    def prefill_chunk(self) -> int:
        """Tokens per prefill forward of this engine's target (default_prefill_chunk)."""
        return default_prefill_chunk(self.target, self.memory.limit)

    def warm_up(self, new_tokens: int = 128) -> list[Stats]:
        """Run AR, greedy and sampled TriForce and method auto once on a short sample text, then two batches of two
        requests, so that the kernels a GPU compiles on first use (Triton, cuBLAS) are ready before a first request,
        and method auto's cost book holds every level's cost, alone and batched (a first request then starts from
        them, as a second would); its caches are released after. The greedy TriForce run drafts the most method auto
        may (AUTO_GAMMA2), so its first verification fills the largest decode step, whose GEMV block the shorter
        steps never compile. On a GPU, greedy and sampled TriForce also run with the full cache offloaded, the regime
        of a prompt beyond the GPU's memory."""
        document, question = warm_up_text()
        stats = []
        longest = {"gamma2": AUTO_GAMMA2, "max_new_tokens": max(new_tokens, AUTO_GAMMA2 + 1)}
        offloaded = [{"method": "triforce", "offload": "on", **sampling} for sampling in ({"greedy": True}, {})] \
            if self.memory.limit is not None else []
        for settings in ({"method": "ar", "greedy": True}, {"method": "triforce", "greedy": True, **longest},
                         {"method": "triforce"}, {"method": "auto"}, *offloaded):
            cfg = self.settings(**{"max_new_tokens": new_tokens, "overflow": "truncate", **settings})  # preset's budget
            stats += [e.stats for e in self.generate(document, question, cfg) if isinstance(e, Finished)]
        # a batch of two, drafting at the paper's γ2 and then not at all: the batched steps' kernels, and the cost
        # book's batched regime, which a first batch of visitors then starts from
        for settings in ({"method": "triforce", "drafter": "none", "gamma2": 6}, {"method": "ar"}):
            cfg = self.settings(**{"max_new_tokens": new_tokens, "overflow": "truncate", **settings})
            requests = [Request(f"warm-up {seed}", document, question, config=replace(cfg, seed=seed))
                        for seed in range(2)]
            stats += [t.event.stats for t in self.generate_many(requests, 2) if isinstance(t.event, Finished)]
        self.release()
        return stats

    def release(self) -> None:
        """Give back the caches kept for a next run to reuse, and on a GPU the memory they (and the CUDA graphs
        captured on them) held: after a warm-up on a prompt unlike the next, that memory is better free."""
        self.memory.release()
        if self.target.device.type == "cuda":
            gc.collect()  # caches caught in reference cycles, then their graphs (held by weak reference)
            torch.cuda.empty_cache()

    def plan(self, prompt_tokens: int, cfg: GenerationConfig) -> Plan:
        """A run's memory plan, its settings resolved once here for the regime its caches fit (the paper's budget
        and γ2 on chip and offloaded: GenerationConfig.resolved); the memory says where they live."""
        return self.memory.plan(prompt_tokens, cfg.resolved, cfg.offload)

    def _events(self, prompt: Prompt, cfg: GenerationConfig, stop: threading.Event | None) -> Iterator[Event]:
        """One run: plan its memory, prefill the full cache, decode, then the figures."""
        ids, model = prompt.ids, self.target
        plan = self.plan(len(ids), cfg)
        cfg = plan.cfg
        yield announce(prompt, plan, self.tokenizer, self.context_length)
        target = Level(model, self.memory.full_cache(plan), [], self.graphs)
        clock = Clock(time.perf_counter())
        try:
            for progress in self._prefill(target, ids, cfg, clock.started, stop):
                yield progress
        except Stopped:  # the half-filled cache is dropped once copies in flight to or from it are done
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            return
        decoder, estimates, request = self._decoder(plan, target, ids)
        yield from decoder.prepare()
        clock.decode_from(target, self.graphs)
        yield from decoder.run()
        self.costs.learn(Regime.of(plan.placement.offloaded, len(ids), cfg.is_greedy), cfg.budget, estimates)
        stats = finish(decoder.footprint(), cfg, request.out, prompt, target, clock, self.graphs,
                       offloaded=plan.placement.offloaded, prefill_reused=progress.reused)
        yield Finished(request.out.text, request.out.ids, ids, stats)

    def _decoder(self, plan: Plan, target: Level, ids: list[int]) -> tuple[Decoder, Estimates, RequestState]:
        """The decoding method the plan's settings name, over the prefilled target level, the estimates its rounds
        teach (from what earlier runs of this kind measured), and its request. Every setting named auto is decided
        here: the policy (method auto's planner, or triforce's fixed hierarchy), its drafters, drafting ahead."""
        cfg, offloaded, device, kind = plan.cfg, plan.placement.offloaded, self.target.device, plan.cfg.kind
        request = begin(target, ids, plan, self.tokenizer,
                        self.memory.retrieval_cache(plan) if kind.drafts else None, self.graphs,
                        self.memory.index_device(plan))
        drafters = self.drafters(plan, ids, request.generator) if kind.drafts else {}
        level2_cuts = plan.sizes.kept_chunks < plan.sizes.index_chunks  # else level 2 reads what level 3 reads
        estimates = self.costs.estimates(Regime.of(offloaded, len(ids), cfg.is_greedy), cfg.budget, list(drafters),
                                         [name for name, d in drafters.items() if d.in_passing], level2_cuts)
        if not kind.drafts:
            return Autoregressive(target, ids, cfg, request.generator, request.out, estimates.observe), estimates, \
                request
        ahead = drafts_ahead(cfg.draft_ahead, offloaded, device)
        if kind.planned:
            policy = Auto(estimates, list(drafters), cfg.gamma1, cfg.gamma2, streamed=offloaded, level2=level2_cuts,
                          ahead=ahead and device.type == "cuda", chained=chains(cfg) and self.graphs is not None)
        else:
            level1 = next(iter(drafters), "")
            policy = Fixed(Hierarchy(level1, True, cfg.gamma1 if level1 else 0, cfg.gamma2, ahead), estimates)
        return TriForce(request, self.memory.kept.queries, drafters, policy, self.graphs), estimates, request

    def _drafter_names(self, cfg: GenerationConfig) -> list[str]:
        """The level-1 drafters a run of these settings holds."""
        return drafter_names(cfg.drafter, cfg.kind.planned, self.draft is not None)

    def _prefill(self, target: Level, ids: list[int], cfg: GenerationConfig, t0: float,
                 stop: threading.Event | None = None) -> Iterator[PrefillProgress]:
        """Fill the full cache with ids[:-1] in chunks, recording the last row's queries (retrieval's first
        selection); the same prompt as the previous run's reuses its cache."""
        full, body = target.cache, ids[:-1]
        if self.memory.prefilled(ids, full):
            full.truncate(len(body))
            target.tokens = list(body)
            yield PrefillProgress(done=len(body), total=len(body), seconds=time.perf_counter() - t0,
                                  cache_bytes=full.nbytes, reused=True)
            return
        full.truncate(0)
        chunk = cfg.prefill_chunk or self.prefill_chunk()
        for done in target.prefill(body, chunk, record=1, stop=stop):
            yield PrefillProgress(done=done, total=len(body), seconds=time.perf_counter() - t0, cache_bytes=full.nbytes)
        self.memory.kept = Prefilled(list(ids), full, target.queries)
