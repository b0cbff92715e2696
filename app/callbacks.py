"""Event handlers wired by the layout: documents in, throttled generation streams out, errors as gr.Error."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gradio as gr

from app.documents import DocumentError, load_samples, read_document
from app.explainer import CPU_NOTE, engine_table
from app.figures import (COSTS_STOPPED, HEATMAP_MODES, compare_bars, cost_figure, empty_figure,
                         selection_heatmap)
from app.inference import (BATCHED, ModelLoadError, OutOfTime, counting_engine, load_engine, loaded_infos,
                           preset_engine, stream_events)
from app.presets import PRESET_SETTINGS, Preset, panel_overrides, preset_by_name
from app.refusals import cut, inert, quote, quoted_in, refuse
from app.service import WAITING_JOBS, Deadline, Ticket, keep_upload, out_of_time_line, run_seconds
from app.settings import build_config, parse, widget_args
from app.state import InLine, RunState, apply_event, budget_share, live_stats, raw_data
from app.views import (AGAIN, COMPARE_METHODS, SHORT_NAMES, STOPPED, answer_html, document_html, method_name,
                       plan_line, run_heading, run_label, sharing_line, stats_for, stats_markdown,
                       status_markdown, stopped_at, timeline_html, what_ran)
from core import GenerationConfig, TriForceError
from core.decode import difference_note, first_difference
from core.config import MAX_SLOTS
from core.events import Event, Finished, PromptReady, RetrievalSelection, Tokens
from core.io import document_fit, gpu_only_note

PLOT_INTERVAL_S = 0.25  # heatmap and document view: at most 4 updates per second
TEXT_INTERVAL_S = 0.1  # answer, stats and status: at most 10 updates per second
GENERIC_INSTRUCTIONS = ("Summarise the document in a few sentences.", "Continue the text.")
TRIFORCE_TAB_METHOD = "triforce"  # the TriForce tab shows the three levels unless the visitor picks method auto
RAW_DIR = Path(tempfile.gettempdir()) / "triforce-studio"  # the Raw stats downloads (Gradio serves a copy)
# Raw-stats files of finished runs kept, newest last: twice the runs that can finish together (every seat of the
# largest batch and every waiting place), so a file stays until Gradio has copied it for its link.
RAW_FILES_KEPT = 2 * (MAX_SLOTS + WAITING_JOBS)
_raw_files: collections.deque[Path] = collections.deque()  # this process's raw-stats files, oldest first
_raw_lock = threading.Lock()


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


class Redraw:
    """Whether to draw a run's plots again: at most once per PLOT_INTERVAL_S, and only once what they are drawn from
    has changed (a prompt, a selection, a round, a token, the end). A prefill's progress or a wait draws nothing
    new, and a plot's frame holds the app's one interpreter lock (Gradio's postprocessing of the figure) that the
    batch's decoding shares: a second visitor's long prefill, redrawn four times a second, held it a third of the
    time it was held at all (py-spy)."""

    def __init__(self) -> None:
        self.gate = Throttle(PLOT_INTERVAL_S)
        self.drawn: tuple | None = None

    def due(self, now: float, force: bool, *states: RunState) -> bool:
        """Whether to redraw now; records the redraw when it says yes."""
        drawn_from = tuple((len(s.chunk_texts), len(s.selection_rounds), len(s.rounds), len(s.pieces), s.finished)
                           for s in states)
        if drawn_from == self.drawn or not self.gate.due(now, force):
            return False
        self.drawn = drawn_from
        return True


UPLOADED = "📄 "  # an uploaded file's entry in the sample menu starts so; no sample's title does


def sample_menu(chosen: str) -> gr.Dropdown:
    """The sample menu with `chosen` in it: the bundled samples' titles, and an uploaded file's entry (UPLOADED)."""
    titles = [s.title for s in load_samples()]
    return gr.Dropdown(choices=titles + [chosen] * (chosen not in titles), value=chosen)


def upload_entry(name: str) -> str:
    """An uploaded file's entry in the sample menu: its name, no longer than the longest sample title, which the
    menu shows whole (tests/test_browser.py: FITS), "…" included."""
    titles = [s.title for s in load_samples()]
    return UPLOADED + cut(name, max(map(len, titles)) - len(UPLOADED) - 1 if titles else len(name))


def choose_sample(title: str | None) -> tuple[str, gr.Dataset, str, str, gr.Dropdown]:
    """Load a bundled sample: its text, its example instructions, the first of them, no upload's note, and the menu
    of the samples alone (an upload's entry leaves it); the upload's own entry, chosen again, changes nothing."""
    if title and title.startswith(UPLOADED):
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
    sample = next((s for s in load_samples() if s.title == title), None)
    if sample is None:
        raise refuse(f"Unknown sample {quote(title)}.")
    instructions = list(sample.instructions) or list(GENERIC_INSTRUCTIONS)
    menu = sample_menu(sample.title)
    return sample.read(), gr.Dataset(samples=[[i] for i in instructions]), instructions[0], "", menu


def upload_document(path: str | None, request: gr.Request) -> str:
    """Text of an uploaded file; unusable files raise a visible gr.Error. The file is kept on disk for its session
    (app.service.keep_upload), not beyond."""
    if not path:
        return gr.skip()
    try:
        return read_document(path)
    except DocumentError as err:
        raise refuse(str(err), "Cannot use this file") from None
    finally:
        keep_upload(request.session_hash, path)


EMBEDDED_ON_YOURS = ("The embedded 135M model is often wrong about a document of your own, and plain decoding "
                     "(autoregressive) gives the same answers: TriForce changes the speed, never the answer.")


def upload_note(path: str | None, preset_name: Any) -> str:
    """One line after an upload: the file's name, and where the embedded model answers, that it is often wrong on a
    visitor's own documents (a larger model's preset says nothing of the kind)."""
    name = f"📄 **{inert(cut(Path(path).name, 80))}** read into the document." if path else ""
    try:
        embedded = _preset(preset_name).target is None
    except ValueError:
        embedded = False
    return " ".join(part for part in (name, EMBEDDED_ON_YOURS if embedded else "") if part)


def leave_sample(path: str | None = None, preset_name: Any = None) -> tuple[gr.Dropdown, gr.Dataset, str, str]:
    """After an upload: the file named in the sample menu in a sample's place, the instruction and its examples
    generic ones (a sample's questions are about that sample), and the upload's note (upload_note)."""
    menu = sample_menu(upload_entry(Path(path).name)) if path else gr.skip()
    examples = gr.Dataset(samples=[[i] for i in GENERIC_INSTRUCTIONS])
    return menu, examples, GENERIC_INSTRUCTIONS[0], upload_note(path, preset_name)


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
        raise TriForceError(f"The {label} must be text, got {type(value).__name__} {quote(str(value))}.")
    return value


def describe_document(document: Any, preset_name: Any, budget: Any, instruction: Any = "",
                      max_new_tokens: Any = None) -> str:
    """Token count of the document against the room a run leaves it (the context less the template, the question
    and the answer), what a run drops, and the retrieval budget's share of the prompt: the counts a run with these
    inputs reports. Its inputs come unprocessed, of any type: a bad one is named in the line."""
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
        engine, exact = counting_engine(_preset(preset_name))
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
    share = budget_share(budget, fit.prompt_tokens)
    if share is not None:
        line += (f" · budget {int(budget):,} tokens = " +
                 ("the whole prompt" if share == 100 else f"{share:.1f} % of the {fit.prompt_tokens:,}-token prompt"))
    return line


def _preset(name: Any) -> Preset:
    """The preset of a name a visitor sent; an unknown one raises ValueError naming it quoted."""
    try:
        return preset_by_name(name)
    except ValueError as err:
        raise ValueError(quoted_in(str(err), name)) from None


def _settings(method: str, values: Mapping[str, Any]) -> GenerationConfig:
    """A validated config or a visible gr.Error explaining the bad setting."""
    try:
        return build_config(method, values)
    except TriForceError as err:
        raise refuse(str(err), "Invalid settings") from None


def _on_device(preset: Preset, *configs: GenerationConfig) -> list[GenerationConfig]:
    """The configs as the preset's device runs them. Offload "on" keeps the full KV cache in CPU memory and streams
    it to a GPU layer by layer: without a GPU every cache is in CPU memory already, and in the app's batch every
    cache stays on the GPU (core.batching), so there it runs as "auto" and a warning says why (the status would
    otherwise describe a cache streamed to a GPU that is not there)."""
    device = preset_engine(preset).target.device.type
    if (device == "cuda" and not BATCHED) or all(config.offload != "on" for config in configs):
        return list(configs)
    gr.Warning(f"{gpu_only_note('Offload on', device)}: every cache is in CPU memory already." if device != "cuda"
               else "Offload on has no effect here: runs decode together in one batch, every cache on the GPU.")
    return [dataclasses.replace(config, offload="auto") for config in configs]


def _prepare(values: Mapping[str, Any]) -> tuple[Preset, str, str]:
    """Check the document and the instruction (text) and load the preset's models; return the preset, the document
    and the instruction. Problems raise gr.Error."""
    try:
        document, instruction = text_input("document", values["document"]), \
            text_input("instruction", values["instruction"])
    except TriForceError as err:
        raise refuse(str(err), "Invalid input") from None
    if not document.strip():
        raise refuse("The document is empty: pick a sample, upload a file or paste text.", "No document")
    try:
        preset = _preset(values["preset_name"])
        preset_engine(preset)
    except (ModelLoadError, ValueError) as err:
        raise refuse(str(err), "Model not available") from None
    return preset, document, instruction


def _stream(preset: Preset, document: str, instruction: str, config: GenerationConfig, state: RunState,
            deadline: Deadline | None = None, turn: Ticket | None = None) -> Iterator[Event]:
    """Fold the engine's events for the job of `turn` into `state` and yield each; engine errors become gr.Error; once
    `deadline` has passed the generation stops, an OutOfTime last (app.inference.stream_events). The status line
    says what the run is doing (Gradio's own progress overlay is left off: one place for it)."""
    try:
        for event in stream_events(preset, document, instruction or "", config, deadline, turn):
            apply_event(state, event)
            if isinstance(event, PromptReady) and event.dropped_tokens:
                gr.Warning(f"The document is longer than the context ({event.context_length:,} tokens): "
                           f"its middle {event.dropped_tokens:,} tokens were dropped (beginning and end kept).")
            yield event
    except (TriForceError, ModelLoadError) as err:
        raise refuse(str(err), "Cannot generate") from None
    except (RuntimeError, OSError, MemoryError) as err:  # engine failures must not take the app down
        raise refuse(f"Generation failed: {type(err).__name__}: {err}", "Generation failed") from None


def _method(values: Mapping[str, Any]) -> str:
    """The decoding method picked on the TriForce tab (TRIFORCE_TAB_METHOD unless the visitor chose another)."""
    return values.get("method") or TRIFORCE_TAB_METHOD


def raw_stats_file(state: RunState) -> str:
    """The run's full data (state.raw_data) as a JSON file to download, under a name of its own; this process's
    files beyond the newest RAW_FILES_KEPT are deleted (those it listed itself: no other process's, no race with a
    directory scan)."""
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=RAW_DIR, prefix="raw-stats-", suffix=".json", delete=False) as f:
        f.write(json.dumps(raw_data(state)))  # one C-encoded string: json.dump writes piece by piece
    with _raw_lock:
        _raw_files.append(Path(f.name))
        old = [_raw_files.popleft() for _ in range(len(_raw_files) - RAW_FILES_KEPT)]
    for path in old:
        path.unlink(missing_ok=True)
    return f.name


def run_triforce(values: Mapping[str, Any], turn: Ticket | None = None) -> Iterator[dict[str, Any]]:
    """Stream one generation (the method picked: TriForce or auto) from the panel's values by name, for the job of
    `turn` (its place in the app's line, app.service.Jobs): frames of status, answer, heatmap, document view,
    timeline, stats, per-level costs and run state; the full data as a download once it has finished."""
    config = _settings(_method(values), values)
    mode = values.get("heatmap_mode") or HEATMAP_MODES[0]
    if mode not in HEATMAP_MODES:
        raise refuse(f"heatmap_mode must be one of {', '.join(HEATMAP_MODES)}, got {quote(mode)}.", "Invalid input")
    chosen, document, instruction = _prepare(values)
    config, = _on_device(chosen, config)
    deadline = Deadline(run_seconds())  # the job's time runs from here (its models are loaded), not while in line
    state = RunState(method=config.method, batched=BATCHED)
    text_gate, redraw = Throttle(TEXT_INTERVAL_S), Redraw()
    yield {"status": "⏳ Starting…", "answer": answer_html(None),
           "heatmap": empty_figure("The retrieval heatmap appears after prefill."), "doc_view": document_html(state),
           "timeline": timeline_html(state), "stats": "", "stats_json": {}, "costs": cost_figure([], None),
           "raw_stats": None, "run_state": state}
    for event in _stream(chosen, document, instruction, config, state, deadline, turn):
        if isinstance(event, OutOfTime):
            yield triforce_frame(state, mode, True) | {"status": out_of_time_line(deadline.seconds, len(state.pieces))}
            return
        now = time.monotonic()
        first = (isinstance(event, RetrievalSelection) and len(state.selection_rounds) == 1) or \
            (isinstance(event, Tokens) and len(state.token_ids) == len(event.ids))  # the first selection or tokens
        force = first or isinstance(event, (InLine, PromptReady, Finished))
        if text_gate.due(now, force):
            yield triforce_frame(state, mode, redraw.due(now, force, state))
    if not state.finished:  # the stream ended without Finished: show the last state in full
        yield triforce_frame(state, mode, True)


def triforce_frame(state: RunState, mode: str = HEATMAP_MODES[0], with_plots: bool = True) -> dict[str, Any]:
    """The TriForce tab's outputs for the current state; heatmap, document view and timeline only `with_plots`,
    the per-level costs and the download once the run has finished."""
    stats_md, stats = stats_for(state)
    frame = {"status": status_markdown(state), "answer": answer_html(state), "stats": stats_md,
             "stats_json": stats, "run_state": state}
    if with_plots:
        frame |= {"heatmap": selection_heatmap(state, mode), "doc_view": document_html(state),
                  "timeline": timeline_html(state)}
    if state.finished:
        frame |= {"costs": cost_figure(stats["levels"], stats["tokens_per_target_forward"]),
                  "raw_stats": raw_stats_file(state)}
    return frame


def redraw_heatmap(state: RunState | None, mode: str) -> object:
    """The heatmap of the last run in the chosen mode."""
    if not isinstance(state, RunState):
        return empty_figure("Run TriForce to see which chunks the retrieval cache keeps.")
    return selection_heatmap(state, mode)


def _stop(state: RunState) -> RunState:
    """Mark an unfinished run stopped (app.stopping ended it): its figures hold still from now."""
    if not state.finished and state.stopped_at is None:
        state.stopped_at = time.monotonic()
    return state


def stopped_triforce(sent: Mapping[str, Any]) -> dict[str, Any]:
    """The TriForce tab after Stop, from the last frame its run sent: the status says stopped, the stats are no
    longer live, the cost panel no longer waits for the end."""
    state = sent.get("run_state")
    if not isinstance(state, RunState) or state.finished:  # nothing had started, or it had finished already
        return {"status": status_markdown(state) if isinstance(state, RunState) else f"{STOPPED}. {AGAIN}"}
    _stop(state)
    return {"status": status_markdown(state), "stats": stats_markdown(live_stats(state)),
            "costs": cost_figure([], None, empty=COSTS_STOPPED)}


def stopped_compare(sent: Mapping[str, Any]) -> dict[str, Any]:
    """The Compare tab after Stop, from the last frame its runs sent: the status says stopped (and at which run),
    the stats of runs that had not finished are no longer live, the cost panel no longer waits."""
    runs = sent.get("compare_state")
    if not isinstance(runs, dict):  # nothing had started
        return {"compare_status": f"{STOPPED}. {AGAIN}"}
    if all(state.finished for state in runs.values()):  # it had finished: its status stands
        return {"compare_status": sent.get("compare_status")}
    current = next((m for m, state in runs.items() if not state.finished and state.stage != "starting"), None)
    for state in runs.values():
        _stop(state)
    at = f" during the {SHORT_NAMES[current]} run, {stopped_at(runs[current])}" if current else ""
    stats = {method: live_stats(state) for method, state in runs.items()}
    greedy = (sent.get("compare_json") or {}).get("greedy", False)
    return {"compare_status": f"{STOPPED}{at}. {AGAIN}", "verdict": comparison_summary(runs, greedy)[0],
            **{f"{method}_stats": stats_markdown(stats[method]) for method in runs},
            "compare_costs": cost_figure(stats["triforce"]["levels"], stats["triforce"]["tokens_per_target_forward"],
                                         stats["ar"]["levels"], empty=COSTS_STOPPED)}


def comparison_summary(runs: Mapping[str, RunState], greedy: bool) -> tuple[str, dict]:
    """Each drafting run's decode speed against autoregressive decoding's, what method auto's planner chose and why,
    and (with greedy decoding) whether each run's tokens are the autoregressive run's, as Markdown and as a dict."""
    ar = runs["ar"]
    stats = {method: live_stats(state) for method, state in runs.items()}
    stopped = [method for method, state in runs.items() if stats[method]["stopped"]]  # a rate of its first tokens
    base = None if "ar" in stopped else stats["ar"].get("tokens_per_s")
    speedups = {method: s["tokens_per_s"] / base if base and s.get("tokens_per_s") and method not in stopped else None
                for method, s in stats.items() if method != "ar"}
    parts = [f"{SHORT_NAMES[method]} **{speedup:.2f}×**" for method, speedup in speedups.items() if speedup]
    parts += [f"{SHORT_NAMES[method]} stopped {stopped_at(runs[method])}" for method in stopped
              if runs[method].stage != "starting"]  # (a run Stop came before has nothing to say)
    lines = ["### Decode speed against autoregressive: " + (" · ".join(parts) if parts else "—")]
    if speedups.get("auto") and what_ran(runs["auto"]) == "autoregressive throughout":
        lines.append(f"Method auto decoded autoregressively throughout, as the autoregressive run did: its "
                     f"{speedups['auto']:.2f}× is the noise between two runs of the same steps, not a speed of its "
                     "own.")
    sharing = [line for line in map(sharing_line, runs.values()) if line]
    if sharing:  # a run decoded beside other visitors' requests went at the batch's pace, not its own
        lines.append(" · ".join(f"{line}." for line in sharing))
    if "auto" in runs and (plan := plan_line(runs["auto"])):
        lines.append(plan)
    identical: dict[str, bool | None] = dict.fromkeys(speedups)
    differs_at: dict[str, int | None] = dict.fromkeys(speedups)
    if greedy and all(state.finished for state in runs.values()):
        for method in speedups:
            differs_at[method] = first_difference(ar.token_ids, runs[method].token_ids)
            identical[method] = differs_at[method] is None
        if all(identical.values()):
            lines.append(f"✅ **Token-identical**: every run produced the same {len(ar.token_ids)} tokens (greedy).")
        for method in (m for m, same in identical.items() if not same):
            note = difference_note(ar.token_ids, runs[method].token_ids, ar.final_stats.near_ties)
            lines.append(f"❌ **{method_name(runs[method])}: not token-identical**: {note}.")
    elif not greedy:
        lines.append("Sampling is on: outputs may differ token by token (each follows the target's distribution). "
                     "Tick *Greedy* for a token-identity check.")
    if any(s.get("prefill_reused") for s in stats.values()):
        lines.append("Prefill and time to first token are apart from decode speed: the runs after the first reused "
                     "the cache it prefilled for the same prompt.")
    ran_on = next((s for s in stats.values() if s.get("device")), {})
    device = " · ".join(v for v in (ran_on.get("device"), ran_on.get("dtype")) if v)
    if device:
        lines.append(f"Ran on **{device}**." + (f" {CPU_NOTE}" if device.startswith("cpu") else ""))
    summary = {"runs": {method: {"ran": run_label(state), **stats[method]} for method, state in runs.items()},
               "speedup": speedups, "greedy": greedy, "identical": identical, "first_difference": differs_at,
               "device": device}
    return "\n\n".join(lines), summary


COMPARE_OUTPUTS = ("compare_status", "verdict", "bars", "compare_costs", "compare_json", "compare_state",
                   *(f"{method}_{part}" for method in COMPARE_METHODS for part in ("head", "answer", "stats")),
                   *(f"{method}_timeline" for method in COMPARE_METHODS if method != "ar"))


def run_compare(values: Mapping[str, Any], turn: Ticket | None = None) -> Iterator[dict[str, Any]]:
    """Autoregressive decoding, TriForce and method auto for the job of `turn`, one after the other on the same input
    and seed (each a request of its own in the batch), streamed side by side, by output name (COMPARE_OUTPUTS); each
    column's heading and bar say what actually ran, the verdict whether each run had the device to itself."""
    configs = {method: _settings(method, values) for method in COMPARE_METHODS}
    chosen, document, instruction = _prepare(values)
    configs = dict(zip(configs, _on_device(chosen, *configs.values())))
    deadline = Deadline(run_seconds())  # one bound for the job's three runs, from here, not while they wait in line
    runs = {method: RunState(method=method, batched=BATCHED) for method in COMPARE_METHODS}
    gate = Throttle(TEXT_INTERVAL_S)
    is_greedy = configs["ar"].is_greedy

    def frame(note: str, with_plot: bool = True, with_costs: bool = False) -> dict[str, Any]:
        """All Compare outputs for the current progress; charts, timelines and verdict only when `with_plot`, the
        per-level costs (known once the runs finished) only `with_costs`."""
        stats = {method: live_stats(state) for method, state in runs.items()}
        out: dict[str, Any] = {"compare_status": note, "compare_state": runs}
        for method, state in runs.items():
            out |= {f"{method}_head": run_heading(state), f"{method}_answer": answer_html(state),
                    f"{method}_stats": stats_markdown(stats[method])}
        if with_plot:
            verdict, summary = comparison_summary(runs, is_greedy)
            out |= {"bars": compare_bars([(m, run_label(state), stats[m]) for m, state in runs.items()]),
                    "verdict": verdict, "compare_json": summary}
            out |= {f"{method}_timeline": timeline_html(state) for method, state in runs.items() if method != "ar"}
        if with_costs:
            out["compare_costs"] = cost_figure(stats["triforce"]["levels"],
                                               stats["triforce"]["tokens_per_target_forward"], stats["ar"]["levels"])
        return out

    yield frame("⏳ Starting…", with_costs=True)
    redraw = Redraw()
    for method in runs:
        state = runs[method]
        for event in _stream(chosen, document, instruction, configs[method], state, deadline, turn):
            if isinstance(event, OutOfTime):
                yield frame(f"{method_name(state)}: {out_of_time_line(deadline.seconds, len(state.pieces))}")
                return
            now = time.monotonic()
            if gate.due(now, isinstance(event, (InLine, Finished))):
                yield frame(f"{method_name(state)}: {status_markdown(state)}",
                            redraw.due(now, isinstance(event, Finished), *runs.values()))
    yield frame("✅ All three runs finished.", with_costs=True)


def describe_engines() -> str:
    """Models, device, dtype and versions of the loaded engines (loads the embedded one if none is)."""
    if not loaded_infos():
        try:
            load_engine(None, None)
        except ModelLoadError as err:
            return f"⚠️ {err}"
    return engine_table(loaded_infos())
