"""Pure renderers from RunState to component values: the answer as text with its provenance and rejected drafts as
overlays, the compact document view, the timeline, stats, status."""

from __future__ import annotations

import html

import numpy as np

from app.state import Rejection, RunState, live_stats
from core.batching import DEVICE_SHARE_BESIDE_DECODING, PACE_BESIDE_PREFILL
from core.events import PROVENANCE_LABELS

# Where an answer token came from (core.events.Provenance): its label (core's one vocabulary) and its colour, that of
# its overlay in the answer and of its cell in the timeline.
COLOURS = {"draft": "#22c55e", "copy": "#14b8a6", "level2": "#f59e0b", "level3": "#ef4444", "target": "#94a3b8"}
PROVENANCE = {key: (label, COLOURS[key]) for key, label in PROVENANCE_LABELS.items()}
REJECTED: dict[Rejection, tuple[str, str]] = {
    (1, 2): ("level-1 draft, rejected by level 2", "#6b7280"),
    (2, 3): ("level-2 draft, rejected by level 3", "#dc2626"),
    (1, 3): ("level-1 draft, rejected by level 3", "#b91c1c"),
}
SPANS = {"sink": ("attention sink", "#a78bfa"), "hot": ("kept by ≥ half of layer×heads", "#f97316"),
         "warm": ("kept by some heads", "#fde68a")}
COMPARE_METHODS = ("ar", "triforce", "auto")  # Compare runs each, in this order, on the same input and seed
# The checkboxes that switch an answer's overlays on, by the answer's element id; pure CSS (:has), so a switch is
# instant, needs no request, and holds while a run streams new frames.
OVERLAYS = {"answer": ("colour-answer", "show-rejected"),
            **{f"compare-{method}": ("colour-compare", "compare-show-rejected") for method in COMPARE_METHODS}}
OVERLAY_ALPHA = "55"  # the provenance colours behind the text, translucent
DOC_VIEW_CHUNKS = 40
TIMELINE_ITEMS = 120  # the timeline shows at most this many of the latest rounds (and groups of autoregressive steps)
TIMELINE_LEGEND = ("<i class='ok'></i> kept <i class='no'></i> rejected <i class='skip'></i> discarded "
                   f"<i class='l2'></i> {PROVENANCE['level2'][0]} <i class='l3'></i> {PROVENANCE['level3'][0]} "
                   "<b class='tl-plan'>▸</b> auto's plan")  # one line on a laptop's screen
STOPPED = "⏹️ Stopped"  # the status a Stop leaves, in both tabs
AGAIN = "Change anything you like and run again."
NEWLINE = "⏎"  # a rejected draft's line break, shown as a mark: struck-through blank lines read as gaps in the answer


