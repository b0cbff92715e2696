"""Per-run UI state and the reducer that folds the engine's typed events (core.events) into it. A batched run's
events come typed from the batch's stream; a run alone's cross from the engine's side as plain dicts (a ZeroGPU
worker can only hand those over) and `typed` rebuilds them at this boundary; the reducer matches on their classes."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from core.events import (Acceptance, Event, Finished, Loading, PlanChosen, PrefillBeside, PrefillProgress,
                         PromptReady, RetrievalSelection, Stats, StepTiming, Tokens, Verdict, event_from_dict)

MAX_COLUMNS = 384  # heatmap columns: about what a screen shows of a document; the download has every chunk
MAX_KEPT_SELECTIONS = 1024  # distinct selections kept at full resolution for the download (memory stays bounded)


@dataclass
class ShownVerdict(Verdict):
    """A Verdict with the text of each proposed token (the app's engine side decodes them, special tokens left out),
    for showing rejected drafts."""

    proposed_texts: list[str] = field(default_factory=list)


@dataclass
class InLine(Event):
    """The run waits for a seat (in the batch, or the app's line): `place` in line (1: next), `seats` runs decoding
    at once. Made on the app's side (app.inference), never sent as a dict."""

    place: int
    seats: int


def typed(data: dict) -> Event:
    """The typed event of an event dict from the engine's side (Event.to_dict(), a Verdict with its texts)."""
    if data.get("kind") == "Verdict" and "proposed_texts" in data:
        return ShownVerdict(**{k: v for k, v in data.items() if k != "kind"})
    return event_from_dict(data)


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


def budget_share(budget: int | None, prompt_tokens: int) -> float | None:
    """The retrieval budget as a percentage of the prompt (100 when it keeps the whole prompt); None without one."""
    if not budget or not prompt_tokens:
        return None
    return min(100.0, 100.0 * budget / prompt_tokens)


# A rejected draft is labelled by the level that drafted it and the level that rejected it.
Rejection = tuple[int, int]


@dataclass
class RoundTrace:
    """One level-3 round: each level-2 step's level-1 tokens (proposed, accepted), then level 3's verdict on the
    drafted tokens (level 2's, or level 1's when the plan leaves level 2 out); `tried` holds the round's rejected
    drafts at their offset in the round until its tokens come."""

    round: int
    steps: list[tuple[int, int]] = field(default_factory=list)
    proposed: int = 0  # tokens level 3 verified (0: none drafted, or not verified yet)
    accepted: int = 0
    bonus: bool = False
    drafter: int = 2  # the level whose tokens level 3 verified
    tried: list[tuple[int, Rejection, str]] = field(default_factory=list)  # (offset, rejection, text)


@dataclass
class RunState:
    """Everything the views need about one generation, built only from events."""

    method: str = "triforce"
    batched: bool = False  # decoded in the app's batch, beside other visitors' runs
    started: float = field(default_factory=time.monotonic)  # reset when the prompt is ready (the engine's clock)
    stage: str = "starting"
    load_fraction: float = 0.0
    place: int = 0  # its place in the batch's line while it waits for a seat (stage "waiting")
    seats: int = 0
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
    prefill_reused: bool = False
    prefill_ended: float | None = None
    prefill_beside: PrefillBeside | None = None  # another run's prompt being prefilled on its device now (batched)
    decoding_beside: int = 0  # other runs decoding while its own prompt is read between their rounds (batched)
    cache_bytes: int = 0
    retrieval_cache_bytes: int = 0
    budget: int = 0
    num_chunks: int = 0
    edges: np.ndarray | None = None
    layer_counts: np.ndarray | None = None  # (layers, chunks) uint8: KV heads of each layer that keep the chunk
    heads_per_layer: int = 0
    selection_rounds: list[int] = field(default_factory=list)
    selection_columns: list[np.ndarray] = field(default_factory=list)  # per selection: binned max count, uint8/16
    kept_selections: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (round, per-chunk totals), distinct
    selections_not_kept: int = 0  # distinct selections past MAX_KEPT_SELECTIONS
    step_rounds: list[int] = field(default_factory=list)
    step_selection: list[int] = field(default_factory=list)
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, provenance)
    token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    stopped_at: float | None = None  # when the visitor's Stop ended the run: its figures hold still from there
    counts: Acceptance = field(default_factory=Acceptance)  # what each level proposed and the next one accepted
    target_forwards: int = 0
    plans: list[PlanChosen] = field(default_factory=list)  # method auto: the hierarchies chosen, in order
    rounds: list[RoundTrace] = field(default_factory=list)
    rejected: list[tuple[int, Rejection, str]] = field(default_factory=list)  # (answer index, rejection, text)
    level_ms: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decode time of levels 1, 2 and 3
    ar_steps: int = 0  # level-3 steps of rounds that drafted nothing (autoregressive) ...
    ar_ms: float = 0.0  # ... and their time, part of level_ms[2]
    selection_s: float = 0.0  # time spent choosing the retrieval cache's chunks
    final_stats: Stats | None = None
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

    @property
    def level2_in_plan(self) -> bool:
        """Whether the current round's hierarchy has level 2 (always, unless method auto's planner left it out)."""
        return self.plans[-1].level2 if self.plans else True


def _selection(state: RunState, ev: RetrievalSelection) -> None:
    """Record a retrieval selection: per-layer head counts, its binned per-chunk total, and (when it differs from the
    previous one) its full-resolution totals."""
    counts = np.zeros((len(ev.chunk_ids), ev.num_chunks), dtype=np.uint8)
    for layer, heads in enumerate(ev.chunk_ids):
        for ids in heads:
            if len(ids):
                counts[layer, np.asarray(ids, dtype=np.int64)] += 1
    if state.edges is None or state.num_chunks != ev.num_chunks:
        state.edges = bin_edges(ev.num_chunks)
    state.num_chunks, state.budget = ev.num_chunks, ev.budget
    state.chunk_size = ev.chunk_size or state.chunk_size
    state.heads_per_layer = max((len(heads) for heads in ev.chunk_ids), default=0)
    state.layer_counts = counts
    state.retrieval_cache_bytes = ev.cache_bytes
    totals = state.totals.astype(compact_dtype(state.max_count))
    state.selection_rounds.append(ev.round)
    state.selection_columns.append(bin_max(totals, state.edges))
    if not state.kept_selections or not np.array_equal(state.kept_selections[-1][1], totals):
        if len(state.kept_selections) < MAX_KEPT_SELECTIONS:
            state.kept_selections.append((ev.round, totals))
        else:
            state.selections_not_kept += 1
    state.selection_s += ev.seconds
    state.stage = "decoding"


def _texts(ev: Verdict) -> list[str]:
    """The text of each proposed token (the app's engine side adds it; else the token ids)."""
    if isinstance(ev, ShownVerdict) and ev.proposed_texts:
        return ev.proposed_texts
    return [f"⟨{token}⟩" for token in ev.proposed]


def _tried_in_order(level1: list[tuple[int, Rejection, str]], accepted: int, drafter: int, rejected: list[str]
                    ) -> list[tuple[int, Rejection, str]]:
    """A round's rejected drafts in the order they were tried: the level-1 proposals level 2 rejected up to level
    3's first rejection, then level 3's rejected tokens, with the level-1 proposals level 2 rejected inside that
    discarded run among them (all at the offset of level 3's correction)."""
    out = [entry for entry in level1 if entry[0] <= accepted]
    cut = 0
    for offset, rejection, text in level1:
        if offset > accepted:
            out += [(accepted, (drafter, 3), "".join(rejected[cut:offset - accepted])), (accepted, rejection, text)]
            cut = offset - accepted
    out.append((accepted, (drafter, 3), "".join(rejected[cut:])))
    return [entry for entry in out if entry[2]]


def _verdict(state: RunState, ev: Verdict) -> None:
    """Count a verification and note what it rejected, at its place in the round."""
    proposed, accepted, counts = len(ev.proposed), ev.accepted, state.counts
    if not state.rounds or state.rounds[-1].round != ev.round:
        state.rounds.append(RoundTrace(ev.round))
    trace = state.rounds[-1]
    if ev.level == 2:
        counts.count(1, proposed, accepted)
        if accepted < proposed:
            offset = sum(kept + 1 for _, kept in trace.steps) + accepted
            trace.tried.append((offset, (1, 2), "".join(_texts(ev)[accepted:])))
        trace.steps.append((proposed, accepted))
        return
    trace.drafter = 2 if state.level2_in_plan else 1  # else level 1's drafts, checked by level 3 directly
    counts.count(trace.drafter, proposed, accepted)
    state.target_forwards += 1
    trace.proposed, trace.accepted, trace.bonus = proposed, accepted, ev.bonus
    trace.tried = _tried_in_order(trace.tried, accepted, trace.drafter, _texts(ev)[accepted:])


def _tokens(state: RunState, ev: Tokens, now: float) -> None:
    """Append a round's tokens, and its rejected drafts where they were tried within what was emitted."""
    if state.first_token_at is None:
        state.first_token_at = now
    if state.prefill_ended is None:
        state.prefill_ended = now
    start = len(state.pieces)
    trace = state.rounds[-1] if state.rounds and state.rounds[-1].round == ev.round else None
    state.pieces.extend(zip(ev.texts, ev.provenance))
    state.token_ids.extend(ev.ids)
    if trace is not None:
        state.rejected += [(start + offset, rejection, text) for offset, rejection, text in trace.tried
                           if start + offset <= len(state.pieces)]
        trace.tried = []
    if state.method == "ar":
        state.target_forwards += len(ev.ids)
    if not state.step_rounds or state.step_rounds[-1] != ev.round:
        state.step_rounds.append(ev.round)
        state.step_selection.append(len(state.selection_columns) - 1)
    state.stage = "decoding"


def _prompt(state: RunState, ev: PromptReady, now: float) -> None:
    """The prompt as the engine built it; the run's clock starts here, as the engine's does."""
    state.started = now
    state.prompt_tokens, state.document_tokens, state.dropped_tokens = (ev.prompt_tokens, ev.document_tokens,
                                                                        ev.dropped_tokens)
    state.context_length, state.max_new_tokens, state.chunk_size = ev.context_length, ev.max_new_tokens, ev.chunk_size
    state.chunk_texts = list(ev.chunk_texts)
    state.offloaded, state.caches = ev.offloaded, dict(ev.caches)
    state.num_chunks = len(state.chunk_texts)
    state.stage = "prefill"


def apply_event(state: RunState, event: Event, now: float | None = None) -> RunState:
    """Fold one typed event into `state` (in place) and return it."""
    now = time.monotonic() if now is None else now
    match event:
        case Loading():
            state.stage, state.load_fraction = f"loading {event.stage}", event.fraction
        case InLine():
            state.stage, state.place, state.seats = "waiting", event.place, event.seats
        case PromptReady():
            _prompt(state, event, now)
        case PrefillProgress():
            state.prefill_done, state.prefill_total, state.prefill_s = event.done, event.total, event.seconds
            state.prefill_reused, state.cache_bytes = event.reused, event.cache_bytes
            state.decoding_beside = event.decoding_beside
            if event.done >= event.total:
                state.prefill_ended, state.stage = now, "decoding"
        case PrefillBeside():
            state.prefill_beside = event if event.prompt_tokens else None
        case RetrievalSelection():
            _selection(state, event)
        case PlanChosen():
            state.plans.append(event)
        case Verdict():
            _verdict(state, event)
        case StepTiming():
            for level, ms in enumerate((event.level1_ms, event.level2_ms, event.level3_ms)):
                state.level_ms[level] += ms
            if not _drafted(state, event.round):  # a verification pass over many rows is not an AR step
                state.ar_steps += 1
                state.ar_ms += event.level3_ms
        case Tokens():
            _tokens(state, event, now)
        case Finished():
            state.final_stats, state.text, state.token_ids = event.stats, event.text, list(event.token_ids)
            state.stage, state.prefill_beside = "finished", None
    return state


def estimate(state: RunState, now: float | None = None) -> Stats:
    """The run's figures so far, as the engine's final Stats would give them."""
    now = state.stopped_at or (time.monotonic() if now is None else now)
    n, counts = len(state.token_ids), state.counts
    decode_s = now - state.prefill_ended if state.prefill_ended is not None else 0.0
    forwards = state.target_forwards
    return Stats(
        method=state.method, new_tokens=n, prompt_tokens=state.prompt_tokens, dropped_tokens=state.dropped_tokens,
        prefill_s=state.prefill_s, prefill_reused=state.prefill_reused, decode_s=decode_s,
        tokens_per_s=n / decode_s if n and decode_s > 0 else 0.0,
        time_to_first_token_s=state.first_token_at - state.started if state.first_token_at else 0.0,
        target_forwards=forwards, tokens_per_target_forward=n / forwards if forwards else 0.0,
        **asdict(counts),
        cache_bytes=state.cache_bytes, retrieval_cache_bytes=state.retrieval_cache_bytes,
        plans=[plan.plan for plan in state.plans])


def live_stats(state: RunState, now: float | None = None) -> dict:
    """Headline figures: the engine's final Stats when finished, else the estimate from events so far; None where a
    figure does not apply (acceptance without drafts, a budget without retrieval) or is not known yet."""
    s = state.final_stats or estimate(state, now)
    return {"method": s.method, "new_tokens": s.new_tokens, "tokens_per_s": s.tokens_per_s or None,
            "time_to_first_token_s": s.time_to_first_token_s or None, "prefill_s": s.prefill_s or None,
            "prefill_reused": s.prefill_reused, "decode_s": s.decode_s or None,
            "level1_acceptance": s.level1_acceptance if s.level1_verified else None,
            "level2_acceptance": s.level2_acceptance if s.level2_verified else None,
            "tokens_per_target_forward": s.tokens_per_target_forward or None,
            "budget_pct_of_prompt": budget_share(state.budget, s.prompt_tokens), "prompt_tokens": s.prompt_tokens,
            "dropped_tokens": s.dropped_tokens, "cache_bytes": s.cache_bytes or None,
            "retrieval_cache_bytes": s.retrieval_cache_bytes or None, "stop_reason": s.stop_reason,
            "device": s.device, "dtype": s.dtype, "levels": level_costs(state), "offloaded": state.offloaded,
            "caches": state.caches, "host_link_bytes_per_token": s.host_link_bytes / max(s.new_tokens, 1) or None,
            "drafts_ahead": (s.ahead_kept, s.ahead_made) if s.ahead_made else None,
            "warmup_s": s.warmup_s, "plans": [{"round": p.round, "plan": p.plan, "reason": p.reason}
                                              for p in state.plans], "finished": state.finished,
            "stopped": state.stopped_at is not None and not state.finished,
            "shared_with": s.shared_with if state.finished else None,
            "prefills_beside": s.prefills_beside if state.finished else None, "prefill_beside_s": s.prefill_beside_s}


LEVEL1_LABELS = {"model": "draft model + StreamingLLM cache", "ngram": "n-gram lookup in the text"}


def _drafted(state: RunState, round_: int) -> bool:
    """Whether round `round_` drafted anything for level 3 to verify."""
    trace = next((trace for trace in reversed(state.rounds) if trace.round == round_), None)
    return trace is not None and bool(trace.proposed or trace.steps)


def level_costs(state: RunState) -> list[dict]:
    """Per level of the finished run: steps, time in total and per step, bytes one step reads (weights plus the
    level's KV cache as allocated) and share of the decode time; [] until the engine reports the end."""
    s = state.final_stats
    if s is None:
        return []
    weights, full = s.target_weight_bytes, s.cache_bytes
    if state.method == "ar":
        rows = [("target", "autoregressive: target + full cache", s.target_forwards, state.level_ms[2],
                 weights + full)]
    else:
        level2_steps = sum(len(trace.steps) for trace in state.rounds)
        rows = [] if s.drafter in ("", "none") else [
            ("level1", f"level 1: {LEVEL1_LABELS.get(s.drafter, s.drafter)}", s.level1_steps or level2_steps,
             state.level_ms[0], s.level1_weight_bytes + s.level1_cache_bytes)]
        where = " (streamed from CPU memory)" if state.offloaded else ""
        rows += [("level2", "level 2: target + retrieval cache", level2_steps, state.level_ms[1],
                  weights + s.retrieval_cache_bytes),
                 ("level3", "level 3: target + full cache, verifying drafts" + where,
                  s.target_forwards - state.ar_steps, state.level_ms[2] - state.ar_ms, weights + full)]
        if state.ar_steps:  # method auto's autoregressive rounds: one row each, apart from the passes verifying many
            rows.append(("target", "autoregressive steps: target + full cache" + where, state.ar_steps, state.ar_ms,
                         weights + full))
        rows.append(("selection", "chunk selection", len(state.selection_rounds), state.selection_s * 1e3, None))
    total_ms = sum(row[3] for row in rows)
    return [{"key": key, "level": name, "steps": steps, "ms": ms, "ms_per_step": ms / steps if steps else None,
             "bytes_per_step": read, "share": ms / total_ms if total_ms else None}
            for key, name, steps, ms, read in rows]


def raw_data(state: RunState) -> dict:
    """Everything the run's views are drawn from, at full resolution (the Raw stats download): the figures, the
    prompt, the answer with provenance and rejected drafts, each round, the plans, and each distinct selection's
    per-chunk count of the (layer, KV head) pairs keeping it."""
    return {
        "stats": state.final_stats.to_dict() if state.final_stats else None, "live": live_stats(state),
        "prompt": {"prompt_tokens": state.prompt_tokens, "document_tokens": state.document_tokens,
                   "dropped_tokens": state.dropped_tokens, "context_length": state.context_length,
                   "chunk_size": state.chunk_size, "num_chunks": state.num_chunks},
        "answer": {"text": state.text, "token_ids": state.token_ids, "pieces": state.pieces},
        "rejected": [{"at": at, "drafted_by": drafted, "rejected_by": by, "text": text}
                     for at, (drafted, by), text in state.rejected],
        "rounds": [{"round": t.round, "level2_steps": t.steps, "proposed": t.proposed, "accepted": t.accepted,
                    "bonus": t.bonus, "verified_level": t.drafter} for t in state.rounds],
        "plans": [asdict(plan) for plan in state.plans],
        "selection_rounds": state.selection_rounds,
        "selections": [{"round": round_, "kept_by": totals.tolist()} for round_, totals in state.kept_selections],
        "selections_not_kept": state.selections_not_kept,
        "last_selection_per_layer": None if state.layer_counts is None else state.layer_counts.tolist(),
        "level_ms": dict(zip(("level1", "level2", "level3"), state.level_ms)),
    }
