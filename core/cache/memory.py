"""One home for a run's memory: how much each cache needs, where it lives, and which cache a run reuses.

A run has up to four caches: the full KV cache (resident on the device, or offloaded to page-locked CPU memory and
streamed to the device one layer at a time), level 2's retrieval cache, the level-1 draft's StreamingLLM cache, and
the chunk index (each prompt chunk's mean key). `Memory.plan` sizes them with one formula (`Sizes`), checks that
they fit the device's limit and the host's free memory, and says where each lives (`Placement`) -- before anything
is allocated. `Memory` then hands the caches out. A cache of about the right size left by the previous run is
reused (the CUDA graphs captured on it stay valid), and the full cache last filled is kept with the prompt it holds
(`Prefilled`), so that a run on the same prompt skips the prefill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch

from core.config import GenerationConfig, TriForceError
from core.cache.kvcache import KVCache, StreamingCache
from core.model.transformer import Transformer
from core.cache.offload import OffloadedKVCache
from core.cache.retrieval import ChunkIndex, chunks_to_keep

GiB = 2**30
T = TypeVar("T")


def parameter_bytes(*models: Transformer | None) -> int:
    """Bytes of the models' parameters, each shared tensor counted once."""
    seen: dict[int, int] = {}
    for m in models:
        for p in m.parameters() if m is not None else ():
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes_per_token(model: Transformer) -> int:
    """Bytes of keys and values one token takes in a cache of this model (every layer)."""
    a = model.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * model.dtype.itemsize


def host_available() -> int:
    """Bytes of host memory available: TRIFORCE_HOST_MEMORY_GIB when set (for machines whose memory grows on demand
    and reports too little up front), else MemAvailable, or a large number where /proc/meminfo is missing."""
    if os.environ.get("TRIFORCE_HOST_MEMORY_GIB"):
        return int(float(os.environ["TRIFORCE_HOST_MEMORY_GIB"]) * GiB)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 1 << 62


def device_limit(device: torch.device, gib: float | None) -> int | None:
    """The device memory runs may plan on: `gib` when given (enforced on CUDA as this process's share of the GPU, so
    a large GPU behaves like a smaller card), else the GPU's total memory; None on a CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if gib is None:
        return total
    limit = int(gib * GiB)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    return limit


def working_bytes(limit: int | None) -> int:
    """Device memory a run keeps free for activations, logits and allocator slack (none planned on a CPU)."""
    return max(GiB, limit // 12) if limit else 0


def reusable(capacity: int, need: int) -> bool:
    """Whether a cache of `capacity` slots may serve a run needing `need`: it fits, and holds at most twice that."""
    return need <= capacity <= 2 * need


@dataclass(frozen=True)
class Sizes:
    """Token capacities of one run's caches, from the prompt length and the resolved settings. The prefill fills
    the full cache with all prompt tokens but the last, so that is what the chunk index covers."""

    full: int  # the prompt, the answer, the lookahead
    retrieval: int  # the chunks the budget buys, one more chunk's room (the partial last one), the answer, lookahead
    index_chunks: int  # full chunks of the prefilled prompt
    kept_chunks: int  # ... and those the budget buys
    streaming: int  # level 1's sink + window (or all a short prompt and its answer need) + lookahead

    @classmethod
    def of(cls, prompt_tokens: int, cfg: GenerationConfig) -> "Sizes":
        past = cfg.max_new_tokens + cfg.lookahead
        chunks = (prompt_tokens - 1) // cfg.chunk_size
        kept = chunks_to_keep(chunks, cfg.budget, cfg.chunk_size)
        return cls(prompt_tokens + past, kept * cfg.chunk_size + cfg.chunk_size + past, chunks, kept,
                   min(cfg.sink_tokens + cfg.window_tokens, prompt_tokens + cfg.max_new_tokens) + cfg.lookahead)


@dataclass
class Placement:
    """Where one run's caches live: whether the full cache is offloaded, whether the chunk index stays on the
    device, the bytes each part takes on the device and on the host, and the device limit planned against."""

    offloaded: bool
    index_on_device: bool
    device: dict[str, int]
    host: dict[str, int]
    limit: int

    def describe(self) -> dict[str, dict]:
        """Each cache and what it takes, by where it lives (plain data, for events): the device's memory is a GPU's
        where there is a limit to plan against, else the CPU's."""
        device = "GPU" if self.limit else "CPU"
        out = {name: {"where": device, "bytes": n} for name, n in self.device.items()}
        out.update({name: {"where": "CPU", "bytes": n} for name, n in self.host.items()})
        return out


@dataclass
class Plan:
    """One run's memory plan: its settings resolved for the regime chosen (offloaded runs default to the paper's
    budget 8192 and γ2 12), its caches' sizes, and where they live."""

    cfg: GenerationConfig
    sizes: Sizes
    placement: Placement


@dataclass
class Prefilled:
    """A full cache holding a prompt's keys and values (all its tokens but the last), with the queries its prefill
    recorded for the last row (retrieval's first selection): a next run on the same prompt starts from it."""

    ids: list[int]
    cache: KVCache
    queries: list[torch.Tensor]


