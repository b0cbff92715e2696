"""The figures on the README and docs/benchmarks.md are the ones `python -m bench.report` writes from the committed
results: a hand edit of either (or a result committed without re-running the report) fails here. Also: the
README's two commands are the ones CI runs, and every headline command names a benchmark script that exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from bench import report


def test_the_benchmarks_page_is_what_the_report_writes_from_the_committed_results():
    results = report.load()
    assert results, "bench/results/ holds no results"
    assert report.PAGE.read_text() == report.page(results), "docs/benchmarks.md: run python -m bench.report"


def test_the_readme_headline_block_is_what_the_report_writes():
    text = report.README.read_text()
    assert text.count(report.START) == 1 and text.count(report.END) == 1
    assert text == report.readme(text, report.load()), "README.md's headline table: run python -m bench.report"


def test_every_headline_row_has_its_figures_and_a_runnable_command():
    rows = report.headline_rows(report.load())
    assert {r.hardware.split(" (")[0].split(",")[0] for r in rows} >= {"CPU", "NVIDIA H200"}
    for row in rows:
        assert row.ar_tok_s > 0 and row.tok_s > 0 and row.ratio > 0, row
        words = shlex.split(row.command)
        assert words[:2] == ["python", "-m"] and (report.ROOT / (words[2].replace(".", "/") + ".py")).is_file()
        assert not any(w.startswith(("/tmp", "/root", ".carry")) for w in words), row.command  # no machine's path
        assert (report.RESULTS / f"{row.stem}.json").is_file()


def test_a_recorded_command_is_shown_with_what_its_paths_held_and_the_file_it_writes():
    shown = report.shown("real-onchip-NVIDIA-H200", "python -m bench.real --target /tmp/Q15.gguf --draft "
                         "/tmp/Q05.gguf --parts onchip --out /x.json")
    assert shown == ("python -m bench.real --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --parts onchip "
                     "--name real-onchip")
    # only options of scripts that take a preset id are rewritten; an empty argument stays one
    assert report.shown(None, "python -m bench.cpu --draft /tmp/Q05.gguf") == "python -m bench.cpu --draft /tmp/Q05.gguf"
    assert report.shown(None, "python -m bench.served gpu --draft  --doc-tokens 2") == \
        "python -m bench.served gpu --draft '' --doc-tokens 2"


def test_result_files_are_named_per_benchmark_without_a_date_or_a_commit():
    for path in report.RESULTS.glob("*.json"):
        assert not re.search(r"\d{4}-\d{2}-\d{2}|-[0-9a-f]{7}(-|$)", path.stem), path.name


def test_the_readme_commands_are_the_ones_ci_runs():
    readme = report.README.read_text()
    ci = (report.ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if line.startswith("bash install.sh"))
    assert f"\n{test_command}  " in readme  # the README's line, followed by its comment
    assert "\nbash install.sh && .venv/bin/python app.py " in readme


def test_a_benchmark_writes_under_out_and_replaces_the_reference_figures_only_with_record(monkeypatch):
    from bench import common

    assert not common.RECORD  # pytest's command line has no --record
    assert common.result_path("cpu-steps") == common.OUT / "cpu-steps.json" and not common.OUT.is_absolute()
    monkeypatch.setattr(common, "RECORD", True)
    assert common.result_path("cpu-steps") == report.RESULTS / "cpu-steps.json"


def test_a_result_names_the_cpu_model_and_the_report_shows_it():
    from bench.common import machine

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "model name" in cpuinfo.read_text():
        named = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("model name"))
        assert machine()["cpu"] == named.partition(":")[2].strip()
    assert report.hardware("x", {"cpu": "AMD EPYC 7B13", "cpu_threads": 2, "torch": "2.13"}) == \
        "CPU (AMD EPYC 7B13), 2 threads, torch 2.13"
    assert report.hardware("x", {"cpu_threads": 2}) == "CPU (model not recorded), 2 threads"


def test_offloaded_rows_show_ar_on_the_gpu_and_random_rows_the_acceptance_their_speed_holds_at():
    rows = report.headline_rows(report.load())
    offloaded = [r for r in rows if r.stem == "real-NVIDIA-H200"]
    assert offloaded and all("AR with it on the GPU: " in r.where for r in offloaded)
    assert all(r.label.endswith(f"(a speed at acceptance {r.acceptance} only)") for r in rows if r.random)
    text = report.headline(report.load())
    assert "Offloading is the regime of a KV cache too big for the GPU's memory" in text
    assert "Rows with real weights lead" in text and [r.random for r in rows] == sorted(r.random for r in rows)
