"""Event handlers wired by the layout: documents in, throttled generation streams out, errors as gr.Error."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import gradio as gr

from core import GenerationConfig, TriForceError, compare
from core.prompting import document_fit

from app.documents import DocumentError, load_samples, read_document
from app.figures import HEATMAP_MODES, compare_bars, cost_figure, empty_figure, selection_heatmap
from app.explainer import engine_table
from app.inference import ModelLoadError, counting_engine, load_engine, loaded_infos, preset_engine, stream_events
from app.presets import PRESET_SETTINGS, Preset, panel_overrides, preset_by_name
from app.settings import build_config, parse, widget_args
from app.state import RunState, apply_event, live_stats
from app.views import answer_pieces, document_view, stats_for, stats_markdown, status_markdown, timeline_html

PLOT_INTERVAL_S = 0.25  # heatmap and document view: at most 4 updates per second
TEXT_INTERVAL_S = 0.1  # answer, stats and status: at most 10 updates per second
GENERIC_INSTRUCTIONS = ("Summarise the document in a few sentences.", "Continue the text.")


class Throttle:
    """Lets an update through at most once per `interval` seconds, unless forced."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last = -math.inf

    def due(self, now: float, force: bool = False) -> bool:
        """Whether to update now; records the update when it says yes."""
        if force or now - self.last >= self.interval:
            self.last = now
            return True
        return False


def choose_sample(title: str | None) -> tuple[str, gr.Dataset, str]:
    """Load a bundled sample: its text, its example instructions, and the first of them."""
    sample = next((s for s in load_samples() if s.title == title), None)
    if sample is None:
        raise gr.Error(f"Unknown sample {title!r}.")
    instructions = list(sample.instructions) or list(GENERIC_INSTRUCTIONS)
    return sample.read(), gr.Dataset(samples=[[i] for i in instructions]), instructions[0]


def upload_document(path: str | None) -> str:
    """Text of an uploaded file; unusable files raise a visible gr.Error."""
    if not path:
        return gr.skip()
    try:
        return read_document(path)
    except DocumentError as err:
        raise gr.Error(str(err), title="Cannot use this file") from None


def pick_instruction(sample: list[str] | str) -> str:
    """The clicked example instruction."""
    return sample[0] if isinstance(sample, list) else sample


def preset_settings(preset_name: str) -> list[dict]:
    """The widgets of PRESET_SETTINGS for the chosen preset: its choices, marked as such, the others' defaults."""
    values, notes = panel_overrides(preset_by_name(preset_name))
    updates = []
    for name in PRESET_SETTINGS:
        _, args = widget_args(name, values.get(name, dataclasses.MISSING), notes.get(name, ""))
        updates.append(gr.update(value=args["value"], info=args["info"]))
    return updates


def text_input(label: str, value: Any) -> str:
    """A text input as it came (None: empty); a value of another type (an API call's number, list or dict) raises
    TriForceError."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TriForceError(f"The {label} must be text, got {type(value).__name__} {str(value)[:40]!r}.")
    return value


def describe_document(document: Any, preset_name: Any, budget: Any, instruction: Any = "",
                      max_new_tokens: Any = None) -> str:
    """Token count of the document against the room a run leaves it (the context less the template, the question
    and the answer), what a run drops, and the retrieval budget. Its inputs come unprocessed, of any type: a bad one
    is named in the line."""
    try:
        document, instruction = text_input("document", document), text_input("instruction", instruction)
        answer = GenerationConfig.max_new_tokens if max_new_tokens in (None, "") else \
            parse("max_new_tokens", max_new_tokens)
    except TriForceError as err:
        return f"⚠️ {err}"
    if not document.strip():
        return "No document yet: pick a sample, upload a file or paste text."
    if not 1 <= answer <= 1 << 20:  # a value typed half-way: count with the default answer length
        answer = GenerationConfig.max_new_tokens
    try:
        engine, exact = counting_engine(preset_by_name(preset_name))
        budget = parse("budget", budget)
        fit = document_fit(engine.tokenizer, document, instruction, engine.context_length, answer)
    except (ModelLoadError, ValueError) as err:  # TriForceError is a ValueError
        return f"⚠️ {err}"
    approx = "" if exact else " (approximate: counted with the embedded tokenizer until this preset is loaded)"
    fate = (f"**longer than the context: a run drops the middle {fit.dropped:,} tokens** (or refuses, as set)"
            if fit.overflows else "fits the context")
    line = (f"**Document:** {'' if fit.exact else 'about '}{fit.document_tokens:,} tokens{approx} · model context "
            f"{engine.context_length:,}, {fit.room:,} left for the document beside the template, the question and "
            f"{answer:,} answer tokens → {fate}")
    if budget:
        kept = min(fit.document_tokens, fit.room)
        share = "the whole document" if budget >= kept else f"{100 * budget / kept:.1f} % of the document"
        line += f" · budget {int(budget):,} tokens = {share}"
    return line


def _settings(method: str, values: Mapping[str, Any]) -> GenerationConfig:
    """A validated config or a visible gr.Error explaining the bad setting."""
    try:
        return build_config(method, values)
    except TriForceError as err:
        raise gr.Error(str(err), title="Invalid settings") from None


def _prepare(values: Mapping[str, Any]) -> tuple[Preset, str, str]:
    """Check the document and the instruction (text) and load the preset's models; return the preset, the document
    and the instruction. Problems raise gr.Error."""
    try:
        document, instruction = text_input("document", values["document"]), \
            text_input("instruction", values["instruction"])
    except TriForceError as err:
        raise gr.Error(str(err), title="Invalid input") from None
    if not document.strip():
        raise gr.Error("The document is empty: pick a sample, upload a file or paste text.", title="No document")
    try:
        preset = preset_by_name(values["preset_name"])
        preset_engine(preset)
    except (ModelLoadError, ValueError) as err:
        raise gr.Error(str(err), title="Model not available") from None
    return preset, document, instruction


def _show_rejected(values: Mapping[str, Any]) -> bool:
    """The show-rejected checkbox's value (absent: shown); anything but true or false raises gr.Error."""
    show = values.get("show_rejected", True)
    if not isinstance(show, bool) and show is not None:
        raise gr.Error(f"show_rejected must be true or false, got {show!r:.40}.", title="Invalid input")
    return show is not False


