"""A request's life, one home for a single run (core.engine) and a batch (core.batching): announced (PromptReady),
its target level on a full cache from the memory module, prefilled, started (its answer, generator and level 2 on
a retrieval cache from the memory module: core.decode.request), decoded by a schedule, and finished (its Stats)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from core.cache.kvcache import KVCache
from core.cache.memory import Plan
from core.config import GenerationConfig
from core.decode.graphs import Graphs
from core.decode.levels import Level
from core.decode.output import Output
from core.decode.request import RequestState
from core.events import Footprint, PromptReady, Stats
from core.io.prompting import Prompt
from core.model.transformer import Transformer


def announce(prompt: Prompt, plan: Plan, tokenizer, context_length: int) -> PromptReady:
    """The first event of a request: its prompt as chunks of the plan's chunk size, and where its caches live."""
    ids, cfg, cs = prompt.ids, plan.cfg, plan.cfg.chunk_size
    return PromptReady(prompt_tokens=len(ids), document_tokens=prompt.document_tokens,
                       dropped_tokens=prompt.dropped_tokens, context_length=context_length,
                       max_new_tokens=cfg.max_new_tokens, chunk_size=cs,
                       chunk_texts=[tokenizer.decode(ids[i:i + cs]) for i in range(0, len(ids), cs)],
                       offloaded=plan.placement.offloaded, caches=plan.placement.describe())


def begin(target: Level, ids: list[int], plan: Plan, tokenizer, retrieval_cache: KVCache | None,
          graphs: Graphs | None, index_device: torch.device | None = None) -> RequestState:
    """A prefilled request's state: its answer, its generator (seeded by its settings) and, with a retrieval cache,
    its level 2."""
    model, cfg = target.model, plan.cfg
    out = Output(tokenizer, cfg, model.eos_ids)
    generator = torch.Generator(model.device).manual_seed(cfg.seed)
    return RequestState.start(target, ids, cfg, generator, out, retrieval_cache, graphs, index_device)


@dataclass
class Clock:
    """When a request started (before its prefill) and began decoding, and the target's forwards, its full cache's
    host-link bytes and the graphs' capture seconds at that point: what its Stats are measured from."""

    started: float
    decoding: float = 0.0
    forwards: int = 0
    moved: int = 0
    captured: float = 0.0

    def decode_from(self, target: Level, graphs: Graphs | None) -> None:
        """Decoding begins now."""
        self.decoding = time.perf_counter()
        self.forwards, self.moved = target.forwards, target.cache.moved
        self.captured = graphs.capture_s if graphs is not None else 0.0

    @property
    def prefill_s(self) -> float:
        return self.decoding - self.started


def finish(footprint: Footprint, cfg: GenerationConfig, out: Output, prompt: Prompt, target: Level, clock: Clock,
           graphs: Graphs | None, offloaded: bool = False, prefill_reused: bool = False, shared_with: int = 0,
           prefills_beside: int = 0, prefill_beside_s: float = 0.0) -> Stats:
    """A finished request's figures: its decoding time without the graphs captured meanwhile (a first use of a
    shape is warm-up, not decoding), its rate, first-token latency, target forwards and bytes, and (batched) what
    it shared its device with."""
    model: Transformer = target.model
    warmup_s = (graphs.capture_s if graphs is not None else 0.0) - clock.captured
    decode_s = time.perf_counter() - clock.decoding - warmup_s
    n, forwards = len(out.ids), target.forwards - clock.forwards
    written = n + (out.stop_reason == "eos")  # the end-of-text token a forward wrote is not in the answer, yet counts
    return Stats.of(
        footprint, method=cfg.method, new_tokens=n, prompt_tokens=len(prompt.ids), dropped_tokens=prompt.dropped_tokens,
        prefill_s=clock.prefill_s, prefill_reused=prefill_reused, decode_s=decode_s, warmup_s=warmup_s,
        tokens_per_s=n / decode_s if decode_s > 0 else 0.0,
        time_to_first_token_s=(out.first_token_at or clock.decoding) - clock.started, target_forwards=forwards,
        tokens_per_target_forward=written / forwards if forwards else 0.0, cache_bytes=target.cache.nbytes,
        target_weight_bytes=model.step_weight_bytes(), stop_reason=out.stop_reason, device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."), settings=cfg.to_dict(), offloaded=offloaded,
        host_link_bytes=target.cache.moved - clock.moved, shared_with=shared_with, prefills_beside=prefills_beside,
        prefill_beside_s=prefill_beside_s)
