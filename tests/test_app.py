"""Tests of the Gradio app: pure reducers/figures/readers first, then the served app through gradio_client."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from core import GenerationConfig, TriForceError
from core.config import settings
from core.events import (Finished, Loading, PlanChosen, PrefillProgress, PromptReady, RetrievalSelection, Stats,
                         StepTiming, Tokens)
from core.io.text import html_to_text

from app import callbacks
from app.documents import MAX_UPLOAD_BYTES, DocumentError, load_samples, read_document
from app.figures import HEATMAP_MODES, compare_bars, cost_figure, pick_rows, selection_heatmap
from app.presets import CUSTOM, EMBEDDED, PRESETS, all_presets, env_preset
from app.settings import app_settings, build_config, build_panel
from app.state import (MAX_COLUMNS, RunState, ShownVerdict, apply_event, bin_edges, bin_max, level_costs, live_stats,
                       raw_data, typed)
from app.views import (PROVENANCE, REJECTED, SPANS, answer_html, document_html, stats_markdown, status_markdown,
                       timeline_html)
from tests.pdfs import text_pdf

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(max_new_tokens=16, budget=128, chunk_size=8, gamma1=2, gamma2=6, drafter="auto", reselect="once",
                temperature=0.6, top_p=0.9, seed=0, greedy=True, overflow="truncate")
BROKEN_TARGET = "/nonexistent/triforce-target"
FRAME_LIMIT = 256 * 1024  # bytes of one streamed frame, whatever the document's length


def selection_event(num_chunks: int, chunk_ids: list[list[list[int]]], round_: int = 0) -> RetrievalSelection:
    """A RetrievalSelection of budget 64 over chunks of 8 tokens."""
    return RetrievalSelection(round_, 0, 8, num_chunks, num_chunks * 8, 64, chunk_ids, 0.0, 4096)


def prompt_event(num_chunks: int, dropped: int = 0) -> PromptReady:
    """A PromptReady with chunk texts 'c0 ', 'c1 ', ..."""
    return PromptReady(num_chunks * 8, num_chunks * 8, dropped, 8192, 8, 8, [f"c{i} " for i in range(num_chunks)])


def tokens_event(texts: list[str], provenance: list[str], round_: int) -> Tokens:
    return Tokens(list(range(len(texts))), texts, provenance, round_)


def verdict_event(level: int, round_: int, texts: str, accepted: int, bonus: bool = False) -> ShownVerdict:
    """A Verdict proposing one token per character of `texts`, with the texts the app's engine side adds."""
    return ShownVerdict(level, round_, [ord(c) for c in texts], accepted, 0, bonus, proposed_texts=list(texts))


def run_stats(**figures) -> Stats:
    """A finished run's Stats: `figures` over zeros."""
    base = dict(method="triforce", new_tokens=0, prompt_tokens=0, dropped_tokens=0, prefill_s=0.0,
                prefill_reused=False, decode_s=0.0, tokens_per_s=0.0, time_to_first_token_s=0.0, target_forwards=0,
                tokens_per_target_forward=0.0)
    return Stats(**{**base, **figures})


def finished_event(token_ids: list[int] = (), **figures) -> Finished:
    return Finished("", list(token_ids), [], run_stats(new_tokens=len(token_ids), **figures))


def answer_parts(markup: str) -> list[tuple[str, str]]:
    """(class, text) of each stretch of an answer's HTML, after its legend."""
    body = markup.split("</div>", 1)[1]
    return [(cls, html.unescape(text)) for _, cls, text in re.findall(r"<(span|del) class='([^']+)'>(.*?)</\1>",
                                                                          body, re.S)]


# ---------------------------------------------------------------- documents