def _stream(preset: Preset, document: str, instruction: str, config: GenerationConfig, state: RunState,
            progress: gr.Progress) -> Iterator[str]:
    """Fold the engine's events into `state`; yield each event's kind. Engine errors become gr.Error."""
    try:
        for event in stream_events(preset, document, instruction or "", config):
            apply_event(state, event)
            kind = event["kind"]
            if kind == "Loading":
                progress(event["fraction"], desc=f"Loading {event['stage']}")
            elif kind == "PrefillProgress":
                progress(event["done"] / max(event["total"], 1), desc="Prefill", total=event["total"], unit="tokens")
            elif kind == "PromptReady" and event["dropped_tokens"]:
                gr.Warning(f"The document is longer than the context ({event['context_length']:,} tokens): "
                           f"its middle {event['dropped_tokens']:,} tokens were dropped (beginning and end kept).")
            yield kind
    except (TriForceError, ModelLoadError) as err:
        raise gr.Error(str(err), title="Cannot generate") from None
    except (RuntimeError, OSError, MemoryError) as err:  # engine failures must not take the app down
        raise gr.Error(f"Generation failed: {type(err).__name__}: {err}", title="Generation failed") from None


def run_triforce(values: Mapping[str, Any], progress: gr.Progress) -> Iterator[dict[str, Any]]:
    """Stream one TriForce generation from the panel's values by name: frames of status, coloured answer (with the
    rejected drafts unless hidden), heatmap, document view, timeline, stats, per-level costs and run state."""
    config = _settings("triforce", values)
    progress(0, desc="Loading model")
    mode, show = values.get("heatmap_mode") or HEATMAP_MODES[0], _show_rejected(values)
    if mode not in HEATMAP_MODES:
        raise gr.Error(f"heatmap_mode must be one of {', '.join(HEATMAP_MODES)}, got {mode!r:.40}.",
                       title="Invalid input")
    chosen, document, instruction = _prepare(values)
    state = RunState(method="triforce")
    text_gate, plot_gate = Throttle(TEXT_INTERVAL_S), Throttle(PLOT_INTERVAL_S)
    yield {"status": "⏳ Starting…", "answer": [],
           "heatmap": empty_figure("The retrieval heatmap appears after prefill."), "doc_view": [],
           "timeline": timeline_html(state), "stats": "", "stats_json": {}, "costs": cost_figure([], None),
           "run_state": state}
    for kind in _stream(chosen, document, instruction, config, state, progress):
        now = time.monotonic()
        force = kind in ("PromptReady", "Finished") or (kind == "RetrievalSelection"
                                                         and len(state.selection_rounds) == 1)
        if text_gate.due(now, force):
            yield _triforce_frame(state, mode, show, plot_gate.due(now, force))
    if not state.finished:  # the stream ended without Finished: show the last state in full
        yield _triforce_frame(state, mode, show, True)


def _triforce_frame(state: RunState, mode: str, show_rejected: bool, with_plots: bool) -> dict[str, Any]:
    """The TriForce tab's outputs for the current state; heatmap, document view and timeline only `with_plots`,
    the per-level costs once the run has finished."""
    stats_md, stats = stats_for(state)
    frame = {"status": status_markdown(state), "answer": answer_pieces(state, show_rejected), "stats": stats_md,
             "stats_json": stats, "run_state": state}
    if with_plots:
        frame |= {"heatmap": selection_heatmap(state, mode), "doc_view": document_view(state),
                  "timeline": timeline_html(state)}
    if state.finished:
        frame["costs"] = cost_figure(stats["levels"], stats["tokens_per_target_forward"])
    return frame


