"""The Blocks layout (TriForce, Compare, How it works tabs) and the wiring of components to callbacks."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.data_classes import FileData
from pydantic import ValidationError
from starlette.middleware import Middleware

from app import callbacks, stopping
from app.documents import MAX_UPLOAD_BYTES, SAMPLES_DIR, SUPPORTED_SUFFIXES, Sample, load_samples
from app.explainer import CPU_NOTE, EXPLANATION, python_snippet
from app.figures import HEATMAP_MODES, cost_figure, empty_figure
from app.inference import BATCHED, ZERO_GPU, seats
from app.presets import PRESET_SETTINGS, all_presets, default_preset, panel_overrides
from app.service import Jobs, Ticket, UploadBudget, handlers, serve
from app.settings import build_panel, method_widget, widget_args
from app.state import RunState
from app.views import COLOURS, COMPARE_METHODS, answer_html, document_html, overlay_css, run_heading
from core.io import default_device

UPLOAD_CACHE = (3600, 3600)  # every hour, delete uploads (in Gradio's cache) older than an hour
UPLOAD_READERS = 4  # uploads read at once (a PDF or an HTML page each in a child process within app.reader's limits)
QUICK_SETTINGS = ("greedy", "max_new_tokens")  # beside the model, above the tabs: what a visitor changes for every run
DOCUMENT_LINES = 4  # the document box's height: with the question, the method and Run in view at 1440×900
DOCUMENT_LABEL = "Document (paste, edit or upload)"
GPU_QUEUE = "gpu"  # one concurrency group for every generation button: the jobs that share the one device
CSS = """
.tl {font-size: 0.8rem; max-height: 16rem; overflow-y: auto}
.tl-head {margin-bottom: 4px; color: var(--body-text-color-subdued)}
.tl-legend {white-space: nowrap; overflow-x: auto}
.tl-rounds {display: flex; flex-wrap: wrap; gap: 5px 7px; align-items: center}
.tl-round {display: inline-flex; flex-direction: column; gap: 2px}
.tl-round > span {display: flex; gap: 1px; height: 9px}
.tl i {display: inline-block; width: 6px; height: 9px; border-radius: 1px; vertical-align: middle}
.tl s {display: inline-block; width: 3px}
.tl .ok {background: #22c55e} .tl .no {background: #374151} .tl .skip {background: #d1d5db}
.tl .tl-plan {font-weight: 600; color: #4f46e5} .tl .tl-ar {color: var(--body-text-color-subdued)}
input[role="combobox"] {padding-right: 32px; text-overflow: ellipsis}
#cpu-note {font-size: 0.9rem; color: var(--body-text-color-subdued)}
""" + f".tl .l2 {{background: {COLOURS['level2']}}} .tl .l3 {{background: {COLOURS['level3']}}}\n" + overlay_css()
HEADER = """## TriForce Studio
Hierarchical speculative decoding for long documents ([TriForce](https://arxiv.org/abs/2404.11912)): a tiny drafter →
the target on a retrieval cache → the target on its full cache, each draft checked exactly."""
READY = "Pick a document, ask, and press **Run**: the answer streams here, beside what the retrieval cache keeps."


class UploadPayload(FileData):
    """An upload's payload: one that is not a file's (a number, text, a path without Gradio's marker) is refused in
    one line, where FileData's own validation error would reach the visitor as a generic error."""

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> FileData:
        try:
            return FileData.model_validate(obj, **options)
        except ValidationError:
            raise gr.Error(f"Expected an uploaded file, got {type(obj).__name__} {str(obj)[:40]!r}.",
                           title="Cannot use this file") from None


def launch_options() -> dict:
    """Keyword arguments for `demo.launch()` (Gradio 6: theme and css belong here, not in Blocks); each address's
    uploads bounded (app.service.UploadBudget) before Gradio reads them."""
    return {"theme": gr.themes.Soft(), "css": CSS, "max_file_size": MAX_UPLOAD_BYTES,
            "app_kwargs": {"middleware": [Middleware(UploadBudget)]}}


def by_name(fn: Callable[[Mapping[str, Any], Ticket | None], Iterator[dict[str, Any]]],
            outputs: dict[str, gr.Component], tab: str,
            stopped: Callable[[Mapping[str, Any]], dict[str, Any]],
            line: Jobs | None = None) -> Callable[..., Iterator[list[Any]]]:
    """A Gradio handler for `fn`, the run of `tab`: its job first admitted to `line` (app.service.Jobs: refused there in
    one line past the bounds, released when the handler ends) and the event's `inputs_kwargs` handed to `fn` as one dict
    by name, with the job's ticket (None without a line), and each frame `fn` yields by output name goes out as the list
    of all outputs, those it leaves out with the value last sent (Gradio rebuilds a component for every output it is
    told to skip, which costs more than a frame; a plot is postprocessed by its component once, so sending it again is
    free). The run is registered for Stop (app.stopping): once stopped, its last frame is `stopped`'s, the words Stop
    writes, since Gradio sends a run's last frame again when it completes, and that may come after Stop's."""
    def handler(request: gr.Request, **values: Any) -> Iterator[list[Any]]:
        with (line.admitted(request) if line else contextlib.nullcontext()) as ticket:  # a refusal registers no run
            run = stopping.started(request.session_hash, tab)

            def sent(frame: dict[str, Any]) -> list[Any]:
                run.sent |= {name: outputs[name].postprocess(value) if isinstance(outputs[name], gr.Plot) else value
                             for name, value in frame.items()}
                return [run.sent.get(name, gr.skip()) for name in outputs]

            try:
                with contextlib.closing(fn(values, ticket)) as frames:
                    for frame in frames:
                        if run.stop.is_set():  # closing `frames` stops the generation
                            yield sent(stopped(run.sent))
                            return
                        yield sent(frame)
            finally:
                stopping.ended(request.session_hash, tab, run)

    handler.__name__ = fn.__name__
    return handler


def stopper(fn: Callable[[Mapping[str, Any]], dict[str, Any]], outputs: dict[str, gr.Component],
            tab: str) -> Callable[[gr.Request], list[Any]]:
    """A Gradio handler for `tab`'s Stop: it stops the visitor's run there and, once the run has sent its last frame
    (or STOP_WAIT_S has passed), sends `fn`'s frame from the run's last one by output name: the words the run's own
    last frame ends with (by_name), so that whichever comes last, the page says Stopped."""
    def handler(request: gr.Request) -> list[Any]:
        run = stopping.stop(request.session_hash, tab)
        frame = fn(run.sent if run else {})
        return [frame.get(name, gr.skip()) for name in outputs]

    handler.__name__ = fn.__name__
    return handler


def default_sample(samples: list[Sample], samples_dir: Path = SAMPLES_DIR) -> Sample | None:
    """The sample samples.json names as the first one shown ("default"), else the first listed; None without any."""
    try:
        name = json.loads((samples_dir / "samples.json").read_text(encoding="utf-8")).get("default")
    except (OSError, ValueError, AttributeError):
        name = None
    return next((s for s in samples if s.path.name == name), samples[0] if samples else None)


def on_cpu() -> bool:
    """Whether runs here decode on a CPU: no CUDA device, and not a ZeroGPU Space (which lends one per request)."""
    return default_device().type == "cpu" and not ZERO_GPU


def build_demo() -> gr.Blocks:
    """Build the whole app; nothing is loaded or run until a user acts."""
    samples = load_samples()
    first = default_sample(samples)
    first_instructions = list(first.instructions) if first and first.instructions else \
        list(callbacks.GENERIC_INSTRUCTIONS)
    preset = default_preset()
    values, notes = panel_overrides(preset)
    with gr.Blocks(title="TriForce Studio", delete_cache=UPLOAD_CACHE) as demo:
        gr.Markdown(HEADER)
        if on_cpu():
            gr.Markdown(f"💡 {CPU_NOTE} *Compare* times them side by side.", elem_id="cpu-note")
        with gr.Row(elem_id="quick-settings", equal_height=True):
            preset_name = gr.Dropdown([p.name for p in all_presets()], value=preset.name, label="Model preset",
                                      elem_id="preset", scale=3)
            quick = {name: kind(**kwargs) for name in QUICK_SETTINGS
                     for kind, kwargs in [widget_args(name, values.get(name, dataclasses.MISSING),
                                                      notes.get(name, ""))]}
        with gr.Tabs():
            with gr.Tab("TriForce", id="triforce"):
                with gr.Row():
                    with gr.Column(scale=2, min_width=340):
                        with gr.Row(equal_height=True):
                            sample = gr.Dropdown([s.title for s in samples], value=first.title if first else None,
                                                 label="Sample document", elem_id="sample", scale=3)
                            upload = gr.UploadButton("📄 Upload", file_types=list(SUPPORTED_SUFFIXES),
                                                     type="filepath", elem_id="upload", scale=0, min_width=100,
                                                     size="md")
                        upload.data_model = UploadPayload
                        document = gr.Textbox(first.read() if first else "", label=DOCUMENT_LABEL,
                                              lines=DOCUMENT_LINES, max_lines=DOCUMENT_LINES, elem_id="document")
                        instruction = gr.Textbox(first_instructions[0], label="Instruction", lines=2,
                                                 elem_id="instruction")
                        method = method_widget(callbacks.TRIFORCE_TAB_METHOD)
                        with gr.Row():
                            run = gr.Button("Run", variant="primary", elem_id="run")
                            stop = gr.Button("Stop", variant="stop", elem_id="stop")
                        examples = gr.Dataset(components=[instruction], samples=[[i] for i in first_instructions],
                                              label="Example instructions", type="values", elem_id="examples")
                        doc_info = gr.Markdown(elem_id="doc-info")
                    with gr.Column(scale=3, min_width=420):
                        uploaded = gr.Markdown(elem_id="upload-note")  # here, Run stays in view after an upload
                        status = gr.Markdown(READY, elem_id="status")
                        answer = gr.HTML(answer_html(None), label="Answer", elem_id="answer")
                        with gr.Row():
                            gr.Checkbox(False, label="Colour by provenance", elem_id="colour-answer", container=False)
                            gr.Checkbox(False, label="Show rejected drafts", elem_id="show-rejected",
                                        container=False)
                        timeline = gr.HTML(elem_id="timeline")
                        heatmap_mode = gr.Radio(list(HEATMAP_MODES), value=HEATMAP_MODES[0], label="Heatmap",
                                                container=False)
                        heatmap = gr.Plot(empty_figure("Run to see which chunks the retrieval cache keeps."),
                                          label="Retrieval cache heatmap", elem_id="heatmap")
                        with gr.Row():
                            doc_view = gr.HTML(document_html(RunState()), label="Kept spans",
                                               elem_id="doc-view", max_height=360)
                            stats = gr.Markdown(elem_id="stats")
                        costs = gr.Plot(cost_figure([], None), label="Cost per level", elem_id="costs")
                        with gr.Accordion("Raw stats", open=False):
                            stats_json = gr.JSON(label="stats")
                            raw_stats = gr.DownloadButton("Download the full data (JSON, after a run)",
                                                          elem_id="raw-stats", size="sm")
                run_state = gr.State()
            with gr.Tab("Compare", id="compare"):
                gr.Markdown("Where speed is judged: plain **autoregressive** decoding, **TriForce** and **method "
                            "auto** run one after the other on the document and instruction of the first tab, with "
                            "the same seed, on the same device; each heading says what ran, and the verdict whether "
                            "each run had the device to itself or decoded beside other visitors' runs. With *Greedy* "
                            "all three must produce the same tokens.")
                with gr.Row():
                    compare_run = gr.Button("Run comparison", variant="primary", elem_id="compare-run")
                    compare_stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                compare_status = gr.Markdown(elem_id="compare-status")
                verdict = gr.Markdown(elem_id="verdict")
                with gr.Row():
                    gr.Checkbox(False, label="Colour by provenance", elem_id="colour-compare", container=False)
                    gr.Checkbox(False, label="Show rejected drafts", elem_id="compare-show-rejected",
                                container=False)
                columns: dict[str, gr.Component] = {}
                with gr.Row():
                    for name in COMPARE_METHODS:
                        with gr.Column(min_width=300):
                            columns[f"{name}_head"] = gr.Markdown(run_heading(RunState(name, batched=BATCHED)),
                                                                  elem_id=f"compare-{name}-head")
                            columns[f"{name}_answer"] = gr.HTML(answer_html(None), elem_id=f"compare-{name}")
                            if name != "ar":
                                columns[f"{name}_timeline"] = gr.HTML(elem_id=f"compare-{name}-timeline")
                            columns[f"{name}_stats"] = gr.Markdown(elem_id=f"compare-{name}-stats")
                bars = gr.Plot(label="Speed", elem_id="compare-bars")
                compare_costs = gr.Plot(cost_figure([], None), label="Cost per level (TriForce, autoregressive)",
                                        elem_id="compare-costs")
                compare_state = gr.State()
                with gr.Accordion("Raw comparison (JSON)", open=False):
                    compare_json = gr.JSON(label="comparison")
            with gr.Tab("Settings", id="settings", elem_id="settings"):
                gr.Markdown("Every generation setting, for the runs of both tabs; a model preset sets some of them.")
                panel = build_panel(values, notes, skip=QUICK_SETTINGS)
            with gr.Tab("How it works", id="how") as how_tab:
                gr.Markdown(EXPLANATION)
                if first:
                    gr.Markdown(python_snippet(first.path, first_instructions[0]), elem_id="python-snippet")
                gr.Markdown("## Models, device and versions")
                engines = gr.Markdown(elem_id="engines")

        jobs = handlers(seats())  # every admitted job's handler at once, and a few to refuse the others at once
        line = Jobs(seats())  # the generation jobs of both tabs, admitted by their handlers (app.service)
        inputs = {"document": document, "instruction": instruction, "preset_name": preset_name, **quick, **panel}
        sample.input(callbacks.choose_sample, sample, [document, examples, instruction, uploaded, sample],
                     api_name="choose_sample")
        upload.upload(callbacks.upload_document, upload, document, api_name="upload_document",
                      concurrency_limit=UPLOAD_READERS).success(
            callbacks.leave_sample, [upload, preset_name], [sample, examples, instruction, uploaded],
            api_visibility="private", concurrency_limit=None)
        examples.click(callbacks.pick_instruction, examples, instruction, api_visibility="private")
        describe = dict(fn=callbacks.describe_document,
                        inputs=[document, preset_name, panel["budget"], instruction, quick["max_new_tokens"]],
                        outputs=doc_info, show_progress="hidden", trigger_mode="always_last", concurrency_limit=None,
                        preprocess=False)  # values of any type reach it, and it names a bad one
        # one listener for every input the line counts, so that "always last" holds across them: picking a sample
        # changes the document and the instruction at once, and two listeners could finish in either order, the
        # line then counting the new document with the old instruction
        gr.on([document.change, instruction.change, panel["budget"].change, quick["max_new_tokens"].change,
               preset_name.change, demo.load], api_name="describe_document", **describe)
        preset_name.input(callbacks.preset_settings, preset_name, [panel[name] for name in PRESET_SETTINGS],
                          api_visibility="private")

        outputs = {"status": status, "answer": answer, "heatmap": heatmap, "doc_view": doc_view, "stats": stats,
                   "stats_json": stats_json, "timeline": timeline, "costs": costs, "raw_stats": raw_stats,
                   "run_state": run_state}
        run_event = run.click(by_name(callbacks.run_triforce, outputs, "triforce", callbacks.stopped_triforce, line),
                              inputs_kwargs={**inputs, "method": method, "heatmap_mode": heatmap_mode},
                              outputs=list(outputs.values()), api_name="triforce", preprocess=False,
                              show_progress="hidden", concurrency_id=GPU_QUEUE, concurrency_limit=jobs)
        stopped = {"status": status, "stats": stats, "costs": costs}
        stop.click(stopper(callbacks.stopped_triforce, stopped, "triforce"), None, list(stopped.values()),
                   cancels=[run_event], api_name="stop", concurrency_limit=None, show_progress="hidden")
        heatmap_mode.change(callbacks.redraw_heatmap, [run_state, heatmap_mode], heatmap, api_visibility="private",
                            concurrency_limit=None)

        components = {"compare_status": compare_status, "verdict": verdict, "bars": bars,
                      "compare_costs": compare_costs, "compare_json": compare_json, "compare_state": compare_state,
                      **columns}
        outputs = {name: components[name] for name in callbacks.COMPARE_OUTPUTS}
        compare_event = compare_run.click(by_name(callbacks.run_compare, outputs, "compare",
                                                  callbacks.stopped_compare, line), inputs_kwargs=inputs,
                                          outputs=list(outputs.values()), api_name="compare", preprocess=False,
                                          show_progress="hidden", concurrency_id=GPU_QUEUE, concurrency_limit=jobs)
        stopped = {name: components[name] for name in ("compare_status", "compare_costs",
                                                        *(f"{method}_stats" for method in COMPARE_METHODS))}
        compare_stop.click(stopper(callbacks.stopped_compare, stopped, "compare"), None, list(stopped.values()),
                           cancels=[compare_event], api_name="stop_compare", concurrency_limit=None,
                           show_progress="hidden")
        how_tab.select(callbacks.describe_engines, None, engines, api_visibility="private")
        demo.load(callbacks.describe_engines, None, engines, api_visibility="private")
    return serve(demo)  # Gradio's queue bounded; generation jobs admitted by the app's line (app.service.Jobs)