class CachePool:
    """Static caches kept for later runs, so that the CUDA graphs captured on them are reused; it keeps at most the
    caches the last run used."""

    def __init__(self):
        self.caches: list[KVCache] = []
        self.taken: set[int] = set()

    def take(self, fits: Callable[[KVCache], bool], make: Callable[[], KVCache],
             kind: Callable[[KVCache], bool]) -> KVCache:
        """A free cache that `fits`, else a new one from make(); free caches of the same `kind` (a run takes one of
        each kind) are given back first, so that an old and a new cache never hold memory at once."""
        c = next((c for c in self.caches if id(c) not in self.taken and fits(c)), None)
        if c is None:
            self.caches = [c for c in self.caches if id(c) in self.taken or not kind(c)]
            c = make()
            self.caches.append(c)
        self.taken.add(id(c))
        return c

    def trim(self) -> None:
        """A run ended: free the caches it did not use (their memory is given back), keep the others."""
        self.caches = [c for c in self.caches if id(c) in self.taken]
        self.taken.clear()


class Memory:
    """The caches of one engine's runs: plans each run, hands out its caches, and keeps what a next run can reuse.
    `limit`: the device bytes a run may plan on (None: a CPU, where nothing is offloaded unless asked)."""

    def __init__(self, target: Transformer, draft: Transformer | None, limit: int | None):
        self.target, self.draft, self.limit = target, draft, limit
        self.weights = parameter_bytes(target, draft)
        self.kept: Prefilled | None = None  # the full cache the last run filled
        self.pool = CachePool()  # retrieval and level-1 caches of the last run

    def plan(self, prompt_tokens: int, settings: Callable[[bool], GenerationConfig], offload: str = "auto") -> Plan:
        """Sizes and placement for a run over `prompt_tokens`: on the device where it fits (or where `offload` says),
        else with its full cache offloaded, each regime with the settings `settings(offloaded)` resolved for it (the
        engine resolves them); raises TriForceError when the run fits neither on the device nor with its full cache
        offloaded, or the host lacks the memory."""
        on_chip = self._parts(prompt_tokens, settings(False), offloaded=False)
        if self.limit is None:  # a CPU run: "on" exercises the streaming code, "auto" never offloads
            return on_chip if offload != "on" else self._parts(prompt_tokens, settings(True), offloaded=True)
        need = sum(on_chip.placement.device.values())
        if offload == "off" or (offload == "auto" and need <= self.limit):
            if need > self.limit:
                raise TriForceError(f"the run needs {need / GiB:.1f} GiB of GPU memory "
                                    f"({_listing(on_chip.placement.device)}) but the limit is "
                                    f"{self.limit / GiB:.1f} GiB: allow offloading (offload auto or on), shorten the "
                                    "document or lower the budget")
            return on_chip
        plan = self._parts(prompt_tokens, settings(True), offloaded=True)
        device, host = plan.placement.device, plan.placement.host
        if sum(device.values()) > self.limit:  # the index then stays in host memory, fetched a layer at a time
            host["chunk index"] = device.pop("chunk index")
            plan.placement.index_on_device = False
        if sum(device.values()) > self.limit:
            raise TriForceError(f"the run needs {sum(device.values()) / GiB:.1f} GiB of GPU memory even with the KV "
                                f"cache offloaded ({_listing(device)}) but the limit is {self.limit / GiB:.1f} GiB: "
                                "shorten the document, lower the retrieval budget or pick a smaller model")
        # the kept offloaded cache is reused or given back before this run allocates: its memory counts as free
        available = host_available() + (self.kept.cache.nbytes if self.kept and not self.kept.cache.resident else 0)
        if sum(host.values()) > 0.9 * available:
            raise TriForceError(f"offloading needs {sum(host.values()) / GiB:.1f} GiB of CPU memory "
                                f"({_listing(host)}) but {available / GiB:.1f} GiB are available: shorten the document")
        return plan

    def _parts(self, prompt_tokens: int, c: GenerationConfig, offloaded: bool) -> Plan:
        """The plan of one regime (`c` resolved for it), every cache on the device but an offloaded full cache."""
        sizes = Sizes.of(prompt_tokens, c)
        token = kv_bytes_per_token(self.target)
        device = {"weights": self.weights, "working memory": working_bytes(self.limit)}
        host: dict[str, int] = {}
        if offloaded:
            device["full KV cache staging (2 layers)"] = 2 * sizes.full * token // self.target.args.n_layers
            host["full KV cache"] = sizes.full * token
        else:
            device["full KV cache"] = sizes.full * token
        # TriForce's caches are counted for AR too, so that both methods get the same placement for the same
        # input: a comparison of the two is like for like
        device["retrieval cache"] = sizes.retrieval * token
        device["chunk index"] = sizes.index_chunks * token // 2  # keys only
        if self.draft is not None:
            device["level-1 cache"] = sizes.streaming * kv_bytes_per_token(self.draft)
        return Plan(c, sizes, Placement(offloaded, True, device, host, self.limit or 0))

    def full_cache(self, plan: Plan) -> KVCache:
        """An empty-or-kept full cache for the plan: the kept one when it lives where the plan says and fits without
        being more than twice the size (page-locking tens of GiB takes seconds, so an offloaded one is kept across
        runs); otherwise the kept one is given back before a new one is allocated."""
        old = self.kept.cache if self.kept else None
        if old is not None and old.resident != plan.placement.offloaded and reusable(old.capacity, plan.sizes.full):
            return old
        self.kept = None
        a = self.target.args
        make = OffloadedKVCache if plan.placement.offloaded else KVCache
        return make(a.n_layers, a.n_kv_heads, a.head_dim, plan.sizes.full, self.target.dtype, self.target.device)

    def own_caches(self, plan: Plan, retrieval: bool) -> tuple[KVCache, KVCache | None]:
        """A batched request's own full cache and, where it drafts (`retrieval`), retrieval cache: never kept nor
        pooled, as the requests of a batch hold theirs side by side (a batch holds no offloaded request)."""
        a, dtype, device = self.target.args, self.target.dtype, self.target.device
        full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, plan.sizes.full, dtype, device)
        return full, KVCache(a.n_layers, a.n_kv_heads, a.head_dim, plan.sizes.retrieval, dtype, device) \
            if retrieval else None

    def own_streaming_cache(self, plan: Plan, model: Transformer) -> StreamingCache:
        """A batched request's own StreamingLLM cache for level-1 `model` (never pooled)."""
        a, cfg = model.args, plan.cfg
        return StreamingCache(a.n_layers, a.n_kv_heads, a.head_dim, plan.sizes.streaming, cfg.sink_tokens,
                              cfg.window_tokens, model.rotary, model.dtype, model.device)

    def prefilled(self, ids: list[int], cache: KVCache) -> Prefilled | None:
        """The kept record when `cache` already holds this prompt, else None (and nothing is kept any more: the
        caller is about to refill the cache)."""
        if self.kept is not None and self.kept.cache is cache and self.kept.ids == ids:
            return self.kept
        self.kept = None
        return None

    def retrieval_cache(self, plan: Plan) -> KVCache:
        """A resident cache with room for the plan's retrieval cache (reused when one of about that size is free)."""
        a, dtype = self.target.args, self.target.dtype

        def kind(c: KVCache) -> bool:
            return (type(c) is KVCache and c.k.shape[:2] == (a.n_layers, a.n_kv_heads) and c.k.shape[3] == a.head_dim
                    and c.k.dtype == dtype)

        return self.pool.take(lambda c: kind(c) and reusable(c.capacity, plan.sizes.retrieval),
                              lambda: KVCache(a.n_layers, a.n_kv_heads, a.head_dim, plan.sizes.retrieval, dtype,
                                              self.target.device), kind)

    def streaming_cache(self, plan: Plan, model: Transformer) -> StreamingCache:
        """An empty StreamingLLM cache of the plan's sink and window for level-1 `model` (sink and window are sizes,
        not only a capacity: only an identical cache is reused)."""
        a, cfg = model.args, plan.cfg
        shape = (a.n_layers, a.n_kv_heads, plan.sizes.streaming, a.head_dim)

        def kind(c: KVCache) -> bool:
            return isinstance(c, StreamingCache) and c.rotary is model.rotary

        cache = self.pool.take(
            lambda c: kind(c) and tuple(c.k.shape) == shape and (c.sink, c.window) == (cfg.sink_tokens,
                                                                                      cfg.window_tokens),
            lambda: self.own_streaming_cache(plan, model), kind)
        cache.reset()
        return cache

    def index_device(self, plan: Plan) -> torch.device:
        """Where the plan keeps the chunk index."""
        return self.target.device if plan.placement.index_on_device else torch.device("cpu")

    def during(self, events: Iterator[T]) -> Iterator[T]:
        """The events of one run: every pooled cache is free at its start; when it ends (finished, failed or closed)
        the pool keeps only the caches it used."""
        self.pool.taken.clear()
        try:
            yield from events
        finally:
            self.pool.trim()

    def caches(self) -> list[KVCache]:
        """Every cache kept for a next run: the pooled ones and the last full cache."""
        return self.pool.caches + ([self.kept.cache] if self.kept else [])

    def release(self) -> None:
        """Give back every kept cache (the caller then frees the device memory they held)."""
        self.kept = None
        self.pool = CachePool()


def retrieval_cache(full: KVCache, index: ChunkIndex, budget: int, extra: int) -> KVCache:
    """A new retrieval cache with exactly the room for the chunks `budget` buys of this prompt (+ tail) and `extra`
    later tokens (a run's own comes from Memory, sized to serve later prompts too): for measuring a step by itself."""
    head = chunks_to_keep(index.num_chunks, budget, index.chunk_size) * index.chunk_size + index.tail
    n_layers, n_kv, _, d = full.k.shape
    return KVCache(n_layers, n_kv, d, head + extra, full.k.dtype, full.device, head=head, start=index.length)


def _listing(parts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n / GiB:.1f}" for name, n in parts.items())