def redraw_heatmap(state: RunState | None, mode: str) -> object:
    """The heatmap of the last run in the chosen mode."""
    if not isinstance(state, RunState):
        return empty_figure("Run TriForce to see which chunks the retrieval cache keeps.")
    return selection_heatmap(state, mode)


def redraw_answer(state: RunState | None, show_rejected: bool) -> list[tuple[str, str | None]]:
    """The last run's answer with or without its rejected drafts."""
    return answer_pieces(state, show_rejected) if isinstance(state, RunState) else []


def stopped() -> str:
    """Status after the Stop button."""
    return "⏹️ Stopped. Change anything you like and run again."


def comparison_summary(ar: RunState, tf: RunState, greedy: bool) -> tuple[str, dict]:
    """Speedup and (with greedy decoding) the token-identity check, as Markdown and as a dict."""
    ar_stats, tf_stats = live_stats(ar), live_stats(tf)
    speedup = (tf_stats["tokens_per_s"] / ar_stats["tokens_per_s"]
               if ar_stats.get("tokens_per_s") and tf_stats.get("tokens_per_s") else None)
    identical, first_difference = None, None
    lines = [f"### Speedup (decode tokens/s): {speedup:.2f}×" if speedup else "### Speedup: –"]
    if greedy and ar.finished and tf.finished:
        identical = ar.token_ids == tf.token_ids
        first_difference = compare.first_difference(ar.token_ids, tf.token_ids)
        note = compare.difference_note(ar.token_ids, tf.token_ids, (ar.final_stats or {}).get("near_ties") or [])
        lines.append(f"✅ **Token-identical**: both produced the same {len(tf.token_ids)} tokens (greedy)." if identical
                     else f"❌ **Not token-identical**: {note}.")
    elif not greedy:
        lines.append("Sampling is on: outputs may differ token by token (both follow the target's distribution). "
                     "Tick *greedy* for a token-identity check.")
    if tf_stats.get("prefill_reused"):
        lines.append("Prefill and time to first token are apart from decode speed: TriForce reused the cache the "
                     "autoregressive run prefilled for the same prompt.")
    device = " · ".join(v for v in (tf_stats.get("device") or ar_stats.get("device"),
                                    tf_stats.get("dtype") or ar_stats.get("dtype")) if v)
    if device:
        lines.append(f"Ran on **{device}**.")
    summary = {"ar": ar_stats, "triforce": tf_stats, "speedup": speedup, "greedy": greedy, "identical": identical,
               "first_difference": first_difference, "device": device}
    return "\n\n".join(lines), summary


def run_compare(values: Mapping[str, Any], progress: gr.Progress) -> Iterator[dict[str, Any]]:
    """Autoregressive then TriForce on the same input and seed, streamed side by side, by output name."""
    configs = {"ar": _settings("ar", values), "triforce": _settings("triforce", values)}
    progress(0, desc="Loading model")
    show = _show_rejected(values)
    chosen, document, instruction = _prepare(values)
    runs = {"ar": RunState(method="ar"), "triforce": RunState(method="triforce")}
    gate = Throttle(TEXT_INTERVAL_S)
    is_greedy = configs["ar"].is_greedy

    def frame(note: str, with_plot: bool = True, with_costs: bool = False) -> dict[str, Any]:
        """All Compare outputs for the current progress; charts, timeline and verdict only when `with_plot`, the
        per-level costs (known once both runs finished) only `with_costs`."""
        ar_stats, tf_stats = live_stats(runs["ar"]), live_stats(runs["triforce"])
        out = {"compare_status": note, "ar_answer": answer_pieces(runs["ar"]),
               "tf_answer": answer_pieces(runs["triforce"], show), "ar_stats": stats_markdown(ar_stats),
               "tf_stats": stats_markdown(tf_stats), "compare_state": runs["triforce"]}
        if with_plot:
            verdict, summary = comparison_summary(runs["ar"], runs["triforce"], is_greedy)
            out |= {"bars": compare_bars(ar_stats, tf_stats), "tf_timeline": timeline_html(runs["triforce"]),
                    "verdict": verdict, "compare_json": summary}
        if with_costs:
            out["compare_costs"] = cost_figure(tf_stats["levels"], tf_stats["tokens_per_target_forward"],
                                               ar_stats["levels"])
        return out

    yield frame("⏳ Starting…", with_costs=True)
    plot_gate = Throttle(PLOT_INTERVAL_S)
    for method, label in (("ar", "Autoregressive"), ("triforce", "TriForce")):
        for kind in _stream(chosen, document, instruction, configs[method], runs[method], progress):
            now = time.monotonic()
            if gate.due(now, kind == "Finished"):
                yield frame(f"{label}: {status_markdown(runs[method])}", plot_gate.due(now, kind == "Finished"))
    yield frame("✅ Both runs finished.", with_costs=True)


def describe_engines() -> str:
    """Models, device, dtype and versions of the loaded engines (loads the embedded one if none is)."""
    if not loaded_infos():
        try:
            load_engine(None, None)
        except ModelLoadError as err:
            return f"⚠️ {err}"
    return engine_table(loaded_infos())