def plural(n: int, noun: str) -> str:
    """`n` and the noun, plural unless n is 1 ("1 round", "3 rounds")."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, …, 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _rejection_class(rejection: Rejection) -> str:
    return f"r{rejection[0]}{rejection[1]}"


def overlay_css() -> str:
    """The answer's CSS: plain text by default; the provenance colours and the rejected drafts shown while their
    checkbox is ticked."""
    colours = " ".join(f".p-{key} {{--c: {colour}{OVERLAY_ALPHA}}}" for key, (_, colour) in PROVENANCE.items())
    rejected = " ".join(f".{_rejection_class(r)} {{color: {colour}}}" for r, (_, colour) in REJECTED.items())
    rules = [".answer-text {white-space: pre-wrap; line-height: 1.7; min-height: 5rem; padding: 6px 2px}",
             ".answer-text .legend {display: none; flex-wrap: wrap; gap: 2px 10px; font-size: 0.8rem; "
             "margin-bottom: 6px; white-space: normal}",
             ".answer-text del {display: none; text-decoration-thickness: 2px}",
             ".answer-text .hint {color: var(--body-text-color-subdued)}", colours, rejected]
    for answer, (colour_box, rejected_box) in OVERLAYS.items():
        on = f"body:has(#{colour_box} input:checked) #{answer}"
        rules += [f"{on} .legend {{display: flex}}", f"{on} [class^='p-'] {{background: var(--c); border-radius: 3px}}",
                  f"body:has(#{rejected_box} input:checked) #{answer} del {{display: inline}}"]
    spans = " ".join(f".doc-view .s-{key} {{background: {colour}66}}" for key, (_, colour) in SPANS.items())
    return "\n".join(rules + [".doc-view {line-height: 1.6} .doc-view .gap {color: var(--body-text-color-subdued)}",
                              ".doc-view .legend {font-size: 0.8rem; margin-bottom: 4px}", spans])


def _runs(pieces: list[tuple[str, str]]) -> list[str]:
    """Spans of consecutive answer pieces of one provenance (a span per token would make long answers heavy)."""
    out: list[str] = []
    start = 0
    for i in range(1, len(pieces) + 1):
        if i == len(pieces) or pieces[i][1] != pieces[start][1]:
            text = "".join(text for text, _ in pieces[start:i])
            out.append(f"<span class='p-{pieces[start][1]}'>{html.escape(text)}</span>")
            start = i
    return out


def answer_html(state: RunState | None, placeholder: str = "The answer appears here.") -> str:
    """The answer so far as text; each stretch carries its provenance and each rejected draft sits (struck through)
    where it was tried, both hidden until their checkbox shows them (overlay_css)."""
    if state is None or not state.pieces:
        return f"<div class='answer-text'><span class='hint'>{html.escape(placeholder)}</span></div>"
    provenances = dict.fromkeys(prov for _, prov in state.pieces)
    legend = [f"<span class='p-{key}'>{PROVENANCE[key][0]}</span>" for key in PROVENANCE if key in provenances]
    legend += [f"<del class='{_rejection_class(r)}'>{label}</del>" for r, (label, _) in REJECTED.items()
               if any(rejection == r for _, rejection, _ in state.rejected)]
    parts: list[str] = []
    done = 0
    for at, rejection, text in state.rejected:  # in answer order
        parts += _runs(state.pieces[done:at])
        done = at
        shown = html.escape(text.replace("\n", NEWLINE))
        parts.append(f"<del class='{_rejection_class(rejection)}'>{shown}</del>")
    parts += _runs(state.pieces[done:])
    return f"<div class='answer-text'><div class='legend'>{''.join(legend)}</div>{''.join(parts)}</div>"


def _cells(proposed: int, accepted: int) -> str:
    """Cells of one verification: the tokens kept, the one rejected and those discarded after it."""
    rejected = proposed - accepted
    return "<i class='ok'></i>" * accepted + "<i class='no'></i>" * min(rejected, 1) + \
        "<i class='skip'></i>" * max(rejected - 1, 0)


def _round_block(trace) -> str:
    """One level-3 round: level 3's verdict on the drafted tokens on top, each level-2 step's verdict below."""
    ending = "bonus" if trace.bonus else "correction"
    drafted = f"level-{trace.drafter} tokens"
    tip = f"round {trace.round}: level 3 kept {trace.accepted} of {trace.proposed} {drafted}, then its {ending}"
    if trace.steps:
        tip += "; level 2 kept " + ", ".join(f"{kept}/{tried}" for tried, kept in trace.steps) + " level-1 tokens"
    top = _cells(trace.proposed, trace.accepted) + "<i class='l3'></i>"
    bottom = "<s></s>".join(_cells(tried, kept) + "<i class='l2'></i>" for tried, kept in trace.steps)
    return (f"<span class='tl-round' title='{html.escape(tip, quote=True)}'><span>{top}</span>"
            f"<span>{bottom}</span></span>")


def timeline_html(state: RunState, limit: int = TIMELINE_ITEMS) -> str:
    """A strip of the level-3 rounds (hover one for its counts), stretches of autoregressive steps grouped, and a
    marker where method auto's planner changed the hierarchy (hover it for why)."""
    if not state.rounds:
        note = ("Autoregressive decoding drafts nothing." if state.method == "ar"
                else "The speculation timeline appears with the first level-3 round.")
        return f"<div class='tl'><div class='tl-head'>{note}</div></div>"
    plans = {plan.round: plan for plan in state.plans}
    items: list[str] = []
    plain = 0  # autoregressive steps in a row (nothing drafted)

    def flush() -> None:
        nonlocal plain
        if plain:
            items.append(f"<span class='tl-ar' title='{plural(plain, 'autoregressive step')}'>{plain} AR</span>")
            plain = 0

    for trace in state.rounds:
        if trace.round in plans:
            flush()
            plan = plans[trace.round]
            items.append(f"<b class='tl-plan' title='{html.escape(plan_words(plan.reason, state), quote=True)}'>▸ "
                         f"{html.escape(plan_words(plan.plan, state))}</b>")
        if trace.proposed or trace.steps:
            flush()
            items.append(_round_block(trace))
        else:  # nothing drafted: an autoregressive step
            plain += 1
    flush()
    verified = sum(1 for trace in state.rounds if trace.proposed)
    shown = f"{plural(verified, 'round')} with drafts" + (f", the last {limit} items shown" if len(items) > limit
                                                           else "")
    return (f"<div class='tl'><div class='tl-head'>Top: level 3 on the drafted tokens · below: level 2 on the "
            f"level-1 tokens, step by step · {shown}</div><div class='tl-head tl-legend'>{TIMELINE_LEGEND}</div>"
            f"<div class='tl-rounds'>{''.join(items[-limit:])}</div></div>")


