"""The command line: JSON output, compare with its equality check, one-line refusals, and the model preset's settings
taken unless a flag is given."""

import json
import subprocess
import sys
from pathlib import Path

from core.cli import main

DOCS = Path(__file__).parent.parent / "assets" / "docs"


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).parent.parent)


def short_doc(tmp_path) -> str:
    path = tmp_path / "doc.txt"
    path.write_text((DOCS / "us_declaration_of_independence.txt").read_text()[:2500])
    return str(path)


def test_generate_json(tmp_path, embedded):
    r = cli("generate", "--doc", short_doc(tmp_path), "--prompt", "Who is complained about?", "--greedy",
            "--max-new-tokens", "8", "--budget", "128", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "prompt_ids", "token_ids", "stats"}
    assert 1 <= len(out["token_ids"]) <= 8 and out["text"]
    assert embedded.tokenizer.decode(out["token_ids"], skip_special_tokens=True) == out["text"]
    stats = out["stats"]
    assert (stats["settings"]["budget"], stats["settings"]["repetition_penalty"]) == (128, 1.2)  # flag, preset
    assert r.stderr.strip() == "preset smollm2-135m: --repetition-penalty 1.2 (a flag overrides)"
    assert stats["dropped_tokens"] == 0 and stats["method"] == "auto"  # the default method
    assert {"level1_acceptance", "level2_acceptance", "tokens_per_s"} <= set(stats)


def test_a_flag_overrides_the_presets_setting_even_at_the_engines_default(tmp_path, embedded, capsys):
    """In this process (the embedded engine is loaded once): a flag typed with GenerationConfig's default value still
    overrides the preset's choice."""
    assert main(["generate", "--doc", short_doc(tmp_path), "--prompt", "Who is complained about?", "--greedy",
                 "--max-new-tokens", "4", "--repetition-penalty", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    settings = json.loads(out)["stats"]["settings"]
    assert (settings["budget"], settings["repetition_penalty"], settings["max_new_tokens"]) == (512, 1.0, 4)
    assert err.strip() == "preset smollm2-135m: --budget 512 (a flag overrides)"


def test_compare_reports_identity(tmp_path):
    r = cli("compare", "--doc", short_doc(tmp_path), "--prompt", "Summarise.", "--greedy", "--max-new-tokens", "8",
            "--budget", "128", "--drafter", "ngram", "--no-draft-fusion")
    assert r.returncode == 0, r.stderr
    assert "token-identical" in r.stdout and "speedup" in r.stdout


def test_refusals_are_one_line_and_nonzero(tmp_path):
    long_doc = str(DOCS / "pride_and_prejudice.txt")
    r = cli("generate", "--doc", long_doc, "--prompt", "Summarise.", "--overflow", "refuse")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "tokens but only" in r.stderr
    r = cli("generate", "--doc", long_doc, "--prompt", "x", "--budget", "100")
    assert r.returncode == 2 and r.stderr.strip() == "error: budget (100) must be a multiple of chunk_size (8)"
    r = cli("generate", "--doc", str(tmp_path / "missing.txt"), "--prompt", "x")
    assert r.returncode == 2 and "missing.txt" in r.stderr
