"""The Blocks layout (TriForce, Compare, How it works tabs) and the wiring of components to callbacks."""

from __future__ import annotations

import gradio as gr

from app import callbacks
from app.documents import MAX_UPLOAD_BYTES, SUPPORTED_SUFFIXES, load_samples
from app.explainer import EXPLANATION
from app.figures import HEATMAP_MODES, empty_figure
from app.presets import all_presets, default_preset
from app.settings import DRAFTERS, OVERFLOW_POLICIES, RESELECT_POLICIES
from app.views import AR_COLORS, SPAN_COLORS, TRIFORCE_COLORS
from core import GenerationConfig

UPLOAD_CACHE = (3600, 3600)  # every hour, delete uploads (in Gradio's cache) older than an hour
GPU_QUEUE = "gpu"  # one concurrency group for every generation button: one run at a time on the one device
CSS = """
#answer, #compare-ar, #compare-tf {min-height: 8rem}
#doc-view {max-height: 22rem; overflow-y: auto}
"""
HEADER = """# TriForce Studio
Hierarchical speculative decoding for long documents
([TriForce, arXiv 2404.11912](https://arxiv.org/abs/2404.11912)): a tiny drafter → the target model on a small
retrieval cache → the target on its full cache. Pick a document, ask something, and watch which parts of the
document the retrieval cache keeps while the answer streams."""


def launch_options() -> dict:
    """Keyword arguments for `demo.launch()` (Gradio 6: theme and css belong here, not in Blocks)."""
    return {"theme": gr.themes.Soft(), "css": CSS, "max_file_size": MAX_UPLOAD_BYTES}


