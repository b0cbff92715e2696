"""Per-run UI state and the reducer that folds engine event dicts (`Event.to_dict()`) into it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

MAX_COLUMNS = 1024


def bin_edges(num_chunks: int, max_columns: int = MAX_COLUMNS) -> np.ndarray:
    """Start index of each column plus the end: ≤ max_columns nearly equal groups of consecutive chunks."""
    columns = max(1, min(num_chunks, max_columns))
    return np.linspace(0, num_chunks, columns + 1).round().astype(np.int64)


def compact_dtype(max_value: int) -> type:
    """The smallest unsigned integer dtype holding 0..max_value (uint8 or uint16)."""
    return np.uint8 if max_value <= 255 else np.uint16


def bin_max(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Maximum of `values` over each column [edges[i], edges[i+1]) along the last axis, keeping the dtype."""
    if values.shape[-1] == 0:
        return np.zeros(values.shape[:-1] + (0,), dtype=values.dtype)
    return np.maximum.reduceat(values, edges[:-1], axis=-1)


@dataclass
class RunState:
    """Everything the views need about one generation, built only from events."""

    method: str = "triforce"
    started: float = field(default_factory=time.monotonic)
    stage: str = "starting"
    load_fraction: float = 0.0
    prompt_tokens: int = 0
    document_tokens: int = 0
    dropped_tokens: int = 0
    context_length: int = 0
    max_new_tokens: int = 0
    chunk_size: int = 0
    chunk_texts: list[str] = field(default_factory=list)
    prefill_done: int = 0
    prefill_total: int = 0
    prefill_s: float = 0.0
    prefill_ended: float | None = None
    budget: int = 0
    num_chunks: int = 0
    edges: np.ndarray | None = None
    layer_counts: np.ndarray | None = None  # (layers, chunks) uint8: KV heads of each layer that keep the chunk
    heads_per_layer: int = 0
    selection_rounds: list[int] = field(default_factory=list)
    selection_columns: list[np.ndarray] = field(default_factory=list)  # per selection: binned max count, uint8/16
    step_rounds: list[int] = field(default_factory=list)
    step_selection: list[int] = field(default_factory=list)
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, provenance)
    token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    level1_proposed: int = 0
    level1_accepted: int = 0
    level2_proposed: int = 0
    level2_accepted: int = 0
    target_forwards: int = 0
    final_stats: dict | None = None
    text: str = ""

    @property
    def finished(self) -> bool:
        """Whether the engine reported the end of generation."""
        return self.final_stats is not None

    @property
    def totals(self) -> np.ndarray:
        """Per chunk: how many (layer, KV head) pairs keep it in the current selection."""
        if self.layer_counts is None:
            return np.zeros(self.num_chunks, dtype=np.int32)
        return self.layer_counts.sum(axis=0, dtype=np.int32)

    @property
    def max_count(self) -> int:
        """The largest possible per-chunk count: layers × KV heads."""
        return 0 if self.layer_counts is None else self.layer_counts.shape[0] * self.heads_per_layer


def _selection(state: RunState, ev: dict) -> None:
    """Record a retrieval selection: per-layer head counts and its binned per-chunk total."""
    num_chunks = int(ev["num_chunks"])
    chunk_ids = ev["chunk_ids"]
    counts = np.zeros((len(chunk_ids), num_chunks), dtype=np.uint8)
    for layer, heads in enumerate(chunk_ids):
        for ids in heads:
            if len(ids):
                counts[layer, np.asarray(ids, dtype=np.int64)] += 1
    if state.edges is None or state.num_chunks != num_chunks:
        state.edges = bin_edges(num_chunks)
    state.num_chunks = num_chunks
    state.budget = int(ev["budget"])
    state.chunk_size = int(ev["chunk_size"]) or state.chunk_size
    state.heads_per_layer = max((len(heads) for heads in chunk_ids), default=0)
    state.layer_counts = counts
    state.selection_rounds.append(int(ev["round"]))
    state.selection_columns.append(bin_max(state.totals.astype(compact_dtype(state.max_count)), state.edges))
    state.stage = "decoding"