def test_read_text_markdown_html_and_pdf(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("plain text ✓", encoding="utf-8")
    (tmp_path / "b.md").write_bytes("\ufeff# Title\nbody".encode("utf-8"))
    (tmp_path / "c.html").write_text("<html><head><style>x{}</style></head><body><h1>Head</h1><script>var a;"
                                     "</script><p>One &amp; two</p></body></html>", encoding="utf-8")
    (tmp_path / "d.pdf").write_bytes(text_pdf("Hello TriForce PDF"))
    assert read_document(tmp_path / "a.txt") == "plain text ✓"
    assert read_document(tmp_path / "b.md") == "# Title\nbody"
    assert read_document(tmp_path / "c.html") == "Head\n\nOne & two"
    assert read_document(tmp_path / "d.pdf") == "Hello TriForce PDF"


def test_source_and_data_files_are_read_as_their_text(tmp_path: Path) -> None:
    sources = {"a.py": "def f():\n    return '<b>'  # ✓\n", "b.rs": "fn main() {}\n", "c.ts": "let x: number = 1;\n",
               "d.json": '{"a": [1, 2]}', "e.yaml": "a: 1\n", "f.csv": "a,b\n1,2\n", "g.xml": "<a>&amp;</a>"}
    for name, text in sources.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert read_document(tmp_path / name) == text  # as written: no markup stripped


@pytest.mark.parametrize("name, data, message", [
    ("bin.txt", b"\x7fELF\x00\x01\x02", "binary"),
    ("latin1.txt", "caf\xe9 au lait".encode("latin-1"), "not valid UTF-8"),
    ("empty.md", b"   \n", "no text"),
    ("image.png", b"\x89PNG", "Unsupported file type"),
    ("broken.pdf", b"%PDF-1.4 garbage", "Could not read this PDF"),
])
def test_unusable_uploads_are_explained(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DocumentError, match=message):
        read_document(tmp_path / name)


def test_oversized_upload_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as handle:
        handle.truncate(MAX_UPLOAD_BYTES + 1)
    with pytest.raises(DocumentError, match="limit"):
        read_document(big)


def test_html_to_text_skips_hidden_elements() -> None:
    assert html_to_text("<div>a</div><noscript>no</noscript><template>t</template>b") == "a\nb"
    assert html_to_text("<nav><a>Home</a></nav><p>x &amp; y</p>") == "x & y"


def test_bundled_samples_are_listed_with_instructions() -> None:
    samples = load_samples()
    assert len(samples) >= 3
    assert all(sample.path.is_file() and sample.instructions for sample in samples)
    assert load_samples(ROOT / "no-such-dir") == []


# ---------------------------------------------------------------- presets and settings


def test_presets_from_environment() -> None:
    assert env_preset({}) is None
    paper = env_preset({"TRIFORCE_TARGET": "NousResearch/Yarn-Llama-2-7b-128k", "TRIFORCE_DRAFT": "JackFram/llama-68m"})
    assert paper.id == "yarn-llama-2-7b-128k" and paper in PRESETS
    custom = env_preset({"TRIFORCE_TARGET": "/models/mine"})
    assert (custom.name, custom.target, custom.draft) == (CUSTOM, "/models/mine", None)
    assert [p.name for p in all_presets({"TRIFORCE_TARGET": "/models/mine"})][:2] == [CUSTOM, EMBEDDED]
    offline = env_preset({"TRIFORCE_TARGET": "qwen2.5-coder-1.5b"})  # a preset id names the preset
    assert offline.name == "Qwen2.5-Coder-1.5B + 0.5B (32K, offline)" and offline in PRESETS
    assert [p.name for p in PRESETS if p.files] == [offline.name, "Qwen2.5-Coder-0.5B (32K, offline)",
                                                    "Qwen2.5-Coder-1.5B + 0.5B, YaRN ×4 (128K, offline)"]
    targets = {p.target for p in PRESETS if not p.files}
    assert {None, "NousResearch/Yarn-Llama-2-7b-128k", "LargeWorldModel/LWM-Text-Chat-128K",
            "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"} == targets


def test_build_config_maps_widgets_and_explains_bad_values() -> None:
    config = build_config("triforce", {**SETTINGS, "reselect": "4", "drafter": "ngram"})
    assert (config.reselect, config.drafter, config.max_new_tokens, config.greedy) == (4, "ngram", 16, True)
    assert build_config("ar", {**SETTINGS, "reselect": "every_verify"}).reselect == "every_verify"
    with pytest.raises(TriForceError, match="multiple of chunk_size"):
        build_config("triforce", {**SETTINGS, "budget": 100})
    with pytest.raises(TriForceError, match="whole number"):
        build_config("triforce", {**SETTINGS, "max_new_tokens": 2.5})
    with pytest.raises(TriForceError, match="empty"):
        build_config("triforce", {**SETTINGS, "seed": None})
    with pytest.raises(TriForceError, match="top_p"):
        build_config("triforce", {**SETTINGS, "top_p": 0})
    assert build_config("triforce", {**SETTINGS, "lookup_min": 4.0}).lookup_min == 4
    with pytest.raises(TriForceError, match="lookup_min"):
        build_config("triforce", {**SETTINGS, "lookup_min": -1})


def test_build_config_reads_text_blanks_and_defaults() -> None:
    config = build_config("triforce", {"budget": " 256 ", "gamma2": "", "max_new_tokens": "32", "temperature": "0.5",
                                       "reselect": " once ", "document": "ignored"})
    assert (config.budget, config.gamma2, config.max_new_tokens, config.temperature) == (256, None, 32, 0.5)
    assert build_config("triforce", {}) == GenerationConfig(method="triforce").validate()  # missing: the default
    top = 2**63 - 1  # the largest seed, exact as a number and as text (a float would round it past the limit)
    assert build_config("triforce", {"seed": top}).seed == build_config("triforce", {"seed": str(top)}).seed == top
    for name, raw, message in (("max_new_tokens", "many", "Max new tokens must be a whole number, got 'many'"),
                               ("temperature", "hot", "Temperature must be a number"),
                               ("budget", "12.5", "whole number"), ("greedy", "yes", "true or false"),
                               ("reselect", "sometimes", "once, every_verify or a whole number"),
                               ("seed", [1], "whole number"), ("max_new_tokens", "", "empty"),
                               ("temperature", "nan", "must be a number"), ("top_p", float("inf"), "must be a number")):
        with pytest.raises(TriForceError, match=message) as err:
            build_config("triforce", {name: raw})
        assert "\n" not in str(err.value)


def test_settings_panel_is_built_from_the_declarations() -> None:
    import gradio as gr

    with gr.Blocks():
        panel = build_panel({"budget": 512}, {"budget": "512 is this preset's choice"})
    declared = {name for name, (_, spec) in settings().items() if spec.app}
    assert list(panel) == list(app_settings()) and set(panel) == declared
    for name, component in panel.items():
        spec = settings()[name][1]
        assert component.label == spec.label and component.info.startswith(spec.help)
    kinds = {name: type(component) for name, component in panel.items()}
    assert kinds["greedy"] is gr.Checkbox and kinds["drafter"] is gr.Radio and kinds["overflow"] is gr.Radio
    assert kinds["temperature"] is gr.Slider and kinds["chunk_size"] is gr.Slider
    assert kinds["max_new_tokens"] is gr.Number and kinds["seed"] is gr.Number
    assert kinds["budget"] is gr.Textbox and kinds["gamma2"] is gr.Textbox and panel["gamma2"].value == ""
    assert panel["budget"].value == "512" and "preset's choice" in panel["budget"].info
    reselect = panel["reselect"]
    assert type(reselect) is gr.Dropdown and reselect.allow_custom_value and reselect.value == "once"
    assert [value for _, value in reselect.choices][:2] == ["once", "every_verify"] and ("8", "8") in reselect.choices
    assert (panel["temperature"].minimum, panel["temperature"].maximum, panel["temperature"].step) == (0.0, 2.0, 0.05)
    assert panel["max_new_tokens"].value == GenerationConfig.max_new_tokens


def test_preset_settings_are_the_presets_choice() -> None:
    budget, penalty = callbacks.preset_settings(EMBEDDED)
    assert budget["value"] == "512" and "preset's choice" in budget["info"]
    assert penalty["value"] == 1.2 and "preset's choice" in penalty["info"]
    budget, penalty = callbacks.preset_settings(PRESETS[1].name)  # the others go back to the engine's defaults
    assert budget["value"] == "" and "preset" not in budget["info"]
    assert penalty["value"] == GenerationConfig.repetition_penalty == 1.0 and "preset" not in penalty["info"]


# ---------------------------------------------------------------- reducer, views, figures


def test_bins_cover_all_chunks_within_the_column_limit() -> None:
    edges = bin_edges(16_384)
    assert len(edges) - 1 == MAX_COLUMNS and edges[0] == 0 and edges[-1] == 16_384
    assert np.all(np.diff(edges) >= 1)
    values = np.zeros(16_384, dtype=np.uint8)
    values[[5, 16_383]] = [7, 3]
    binned = bin_max(values, edges)
    assert binned.dtype == np.uint8 and binned[0] == 7 and binned[-1] == 3 and binned[1:-1].sum() == 0
    assert len(bin_edges(10)) - 1 == 10


def test_events_from_the_engine_are_rebuilt_typed_at_the_boundary(embedded) -> None:
    cfg = GenerationConfig(method="triforce", max_new_tokens=6, budget=64, greedy=True)
    events = list(embedded.generate("The cat sat on the mat. " * 20, "Where did the cat sit?", cfg))
    assert {type(e).__name__ for e in events} >= {"PromptReady", "PrefillProgress", "RetrievalSelection", "Verdict",
                                                   "Tokens", "StepTiming", "Finished"}
    assert [typed(e.to_dict()) for e in events] == events
    stats = typed(events[-1].to_dict()).stats
    assert isinstance(stats, Stats) and stats.level2_acceptance == events[-1].stats.level2_acceptance
    shown = typed({"kind": "Verdict", "level": 3, "round": 0, "proposed": [5], "accepted": 0, "token": 1,
                   "bonus": False, "proposed_texts": ["x"]})
    assert isinstance(shown, ShownVerdict) and shown.proposed_texts == ["x"]
    with pytest.raises(ValueError, match="unknown event kind 'Nonsense'"):
        typed({"kind": "Nonsense"})


def test_reducer_tracks_tokens_selection_and_acceptance() -> None:
    state = RunState()
    apply_event(state, prompt_event(20), now=0.0)
    apply_event(state, PrefillProgress(159, 159, 1.5, 1000), now=1.5)
    # 2 layers × 2 KV heads; chunk 0 kept by all four, chunk 7 by three, chunk 19 by one
    apply_event(state, selection_event(20, [[[0, 7], [0, 7]], [[0, 7], [0, 19]]]))
    apply_event(state, verdict_event(2, 0, "ab", 1))
    apply_event(state, verdict_event(3, 0, "abc", 2))
    apply_event(state, tokens_event(["A", "b", "c"], ["draft", "level2", "level3"], 0), now=2.0)
    apply_event(state, selection_event(20, [[[0, 1], [0, 1]], [[0, 1], [0, 1]]], round_=1))
    apply_event(state, tokens_event(["d"], ["level3"], 1), now=2.5)
    assert state.totals.tolist()[:2] == [4, 4] and state.max_count == 4
    assert state.step_rounds == [0, 1] and state.step_selection == [0, 1]
    assert answer_parts(answer_html(state)) == [("p-draft", "A"), ("r12", "b"), ("p-level2", "b"), ("r23", "c"),
                                                ("p-level3", "cd")]  # one stretch per provenance in a row
    stats = live_stats(state, now=3.5)
    assert stats["level1_acceptance"] == 0.5 and stats["level2_acceptance"] == pytest.approx(2 / 3)
    assert stats["tokens_per_s"] == pytest.approx(4 / 2.0) and stats["tokens_per_target_forward"] == 4.0
    assert stats["budget_pct_of_prompt"] == pytest.approx(100 * 64 / 160) and not stats["finished"]
    assert stats["cache_bytes"] == 1000 and stats["retrieval_cache_bytes"] == 4096  # known while running
    first = state.selection_columns[0]
    assert first[0] == 4 and first[7] == 3 and first[19] == 1 and first[1] == 0
    assert [r for r, _ in state.kept_selections] == [0, 1] and state.kept_selections[0][1].shape == (20,)


def test_time_to_first_token_is_counted_from_the_runs_own_prompt() -> None:
    """Compare creates both runs' states before the first one starts: the second run's clock starts at its own
    prompt, not at the first run's."""
    state = RunState(started=0.0)
    apply_event(state, prompt_event(4), now=30.0)
    apply_event(state, PrefillProgress(31, 31, 0.5, 0, reused=True), now=30.5)
    apply_event(state, tokens_event(["a"], ["level3"], 0), now=30.8)
    stats = live_stats(state, now=31.0)
    assert stats["time_to_first_token_s"] == pytest.approx(0.8) and stats["prefill_reused"]


def test_rejected_drafts_are_placed_where_they_were_tried() -> None:
    state = RunState()
    # round 0 (γ2 = 4): level 2 keeps a of "ab", none of "cd", then e; level 3 keeps A of "ABCD" and corrects to X
    for ev in (verdict_event(2, 0, "ab", 1), verdict_event(2, 0, "cd", 0), verdict_event(2, 0, "e", 1, bonus=True),
               verdict_event(3, 0, "ABCD", 1), tokens_event(["A", "X"], ["draft", "level3"], 0),
               verdict_event(2, 1, "fg", 2, bonus=True), verdict_event(3, 1, "FGH", 3, bonus=True),
               tokens_event(["F", "G", "H", "Y"], ["draft", "draft", "level2", "level3"], 1),
               verdict_event(3, 2, "IJK", 2), tokens_event(["I"], ["level2"], 2)):  # the answer ends after I
        apply_event(state, ev)
    # "b" was tried at position 1 and rejected by level 2; level 3 rejected B there, and with it the run CD, inside
    # which level 2 had rejected "cd"; the K level 3 rejected in round 2 lies beyond the answer (cut after I)
    assert state.rejected == [(1, (1, 2), "b"), (1, (2, 3), "B"), (1, (1, 2), "cd"), (1, (2, 3), "CD")]
    parts = answer_parts(answer_html(state))
    assert parts[:6] == [("p-draft", "A"), ("r12", "b"), ("r23", "B"), ("r12", "cd"), ("r23", "CD"),
                         ("p-level3", "X")]
    assert "".join(text for cls, text in parts if cls.startswith("p-")) == "AXFGHYI"
    legend = answer_html(state).split("</div>", 1)[0]
    assert REJECTED[(1, 2)][0] in legend and REJECTED[(1, 3)][0] not in legend and PROVENANCE["copy"][0] not in legend
    assert [(t.steps, t.proposed, t.accepted, t.bonus) for t in state.rounds] == [
        ([(2, 1), (2, 0), (1, 1)], 4, 1, False), ([(2, 2)], 3, 3, True), ([], 3, 2, False)]
    c = state.counts
    assert (c.level1_proposed, c.level1_accepted, c.level2_proposed, c.level2_accepted) == (7, 4, 10, 6)
    strip = timeline_html(state)
    assert strip.count("'tl-round'") == 3 and "3 rounds" in strip and "level 3 kept 1 of 4 level-2 tokens" in strip
    first = strip.split("'tl-round'")[1]
    assert first.count("'ok'") == 1 + 2 and first.count("'no'") == 1 + 2 and first.count("'skip'") == 2 + 1
    assert timeline_html(state, limit=2).count("'tl-round'") == 2 and "the last 2 items shown" in \
        timeline_html(state, 2)
    assert "drafts nothing" in timeline_html(RunState(method="ar"))


def test_a_rejected_line_break_is_a_visible_mark_and_a_single_round_or_selection_is_singular() -> None:
    state = RunState()
    apply_event(state, prompt_event(4))
    apply_event(state, selection_event(4, [[[0, 1], [2]], [[3], [0]]]))
    apply_event(state, verdict_event(3, 0, "\n\nx", 0))  # level 3 rejected a draft of two line breaks and an x
    apply_event(state, tokens_event(["A"], ["level3"], 0))
    parts = answer_parts(answer_html(state))
    assert parts == [("r23", "⏎⏎x"), ("p-level3", "A")]  # struck-through line breaks would draw blank lines
    assert "1 round with drafts" in timeline_html(state)
    apply_event(state, tokens_event(["B"], ["level3"], 1))  # a second step, under the one selection
    title = selection_heatmap(state, HEATMAP_MODES[1]).layout.title.text
    assert title.startswith("Per decoding step: one selection, kept at every decoding step<br>")
    # a colour bar of counts (KV heads, layer×heads) ticks whole numbers only
    for mode in HEATMAP_MODES[1:]:
        bar = selection_heatmap(state, mode).data[0].colorbar
        assert bar.dtick >= 1 and float(bar.dtick).is_integer() and bar.tick0 == 0 and bar.tickformat == "d"


def test_plots_are_drawn_again_only_once_what_they_show_has_changed() -> None:
    state, redraw = RunState(), callbacks.Redraw()
    apply_event(state, prompt_event(4))
    assert redraw.due(0.0, False, state)
    apply_event(state, PrefillProgress(done=2, total=4, seconds=1.0, cache_bytes=0))
    assert not redraw.due(10.0, False, state) and not redraw.due(20.0, True, state)  # a prefill's progress, a wait
    apply_event(state, tokens_event(["A"], ["level3"], 0))
    assert redraw.due(10.0, False, state)
    apply_event(state, tokens_event(["B"], ["level3"], 1))
    assert not redraw.due(10.1, False, state)  # within PLOT_INTERVAL_S of the last drawing
    assert redraw.due(10.0 + callbacks.PLOT_INTERVAL_S, False, state)


def test_an_upload_is_named_in_the_sample_menu_and_its_questions_are_generic_ones() -> None:
    titles = [sample.title for sample in callbacks.load_samples()]
    menu, examples, instruction, _ = callbacks.leave_sample("/tmp/gradio/ab12/notes.pdf")
    assert menu.value == "📄 notes.pdf" and [value for _, value in menu.choices] == [*titles, "📄 notes.pdf"]
    assert instruction == callbacks.GENERIC_INSTRUCTIONS[0]
    assert examples.raw_samples == [[i] for i in callbacks.GENERIC_INSTRUCTIONS]
    long = callbacks.leave_sample("/tmp/gradio/ab12/" + "a" * 200 + ".txt")[0].value  # no wider than a title
    assert long.startswith("📄 aaa") and long.endswith("…") and len(long) <= max(map(len, titles))
    # the upload's entry chosen again changes nothing; a sample chosen then loads and takes the entry's place
    assert all(update == callbacks.gr.skip() for update in callbacks.choose_sample("📄 notes.pdf"))
    text, _, _, note, menu = callbacks.choose_sample(titles[1])
    assert text and note == "" and menu.value == titles[1] and [value for _, value in menu.choices] == titles


def test_an_upload_is_named_and_the_embedded_model_said_to_be_often_wrong_on_it_only_where_it_answers() -> None:
    from app.presets import EMBEDDED, all_presets

    larger = next(preset.name for preset in all_presets() if preset.target is not None)
    note = callbacks.leave_sample("/tmp/gradio/ab12/my <b>notes.pdf", EMBEDDED)[3]
    assert "my &#60;b&#62;notes.pdf" in note and callbacks.EMBEDDED_ON_YOURS in note  # named, as text
    note = callbacks.leave_sample("/tmp/gradio/ab12/notes.pdf", larger)[3]
    assert "notes.pdf" in note and callbacks.EMBEDDED_ON_YOURS not in note
    assert callbacks.choose_sample(callbacks.load_samples()[0].title)[3] == ""  # a sample clears the note


def test_the_models_table_is_headed_by_the_target_not_an_empty_row() -> None:
    from app.explainer import engine_table

    table = engine_table([{"target": "tiny", "draft": None, "device": "cpu", "dtype": "float32",
                           "context_length": 8192, "versions": {"torch": "2.x"}}])
    assert table.splitlines()[:3] == ["| target | tiny |", "|---|---|", "| draft | none |"]


def test_answer_is_escaped_text_and_its_overlays_are_switched_by_their_checkboxes() -> None:
    state = RunState()
    apply_event(state, tokens_event(["<b>x</b>", " & y\n"], ["draft", "draft"], 0))
    markup = answer_html(state)
    assert "<b>x" not in markup and answer_parts(markup) == [("p-draft", "<b>x</b> & y\n")]
    assert "appears here" in answer_html(RunState()) and "appears here" in answer_html(None)
    css = callbacks_css()
    compare = [(f"compare-{method}", ("colour-compare", "compare-show-rejected")) for method in ("ar", "triforce",
                                                                                               "auto")]
    for answer, (colour, rejected) in (("answer", ("colour-answer", "show-rejected")), *compare):
        assert f"body:has(#{colour} input:checked) #{answer} [class^='p-']" in css
        assert f"body:has(#{rejected} input:checked) #{answer} del {{display: inline}}" in css
    assert ".answer-text del {display: none" in css  # plain text unless asked


def callbacks_css() -> str:
    from app.layout import CSS

    return CSS


def test_a_plan_the_planner_chooses_is_said_in_one_line_and_marked_on_the_timeline() -> None:
    state = RunState(method="auto")
    apply_event(state, PlanChosen(0, "levels 1 → 2 → 3 (draft model, γ1 2, γ2 6)",
                                  "measuring what each level costs", "model", True, 2, 6))
    apply_event(state, verdict_event(2, 0, "ab", 2, bonus=True))
    apply_event(state, verdict_event(3, 0, "abc", 3, bonus=True))
    apply_event(state, tokens_event(list("abcd"), ["draft", "draft", "level2", "level3"], 0))
    apply_event(state, PlanChosen(1, "levels 1 → 3 (draft model, γ 4)",
                                  "expected 1.30× autoregressive; a level-1 token 5%", "model", False, 0, 4))
    apply_event(state, verdict_event(3, 1, "efgh", 1))  # level 3 checks level 1's tokens directly
    apply_event(state, tokens_event(["e", "Z"], ["draft", "level3"], 1))
    apply_event(state, PlanChosen(2, "autoregressive", "expected 1.12× autoregressive", "", False, 0, 0))
    for round_ in (2, 3, 4):
        apply_event(state, verdict_event(3, round_, "", 0, bonus=True))
        apply_event(state, tokens_event(["q"], ["target"], round_))  # the engine's provenance for a round that
        # drafted nothing: an autoregressive step, and its token says so (not "level-3 correction/bonus")
    assert [provenance for _, provenance in state.pieces][-4:] == ["level3", "target", "target", "target"]
    assert PROVENANCE["target"][0] == "autoregressive" and ("p-target", "qqq") in answer_parts(answer_html(state))
    c = state.counts
    assert (c.level1_proposed, c.level1_accepted, c.level2_proposed, c.level2_accepted) == (2 + 4, 2 + 1, 3, 3)
    assert state.rejected == [(5, (1, 3), "fgh")]
    strip = timeline_html(state)
    marks = re.findall(r"<b class='tl-plan' title='([^']*)'>▸ ([^<]*)</b>", strip)
    assert [plan for _, plan in marks] == [p.plan for p in state.plans] and "expected 1.30×" in marks[1][0]
    assert "3 AR" in strip and "level 3 kept 1 of 4 level-1 tokens" in strip
    status = status_markdown(state)
    line = next(line for line in status.split("\n\n") if "Method auto" in line)
    assert "**autoregressive** from round 2: expected 1.12× autoregressive" in line
    assert "before: levels 1 → 2 → 3 (draft model, γ1 2, γ2 6) → levels 1 → 3 (draft model, γ 4)" in line
    assert [p["plan"] for p in live_stats(state)["plans"]] == [p.plan for p in state.plans]


def test_level_costs_of_a_finished_run() -> None:
    state = RunState()
    apply_event(state, RetrievalSelection(0, 0, 8, 4, 32, 64, [[[0]]], 0.001, 100))
    for ev in (verdict_event(2, 0, "ab", 1), verdict_event(2, 0, "c", 1), verdict_event(3, 0, "abc", 3, True),
               verdict_event(2, 1, "d", 0), verdict_event(3, 1, "d", 0)):
        apply_event(state, ev)
    for round_, ms in ((0, 3.0), (1, 2.0)):
        apply_event(state, StepTiming(round_, ms, 2 * ms, 3 * ms, 0.0, 1))
    assert level_costs(state) == [] and live_stats(state)["levels"] == []
    stats = dict(drafter="model", level1_steps=5, target_forwards=2, level1_weight_bytes=1000, level1_cache_bytes=24,
                 target_weight_bytes=4000, retrieval_cache_bytes=100, cache_bytes=1000,
                 tokens_per_target_forward=2.5, device="cpu", dtype="float32")
    apply_event(state, finished_event(**stats))
    rows = {row["key"]: row for row in level_costs(state)}
    assert list(rows) == ["level1", "level2", "level3", "selection"]
    assert (rows["level1"]["steps"], rows["level1"]["ms_per_step"], rows["level1"]["bytes_per_step"]) == (5, 1.0, 1024)
    assert (rows["level2"]["steps"], rows["level2"]["bytes_per_step"]) == (3, 4100)
    assert rows["level2"]["ms_per_step"] == pytest.approx(10 / 3)
    assert (rows["level3"]["steps"], rows["level3"]["ms_per_step"], rows["level3"]["bytes_per_step"]) == (2, 7.5, 5000)
    assert rows["selection"]["ms"] == pytest.approx(1.0) and rows["selection"]["bytes_per_step"] is None
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
    assert rows["level3"]["share"] == pytest.approx(15 / 31)
    ar = RunState(method="ar", final_stats=run_stats(**stats))
    assert [row["key"] for row in level_costs(ar)] == ["target"]
    ngram = RunState(rounds=state.rounds, final_stats=run_stats(**{**stats, "drafter": "ngram", "level1_steps": 0}))
    assert level_costs(ngram)[0]["steps"] == 3 and "n-gram" in level_costs(ngram)[0]["level"]
    assert "level1" not in {r["key"] for r in level_costs(RunState(final_stats=run_stats(**{**stats,
                                                                                         "drafter": "none"})))}
    figure = cost_figure(live_stats(state)["levels"], 2.5, level_costs(ar))
    assert len(figure.data) == 3 and len(figure.data[0].y) == 5 and len(figure.data[2].y) == 4
    assert "2.50 tokens per target forward" in figure.layout.title.text
    assert_valid_plotly(figure)


def test_the_autoregressive_steps_of_an_auto_run_are_costed_apart_from_its_verification_passes() -> None:
    """A pass verifying many drafts costs more than a one-token step: their average would read as a dear
    autoregressive step. A round that drafted nothing is costed as an autoregressive step, apart."""
    state = RunState(method="auto")
    for ev in (verdict_event(2, 0, "ab", 1), verdict_event(3, 0, "ab", 2, True), verdict_event(3, 1, "", 0, True)):
        apply_event(state, ev)
    apply_event(state, StepTiming(0, 1.0, 2.0, 9.0, 0.0, 3))
    apply_event(state, StepTiming(1, 0.0, 0.0, 4.0, 0.0, 1))
    apply_event(state, finished_event(drafter="none", target_forwards=2, target_weight_bytes=10, cache_bytes=5))
    rows = {row["key"]: row for row in level_costs(state)}
    assert (rows["level3"]["steps"], rows["level3"]["ms"]) == (1, 9.0)
    assert (rows["target"]["steps"], rows["target"]["ms_per_step"]) == (1, 4.0)


def test_an_autoregressive_table_shows_a_dash_for_what_does_not_apply() -> None:
    ar = RunState(method="ar")
    apply_event(ar, prompt_event(4))
    apply_event(ar, finished_event([1, 2], method="ar", tokens_per_s=5.0, target_forwards=2,
                                   tokens_per_target_forward=1.0, cache_bytes=2**20))
    table = stats_markdown(live_stats(ar))
    for row in ("level-1 acceptance", "level-2 acceptance (by level 3)", "budget / prompt", "retrieval cache"):
        assert f"| {row} | — |" in table
    assert "tokens per target forward" not in table and "| full KV cache | 1.0 MiB |" in table  # one by definition
    assert "0 %" not in table and "–" not in table


def assert_valid_plotly(figure) -> None:
    """The figure, built without validation for speed, passes plotly's validation (a misspelt property raises)."""
    import plotly.graph_objects as go

    spec = figure.to_plotly_json()
    assert len(go.Figure(spec).data) == len(spec["data"])


def test_document_view_highlights_kept_chunks_and_summarises_gaps() -> None:
    state = RunState()
    apply_event(state, prompt_event(20))
    apply_event(state, selection_event(20, [[[0, 7], [0, 7]], [[0, 7], [0, 19]]]))
    view = document_html(state)
    marks = re.findall(r"<mark class='s-(\w+)'>([^<]*)</mark>", view.split("</div>", 1)[1])
    assert marks == [("sink", "c0 "), ("hot", "c7 "), ("warm", "c19 ")]
    assert " … 48 tokens … " in view and "c3 " not in view
    assert all(label in view for label, _ in SPANS.values())


def heavy_run(tokens: int, rounds: int, answer_per_round: int = 4) -> RunState:
    """A run over a `tokens`-token prompt (chunks of 8, a 30-layer × 3-KV-head model, budget 4096) re-selecting
    every round, as RetrievalSelection events would say: synthetic events, no model."""
    rng = np.random.default_rng(0)
    chunks, state = tokens // 8, RunState(method="auto")
    apply_event(state, PromptReady(tokens, tokens - 40, 0, 131072, 256, 8, ["a chunk " for _ in range(chunks)]))
    apply_event(state, PrefillProgress(tokens - 1, tokens - 1, 9.0, 2**34))
    apply_event(state, PlanChosen(0, "levels 1 → 2 → 3 (draft model, γ1 2, γ2 6)",
                                  "measuring what each level costs", "model", True, 2, 6))
    base = [[rng.choice(chunks, 512, replace=False) for _ in range(3)] for _ in range(30)]
    for round_ in range(rounds):
        ids = [[np.sort((h + round_) % chunks).tolist() for h in heads] for heads in base]
        apply_event(state, RetrievalSelection(round_, 0, 8, chunks, tokens, 4096, ids, 0.001, 2**27))
        apply_event(state, verdict_event(2, round_, "ab", 1))
        apply_event(state, verdict_event(3, round_, "wxyz", answer_per_round - 1))
        apply_event(state, tokens_event([" tok"] * answer_per_round, ["draft"] * (answer_per_round - 1) + ["level3"],
                                        round_))
        apply_event(state, StepTiming(round_, 1.0, 2.0, 3.0, 0.1, answer_per_round))
    return state


def frame_bytes(frame: dict) -> int:
    """Bytes of a frame as the app sends it: every output but the server-side state, a figure as plotly JSON."""
    import plotly.graph_objects as go

    sent = {name: value.to_json() if isinstance(value, go.Figure) else value for name, value in frame.items()
            if name != "run_state"}
    return len(json.dumps(sent, ensure_ascii=False, default=str).encode())


def test_frames_stay_small_at_120k_tokens_and_the_download_has_every_chunk(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(callbacks, "RAW_DIR", tmp_path)
    state = heavy_run(122_880, rounds=160)
    frame = callbacks.triforce_frame(state, HEATMAP_MODES[0])
    assert frame_bytes(frame) <= FRAME_LIMIT
    trace = json.loads(frame["heatmap"].to_json())["data"][0]
    rows, columns = (int(n) for n in trace["z"]["shape"].split(","))
    assert columns == MAX_COLUMNS and rows <= 96 and "Per decoding step: 160 selections" in \
        frame["heatmap"].layout.title.text
    apply_event(state, finished_event(list(range(640)), prompt_tokens=122_880, cache_bytes=2**34))
    frame = callbacks.triforce_frame(state, HEATMAP_MODES[0])
    assert frame_bytes({**frame, "raw_stats": None}) <= FRAME_LIMIT
    raw = json.loads(Path(frame["raw_stats"]).read_text())
    assert len(raw["selections"]) == 160 and all(len(s["kept_by"]) == 15_360 for s in raw["selections"])
    assert raw == json.loads(json.dumps(raw_data(state)))
    assert len(raw["last_selection_per_layer"]) == 30 and raw["answer"]["pieces"][0] == [" tok", "draft"]


def test_heatmap_shows_layers_for_one_selection_and_steps_once_rows_differ() -> None:
    """One selection: its layers, or one row per decoding step's view (not as many identical rows as steps); a
    re-selection: the steps, as many rows as differ."""
    state = RunState()
    apply_event(state, prompt_event(5000))
    rng = np.random.default_rng(0)
    heads = [[sorted({0, *rng.choice(5000, 64, replace=False).tolist()}) for _ in range(3)] for _ in range(4)]
    apply_event(state, selection_event(5000, heads))
    for step in range(300):
        apply_event(state, tokens_event(["x"], ["draft"], step))
    auto = selection_heatmap(state, HEATMAP_MODES[0])
    assert auto.layout.title.text.startswith("Per layer: the answer's one selection, kept at every decoding step")
    layer = json.loads(auto.to_json())["data"][0]
    assert layer["z"]["shape"].replace(" ", "") == f"4,{MAX_COLUMNS}" and layer["y"] == [0, 1, 2, 3]
    steps = json.loads(selection_heatmap(state, HEATMAP_MODES[1]).to_json())["data"][0]
    rows, columns = (int(n) for n in steps["z"]["shape"].split(","))
    assert columns == MAX_COLUMNS and rows == 1 and steps["z"]["dtype"] == "u1"  # one selection: one row, not 300
    assert steps["x"][0].startswith("chunks 0–") and "tokens 0–" in steps["x"][0] and "“c0 c1" in steps["x"][0]
    apply_event(state, selection_event(5000, [[[0, 1]] * 3] * 4, round_=300))  # a re-selection: rows now differ
    apply_event(state, tokens_event(["x"], ["draft"], 300))
    assert selection_heatmap(state, HEATMAP_MODES[0]).layout.title.text.startswith("Per decoding step: 2 selections")
    steps = json.loads(selection_heatmap(state, HEATMAP_MODES[1]).to_json())["data"][0]
    assert int(steps["z"]["shape"].split(",")[0]) == len(pick_rows(301)) <= 96  # steps binned to a bounded height
    apply_event(state, selection_event(5000, [[[0, 1]] * 3] * 4, round_=301))  # the same again: nothing new kept
    assert len(state.kept_selections) == 2
    assert_valid_plotly(auto)


def test_heatmap_hover_shows_document_markup_as_text() -> None:
    from app.figures import column_labels

    state = RunState()
    apply_event(state, PromptReady(16, 16, 0, 8192, 8, 8, ["<b>bold</b> & ", "<a href='x'>link</a>"]))
    apply_event(state, selection_event(2, [[[0, 1]]]))
    labels = column_labels(state)
    assert "“&lt;b&gt;bold&lt;/b&gt; &amp;”" in labels[0] and "“&lt;a href=&#x27;x&#x27;&gt;link" in labels[1]
    assert "<" not in "".join(labels)


def test_upload_cache_is_cleaned() -> None:
    from app.layout import UPLOAD_CACHE, build_demo

    assert build_demo().delete_cache == UPLOAD_CACHE and UPLOAD_CACHE[1] <= 86400


def test_heatmap_without_retrieval_says_why() -> None:
    figure = selection_heatmap(RunState(method="ar"))
    assert "no retrieval" in figure.layout.annotations[0].text
    assert_valid_plotly(figure)


def test_status_and_stats_give_one_count_of_the_prompt_and_of_what_was_dropped() -> None:
    state = RunState()
    apply_event(state, PromptReady(2193, 4880, 2691, 8192, 128, 8, ["x"] * 275))
    assert "Prefill: the 2,193-token prompt" in status_markdown(state)
    apply_event(state, PrefillProgress(1024, 2192, 1.0, 0))
    status = status_markdown(state)
    assert "Prefill: 47% of the 2,193-token prompt" in status and "2,192" not in status
    assert "middle 2,691 tokens were dropped" in status
    assert "| tokens dropped (truncated) | 2,691 |" in stats_markdown(live_stats(state))
    apply_event(state, PrefillProgress(2192, 2192, 2.0, 0))  # prefilled, no token yet: never "0 tokens"
    assert status_markdown(state).startswith("▶️ Decoding: the first token"), status_markdown(state)


def test_offloaded_run_says_where_caches_live_and_what_crosses_the_link() -> None:
    state = RunState()
    apply_event(state, prompt_event(4))
    assert "CPU memory" not in status_markdown(state)
    caches = {"full KV cache": {"where": "CPU", "bytes": 3 * 2**30},
              "retrieval cache": {"where": "GPU", "bytes": 2**29}}
    apply_event(state, PromptReady(32, 32, 0, 8192, 8, 8, ["c "] * 4, offloaded=True, caches=caches))
    status = status_markdown(state)
    assert "lives in CPU memory" in status and "full KV cache 3.00 GiB on the CPU" in status
    assert "retrieval cache 0.50 GiB on the GPU" in status
    apply_event(state, finished_event([1, 2, 3, 4], host_link_bytes=2 * 2**30, target_forwards=1,
                                      cache_bytes=3 * 2**30, warmup_s=0.5, drafter="none"))
    table = stats_markdown(live_stats(state))
    assert "CPU → GPU per token (host link) | 0.50 GiB" in table and "in CPU memory, streamed" in table
    assert "warm-up (CUDA graphs captured, not in decode time) | 0.50 s" in table
    assert "streamed from CPU memory" in {r["key"]: r for r in level_costs(state)}["level3"]["level"]


def test_a_budget_over_the_prompt_reads_whole_prompt() -> None:
    state = RunState()
    state.prompt_tokens, state.budget = 100, 140
    assert live_stats(state)["budget_pct_of_prompt"] == 100.0
    assert "| budget / prompt | 100 % (whole prompt) |" in stats_markdown(live_stats(state))


def test_document_line_counts_what_the_run_drops_and_the_budgets_share_of_its_prompt() -> None:
    long_doc = (ROOT / "assets" / "docs" / "pride_and_prejudice.txt").read_text(encoding="utf-8")
    engine = callbacks.load_engine(None, None)
    events = engine.generate(long_doc, "Who is Mr Darcy?", GenerationConfig(max_new_tokens=64))
    ready = next(events)
    events.close()
    assert isinstance(ready, PromptReady) and ready.dropped_tokens > 100_000
    line = callbacks.describe_document(long_doc, EMBEDDED, 4096, "Who is Mr Darcy?", 64)
    assert f"drops the middle {ready.dropped_tokens:,} tokens" in line and "64 answer tokens" in line
    state = RunState()
    apply_event(state, ready)
    apply_event(state, RetrievalSelection(0, 0, 8, ready.prompt_tokens // 8, ready.prompt_tokens, 4096, [[[0]]], 0.0,
                                          0))
    share = live_stats(state)["budget_pct_of_prompt"]
    assert f"budget 4,096 tokens = {share:.1f} % of the {ready.prompt_tokens:,}-token prompt" in line
    assert "= the whole prompt" in callbacks.describe_document("A short note.", EMBEDDED, 4096)


def test_comparison_summary_checks_token_identity_and_says_where_outputs_differ() -> None:
    runs = {method: RunState(method=method) for method in ("ar", "triforce", "auto")}
    ar, tf, auto = runs.values()
    ar.final_stats = run_stats(method="ar", tokens_per_s=2.0, near_ties=[(2, 0.01)])
    tf.final_stats = run_stats(method="triforce", tokens_per_s=5.0)
    auto.final_stats = run_stats(method="auto", tokens_per_s=3.0)
    ar.token_ids, tf.token_ids, auto.token_ids = [1, 2, 3], [1, 2, 4], [1, 2, 3]
    text, summary = callbacks.comparison_summary(runs, greedy=True)
    assert summary["identical"] == {"triforce": False, "auto": True} and summary["first_difference"]["triforce"] == 2
    assert summary["speedup"] == {"triforce": 2.5, "auto": 1.5} and "TriForce **2.50×** · auto **1.50×**" in text
    assert "TriForce (levels 1 → 2 → 3): not token-identical" in text and "differ from token 3" in text
    assert "near-tie" in text and "Token-identical" not in text
    tf.token_ids = [1, 2, 3]
    assert callbacks.comparison_summary(runs, greedy=True)[1]["identical"] == {"triforce": True, "auto": True}
    assert "every run produced the same 3 tokens" in callbacks.comparison_summary(runs, greedy=True)[0]
    assert callbacks.comparison_summary(runs, greedy=False)[1]["identical"] == {"triforce": None, "auto": None}
    tf.final_stats = run_stats(method="triforce", tokens_per_s=5.0, device="cuda:0", dtype="bfloat16",
                               prefill_reused=True, prefill_s=0.01)
    auto.plans.append(PlanChosen(0, "autoregressive", "expected 1.00× autoregressive", "", False, 0, 0))
    text, summary = callbacks.comparison_summary(runs, greedy=False)
    assert summary["device"] == "cuda:0 · bfloat16" and "Ran on **cuda:0 · bfloat16**." in text and "reused" in text
    assert "**Method auto** chose **autoregressive** from round 0: expected 1.00×" in text
    assert callbacks.CPU_NOTE not in text  # said beside figures measured on a CPU only
    tf.final_stats = run_stats(method="triforce", tokens_per_s=5.0, device="cpu", dtype="float32")
    assert "Ran on **cpu · float32**. " + callbacks.CPU_NOTE in callbacks.comparison_summary(runs, greedy=False)[0]
    bars = compare_bars([(method, f"run {method}", live_stats(state)) for method, state in runs.items()])
    assert len(bars.data) == 12 and [bar.name for bar in bars.data[::4]] == ["run ar", "run triforce", "run auto"]
    assert "cpu · float32" in bars.layout.title.text
    assert [a.text for a in bars.layout.annotations][2:] == ["prefill (s)", "time to first token (s)"]
    assert_valid_plotly(bars)
    table = stats_markdown(live_stats(tf))
    assert "decode: tokens / s | 5.00" in table and "decode: ms / token | 200.0" in table
    assert "drafts made ahead" not in table  # a row only where level 2 drafted ahead
    tf.final_stats = run_stats(method="triforce", tokens_per_s=5.0, ahead_made=12, ahead_kept=7, prefill_reused=True)
    table = stats_markdown(live_stats(tf))
    assert "| level-2 drafts made ahead, during level 3 (used) | 12 (7 used) |" in table
    assert "prefill (cache of the previous run reused)" in table


def test_what_ran_names_an_auto_run_that_decoded_autoregressively_as_such() -> None:
    from app.views import run_heading, run_label, what_ran

    auto = RunState(method="auto")
    apply_event(auto, PlanChosen(0, "levels 1 → 2 → 3 (draft model, γ1 2, γ2 6)", "measuring", "model", True, 2, 6))
    apply_event(auto, verdict_event(2, 0, "ab", 2, bonus=True))
    apply_event(auto, verdict_event(3, 0, "abc", 3, bonus=True))
    apply_event(auto, tokens_event(list("abcd"), ["draft", "draft", "level2", "level3"], 0))
    assert what_ran(auto) == "levels 1 → 2 → 3" and run_label(auto) == "auto: drafting"
    apply_event(auto, PlanChosen(1, "autoregressive", "expected 1.02× autoregressive", "", False, 0, 0))
    for round_ in (1, 2):
        apply_event(auto, verdict_event(3, round_, "", 0, bonus=True))
        apply_event(auto, tokens_event(["q"], ["target"], round_))
    assert what_ran(auto) == "levels 1 → 2 → 3, then autoregressive (2 of 6 tokens autoregressive)"
    assert run_label(auto) == "auto: 2/6 tokens AR"
    assert run_heading(auto).startswith("**Method auto") and "then autoregressive (2 of 6" in run_heading(auto)
    plain = RunState(method="auto")
    apply_event(plain, PlanChosen(0, "autoregressive", "measuring an autoregressive step", "", False, 0, 0))
    apply_event(plain, verdict_event(3, 0, "", 0, bonus=True))
    apply_event(plain, tokens_event(["q"], ["target"], 0))
    assert what_ran(plain) == "autoregressive throughout" and run_label(plain) == "auto: autoregressive"
    assert run_label(RunState(method="triforce")) == "TriForce" and what_ran(RunState(method="ar")) == \
        "autoregressive"


def test_throttle_limits_rate_but_lets_forced_updates_through() -> None:
    gate = callbacks.Throttle(0.25)
    assert [gate.due(t) for t in (0.0, 0.1, 0.2, 0.3, 0.4)] == [True, False, False, True, False]
    assert gate.due(0.41, force=True)


# ---------------------------------------------------------------- the served app (real engine, embedded model)


def test_the_python_snippet_runs_from_anywhere_and_answers_the_default_question_right(tmp_path: Path) -> None:
    """The app's first sample and question, asked (greedy, TriForce) by the script the app shows, saved outside the
    checkout and run with no PYTHONPATH: the one real run of the embedded model on the default sample."""
    from app.explainer import python_snippet
    from app.layout import default_sample

    sample = default_sample(load_samples())
    code = python_snippet(sample.path, sample.instructions[0]).split("```python\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "ask.py").write_text(code, encoding="utf-8")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "ask.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stderr[-2000:]
    answer = run.stdout.rsplit("\n", 2)[0]  # the answer, then the line of its figures
    assert "July 4, 1776" in answer, answer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The app on a free loopback port, with an unloadable model in TRIFORCE_TARGET (it must stay usable)."""
    from gradio_client import Client

    from app.layout import build_demo, launch_options

    mp = pytest.MonkeyPatch()
    mp.setenv("TRIFORCE_TARGET", BROKEN_TARGET)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    demo = build_demo()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options())
    url = f"http://127.0.0.1:{port}/"
    yield url, Client(url, verbose=False)
    demo.close()
    mp.undo()


@pytest.fixture(scope="module")
def short_doc() -> str:
    """The first ~450 tokens of a bundled sample: quick to prefill on CPU."""
    return (ROOT / "assets" / "docs" / "us_declaration_of_independence.txt").read_text(encoding="utf-8")[:2000]


def run_kwargs(document: str, **overrides) -> dict:
    """Arguments of the /triforce and /compare endpoints with the embedded model."""
    return {"document": document, "instruction": "Who wrote this and why?", "preset_name": EMBEDDED, **SETTINGS,
            **overrides}


def test_triforce_streams_the_answer_heatmap_stats_and_the_full_data(server, short_doc: str) -> None:
    _, client = server
    job = client.submit(**run_kwargs(short_doc, method="triforce"), api_name="/triforce")
    emitted = [len("".join(text for cls, text in answer_parts(update[1]) if cls.startswith("p-")))
               for update in job if update[1] and "</div>" in update[1]]
    status, answer, plot, doc_view, stats_md, stats, timeline, costs, raw = job.outputs()[-1]
    assert status.startswith("✅ Finished")
    assert len([n for n in emitted if n]) >= 2 and emitted == sorted(emitted), "answer did not stream"
    parts = answer_parts(answer)
    accepted = "".join(text for cls, text in parts if cls.startswith("p-"))
    assert {cls for cls, _ in parts} <= {f"p-{p}" for p in ("draft", "copy", "level2", "level3")} | \
        {"r12", "r23", "r13"} and accepted.strip()
    assert "im_end" not in answer and "im_start" not in doc_view  # special tokens are never shown as text
    levels = {row["key"]: row for row in stats["levels"]}
    assert {"level1", "level2", "level3", "selection"} <= set(levels) and levels["level3"]["steps"] >= 1
    assert levels["level3"]["bytes_per_step"] > levels["level2"]["bytes_per_step"] > levels["level1"]["bytes_per_step"]
    assert all(levels[key]["ms_per_step"] > 0 for key in ("level1", "level2", "level3"))
    assert stats["shared_with"] == 0 and "| decoded beside other runs (most at once) | none: it ran alone |" in stats_md
    rounds = levels["level3"]["steps"]
    assert f"{rounds} rounds" in timeline and timeline.count("'tl-round'") == rounds
    assert [trace["y"] for trace in json.loads(costs["plot"])["data"]][0][-2].startswith("level 3")
    figure = json.loads(plot["plot"])
    heat = figure["data"][0]
    assert heat["type"] == "heatmap" and figure["layout"]["title"]["text"].startswith("Per layer: the answer's one")
    z = np.frombuffer(base64.b64decode(heat["z"]["bdata"]), dtype=np.uint8)
    assert z.size > 0 and z.max() > 0
    assert "<mark class='s-sink'>" in doc_view
    assert 1 <= stats["new_tokens"] <= SETTINGS["max_new_tokens"] and stats["finished"]
    assert stats["tokens_per_s"] > 0 and stats["prefill_s"] > 0 and stats["time_to_first_token_s"] > 0
    assert stats["tokens_per_target_forward"] >= 1 and stats["cache_bytes"] > 0
    assert "tokens / s" in stats_md
    data = json.loads(Path(raw).read_text())
    assert data["stats"]["new_tokens"] == stats["new_tokens"] and data["answer"]["token_ids"]
    assert len(data["selections"][0]["kept_by"]) == data["prompt"]["num_chunks"] > 0


def compare_frame(values: tuple) -> dict:
    """A /compare frame by output name (a gr.State is never sent to a client)."""
    return dict(zip([name for name in callbacks.COMPARE_OUTPUTS if name != "compare_state"], values, strict=True))


def test_compare_runs_ar_triforce_and_auto_side_by_side_and_greedy_outputs_are_token_identical(server,
                                                                                              short_doc: str) -> None:
    _, client = server
    job = client.submit(**run_kwargs(short_doc, max_new_tokens=12), api_name="/compare")
    list(job)
    out = compare_frame(job.outputs()[-1])
    summary, verdict = out["compare_json"], out["verdict"]
    assert summary["greedy"] is True and summary["identical"] == {"triforce": True, "auto": True}, summary
    assert out["triforce_head"] == "**TriForce (levels 1 → 2 → 3)**" and "Method auto" in out["auto_head"]
    assert "· ran " in out["auto_head"] and "**Method auto** chose" in verdict and "tl-plan" in out["auto_timeline"]
    ar_parts = answer_parts(out["ar_answer"])
    assert {cls for cls, _ in ar_parts} == {"p-target"}
    for method in ("triforce", "auto"):
        text = "".join(text for cls, text in answer_parts(out[f"{method}_answer"]) if cls.startswith("p-"))
        assert "".join(text for _, text in ar_parts) == text
    assert "tl-round" in out["triforce_timeline"]  # TriForce drafts every round
    assert "Ran on **cpu · float32**" in verdict and "cpu · float32" in out["triforce_stats"]
    assert "| level-1 acceptance | — |" in out["ar_stats"] and "| budget / prompt | — |" in out["ar_stats"]
    cost_rows = json.loads(out["compare_costs"]["plot"])["data"][0]["y"]
    assert cost_rows[-1] == "autoregressive: target + full cache" and cost_rows[0].startswith("level 1")
    assert all(f"{name} ran alone" in verdict for name in ("Autoregressive", "TriForce (levels 1 → 2 → 3)",
                                                            "Method auto (the planner picks the levels)"))
    runs = summary["runs"]
    assert all(runs[method]["tokens_per_s"] > 0 for method in ("ar", "triforce", "auto"))
    assert all(summary["speedup"][method] > 0 for method in ("triforce", "auto")) and runs["auto"]["plans"]
    bars = json.loads(out["bars"]["plot"])["data"]
    assert [bar["name"] for bar in bars[::4]] == [runs[method]["ran"] for method in ("ar", "triforce", "auto")]
    live = [compare_frame(frame)["compare_json"]["runs"]["triforce"]["time_to_first_token_s"]
            for frame in job.outputs() if isinstance(compare_frame(frame)["compare_json"], dict)]
    # while it ran, TriForce's time to first token ran on its own clock: counted from the AR run's start, it would
    # exceed the engine's figure by the whole AR run
    first_live = next(t for t in live if t is not None)
    ar_run_s = runs["ar"]["prefill_s"] + runs["ar"]["decode_s"]
    assert first_live < runs["triforce"]["time_to_first_token_s"] + ar_run_s / 2


@pytest.mark.parametrize("overrides, message", [
    ({"document": "   "}, "document is empty"),
    ({"budget": 100}, "multiple of chunk_size"),
    ({"max_new_tokens": "lots"}, "must be a whole number, got 'lots'"),
    ({"temperature": "warm"}, "Temperature must be a number"),
    ({"drafter": "oracle"}, "drafter must be one of auto"),
    ({"preset_name": CUSTOM}, "Could not load"),
])
def test_bad_input_is_reported_and_the_next_run_works(server, short_doc: str, overrides: dict,
                                                      message: str) -> None:
    from gradio_client.exceptions import AppError

    _, client = server
    with pytest.raises(AppError, match=message):
        client.predict(**{**run_kwargs(short_doc), **overrides}, api_name="/triforce")
    result = client.predict(**run_kwargs(short_doc[:600], max_new_tokens=2), api_name="/triforce")
    assert result[0].startswith("✅ Finished")


def test_bad_uploads_are_refused_visibly(server, tmp_path: Path) -> None:
    from gradio_client import handle_file
    from gradio_client.exceptions import AppError

    _, client = server
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "latin.txt").write_bytes("d\xe9j\xe0 vu".encode("latin-1"))
    (tmp_path / "ok.html").write_text("<p>Fine &amp; dandy</p>", encoding="utf-8")
    for name, message in (("blob.txt", "binary"), ("latin.txt", "UTF-8")):
        with pytest.raises(AppError, match=message):
            client.predict(handle_file(str(tmp_path / name)), api_name="/upload_document")
    assert client.predict(handle_file(str(tmp_path / "ok.html")), api_name="/upload_document") == "Fine & dandy"
    big = tmp_path / "big.txt"
    with big.open("wb") as handle:
        handle.truncate(MAX_UPLOAD_BYTES + 1)
    with pytest.raises(Exception, match="(?i)too large|exceed|413|limit"):
        client.predict(handle_file(str(big)), api_name="/upload_document")


def test_a_python_source_file_uploads_as_its_text(server, tmp_path: Path) -> None:
    from gradio_client import handle_file

    _, client = server
    source = (ROOT / "core" / "decode" / "sampling.py").read_text(encoding="utf-8")
    (tmp_path / "sampling.py").write_text(source, encoding="utf-8")
    assert client.predict(handle_file(str(tmp_path / "sampling.py")), api_name="/upload_document") == source


def test_a_sample_picked_in_the_served_app_is_the_menus_choice_with_no_uploads_entry_left(server) -> None:
    _, client = server
    titles = [sample.title for sample in load_samples()]
    text, _, _, note, menu = client.predict(titles[1], api_name="/choose_sample")
    assert text == load_samples()[1].read() and note == ""
    assert menu["value"] == titles[1] and [value for _, value in menu["choices"]] == titles


def test_overlong_document_is_truncated_or_refused(server) -> None:
    from gradio_client.exceptions import AppError

    _, client = server
    long_doc = (ROOT / "assets" / "docs" / "pride_and_prejudice.txt").read_text(encoding="utf-8")
    info = client.predict(long_doc, EMBEDDED, 128, api_name="/describe_document")
    assert "longer than the context" in info
    with pytest.raises(AppError, match="(?i)context"):
        client.predict(**run_kwargs(long_doc, overflow="refuse"), api_name="/triforce")
    status, *_, stats, _, _, _ = client.predict(**run_kwargs(long_doc, max_new_tokens=1), api_name="/triforce")
    assert stats["dropped_tokens"] > 100_000 and "dropped" in status


def test_ten_concurrent_sessions_from_ten_addresses_all_finish(server, short_doc: str) -> None:
    """Ten visitors, each from an address of its own, click at once: every one is served to the end, none refused
    and none starved. (Their finishing order is not their arrival order: the first SEATS decode together, several
    finish in one round, and requests whose handlers start within milliseconds join the batch's line in the order
    they reach it.)"""
    from gradio_client import Client
    from gradio_client.utils import Status

    url, _ = server
    jobs = []
    for index in range(10):
        client = Client(url, verbose=False, headers={"X-Forwarded-For": f"10.0.0.{index + 1}"})
        jobs.append(client.submit(**run_kwargs(short_doc[:400], max_new_tokens=4, seed=index), api_name="/triforce"))
        deadline = time.monotonic() + 30
        while jobs[-1].status().code in (Status.STARTING, Status.JOINING_QUEUE) and time.monotonic() < deadline:
            time.sleep(0.02)  # this session holds its place in the queue before the next one joins
    results = [job.result(timeout=300) for job in jobs]
    assert all(result[0].startswith("✅ Finished") for result in results)


def test_a_waiting_stream_yields_and_its_close_reaches_the_engine(monkeypatch):
    """While the engine is inside a long prefill forward (no events), the stream says it is waiting every WAITING_S,
    so the UI's generator yields and a Stop lands; closing the stream sets the stop the engine checks between
    layers."""
    from app import inference

    seen: dict = {}

    def long_prefill(target, draft, document, instruction, config, stop=None):
        seen["stop"] = stop
        yield {"kind": "Loading", "stage": "ready", "fraction": 1.0}
        seen["stopped"] = stop.wait(30)  # a prefill forward, checking `stop` before each layer

    monkeypatch.setattr(inference, "_event_dicts", long_prefill)
    monkeypatch.setattr(inference, "BATCHED", False)  # a run alone (as on ZeroGPU); tests/test_visitors.py: the batch
    stream = inference.stream_events(PRESETS[0], "a document", "a question", GenerationConfig())
    assert next(stream) == Loading("ready", 1.0)  # rebuilt typed from the engine side's dict
    started = time.monotonic()
    assert isinstance(next(stream), inference.Waiting) and time.monotonic() - started < 10
    stream.close()
    deadline = time.monotonic() + 10
    while "stopped" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen.get("stopped") is True


def test_stop_and_the_stopped_run_end_on_the_same_words_whichever_arrives_last() -> None:
    """The cancelled run's last frame, which Gradio sends again when the run completes, once overwrote Stop's status:
    now a flagged run sends nothing more but Stop's own words, and Stop answers once the run has ended
    (app.stopping)."""
    from types import SimpleNamespace

    import gradio as gr

    from app.layout import by_name, stopper

    request = SimpleNamespace(session_hash="stop-order", client=None)
    outputs = {"status": gr.Markdown(), "run_state": gr.State()}
    sent: list[tuple[str, object]] = []
    drawing = threading.Event()

    def run(values, visitor):
        for n in range(100):
            if n == 2:
                drawing.set()
                time.sleep(0.2)  # a frame drawn while Stop comes: dropped, never sent after Stop's words
            yield {"status": f"frame {n}", "run_state": n}

    def words(last):
        return {"status": f"Stopped at {last.get('run_state')}"}

    def consume() -> None:
        for frame in by_name(run, outputs, "triforce", words)(request):
            sent.append(("run", frame[0]))

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert drawing.wait(5)
    sent.append(("stop", stopper(words, {"status": outputs["status"]}, "triforce")(request)[0]))
    consumer.join(5)
    assert not consumer.is_alive() and sent[-2:] == [("run", "Stopped at 1"), ("stop", "Stopped at 1")], sent
    assert stopper(words, outputs, "triforce")(request)[0] == "Stopped at None"  # no run streaming: at once


def test_a_stopped_run_says_so_its_stats_hold_still_and_the_cost_panel_stops_waiting() -> None:
    state = RunState(method="triforce")
    apply_event(state, PromptReady(100, 90, 0, 8192, 64, 8, ["a"] * 13))
    apply_event(state, tokens_event(["A"], ["level3"], 0))
    frame = callbacks.stopped_triforce({"run_state": state})
    assert frame["status"].startswith("⏹️ Stopped after 1 token.") and "| | stopped |" in frame["stats"]
    assert "Stopped before the end" in frame["costs"].layout.annotations[0].text
    assert live_stats(state, time.monotonic() + 60)["decode_s"] == live_stats(state)["decode_s"]  # held still
    from app.views import COMPARE_METHODS

    runs = {method: RunState(method=method) for method in COMPARE_METHODS}
    apply_event(runs["ar"], PromptReady(100, 90, 0, 8192, 64, 8, ["a"] * 13))
    frame = callbacks.stopped_compare({"compare_state": runs})
    assert frame["compare_status"].startswith("⏹️ Stopped during the autoregressive run, before the first token")
    assert all("| | stopped |" in frame[f"{method}_stats"] for method in COMPARE_METHODS)
    assert callbacks.stopped_compare({})["compare_status"].startswith("⏹️ Stopped.")  # before anything started
    # stopped during TriForce, the autoregressive run finished: no speed-up from the rate of its first tokens
    runs = {method: RunState(method=method) for method in COMPARE_METHODS}
    apply_event(runs["ar"], tokens_event(["A", "B"], ["target"] * 2, 0))
    apply_event(runs["ar"], Finished("AB", [0, 1], [], Stats(
        method="ar", new_tokens=2, prompt_tokens=9, dropped_tokens=0, prefill_s=1.0, prefill_reused=False,
        decode_s=2.0, tokens_per_s=1.0, time_to_first_token_s=1.5, target_forwards=2, tokens_per_target_forward=1.0)))
    apply_event(runs["triforce"], PromptReady(100, 90, 0, 8192, 64, 8, ["a"] * 13))
    apply_event(runs["triforce"], tokens_event(["A"], ["level3"], 0))
    runs["triforce"].prefill_ended -= 1.0  # its first token came fast: live, 2x the autoregressive rate and more
    assert "TriForce **" in callbacks.comparison_summary(runs, greedy=False)[0]
    verdict = callbacks.stopped_compare({"compare_state": runs, "compare_json": {"greedy": False}})["verdict"]
    assert verdict.startswith("### Decode speed against autoregressive: TriForce stopped after 1 token\n"), verdict
    assert "×" not in verdict.split("\n")[0] and "auto stopped" not in verdict  # auto had not started


def test_a_lone_visitor_is_not_told_of_a_batch_and_an_auto_run_that_decoded_as_ar_is_called_noise() -> None:
    from app.views import plan_line

    runs = {method: RunState(method=method, batched=True) for method in ("ar", "auto")}
    apply_event(runs["auto"], PlanChosen(0, "autoregressive (batched)", "γ2 0: 0.00666 tokens/ms for the batch "
                                         "(autoregressive 0.00666)", "", False, 0, 0))
    for state in runs.values():
        apply_event(state, tokens_event(["A", "B"], ["target"] * 2, 0))
        apply_event(state, Finished("AB", [0, 1], [], Stats(
            method=state.method, new_tokens=2, prompt_tokens=9, dropped_tokens=0, prefill_s=1.0, prefill_reused=False,
            decode_s=2.0, tokens_per_s=1.0, time_to_first_token_s=1.5, target_forwards=2,
            tokens_per_target_forward=1.0)))
    line = plan_line(runs["auto"])
    assert "batch" not in line and "**autoregressive** from round 0: γ2 0: 0.00666 tokens/ms (autoregressive" in line
    summary, _ = callbacks.comparison_summary(runs, greedy=True)
    assert "decoded autoregressively throughout" in summary and "noise" in summary
    assert "tokens per target forward" not in stats_markdown(live_stats(runs["ar"]))  # AR: one a forward, always
    assert "tokens per target forward" in stats_markdown(live_stats(runs["auto"]))
    runs["auto"].final_stats.shared_with = 2  # beside two other requests: then the batch is named
    assert "autoregressive (batched)" in plan_line(runs["auto"])