def selected_chunks(totals: np.ndarray, limit: int = DOC_VIEW_CHUNKS) -> list[int]:
    """Chunk 0 (if kept) plus the `limit` most-kept chunks, in document order."""
    kept = np.flatnonzero(totals > 0)
    if len(kept) == 0:
        return []
    order = kept[np.argsort(-totals[kept], kind="stable")][:limit]
    chosen = set(order.tolist()) | ({0} if totals[0] > 0 else set())
    return sorted(chosen)


def document_html(state: RunState, limit: int = DOC_VIEW_CHUNKS) -> str:
    """A compact view of the document: the most-kept chunks of the latest selection highlighted, the stretches
    between them summarised."""
    if state.layer_counts is None or not state.chunk_texts:
        return "<div class='doc-view'><span class='gap'>The kept spans appear after the first selection.</span></div>"
    totals = state.totals
    half = max(state.max_count // 2, 1)
    legend = " ".join(f"<mark class='s-{key}'>{label}</mark>" for key, (label, _) in SPANS.items())
    out: list[str] = []
    previous = -1
    for idx in selected_chunks(totals, limit):
        if idx > previous + 1:
            out.append(f"<span class='gap'> … {(idx - previous - 1) * state.chunk_size:,} tokens … </span>")
        key = "sink" if idx == 0 else "hot" if totals[idx] >= half else "warm"
        out.append(f"<mark class='s-{key}'>{html.escape(state.chunk_texts[idx])}</mark>")
        previous = idx
    if previous < len(state.chunk_texts) - 1:
        out.append(f"<span class='gap'> … {(len(state.chunk_texts) - previous - 1) * state.chunk_size:,} tokens …"
                   "</span>")
    return f"<div class='doc-view'><div class='legend'>{legend}</div>{''.join(out)}</div>"


NOT_APPLICABLE = "—"


def _fmt(value: float | None, pattern: str) -> str:
    """Format a number, or a dash where it does not apply or is not known yet."""
    return NOT_APPLICABLE if value is None else pattern.format(value)


def stats_markdown(stats: dict) -> str:
    """A two-column Markdown table of the headline figures."""
    mib = 1 / 2**20
    speed = stats.get("tokens_per_s")
    budget = stats.get("budget_pct_of_prompt")
    rows = [
        ("tokens generated", str(stats.get("new_tokens", 0))),
        ("decode: tokens / s", _fmt(speed, "{:.2f}")),
        ("decode: ms / token", _fmt(1000 / speed if speed else None, "{:.1f}")),
        ("prefill" + (" (cache of the previous run reused)" if stats.get("prefill_reused") else ""),
         _fmt(stats.get("prefill_s"), "{:.2f} s")),
        ("time to first token (prefill + first round)", _fmt(stats.get("time_to_first_token_s"), "{:.2f} s")),
        ("level-1 acceptance", _fmt(stats.get("level1_acceptance"), "{:.0%}")),
        ("level-2 acceptance (by level 3)", _fmt(stats.get("level2_acceptance"), "{:.0%}")),
        *([] if stats.get("method") == "ar" else  # one a forward by definition: no figure of the method's
          [("tokens per target forward", _fmt(stats.get("tokens_per_target_forward"), "{:.2f}"))]),
        ("budget / prompt", "100 % (whole prompt)" if budget == 100 else _fmt(budget, "{:.1f} %")),
        ("full KV cache" + (" (in CPU memory, streamed to the GPU)" if stats.get("offloaded") else ""),
         _fmt(stats["cache_bytes"] * mib if stats.get("cache_bytes") else None, "{:.1f} MiB")),
        ("retrieval cache", _fmt(stats["retrieval_cache_bytes"] * mib if stats.get("retrieval_cache_bytes") else None,
                                 "{:.1f} MiB")),
    ]
    if stats.get("host_link_bytes_per_token"):
        rows.append(("CPU → GPU per token (host link)", f"{stats['host_link_bytes_per_token'] / 2**30:.2f} GiB"))
    if stats.get("drafts_ahead"):
        kept, made = stats["drafts_ahead"]
        rows.append(("level-2 drafts made ahead, during level 3 (used)", f"{made} ({kept} used)"))
    if stats.get("warmup_s"):
        rows.append(("warm-up (CUDA graphs captured, not in decode time)", f"{stats['warmup_s']:.2f} s"))
    if stats.get("shared_with") is not None:
        beside = stats["shared_with"]
        prefills = prefill_words(stats.get("prefills_beside") or 0, stats.get("prefill_beside_s") or 0.0,
                                 stats.get("device") or "")
        words = [f"{beside} (batched)" if beside else "none" if prefills else "none: it ran alone", prefills]
        rows.append(("decoded beside other runs (most at once)", "; ".join(word for word in words if word)))
    if stats.get("device"):
        rows.append(("device · dtype", f"{stats['device']} · {stats.get('dtype', '')}"))
    if stats.get("dropped_tokens"):
        rows.append(("tokens dropped (truncated)", f"{stats['dropped_tokens']:,}"))
    column = "final" if stats.get("finished") else "stopped" if stats.get("stopped") else "live"
    header = f"| | {column} |\n|---|---|\n"
    return header + "\n".join(f"| {name} | {value} |" for name, value in rows)


def placement_markdown(caches: dict) -> str:
    """Where each cache lives (GPU / CPU memory) and its size, on one line."""
    parts = [f"{name} {info['bytes'] / 2**30:.2f} GiB on the {info['where']}" for name, info in caches.items()]
    return "🔀 The full KV cache does not fit the GPU's memory budget: it lives in CPU memory and is streamed to the " \
           "GPU layer by layer at each level-3 (full-cache) step · " + " · ".join(parts)


METHOD_NAMES = {"ar": "Autoregressive", "triforce": "TriForce (levels 1 → 2 → 3)",
                "auto": "Method auto (the planner picks the levels)"}
SHORT_NAMES = {"ar": "autoregressive", "triforce": "TriForce", "auto": "auto"}


def plan_kind(plan: str) -> str:
    """A plan's hierarchy without its drafter and γs: "levels 1 → 2 → 3 (draft model, γ1 2, γ2 6)" → "levels 1 → 2 →
    3"."""
    return plan.split(" (")[0]


def autoregressive_tokens(state: RunState) -> int:
    """Answer tokens from steps that drafted nothing (the target alone on its full cache)."""
    return sum(1 for _, provenance in state.pieces if provenance == "target")


def triforce_levels(state: RunState) -> str:
    """The levels a TriForce run drafts through: 1 → 2 → 3, or 2 → 3 where no level 1 ran (drafter none)."""
    alone = state.final_stats is not None and state.final_stats.drafter == "none"
    return "levels 2 → 3" if alone else "levels 1 → 2 → 3"


def method_name(state: RunState) -> str:
    """A run's method as a heading names it (METHOD_NAMES), TriForce's levels those it drafts through."""
    return f"TriForce ({triforce_levels(state)})" if state.method == "triforce" else METHOD_NAMES[state.method]


def what_ran(state: RunState) -> str:
    """What a run's decoding actually did, in a few words: a method auto run names the hierarchies its planner chose,
    in order, and says how many of its tokens were decoded autoregressively."""
    if state.method != "auto":
        return "autoregressive" if state.method == "ar" else triforce_levels(state)
    kinds: list[str] = []
    for plan in state.plans:
        if not kinds or kinds[-1] != plan_kind(plan.plan):
            kinds.append(plan_kind(plan.plan))
    n, plain = len(state.pieces), autoregressive_tokens(state)
    if n and plain == n:
        return "autoregressive throughout"
    ran = ", then ".join(kinds if len(kinds) <= 3 else ["…", *kinds[-3:]]) or "nothing yet"
    return ran + (f" ({plain} of {plural(n, 'token')} autoregressive)" if plain else "")


def run_heading(state: RunState) -> str:
    """A Compare column's heading: the method and, for method auto, what it ran."""
    heading = f"**{method_name(state)}**"
    return heading + (f" · ran {what_ran(state)}" if state.method == "auto" and state.plans else "")


def run_label(state: RunState) -> str:
    """A run's short name on a chart, saying what ran where the method alone does not (an auto run that decoded
    autoregressively)."""
    name = SHORT_NAMES[state.method]
    if state.method != "auto" or not state.pieces:
        return name
    n, plain = len(state.pieces), autoregressive_tokens(state)
    return f"{name}: " + ("autoregressive" if plain == n else "drafting" if not plain else f"{plain}/{n} tokens AR")


def device_word(device: str) -> str:
    """A torch device's name as a visitor reads it: "GPU" or "CPU"."""
    return "GPU" if device.startswith("cuda") else "CPU"


def prefill_words(prefills: int, seconds: float, device: str) -> str | None:
    """What other runs' prefills took of a run's device between its rounds ("the CPU also read 1 other run's
    prompt, 6.1 s of its decoding"); None where none did."""
    if not prefills:
        return None
    whose = "1 other run's prompt" if prefills == 1 else f"{prefills:,} other runs' prompts"
    return f"the {device_word(device)} also read {whose}, {seconds:.1f} s of its decoding"


def sharing_line(state: RunState) -> str | None:
    """Whether a finished run had the device to itself: "ran alone", or beside how many other requests and other
    runs' prefills (its speed, and a ratio against it, then not a clean single-request figure); None before it
    finished."""
    s = state.final_stats
    if s is None:
        return None
    prefills = prefill_words(s.prefills_beside, s.prefill_beside_s, s.device)
    if not s.shared_with and not prefills:
        return f"{method_name(state)} ran alone"
    beside = [f"ran beside {plural(s.shared_with, 'other request')}" if s.shared_with else "", prefills or ""]
    return f"{method_name(state)} {' and '.join(part for part in beside if part)} — its ratio is not a clean " \
           "single-request figure"


BATCH_WORDS = ((" (batched)", ""), (", batched)", ")"), (" for the batch", ""))  # core's plan words for a batch


def shared(state: RunState) -> bool:
    """Whether the run is known to have decoded beside other requests (its final stats say so)."""
    return bool(state.final_stats and state.final_stats.shared_with)


def plan_words(text: str, state: RunState) -> str:
    """A plan's name or reason as the run's visitor reads it: the batch's words (core.decode.batch names every plan
    of the app's batch so) left out unless the run is known to have shared the batch with other requests."""
    if shared(state):
        return text
    for words, instead in BATCH_WORDS:
        text = text.replace(words, instead)
    return text


def plan_line(state: RunState) -> str | None:
    """One line on what method auto's planner chose and why (None when no planner ran)."""
    if not state.plans:
        return None
    now = state.plans[-1]
    line = (f"🧭 **Method auto** chose **{plan_words(now.plan, state)}** from round {now.round}: "
            f"{plan_words(now.reason, state)}")
    earlier = [plan_words(plan.plan, state) for plan in state.plans[:-1]]
    return line + (f" (before: {' → '.join(earlier)})" if earlier else "")


def truncation_line(state: RunState) -> str | None:
    """The notice of a document that lost its middle to fit the context."""
    if not state.dropped_tokens:
        return None
    return (f"⚠️ The document did not fit the context ({state.context_length:,} tokens): its middle "
            f"{state.dropped_tokens:,} tokens were dropped (beginning and end kept).")


def stopped_at(state: RunState) -> str:
    """Where a run was when it stopped: "after 7 tokens", or the stage before any ("before the first token")."""
    return f"after {plural(len(state.pieces), 'token')}" if state.pieces else "before the first token"


def status_markdown(state: RunState) -> str:
    """One line on what the run is doing, then the planner's choice and a truncation notice where they apply."""
    if state.finished:
        reason = state.final_stats.stop_reason or "done"
        line = f"✅ Finished ({reason}): {plural(len(state.token_ids), 'token')}."
    elif state.stopped_at is not None:
        line = f"{STOPPED} {stopped_at(state)}. {AGAIN}"
    elif state.stage == "waiting":
        line = (f"⏳ Waiting: {ordinal(state.place)} in line for the batch (up to {plural(state.seats, 'run')} "
                "decode at once, their prompts read one at a time)")
    elif state.stage == "prefill":
        share = f"{state.prefill_done / state.prefill_total:.0%} of " if state.prefill_total else ""
        line = f"⏳ Prefill: {share}the {state.prompt_tokens:,}-token prompt ({state.prefill_s:.1f} s)"
        if state.decoding_beside:  # why it is slow: read between the steps of runs already decoding
            one = state.decoding_beside == 1
            line += (f" · slower while {plural(state.decoding_beside, 'other run')} decode{'s' if one else ''}: the "
                     f"prompt is read between {'its' if one else 'their'} steps, in about "
                     f"{DEVICE_SHARE_BESIDE_DECODING:.0%} of the time")
    elif state.stage.startswith("loading"):
        line = f"⏳ {state.stage.capitalize()} ({state.load_fraction:.0%})"
    elif state.stage == "decoding":  # before its first token the prefill's last words would read as a stall
        line = f"▶️ Decoding: {plural(len(state.pieces), 'token')}" if state.pieces else "▶️ Decoding: the first token"
        if state.prefill_beside is not None:  # why it slowed: another visitor's prompt read between its rounds
            line += (f" · slower while the {device_word(state.prefill_beside.device)} also reads another run's "
                     f"{state.prefill_beside.prompt_tokens:,}-token prompt (about {PACE_BESIDE_PREFILL:.0%} of "
                     "its pace meanwhile)")
    else:
        line = "⏳ Starting…"
    notes = [placement_markdown(state.caches) if state.offloaded else None, plan_line(state), truncation_line(state)]
    return "\n\n".join([line, *(note for note in notes if note)])


def stats_for(state: RunState) -> tuple[str, dict]:
    """Stats as Markdown and as a plain dict."""
    stats = live_stats(state)
    return stats_markdown(stats), stats