def apply_event(state: RunState, ev: dict, now: float | None = None) -> RunState:
    """Fold one event dict into `state` (in place) and return it."""
    now = time.monotonic() if now is None else now
    kind = ev.get("kind")
    if kind == "Loading":
        state.stage, state.load_fraction = f"loading {ev['stage']}", float(ev["fraction"])
    elif kind == "PromptReady":
        for key in ("prompt_tokens", "document_tokens", "dropped_tokens", "context_length", "max_new_tokens",
                    "chunk_size"):
            setattr(state, key, int(ev[key]))
        state.chunk_texts = list(ev["chunk_texts"])
        state.num_chunks = len(state.chunk_texts)
        state.prefill_total = state.prompt_tokens
        state.stage = "prefill"
    elif kind == "PrefillProgress":
        state.prefill_done, state.prefill_total = int(ev["done"]), int(ev["total"])
        state.prefill_s = float(ev["seconds"])
        if state.prefill_done >= state.prefill_total:
            state.prefill_ended, state.stage = now, "decoding"
    elif kind == "RetrievalSelection":
        _selection(state, ev)
    elif kind == "Verdict":
        proposed, accepted = len(ev["proposed"]), int(ev["accepted"])
        if int(ev["level"]) == 2:
            state.level1_proposed += proposed
            state.level1_accepted += accepted
        else:
            state.level2_proposed += proposed
            state.level2_accepted += accepted
            state.target_forwards += 1
    elif kind == "Tokens":
        if state.first_token_at is None:
            state.first_token_at = now
        if state.prefill_ended is None:
            state.prefill_ended = now
        state.pieces.extend(zip(ev["texts"], ev["provenance"]))
        state.token_ids.extend(ev["ids"])
        if state.method == "ar":
            state.target_forwards += len(ev["ids"])
        if not state.step_rounds or state.step_rounds[-1] != ev["round"]:
            state.step_rounds.append(int(ev["round"]))
            state.step_selection.append(len(state.selection_columns) - 1)
        state.stage = "decoding"
    elif kind == "Finished":
        state.final_stats = dict(ev["stats"])
        state.text = ev["text"]
        state.token_ids = list(ev["token_ids"])
        state.stage = "finished"
    return state


def live_stats(state: RunState, now: float | None = None) -> dict:
    """Headline figures: the engine's final Stats when finished, else estimates from events so far."""
    now = time.monotonic() if now is None else now
    budget_pct = 100.0 * state.budget / state.prompt_tokens if state.prompt_tokens and state.budget else None
    if state.final_stats is not None:
        s = state.final_stats
        return {"method": s.get("method", state.method), "new_tokens": s.get("new_tokens", len(state.token_ids)),
                "tokens_per_s": s.get("tokens_per_s"), "time_to_first_token_s": s.get("time_to_first_token_s"),
                "prefill_s": s.get("prefill_s"), "prefill_reused": s.get("prefill_reused", False),
                "decode_s": s.get("decode_s"), "level1_acceptance": s.get("level1_acceptance"),
                "level2_acceptance": s.get("level2_acceptance"),
                "tokens_per_target_forward": s.get("tokens_per_target_forward"),
                "budget_pct_of_context": budget_pct, "prompt_tokens": s.get("prompt_tokens", state.prompt_tokens),
                "dropped_tokens": s.get("dropped_tokens", state.dropped_tokens),
                "cache_bytes": s.get("cache_bytes"), "retrieval_cache_bytes": s.get("retrieval_cache_bytes"),
                "stop_reason": s.get("stop_reason", ""), "device": s.get("device", ""), "dtype": s.get("dtype", ""),
                "finished": True}
    n = len(state.token_ids)
    decode_s = now - state.prefill_ended if state.prefill_ended is not None else 0.0
    forwards = state.target_forwards
    return {"method": state.method, "new_tokens": n,
            "tokens_per_s": n / decode_s if n and decode_s > 0 else None,
            "time_to_first_token_s": state.first_token_at - state.started if state.first_token_at else None,
            "prefill_s": state.prefill_s or None, "prefill_reused": False, "decode_s": decode_s or None,
            "level1_acceptance": state.level1_accepted / state.level1_proposed if state.level1_proposed else None,
            "level2_acceptance": state.level2_accepted / state.level2_proposed if state.level2_proposed else None,
            "tokens_per_target_forward": n / forwards if forwards else None,
            "budget_pct_of_context": budget_pct, "prompt_tokens": state.prompt_tokens,
            "dropped_tokens": state.dropped_tokens, "cache_bytes": None, "retrieval_cache_bytes": None,
            "stop_reason": "", "device": "", "dtype": "", "finished": False}
