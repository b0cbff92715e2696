"""The command line: JSON output, compare with its equality check, one-line refusals, the model preset's settings
taken unless a flag is given, progress on stderr."""

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from core.cli.main import _batch_answer, _stats_line, main
from core.events import Finished, Loading, PlanChosen, PrefillProgress, PromptReady, Stats, Tokens
from core.cli.progress import Progress

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
    assert "preset smollm2-135m: --repetition-penalty 1.2 (a flag overrides)" in r.stderr.splitlines()
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
    assert "preset smollm2-135m: --budget 512 (a flag overrides)" in err.splitlines()


def test_compare_reports_identity(tmp_path):
    r = cli("compare", "--doc", short_doc(tmp_path), "--prompt", "Summarise.", "--greedy", "--max-new-tokens", "8",
            "--budget", "128", "--drafter", "ngram", "--no-draft-fusion")
    assert r.returncode == 0, r.stderr
    assert "token-identical" in r.stdout and "speedup" in r.stdout


def test_refusals_are_one_line_and_nonzero(tmp_path):
    long_doc = str(DOCS / "pride_and_prejudice.txt")
    r = cli("generate", "--doc", long_doc, "--prompt", "Summarise.", "--overflow", "refuse", "--quiet")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "tokens but only" in r.stderr
    r = cli("generate", "--doc", long_doc, "--prompt", "x", "--budget", "100")
    assert r.returncode == 2 and r.stderr.strip() == "error: budget (100) must be a multiple of chunk_size (8)"
    r = cli("generate", "--doc", str(tmp_path / "missing.txt"), "--prompt", "x")
    assert r.returncode == 2 and "missing.txt" in r.stderr


def test_progress_goes_to_stderr_as_lines_off_a_terminal_and_quiet_silences_it(tmp_path):
    # 7,900 answer tokens leave the document a few hundred: it is truncated; the first space ends the answer
    args = ("generate", "--doc", short_doc(tmp_path), "--prompt", "Who is complained about?", "--max-new-tokens",
            "7900", "--stop", " ", "--json")
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] in ("loading the target model", "converting the GGUF into a checkpoint, once (about a minute on "
                        "a 2-core CPU; later starts load in seconds)") and re.fullmatch(r"models ready in [\d.]+ s",
                                                                                       lines[2])
    dropped = json.loads(r.stdout)["stats"]["dropped_tokens"]
    assert dropped > 0 and f"its middle {dropped:,} tokens were dropped" in r.stderr
    prefill = [line for line in lines if line.startswith("prefill ")]
    assert prefill and all(re.fullmatch(r"prefill [\d,]+ / [\d,]+ tokens \([\d.]+ s\)", line) for line in prefill)
    assert "method auto from round 0: " in r.stderr and "\r" not in r.stderr  # lines, not a bar
    r = cli(*args, "--quiet")
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout)["stats"]["dropped_tokens"] == dropped


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_bar_that_vanishes_and_lines_above_it():
    screen = Terminal()
    progress = Progress(stream=screen)
    progress.loading(Loading("ready", 1.0))
    progress.run("auto").event(PromptReady(900, 2000, 1100, 1024, 100, 8, []))
    for done in (256, 512, 899):
        progress.event(PrefillProgress(done, 899, done / 100, 0))
    progress.event(PlanChosen(0, "autoregressive", "measuring an autoregressive step", "", False, 0, 0))
    for _ in range(3):
        progress.event(Tokens([1, 2], ["a", "b"], ["target"] * 2, 0))
    stats = Stats(method="auto", new_tokens=6, prompt_tokens=900, dropped_tokens=1100, prefill_s=9.0,
                  prefill_reused=False, decode_s=1.0, tokens_per_s=6.0, time_to_first_token_s=9.1, target_forwards=6,
                  tokens_per_target_forward=1.0)
    progress.event(Finished("abab", [1] * 6, [], stats))
    out = screen.getvalue()
    assert "auto: prefill: " in out and "899/899" in out and "auto: decoding: " in out and "6/100" in out
    assert "auto: warning: " not in out and "warning: the document is longer than the context (1,024 tokens): its " \
        "middle 1,100 tokens were dropped" in out and "auto: method auto from round 0: autoregressive" in out
    assert not progress.bars and "prefill 256 / 899" not in out  # bars closed; no plain prefill lines
    quiet = Terminal()
    Progress(stream=quiet, quiet=True).run("x").event(PrefillProgress(1, 2, 0.1, 0))
    assert quiet.getvalue() == ""


