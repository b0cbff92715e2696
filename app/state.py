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
class RoundTrace:
    """One level-3 round: each level-2 step's level-1 tokens (proposed, accepted), then level 3's verdict on the
    level-2 tokens; `tried` holds the round's rejected drafts at their offset in the round until its tokens come."""

    round: int
    steps: list[tuple[int, int]] = field(default_factory=list)
    proposed: int = 0  # level-2 tokens level 3 verified (0: not verified yet)
    accepted: int = 0
    bonus: bool = False
    tried: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, rejecting level, text)


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
    offloaded: bool = False  # the full KV cache lives in CPU memory, streamed to the GPU layer by layer
    caches: dict = field(default_factory=dict)  # cache name -> {"where": "GPU" | "CPU", "bytes": int}
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
    rounds: list[RoundTrace] = field(default_factory=list)
    rejected: list[tuple[int, int, str]] = field(default_factory=list)  # (answer index, rejecting level, text)
    level_ms: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decode time of levels 1, 2 and 3
    selection_s: float = 0.0  # time spent choosing the retrieval cache's chunks
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


def _texts(ev: dict) -> list[str]:
    """The text of each proposed token of a Verdict (the app's engine side adds it; else the token ids)."""
    return ev.get("proposed_texts") or [f"⟨{token}⟩" for token in ev["proposed"]]


def _tried_in_order(level1: list[tuple[int, int, str]], accepted: int, rejected: list[str]
                    ) -> list[tuple[int, int, str]]:
    """A round's rejected drafts in the order they were tried: the level-1 proposals level 2 rejected up to level
    3's first rejection, then level 3's rejected level-2 tokens, with the level-1 proposals level 2 rejected inside
    that discarded run among them (all at the offset of level 3's correction)."""
    out = [entry for entry in level1 if entry[0] <= accepted]
    cut = 0
    for offset, _, text in level1:
        if offset > accepted:
            out += [(accepted, 3, "".join(rejected[cut:offset - accepted])), (accepted, 2, text)]
            cut = offset - accepted
    out.append((accepted, 3, "".join(rejected[cut:])))
    return [entry for entry in out if entry[2]]


def _verdict(state: RunState, ev: dict) -> None:
    """Count a verification and note what it rejected, at its place in the round."""
    proposed, accepted, level = len(ev["proposed"]), int(ev["accepted"]), int(ev["level"])
    if not state.rounds or state.rounds[-1].round != ev["round"]:
        state.rounds.append(RoundTrace(int(ev["round"])))
    trace = state.rounds[-1]
    if level == 2:
        state.level1_proposed += proposed
        state.level1_accepted += accepted
        if accepted < proposed:
            offset = sum(kept + 1 for _, kept in trace.steps) + accepted
            trace.tried.append((offset, 2, "".join(_texts(ev)[accepted:])))
        trace.steps.append((proposed, accepted))
        return
    state.level2_proposed += proposed
    state.level2_accepted += accepted
    state.target_forwards += 1
    trace.proposed, trace.accepted, trace.bonus = proposed, accepted, bool(ev["bonus"])
    trace.tried = _tried_in_order(trace.tried, accepted, _texts(ev)[accepted:])


def _tokens(state: RunState, ev: dict) -> None:
    """Append a round's tokens, and its rejected drafts where they were tried within what was emitted."""
    start = len(state.pieces)
    state.pieces.extend(zip(ev["texts"], ev["provenance"]))
    state.token_ids.extend(ev["ids"])
    if state.rounds and state.rounds[-1].round == ev["round"]:
        trace = state.rounds[-1]
        state.rejected += [(start + offset, level, text) for offset, level, text in trace.tried
                           if start + offset <= len(state.pieces)]
        trace.tried = []


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
        state.offloaded, state.caches = bool(ev.get("offloaded")), dict(ev.get("caches") or {})
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
        state.selection_s += float(ev["seconds"])
    elif kind == "Verdict":
        _verdict(state, ev)
    elif kind == "StepTiming":
        for level, key in enumerate(("level1_ms", "level2_ms", "level3_ms")):
            state.level_ms[level] += float(ev[key])
    elif kind == "Tokens":
        if state.first_token_at is None:
            state.first_token_at = now
        if state.prefill_ended is None:
            state.prefill_ended = now
        _tokens(state, ev)
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
    budget_pct = min(100.0, 100.0 * state.budget / state.prompt_tokens) if state.prompt_tokens and state.budget \
        else None  # a budget over the prompt keeps the whole prompt
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
                "levels": level_costs(state), "offloaded": state.offloaded, "caches": state.caches,
                "host_link_bytes_per_token": s.get("host_link_bytes", 0) / max(s.get("new_tokens", 0), 1),
                "warmup_s": s.get("warmup_s", 0.0), "finished": True}
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
            "stop_reason": "", "device": "", "dtype": "", "levels": [], "offloaded": state.offloaded,
            "caches": state.caches, "host_link_bytes_per_token": None, "warmup_s": 0.0, "finished": False}


LEVEL1_LABELS = {"model": "draft model + StreamingLLM cache", "ngram": "n-gram lookup in the text"}


def level_costs(state: RunState) -> list[dict]:
    """Per level of the finished run: steps, time in total and per step, bytes one step reads (weights plus the
    level's KV cache as allocated) and share of the decode time; [] until the engine reports the end."""
    s = state.final_stats
    if s is None:
        return []
    weights, full = s.get("target_weight_bytes", 0), s.get("cache_bytes", 0)
    if state.method == "ar":
        rows = [("target", "autoregressive: target + full cache", s.get("target_forwards", 0), state.level_ms[2],
                 weights + full)]
    else:
        level2_steps = sum(len(trace.steps) for trace in state.rounds)
        drafter = s.get("drafter", "")
        rows = [] if drafter in ("", "none") else [
            ("level1", f"level 1: {LEVEL1_LABELS.get(drafter, drafter)}", s.get("level1_steps") or level2_steps,
             state.level_ms[0], s.get("level1_weight_bytes", 0) + s.get("level1_cache_bytes", 0))]
        rows += [("level2", "level 2: target + retrieval cache", level2_steps, state.level_ms[1],
                  weights + s.get("retrieval_cache_bytes", 0)),
                 ("level3", "level 3: target + full cache" + (" (streamed from CPU memory)" if state.offloaded else ""),
                  s.get("target_forwards", 0), state.level_ms[2], weights + full),
                 ("selection", "chunk selection", len(state.selection_rounds), state.selection_s * 1e3, None)]
    total_ms = sum(row[3] for row in rows)
    return [{"key": key, "level": name, "steps": steps, "ms": ms, "ms_per_step": ms / steps if steps else None,
             "bytes_per_step": read, "share": ms / total_ms if total_ms else None}
            for key, name, steps, ms, read in rows]
