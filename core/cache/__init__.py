"""Where keys and values live: static and offloaded KV caches, level 2's retrieval cache, and the memory plan that
sizes and places them before anything is allocated."""

from __future__ import annotations

from core.cache.kvcache import KVCache, StreamingCache, pinned_empty
from core.cache.offload import OffloadedKVCache
from core.cache.retrieval import LEVEL2_CACHES, ChunkIndex, Retrieval, chunks_to_keep, gather_selection, select_chunks
from core.cache.memory import GiB, Memory, Plan, retrieval_cache

__all__ = ["KVCache", "StreamingCache", "pinned_empty", "OffloadedKVCache", "LEVEL2_CACHES", "ChunkIndex", "Retrieval",
           "chunks_to_keep", "gather_selection", "retrieval_cache", "select_chunks", "GiB", "Memory", "Plan"]