def test_batch_file_answers_each_request_as_alone(tmp_path, embedded, capsys):
    """generate --batch: each answer under its id with its figures (--json --ids: one JSON line each, with its ids),
    each greedy answer the one its single run gives, each request's progress on stderr; a bad line is refused in
    one line naming it, before any model loads (more: test_batch_file.py)."""
    short_doc(tmp_path)
    lines = [{"id": "who", "doc": "doc.txt", "prompt": "Who is complained about?", "greedy": True, "max_new_tokens": 8},
             {"id": "ar", "document": "The dog sat on the log.", "prompt": "Where did the dog sit?", "method": "ar",
              "greedy": True, "max_new_tokens": 8}]
    batch = tmp_path / "requests.jsonl"
    batch.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["generate", "--batch", str(batch), "--budget", "128"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^=== who ===\n.+\n\[auto: \d+ tokens, ", out, re.MULTILINE) and "=== ar ===" in out
    assert '"token_ids"' not in out and "[ar: " in out
    assert "2 requests, at most 8 decoded at once" in err and "who: prompt of " in err
    assert "who: finished (" in err and "ar: finished (" in err
    assert main(["generate", "--batch", str(batch), "--budget", "128", "--quiet", "--json", "--ids"]) == 0
    answers = {a["id"]: a for a in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(answers) == {"who", "ar"} and answers["ar"]["stats"]["method"] == "ar"
    assert answers["who"]["stats"]["shared_with"] == 1
    assert main(["generate", "--doc", str(tmp_path / "doc.txt"), "--prompt", "Who is complained about?", "--greedy",
                 "--max-new-tokens", "8", "--budget", "128", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == answers["who"]["token_ids"]
    batch.write_text('{"id": "x", "doc": "doc.txt", "prompt": "?", "temprature": 1}\n')
    assert main(["generate", "--batch", str(batch)]) == 2
    assert capsys.readouterr().err.strip() == "error: requests.jsonl line 1: unknown field 'temprature'"


def test_plans_chosen_while_the_answer_streams_to_the_same_place_come_after_it_not_inside_it():
    screen = Terminal()  # stdout and stderr on one terminal
    progress = Progress(stream=screen).run("", count_tokens=False)
    progress.streams_answer(screen)
    progress.event(PlanChosen(0, "levels 1 → 2 → 3", "measuring what each level costs", "", False, 0, 0))
    for round_, texts in enumerate((["The", " dog"], [" sat", "."])):
        if round_:
            progress.event(PlanChosen(round_, "autoregressive", "measuring an autoregressive step", "", False, 0, 0))
        progress.event(Tokens([1, 2], texts, ["target"] * 2, round_))
        screen.write("".join(texts))  # as core.cli.main._run streams it
    progress.event(Finished("The dog sat.", [1] * 4, [], Stats(
        method="auto", new_tokens=4, prompt_tokens=9, dropped_tokens=0, prefill_s=0.1, prefill_reused=False,
        decode_s=0.2, tokens_per_s=20.0, time_to_first_token_s=0.2, target_forwards=4, tokens_per_target_forward=1.0)))
    assert screen.getvalue() == ("method auto from round 0: levels 1 → 2 → 3 (measuring what each level costs)\n"
                                 "The dog sat.\nmethod auto from round 1: autoregressive (measuring an autoregressive "
                                 "step)\n")
    apart = io.StringIO()  # the answer elsewhere (stdout to a file): the lines come as they are said
    progress = Progress(stream=apart).run("", count_tokens=False)
    progress.streams_answer(io.StringIO())
    progress.event(Tokens([1], ["The"], ["target"], 0))
    progress.event(PlanChosen(1, "autoregressive", "measuring an autoregressive step", "", False, 0, 0))
    assert apart.getvalue() == "method auto from round 1: autoregressive (measuring an autoregressive step)\n"


def test_the_stats_line_gives_acceptance_only_for_levels_whose_drafts_were_checked():
    stats = Stats(method="auto", new_tokens=10, prompt_tokens=47, dropped_tokens=0, prefill_s=0.5, prefill_reused=False,
                  decode_s=1.0, tokens_per_s=10.0, time_to_first_token_s=0.6, target_forwards=11,
                  tokens_per_target_forward=1.0, plans=["autoregressive"])
    assert "acceptance" not in _stats_line(stats)  # auto decoding autoregressively throughout: nothing was drafted
    stats = dataclasses.replace(stats, level1_proposed=4, level1_verified=4, level1_accepted=3)
    assert ", acceptance L1 0.75;" in _stats_line(stats)


def test_a_batch_requests_prefill_line_says_it_is_read_between_others_rounds():
    log = io.StringIO()
    progress = Progress(stream=log).run("b")
    progress.event(PrefillProgress(300, 899, 3.0, 0, decoding_beside=2))
    progress.event(PrefillProgress(899, 899, 9.0, 0))
    assert log.getvalue().splitlines() == ["b: prefill 300 / 899 tokens (3.0 s), between the rounds of 2 requests "
                                           "decoding", "b: prefill 899 / 899 tokens (9.0 s)"]


def test_a_batch_answer_in_json_leaves_the_ids_out_unless_asked() -> None:
    stats = Stats(method="ar", new_tokens=2, prompt_tokens=9, dropped_tokens=0, prefill_s=0.1, prefill_reused=False,
                  decode_s=0.2, tokens_per_s=10.0, time_to_first_token_s=0.1, target_forwards=2,
                  tokens_per_target_forward=1.0)
    finished = Finished(" On the log.", [5, 6], [1, 2, 3], stats)
    assert set(json.loads(_batch_answer("dog", finished, as_json=True, ids=False))) == {"id", "text", "stats"}
    assert json.loads(_batch_answer("dog", finished, as_json=True, ids=True))["token_ids"] == [5, 6]
    assert _batch_answer("dog", finished, as_json=False, ids=False).startswith("=== dog ===\nOn the log.\n[ar: 2 "
                                                                               "tokens, 10.00 tok/s")


def test_importing_core_sets_nothing_in_the_process_and_loads_no_torch():
    """The process settings are the entry points' (core.process.configure before torch loads; app.py's switch
    interval): a program that imports core, or a light module of it, keeps its own."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = ("import os, sys; import core, core.io.text, core.config; "
             "print(os.environ.get('OMP_WAIT_POLICY'), sys.getswitchinterval(), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env,
                       cwd=Path(__file__).parent.parent)
    assert r.stdout.split() == ["None", "0.005", "False"], r.stderr
    r = subprocess.run([sys.executable, "-c", "from core import Engine, events; print(Engine.__name__, "
                        "events.Finished.__name__)"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=Path(__file__).parent.parent)
    assert r.stdout.split() == ["Engine", "Finished"], r.stderr


def test_the_decoding_bar_counts_its_rate_from_the_end_of_prefill_not_from_the_first_tokens():
    screen = Terminal()
    progress = Progress(stream=screen)
    progress.run("auto").event(PromptReady(900, 900, 0, 1024, 100, 8, []))
    progress.event(PrefillProgress(899, 899, 9.0, 0))
    time.sleep(0.2)  # the first round: its tokens come at once, and the answer ends with them
    progress.event(Tokens([1, 2, 3, 4], ["a", "b", "c", "d"], ["target"] * 4, 0))
    stats = Stats(method="auto", new_tokens=4, prompt_tokens=900, dropped_tokens=0, prefill_s=9.0,
                  prefill_reused=False, decode_s=0.2, tokens_per_s=20.0, time_to_first_token_s=9.2, target_forwards=4,
                  tokens_per_target_forward=1.0)
    progress.event(Finished("abcd", [1, 2, 3, 4], [], stats))
    rates = [float(rate) for rate in re.findall(r"auto: decoding: [^\r\n]*?([\d.]+)tok/s", screen.getvalue())]
    assert rates and max(rates) < 100, rates  # 4 tokens in 0.2 s, never thousands a second