def build_demo() -> gr.Blocks:
    """Build the whole app; nothing is loaded or run until a user acts."""
    samples = load_samples()
    first = min(samples, key=lambda s: s.path.stat().st_size, default=None)  # the shortest: a quick first run on CPU
    first_instructions = list(first.instructions) if first and first.instructions else \
        list(callbacks.GENERIC_INSTRUCTIONS)
    preset = default_preset()
    with gr.Blocks(title="TriForce Studio", delete_cache=UPLOAD_CACHE) as demo:
        gr.Markdown(HEADER)
        with gr.Tabs():
            with gr.Tab("TriForce", id="triforce"):
                with gr.Row():
                    with gr.Column(scale=2, min_width=340):
                        sample = gr.Dropdown([s.title for s in samples], value=first.title if first else None,
                                             label="Sample document", elem_id="sample")
                        upload = gr.File(label="…or upload (.txt .md .html .pdf)", file_types=list(SUPPORTED_SUFFIXES),
                                         type="filepath")
                        document = gr.Textbox(first.read() if first else "", label="Document (paste or edit)",
                                              lines=8, max_lines=8, elem_id="document")
                        doc_info = gr.Markdown(elem_id="doc-info")
                        instruction = gr.Textbox(first_instructions[0], label="Instruction", lines=2,
                                                 elem_id="instruction")
                        examples = gr.Dataset(components=[instruction], samples=[[i] for i in first_instructions],
                                              label="Example instructions", type="values")
                        with gr.Accordion("Settings", open=False, elem_id="settings"):
                            preset_name = gr.Dropdown([p.name for p in all_presets()], value=preset.name,
                                                      label="Model preset (target + draft)")
                            with gr.Row():
                                budget = gr.Number(preset.budget, label="Retrieval budget (tokens)", precision=0,
                                                   minimum=1)
                                chunk_size = gr.Slider(1, 64, 8, step=1, label="Chunk size (tokens)")
                            with gr.Row():
                                gamma1 = gr.Slider(1, 8, 2, step=1, label="γ1 (level-1 tokens per level-2 check)")
                                gamma2 = gr.Slider(1, 16, 6, step=1, label="γ2 (level-2 tokens per level-3 check)")
                            drafter = gr.Radio(list(DRAFTERS), value="auto", label="Level-1 drafter",
                                               info="auto: the draft model if the preset has one, else n-gram lookup")
                            draft_confidence = gr.Slider(0, 0.95, 0, step=0.05, label="Draft confidence gate",
                                                         info="the draft model stops proposing when its top "
                                                              "probability is below this (0: always γ1 tokens)")
                            lookup_min = gr.Slider(0, 8, GenerationConfig.lookup_min, step=1,
                                                   label="Copy from the text after a match of (tokens)",
                                                   info="the draft model proposes what followed the text's last "
                                                        "tokens where they occurred before (0: never)")
                            draft_fusion = gr.Checkbox(True, label="Draft reads the target's hidden state",
                                                       info="a draft distilled with a fusion module (the embedded "
                                                            "one) also reads the state of level 2 or 3 that produced "
                                                            "the last token; off: the draft alone")
                            with gr.Row():
                                reselect = gr.Radio(list(RESELECT_POLICIES), value="once", label="Re-select chunks")
                                reselect_every = gr.Number(8, label="N (rounds)", precision=0, minimum=1)
                            with gr.Row():
                                temperature = gr.Slider(0, 1.5, 0.6, step=0.05, label="Temperature")
                                top_p = gr.Slider(0.05, 1, 0.9, step=0.05, label="Top-p")
                            with gr.Row():
                                max_new_tokens = gr.Number(64, label="Max new tokens", precision=0, minimum=1,
                                                           maximum=4096)
                                seed = gr.Number(0, label="Seed", precision=0)
                            with gr.Row():
                                greedy = gr.Checkbox(False, label="Greedy (token-identical to autoregressive)")
                                overflow = gr.Radio(list(OVERFLOW_POLICIES), value="truncate",
                                                    label="Document longer than the context")
                        with gr.Row():
                            run = gr.Button("Run TriForce", variant="primary", elem_id="run")
                            stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    with gr.Column(scale=3, min_width=420):
                        status = gr.Markdown("Ready.", elem_id="status")
                        answer = gr.HighlightedText(label="Answer (coloured by provenance)", color_map=TRIFORCE_COLORS,
                                                    show_legend=True, elem_id="answer")
                        heatmap_mode = gr.Radio(list(HEATMAP_MODES), value=HEATMAP_MODES[0], label="Heatmap",
                                                container=False)
                        heatmap = gr.Plot(empty_figure("Run TriForce to see which chunks the retrieval cache keeps."),
                                          label="Retrieval cache heatmap", elem_id="heatmap")
                        with gr.Row():
                            doc_view = gr.HighlightedText(label="Selected spans of the document (latest selection)",
                                                          color_map=SPAN_COLORS, show_legend=True, elem_id="doc-view")
                            stats = gr.Markdown(elem_id="stats")
                        with gr.Accordion("Raw stats (JSON)", open=False):
                            stats_json = gr.JSON(label="stats")
                run_state = gr.State()
            with gr.Tab("Compare", id="compare"):
                gr.Markdown("Runs plain **autoregressive** decoding and then **TriForce** on the document, instruction "
                            "and settings of the TriForce tab, with the same seed, on the same device. Tick *greedy* "
                            "in Settings to check that both produce the same tokens.")
                with gr.Row():
                    compare_run = gr.Button("Run comparison", variant="primary", elem_id="compare-run")
                    compare_stop = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                compare_status = gr.Markdown()
                with gr.Row():
                    with gr.Column():
                        ar_answer = gr.HighlightedText(label="Autoregressive", color_map=AR_COLORS, show_legend=True,
                                                       elem_id="compare-ar")
                        ar_stats = gr.Markdown()
                    with gr.Column():
                        tf_answer = gr.HighlightedText(label="TriForce", color_map=TRIFORCE_COLORS,
                                                       show_legend=True, elem_id="compare-tf")
                        tf_stats = gr.Markdown()
                verdict = gr.Markdown(elem_id="verdict")
                bars = gr.Plot(label="Speed", elem_id="compare-bars")
                with gr.Accordion("Raw comparison (JSON)", open=False):
                    compare_json = gr.JSON(label="comparison")
            with gr.Tab("How it works", id="how") as how_tab:
                gr.Markdown(EXPLANATION)
                gr.Markdown("## Models, device and versions")
                engines = gr.Markdown(elem_id="engines")

        # The generation buttons take raw values (preprocess=False): build_config parses and explains bad settings,
        # where a component's own preprocessing would fail as a bare "Error".
        settings = [preset_name, max_new_tokens, budget, chunk_size, gamma1, gamma2, drafter, reselect,
                    reselect_every, temperature, top_p, seed, greedy, overflow, draft_confidence,
                    lookup_min, draft_fusion]
        sample.input(callbacks.choose_sample, sample, [document, examples, instruction], api_name="choose_sample")
        upload.upload(callbacks.upload_document, upload, document, api_name="upload_document")
        examples.click(callbacks.pick_instruction, examples, instruction, api_visibility="private")
        describe = dict(fn=callbacks.describe_document, inputs=[document, preset_name, budget, instruction,
                                                                max_new_tokens], outputs=doc_info,
                        show_progress="hidden", trigger_mode="always_last", concurrency_limit=None)
        document.change(api_name="describe_document", **describe)
        budget.change(api_visibility="private", **describe)
        preset_name.input(callbacks.preset_budget, preset_name, budget, api_visibility="private")
        demo.load(api_visibility="private", **describe)

        run_event = run.click(callbacks.run_triforce, [document, instruction, *settings, heatmap_mode],
                              [status, answer, heatmap, doc_view, stats, stats_json, run_state], api_name="triforce",
                              concurrency_id=GPU_QUEUE, concurrency_limit=1, preprocess=False)
        stop.click(callbacks.stopped, None, status, cancels=[run_event], api_name="stop", concurrency_limit=None)
        heatmap_mode.change(callbacks.redraw_heatmap, [run_state, heatmap_mode], heatmap, api_visibility="private",
                            concurrency_limit=None)

        compare_event = compare_run.click(callbacks.run_compare, [document, instruction, *settings],
                                          [compare_status, ar_answer, tf_answer, ar_stats, tf_stats, bars, verdict,
                                           compare_json], api_name="compare", concurrency_id=GPU_QUEUE,
                                          concurrency_limit=1, preprocess=False)
        compare_stop.click(callbacks.stopped, None, compare_status, cancels=[compare_event], api_name="stop_compare",
                           concurrency_limit=None)
        how_tab.select(callbacks.describe_engines, None, engines, api_visibility="private")
        demo.load(callbacks.describe_engines, None, engines, api_visibility="private")
    demo.queue(default_concurrency_limit=1)
    return demo
