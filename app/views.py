"""Pure renderers from RunState to component values: coloured answer, compact document view, stats, status."""

from __future__ import annotations

import html

import numpy as np

from app.state import RunState, live_stats

PROVENANCE_LABELS = {
    "draft": "level-1 draft, accepted",
    "copy": "level-1 copy from the text, accepted",
    "level2": "level-2 correction/bonus",
    "level3": "level-3 correction/bonus",
    "target": "autoregressive (target)",
}
PROVENANCE_COLORS = {
    PROVENANCE_LABELS["draft"]: "#22c55e",
    PROVENANCE_LABELS["copy"]: "#14b8a6",
    PROVENANCE_LABELS["level2"]: "#f59e0b",
    PROVENANCE_LABELS["level3"]: "#ef4444",
    PROVENANCE_LABELS["target"]: "#94a3b8",
}
REJECTED_LABELS = {2: "level-1 draft, rejected by level 2", 3: "level-2 draft, rejected by level 3"}
REJECTED_COLORS = {REJECTED_LABELS[2]: "#d1d5db", REJECTED_LABELS[3]: "#fecaca"}
TRIFORCE_COLORS = {**{label: colour for label, colour in PROVENANCE_COLORS.items()
                      if label != PROVENANCE_LABELS["target"]}, **REJECTED_COLORS}
AR_COLORS = {PROVENANCE_LABELS["target"]: PROVENANCE_COLORS[PROVENANCE_LABELS["target"]]}
SPAN_LABELS = {"sink": "attention sink", "hot": "kept by ≥ half of layer×heads", "warm": "kept by some heads"}
SPAN_COLORS = {SPAN_LABELS["sink"]: "#a78bfa", SPAN_LABELS["hot"]: "#f97316", SPAN_LABELS["warm"]: "#fde68a"}
DOC_VIEW_CHUNKS = 40
TIMELINE_ROUNDS = 300  # the timeline shows at most this many of the latest rounds
TIMELINE_LEGEND = ("<i class='ok'></i> kept <i class='no'></i> rejected <i class='skip'></i> discarded after it "
                   "<i class='l2'></i> level-2 token <i class='l3'></i> level-3 correction/bonus")


def struck(text: str) -> str:
    """Text drawn struck through (a combining long stroke after each visible character), on one line."""
    return "".join(" " if c.isspace() else c + "\u0336" for c in text.replace("\n", "↵"))


def answer_pieces(state: RunState, show_rejected: bool = True) -> list[tuple[str, str | None]]:
    """The answer so far as (text, provenance label) pairs for gr.HighlightedText; with `show_rejected`, the drafts a
    level rejected, struck through where they were tried."""
    pieces = [(text, PROVENANCE_LABELS.get(prov, prov)) for text, prov in state.pieces]
    if not show_rejected:
        return pieces
    out: list[tuple[str, str | None]] = []
    done = 0
    for at, level, text in state.rejected:  # in answer order
        out += pieces[done:at]
        done = at
        out.append((struck(text), REJECTED_LABELS[level]))
    return out + pieces[done:]


def _cells(proposed: int, accepted: int) -> str:
    """Cells of one verification: the tokens kept, the one rejected and those discarded after it."""
    rejected = proposed - accepted
    return "<i class='ok'></i>" * accepted + "<i class='no'></i>" * min(rejected, 1) + \
        "<i class='skip'></i>" * max(rejected - 1, 0)


def timeline_html(state: RunState, limit: int = TIMELINE_ROUNDS) -> str:
    """A strip of the level-3 rounds: level 3's verdict on the level-2 tokens on top, each level-2 step's verdict on
    the level-1 tokens below (hover a round for the counts)."""
    rounds = [trace for trace in state.rounds if trace.proposed]
    if not rounds:
        note = ("Autoregressive decoding drafts nothing." if state.method == "ar"
                else "The speculation timeline appears with the first level-3 round.")
        return f"<div class='tl'><div class='tl-head'>{note}</div></div>"
    blocks = []
    for trace in rounds[-limit:]:
        ending = "bonus" if trace.bonus else "correction"
        steps = ", ".join(f"{kept}/{tried}" for tried, kept in trace.steps)
        tip = (f"round {trace.round}: level 3 kept {trace.accepted} of {trace.proposed} level-2 tokens, then its "
               f"{ending}; level 2 kept {steps} level-1 tokens")
        top = _cells(trace.proposed, trace.accepted) + "<i class='l3'></i>"
        bottom = "<s></s>".join(_cells(tried, kept) + "<i class='l2'></i>" for tried, kept in trace.steps)
        blocks.append(f"<span class='tl-round' title='{html.escape(tip, quote=True)}'><span>{top}</span>"
                      f"<span>{bottom}</span></span>")
    shown = f"{len(rounds)} rounds" + (f", the last {limit} shown" if len(rounds) > limit else "")
    return (f"<div class='tl'><div class='tl-head'>Top: level 3 on the level-2 tokens · below: level 2 on the "
            f"level-1 tokens, step by step · {TIMELINE_LEGEND} · {shown}</div>"
            f"<div class='tl-rounds'>{''.join(blocks)}</div></div>")


def selected_chunks(totals: np.ndarray, limit: int = DOC_VIEW_CHUNKS) -> list[int]:
    """Chunk 0 (if kept) plus the `limit` most-kept chunks, in document order."""
    kept = np.flatnonzero(totals > 0)
    if len(kept) == 0:
        return []
    order = kept[np.argsort(-totals[kept], kind="stable")][:limit]
    chosen = set(order.tolist()) | ({0} if totals[0] > 0 else set())
    return sorted(chosen)


def document_view(state: RunState, limit: int = DOC_VIEW_CHUNKS) -> list[tuple[str, str | None]]:
    """A compact view of the document: the most-kept chunks highlighted, skipped stretches summarised."""
    if state.layer_counts is None or not state.chunk_texts:
        return []
    totals = state.totals
    half = max(state.max_count // 2, 1)
    out: list[tuple[str, str | None]] = []
    previous = -1
    for idx in selected_chunks(totals, limit):
        if idx > previous + 1:
            skipped = (idx - previous - 1) * state.chunk_size
            out.append((f" … [{skipped} tokens] … ", None))
        label = SPAN_LABELS["sink"] if idx == 0 else SPAN_LABELS["hot" if totals[idx] >= half else "warm"]
        out.append((state.chunk_texts[idx], label))
        previous = idx
    if previous < len(state.chunk_texts) - 1:
        out.append((f" … [{(len(state.chunk_texts) - previous - 1) * state.chunk_size} tokens] …", None))
    return out


def _fmt(value: float | None, pattern: str) -> str:
    """Format a number or show a dash when unknown."""
    return "–" if value is None else pattern.format(value)


def stats_markdown(stats: dict) -> str:
    """A two-column Markdown table of the headline figures."""
    mib = 1 / 2**20
    speed = stats.get("tokens_per_s")
    rows = [
        ("tokens generated", str(stats.get("new_tokens", 0))),
        ("decode: tokens / s", _fmt(speed, "{:.2f}")),
        ("decode: ms / token", _fmt(1000 / speed if speed else None, "{:.1f}")),
        ("prefill" + (" (cache of the previous run reused)" if stats.get("prefill_reused") else ""),
         _fmt(stats.get("prefill_s"), "{:.2f} s")),
        ("time to first token (prefill + first round)", _fmt(stats.get("time_to_first_token_s"), "{:.2f} s")),
        ("level-1 acceptance (by level 2)", _fmt(stats.get("level1_acceptance"), "{:.0%}")),
        ("level-2 acceptance (by level 3)", _fmt(stats.get("level2_acceptance"), "{:.0%}")),
        ("tokens per target forward", _fmt(stats.get("tokens_per_target_forward"), "{:.2f}")),
        ("budget / prompt", "100 % (whole prompt)" if (stats.get("budget_pct_of_context") or 0) >= 100
         else _fmt(stats.get("budget_pct_of_context"), "{:.1f} %")),
        ("full KV cache" + (" (in CPU memory, streamed to the GPU)" if stats.get("offloaded") else ""),
         _fmt(stats["cache_bytes"] * mib if stats.get("cache_bytes") else None, "{:.1f} MiB")),
        ("retrieval cache", _fmt(stats["retrieval_cache_bytes"] * mib if stats.get("retrieval_cache_bytes") else None,
                                 "{:.1f} MiB")),
    ]
    if stats.get("host_link_bytes_per_token"):
        rows.append(("CPU → GPU per token (host link)", f"{stats['host_link_bytes_per_token'] / 2**30:.2f} GiB"))
    if stats.get("warmup_s"):
        rows.append(("warm-up (CUDA graphs captured, not in decode time)", f"{stats['warmup_s']:.2f} s"))
    if stats.get("device"):
        rows.append(("device · dtype", f"{stats['device']} · {stats.get('dtype', '')}"))
    if stats.get("dropped_tokens"):
        rows.append(("tokens dropped (truncated)", str(stats["dropped_tokens"])))
    header = "| | " + ("final" if stats.get("finished") else "live") + " |\n|---|---|\n"
    return header + "\n".join(f"| {name} | {value} |" for name, value in rows)


def placement_markdown(caches: dict) -> str:
    """Where each cache lives (GPU / CPU memory) and its size, on one line."""
    parts = [f"{name} {info['bytes'] / 2**30:.2f} GiB on the {info['where']}" for name, info in caches.items()]
    return "🔀 The full KV cache does not fit the GPU's memory budget: it lives in CPU memory and is streamed to the " \
           "GPU layer by layer at each level-3 (full-cache) step · " + " · ".join(parts)


def status_markdown(state: RunState) -> str:
    """One line on what the run is doing, plus a truncation notice."""
    if state.finished:
        reason = (state.final_stats or {}).get("stop_reason") or "done"
        line = f"✅ Finished ({reason}): {len(state.token_ids)} tokens."
    elif state.stage == "prefill":
        line = f"⏳ Prefill: {state.prefill_done:,} / {state.prefill_total:,} prompt tokens ({state.prefill_s:.1f} s)"
    elif state.stage.startswith("loading"):
        line = f"⏳ {state.stage.capitalize()} ({state.load_fraction:.0%})"
    elif state.stage == "decoding":
        line = f"▶️ Decoding: {len(state.pieces)} tokens"
    else:
        line = "⏳ Starting…"
    if state.offloaded:
        line += "\n\n" + placement_markdown(state.caches)
    if state.dropped_tokens:
        line += (f"\n\n⚠️ The document did not fit the context ({state.context_length:,} tokens): its middle "
                 f"{state.dropped_tokens:,} tokens were dropped (beginning and end kept).")
    return line


def stats_for(state: RunState) -> tuple[str, dict]:
    """Stats as Markdown and as a plain dict."""
    stats = live_stats(state)
    return stats_markdown(stats), stats
