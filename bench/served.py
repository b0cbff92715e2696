"""The served app driven as a visitor drives it: `python app.py` in a process of its own, called over HTTP through
gradio_client. Its parts:

gpu   what the Compare tab shows on a GPU: the first and the second greedy click on the same ~8K-token document,
      then a sampled click (T 0.6 / top-p 0.9); beside them the same clicks through Engine.generate in this
      process (engine_replay), so the app's share of the cost is visible (app tokens/s over the engine's). The
      figures go to the GPU's result file under summary.app_gpu.
      python -m bench.served gpu --target DIR [--draft assets/draft] [--doc-tokens 8000] [--new-tokens 128]
      python -m bench.served gpu --random smollm2_135m --tokenizer smollm2-135m   # random bf16 weights at that shape
soak  N mixed runs (TriForce and Compare, greedy and sampled, varied document sizes and budgets, a refused input
      every tenth run) against the embedded model on the CPU; the server's RSS is sampled after each run and must
      end within 20 % of its level after the first 10 runs.
      python -m bench.served soak [--runs 200]
stop  Stop during a CPU prefill: a long TriForce run on the embedded model is cancelled inside a 2048-token prefill
      forward; the time until a short run then finishes is how long the Stop kept the app busy.
      python -m bench.served stop [--trials 3]
slow  A slow upload beside a short run: while one client uploads a crafted PDF (2,000 pages sharing one content
      stream, refused by the page limit; 900 such pages, each a second or more of reading, so read until the time
      limit), another client's 4-token TriForce runs on the embedded model go on; each must finish within 2x the
      median time of the same run alone.
      python -m bench.served slow [--runs 5] [--pdfs pages-2000 pages-900] [--max-wait 120]
scale the app at a document's full length (summary.app_scale): the first and the second greedy Compare click and a
      sampled one (speedups), a TriForce-tab run (its heatmap), the largest frame any of them streamed, the server's
      RSS after the first and the last click (ten by default), Stop during the prefill of a new document (the first
      progress line, and how soon a short run then finished), then the app's Compare clicks up to the sampled one
      again through Engine.generate, in the same order, once the app has stopped (engine_replay: the app's tokens/s
      over the engine's on the sampled click, per method). Random weights are built as
      bench.common's random models are (PyTorch's default initialisation, not transformers': that one's attention
      is near uniform, where retrieval means nothing).
      python -m bench.served scale --random llama31_8b --random-draft llama32_1b --tokenizer smollm2-135m \\
          --doc-tokens 120000 --gpu-memory-gib 24 [--new-tokens 64 --clicks 4]   # on the GPU: summary.app_scale
      python -m bench.served scale --doc-tokens 2000 --new-tokens 32   # the embedded model on the CPU
planner method auto against autoregressive decoding through the served app's Compare, the embedded model on the CPU
      at ~8K tokens (its whole context), greedy and sampled, after a warm-up click: the tokens/s ratios and the
      plans with their reasons, merged into summary.planner of bench/results/planner.json.
      python -m bench.served planner [--doc-tokens 7900] [--clicks 2]
pace  a lone visitor's decode rate while a second visitor's long prompt (the ~6K-token needle sample, a new copy
      each trial: nothing to reuse) is prefilled beside it, against its rate alone: TriForce-tab runs through the
      served app, the embedded model on the CPU, greedy, the second visitor submitted as the first one's prefill
      begins (it fills as soon as the first decodes, and outlasts it). Target: at least 0.7 of alone (by design
      1 / (1 + core.batching.PREFILL_SHARE)), or the first visitor's status saying why it slowed.
      python -m bench.served pace [--trials 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from app.callbacks import COMPARE_OUTPUTS
from app.presets import CUSTOM, EMBEDDED, preset_by_name
from app.service import RUN_SECONDS_ENV
from bench.common import DOCS, SHAPES, GpuResults, environment, finish, merge_summary, model_source, save, tokenizer_of
from core import Engine, GenerationConfig
from core.io import load_tokenizer

ROOT = Path(__file__).parent.parent
DOCUMENT = "pride_and_prejudice.txt"
QUESTION = "Summarise what has happened so far, naming the main characters."
SAMPLED = {"greedy": False, "temperature": 0.6, "top_p": 0.9}
EMBEDDED_ON_CPU = {"TRIFORCE_TARGET": "", "CUDA_VISIBLE_DEVICES": ""}  # the app's environment for soak and stop


@contextlib.contextmanager
def serving(env: dict[str, str], log: Path, timeout_s: float = 600) -> Iterator[tuple[object, int]]:
    """`python app.py` on a free local port with `env` added; yields a gradio_client Client and the server's pid once
    it answers (it loads its default model first); the server is stopped on exit."""
    from gradio_client import Client

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the app exited ({server.returncode}): {log.read_text()[-2000:]}")
            try:
                client = Client(f"http://127.0.0.1:{port}/", verbose=False)
                break
            except Exception:  # not serving yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the app did not serve within {timeout_s:.0f} s: {log.read_text()[-2000:]}")
                time.sleep(1)
        yield client, server.pid
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def rss_mib(pid: int) -> float:
    """Resident memory of a process in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def click(client, endpoint: str, document: str, preset: str, **settings) -> tuple[tuple, int]:
    """One click of /compare or /triforce (settings not given keep the panel's defaults): its last outputs and the
    bytes of the largest frame it streamed (every output of one update, as JSON: an upper bound of what the wire
    carried, which may send a frame as its difference from the one before)."""
    if endpoint == "/compare":  # Compare runs every method: none is picked
        settings = {k: v for k, v in settings.items() if k != "method"}
    job = client.submit(document=document, instruction=QUESTION, preset_name=preset, **settings, api_name=endpoint)
    list(job)
    frames = job.outputs()
    return frames[-1], max(len(json.dumps(frame, default=str, ensure_ascii=False).encode()) for frame in frames)


def compare(client, document: str, preset: str, **settings) -> dict:
    """One Compare click (autoregressive decoding, TriForce and method auto on the same input and seed); returns its
    summary (each run's stats, what it ran, the speed-ups over AR). Raises where a run did not finish (a slow
    machine's run can outlast the app's time limit: then there is no speed-up to measure)."""
    summary = click(client, "/compare", document, preset, **settings)[0][COMPARE_OUTPUTS.index("compare_json")]
    unfinished = [method for method, x in summary.get("speedup", {}).items() if x is None]
    if unfinished:
        raise RuntimeError(f"the Compare click's {', '.join(unfinished)} run did not finish: on this machine a run "
                           f"outlasts the app's limit (set {RUN_SECONDS_ENV} higher for the benchmark's app)")
    return summary


def random_model_dir(shape: str, tokenizer: str, out: Path, context: int = 8192, torch_init: bool = False) -> Path:
    """A model directory with random bf16 weights at a named shape (its context cut to `context`, by default the
    embedded model's 8K) and the tokenizer `tokenizer` (a preset id, directory or hub id); `torch_init`: the weights drawn as
    bench.common.random_model draws them (PyTorch's defaults), not by transformers' initialisation."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPES[shape], "max_position_embeddings": context})
    # drawn on the GPU where there is one (the 8B and 1B shapes took 24 s on the H200)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if torch_init:
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                        module.reset_parameters()
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    tokenizer_of(tokenizer).save_pretrained(out)
    return out


def engine_replay(target: str | None, draft: str | None, document: str, clicks: dict[str, dict],
                  gpu_memory_gib: float | None = None) -> dict[str, dict]:
    """The app's Compare clicks again through Engine.generate in this process (once the app has stopped: the two
    never hold a GPU's memory at once), within the app's GPU memory budget and in the app's order, after the warm-up
    the app runs before serving on a GPU: each click's settings (GenerationConfig fields, its method beside AR)
    decoded autoregressively, then by its method. Method auto's cost book then holds at each click what the app's
    held, so a click's figures here and in the app differ only by what serving adds. By click name, then method:
    tokens/s, acceptances, tokens per pass, plans."""
    engine = Engine.load(target, draft, gpu_memory_gib=gpu_memory_gib)
    if engine.target.device.type == "cuda":
        engine.warm_up()
    figures: dict[str, dict] = {}
    for name, settings in clicks.items():
        for method in ("ar", settings["method"]):
            s = finish(engine, document, QUESTION, GenerationConfig(**{**settings, "method": method}).validate()).stats
            figures.setdefault(name, {})[method] = {
                "tokens_per_s": s.tokens_per_s, "new_tokens": s.new_tokens, "level1_acceptance": s.level1_acceptance,
                "level2_acceptance": s.level2_acceptance, "tokens_per_target_forward": s.tokens_per_target_forward,
                "plans": s.plans}
    return figures


def brief(summary: dict, method: str) -> dict:
    """The figures of a Compare summary worth keeping: autoregressive decoding's and `method`'s (keys triforce_*:
    the method beside AR, as the results have always named it), and its speed-up over AR."""
    keep = ("tokens_per_s", "new_tokens", "prompt_tokens", "prefill_s", "time_to_first_token_s", "warmup_s",
            "level1_acceptance", "level2_acceptance", "tokens_per_target_forward", "device", "dtype")
    runs = summary["runs"]
    return {"speedup": summary["speedup"][method], "identical": summary["identical"][method],
            **{f"{run}_{key}": runs[name].get(key) for run, name in (("ar", "ar"), ("triforce", method))
               for key in keep}, "ran": runs[method].get("ran"), "plans": runs[method].get("plans")}


def gpu(args: argparse.Namespace) -> None:
    """First/second greedy and sampled Compare clicks through the served app, then the engine's own figures."""
    work = Path(tempfile.mkdtemp(prefix="served-"))
    target = str(random_model_dir(args.random, args.tokenizer, work / "target")) if args.random else args.target
    env = {"TRIFORCE_TARGET": target, **({"TRIFORCE_DRAFT": args.draft} if args.draft else {})}
    cuda = torch.cuda.is_available()
    results = GpuResults(args.out, ["app_gpu"]) if cuda else None
    common = {"max_new_tokens": args.new_tokens, "overflow": "truncate", "seed": 0, "method": "triforce"}
    rows: dict = {"target": f"random bf16 weights at the {args.random} shape" if args.random else target,
                  "draft": args.draft, "new_tokens": args.new_tokens, "document": DOCUMENT}

    def record() -> None:
        print({k: v for k, v in rows.items() if not isinstance(v, dict)}, flush=True)
        if results is not None:
            results.data["app_gpu"] = rows
            results.save()

    clicks = (("first_click", {"greedy": True}), ("second_click", {"greedy": True}), ("sampled", SAMPLED))
    started = time.monotonic()
    with serving(env, work / "app.log") as (client, pid):
        rows["app_start_s"] = time.monotonic() - started
        document = cut(load_tokenizer(target), args.doc_tokens)  # no weights in this process beside the app's
        for name, overrides in clicks:
            t0 = time.monotonic()
            rows[name] = {**brief(compare(client, document, CUSTOM, **common, **overrides), "triforce"),
                          "wall_s": time.monotonic() - t0}
            print(name, rows[name], flush=True)
            record()
        rows["app_rss_mib"] = rss_mib(pid)
    rows["engine_clicks"] = engine_replay(target, args.draft, document, {
        name: {**common, **overrides} for name, overrides in clicks})
    sampled = rows["sampled"]
    for method, key in (("ar", "ar_tokens_per_s"), ("triforce", "triforce_tokens_per_s")):
        rows[f"app_over_engine_sampled_{method}"] = \
            sampled[key] / rows["engine_clicks"]["sampled"][method]["tokens_per_s"]
    rows["summary"] = {"first_click_speedup": rows["first_click"]["speedup"],
                       "second_click_speedup": rows["second_click"]["speedup"],
                       "sampled_speedup_8k": sampled["speedup"],
                       "sampled_tf_tok_s_8k": sampled["triforce_tokens_per_s"],
                       "sampled_ar_tok_s_8k": sampled["ar_tokens_per_s"]}
    if results is not None:
        results.summary["app_gpu"] = rows["summary"]
    record()
    if results is None:
        print(save("served-cpu", {**environment(), **rows}))


def soak(args: argparse.Namespace) -> None:
    """Mixed runs through the served app (embedded model, CPU), the server's RSS after each."""
    from gradio_client.exceptions import AppError

    rng = random.Random(0)
    text = (DOCS / DOCUMENT).read_text()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    samples, failures = [], []
    with serving(EMBEDDED_ON_CPU, work / "app.log") as (client, pid):
        base = rss_mib(pid)
        started = time.monotonic()
        for run in range(args.runs):
            start = rng.randrange(0, len(text) - 40_000)
            document = text[start:start + rng.choice((1_000, 4_000, 12_000))]
            overrides = {"max_new_tokens": rng.choice((4, 8, 16)), "budget": rng.choice((64, 256, 1024, 4096)),
                         "seed": run, **rng.choice(({"greedy": True}, SAMPLED))}
            endpoint = rng.choice(("/triforce", "/compare"))
            if run % 10 == 9:  # a refused input: the server must say why and go on
                overrides["temperature"] = "hot"
            try:
                client.predict(document=document, instruction=QUESTION, preset_name=EMBEDDED, **overrides,
                               api_name=endpoint)
                if run % 10 == 9:
                    failures.append(f"run {run}: a bad temperature was accepted")
            except AppError as err:
                if run % 10 != 9:
                    failures.append(f"run {run}: {err}")
            samples.append(rss_mib(pid))
            if run % 10 == 9:
                print(f"run {run + 1}/{args.runs}: RSS {samples[-1]:.0f} MiB "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    after10 = samples[min(9, len(samples) - 1)]
    growth = samples[-1] / after10 - 1
    payload = {**environment(), "runs": args.runs, "rss_start_mib": base, "rss_after_10_mib": after10,
               "rss_peak_mib": max(samples), "rss_end_mib": samples[-1], "growth_after_10": growth,
               "within_20_percent": growth <= 0.2, "failures": failures, "rss_mib": samples,
               "seconds": time.monotonic() - started}
    print(f"RSS after 10 runs {after10:.0f} MiB, peak {max(samples):.0f}, end {samples[-1]:.0f} "
          f"({growth:+.1%}); {len(failures)} unexpected outcomes")
    print(save("soak", payload))
    if failures or growth > 0.2:
        sys.exit(1)


def stop(args: argparse.Namespace) -> None:
    """Seconds from cancelling a run inside a prefill forward until a short run has finished, per trial."""
    text = (DOCS / DOCUMENT).read_text()
    short = {"document": text[:1500], "instruction": QUESTION, "preset_name": EMBEDDED, "max_new_tokens": 4}
    work = Path(tempfile.mkdtemp(prefix="stop-"))
    seconds = []
    with serving(EMBEDDED_ON_CPU, work / "app.log") as (client, _):
        client.predict(**short, api_name="/triforce")  # the model loaded and warm
        for trial in range(args.trials):
            job = client.submit(document=text[:40_000], instruction=QUESTION, preset_name=EMBEDDED,
                                max_new_tokens=8, api_name="/triforce")  # ~8K tokens: four 2048-token forwards
            time.sleep(4 + 3 * trial)  # somewhere inside the first or second forward
            t0 = time.monotonic()
            job.cancel()
            client.predict(**short, api_name="/triforce")
            seconds.append(time.monotonic() - t0)
            print(f"trial {trial}: a short run finished {seconds[-1]:.1f} s after Stop", flush=True)
    print(save("served-stop", {**environment(), "seconds_until_next_run_finished": seconds}))


SLOW_PDFS = {"pages-2000": 2000, "pages-900": 900}  # pages of tests.pdfs.slow_pdf: over and under the page limit


def slow(args: argparse.Namespace) -> None:
    """Seconds of a short run alone, then of the same run again and again while another client uploads each crafted
    PDF (until the upload is answered, or max_wait seconds), with the upload's answer and how long it took."""
    import gradio
    import pypdf
    from gradio_client import Client, handle_file

    from tests.pdfs import slow_pdf

    short = {"document": (DOCS / DOCUMENT).read_text()[:1500], "instruction": QUESTION, "preset_name": EMBEDDED,
             "max_new_tokens": 4}
    work = Path(tempfile.mkdtemp(prefix="slow-"))

    def timed_run(client) -> float:
        t0 = time.monotonic()
        client.predict(**short, api_name="/triforce")
        return time.monotonic() - t0

    rows: dict = {}
    with serving(EMBEDDED_ON_CPU, work / "app.log") as (client, _):
        timed_run(client)  # the model loaded and warm
        alone = [timed_run(client) for _ in range(args.runs)]
        limit = 2 * statistics.median(alone)
        print(f"alone: {[round(s, 2) for s in alone]} s; limit {limit:.2f} s", flush=True)
        for name in args.pdfs:
            path = work / f"{name}.pdf"
            path.write_bytes(slow_pdf(SLOW_PDFS[name]))
            uploader = Client(client.src, verbose=False)  # another visitor
            started = time.monotonic()
            job = uploader.submit(handle_file(str(path)), api_name="/upload_document")
            during = [timed_run(client)]
            while not job.done() and time.monotonic() - started < args.max_wait:
                during.append(timed_run(client))
            answered = job.done()
            upload_s = time.monotonic() - started if answered else None
            if answered:
                error = job.exception()
                answer = f"refused: {error}" if error else f"read: {len(job.result()):,} characters"
            else:
                answer = f"still reading after {args.max_wait:.0f} s"
                job.cancel()
            rows[name] = {"pdf_bytes": path.stat().st_size, "pages": SLOW_PDFS[name], "upload": answer,
                          "upload_answered_s": upload_s, "runs_during_upload_s": during,
                          "worst_over_median_alone": max(during) / statistics.median(alone),
                          "within_2x": max(during) <= limit}
            print(name, {k: v for k, v in rows[name].items() if k != "runs_during_upload_s"},
                  f"runs {[round(s, 2) for s in during]}", flush=True)
    payload = {**environment(), "gradio": gradio.__version__, "pypdf": pypdf.__version__,
               "run": {"preset": EMBEDDED, "max_new_tokens": short["max_new_tokens"],
                       "document_chars": len(short["document"])},
               "runs_alone_s": alone, "median_alone_s": statistics.median(alone), "uploads": rows}
    print(save("served-slow-input", payload))
    if not all(row["within_2x"] for row in rows.values()):
        sys.exit(1)


def cut(tokenizer, tokens: int) -> str:
    """The first `tokens` tokens of the benchmark's document, as text."""
    ids = tokenizer((DOCS / DOCUMENT).read_text(), add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:tokens])


def stop_probe(client, document: str, preset: str, common: dict) -> dict:
    """Prefill progress and Stop on a document the app has not prefilled: a TriForce-tab run whose status lines are
    read while it prefills, Stop once one reports progress, then the seconds until a short run has finished (a Stop
    that did not end the prefill would keep the app busy until the whole prompt was in)."""
    fresh = "A second copy.\n\n" + document  # other ids from the first token on: nothing to reuse
    job = client.submit(document=fresh, instruction=QUESTION, preset_name=preset, **common, api_name="/triforce")
    t0 = time.monotonic()
    progress: list[str] = []
    while not progress and not job.done() and time.monotonic() - t0 < 300:
        time.sleep(0.1)
        progress = [frame[0] for frame in job.outputs() if re.search(r"Prefill: [1-9]\d*% of", frame[0])]
    seen_s = time.monotonic() - t0
    finished_first = job.done()
    job.cancel()
    client.predict(document=document[:2000], instruction=QUESTION, preset_name=preset,
                   **{**common, "max_new_tokens": 4}, api_name="/triforce")
    return {"first_progress_s": seen_s, "progress_line": progress[0] if progress else None,
            "finished_before_stop": finished_first, "short_run_done_after_stop_s": time.monotonic() - t0 - seen_s}


def scale(args: argparse.Namespace) -> None:
    """summary.app_scale: Compare clicks and a TriForce run through the served app at the document's full length,
    the largest frame, the RSS after the first and the last click, then the engine's own tokens/s."""
    work = Path(tempfile.mkdtemp(prefix="scale-"))
    context = args.doc_tokens + args.new_tokens + 1024
    target = draft = None
    t_built = time.monotonic()
    if args.random:
        target = str(random_model_dir(args.random, args.tokenizer, work / "target", context, torch_init=True))
        draft = str(random_model_dir(args.random_draft, args.tokenizer, work / "draft", context, torch_init=True)) \
            if args.random_draft else ""
        print(f"random weights written in {time.monotonic() - t_built:.0f} s", flush=True)
    elif args.target:
        target, draft = model_source(args.target), model_source(args.draft)
    env = EMBEDDED_ON_CPU if target is None else {"TRIFORCE_TARGET": target, "TRIFORCE_DRAFT": draft or ""}
    if args.gpu_memory_gib:
        env = {**env, "TRIFORCE_GPU_MEMORY_GIB": str(args.gpu_memory_gib)}
    preset = EMBEDDED if target is None else CUSTOM
    document = cut(load_tokenizer(target), args.doc_tokens)  # only the tokenizer here while the app serves
    common = {"max_new_tokens": args.new_tokens, "overflow": "truncate", "seed": 0, "method": args.method}
    rows: dict = {"target": target or EMBEDDED, "draft": draft, "method": args.method, "doc_tokens": args.doc_tokens,
                  "new_tokens": args.new_tokens}
    frames, rss = [], []
    started = time.monotonic()
    with serving(env, work / "app.log") as (client, pid):
        rows["app_start_s"] = time.monotonic() - started
        print(f"app serving after {rows['app_start_s']:.0f} s", flush=True)
        clicks = [("first_click", "/compare", {"greedy": True}), ("second_click", "/compare", {"greedy": True}),
                  ("sampled", "/compare", SAMPLED), ("triforce_tab", "/triforce", {"greedy": True})]
        clicks += [(f"click_{n}", "/compare", SAMPLED if n % 2 else {"greedy": True})
                   for n in range(5, args.clicks + 1)]
        for name, endpoint, overrides in clicks[:args.clicks]:
            t0 = time.monotonic()
            outputs, biggest = click(client, endpoint, document, preset, **common, **overrides)
            frames.append(biggest)
            rss.append(rss_mib(pid))
            if endpoint == "/compare":
                rows[name] = {**brief(outputs[COMPARE_OUTPUTS.index("compare_json")], args.method),
                              "max_frame_bytes": biggest,
                              "wall_s": time.monotonic() - t0}
            print(name, f"{time.monotonic() - t0:.0f} s, largest frame {biggest:,} bytes, RSS {rss[-1]:.0f} MiB",
                  json.dumps(rows.get(name, {})), flush=True)
        rows["stop"] = stop_probe(client, document, preset, common)
        print("stop", json.dumps(rows["stop"]), flush=True)
    rows["rss_mib"], rows["load_average_during_app"] = rss, os.getloadavg()
    chosen = dict(preset_by_name(EMBEDDED).settings) if target is None else {}  # what the app's panel started from
    history = clicks[:[name for name, _, _ in clicks].index("sampled") + 1]  # Compare clicks, up to the sampled one
    rows["engine_clicks"] = engine_replay(target, draft or None, document, {
        name: {**chosen, **common, **overrides} for name, _, overrides in history}, args.gpu_memory_gib)
    rows["load_average_after_engine"] = os.getloadavg()  # the machine's other work (a shared CPU skews the ratios)
    sampled, engine = rows["sampled"], rows["engine_clicks"]["sampled"]
    engine_speedup = engine[args.method]["tokens_per_s"] / engine["ar"]["tokens_per_s"]
    rows["summary"] = {
        "first_click_speedup": rows["first_click"]["speedup"], "second_click_speedup": rows["second_click"]["speedup"],
        "sampled_speedup": sampled["speedup"], "engine_sampled_speedup": engine_speedup,
        "app_over_engine_ar": sampled["ar_tokens_per_s"] / engine["ar"]["tokens_per_s"],
        "app_over_engine_triforce": sampled["triforce_tokens_per_s"] / engine[args.method]["tokens_per_s"],
        "max_frame_bytes": max(frames), f"rss_growth_after_{len(rss)}": rss[-1] / rss[0] - 1, "method": args.method,
        "stop_short_run_done_after_s": rows["stop"]["short_run_done_after_stop_s"]}
    print(rows["summary"], flush=True)
    if torch.cuda.is_available():
        results = GpuResults(args.out, ["app_scale"])
        results.data["app_scale"], results.summary["app_scale"] = rows, rows["summary"]
        results.save()
        print(f"wrote {results.path}")
    else:
        print(save(args.name, {**environment(), **rows}))


def planner(args: argparse.Namespace) -> None:
    """Method auto against autoregressive decoding through the served app's Compare (embedded model, CPU, ~8K
    tokens): tokens/s ratios greedy and sampled, and the plans auto chose with their reasons."""
    work = Path(tempfile.mkdtemp(prefix="planner-"))
    document = cut(load_tokenizer(None), args.doc_tokens)
    common = {"max_new_tokens": args.new_tokens, "overflow": "truncate", "seed": 0, "method": "auto"}
    runs: dict = {}
    with serving(EMBEDDED_ON_CPU, work / "app.log") as (client, _):
        compare(client, document, EMBEDDED, **common, greedy=True)  # the prefill, and the step costs measured
        for n in range(args.clicks):
            for sampling, overrides in (("greedy", {"greedy": True}), ("sampled", SAMPLED)):
                summary = compare(client, document, EMBEDDED, **common, **overrides)
                runs[f"{sampling} {n}"] = brief(summary, "auto")
                print(sampling, n, f"auto / AR tokens/s {summary['speedup']['auto']:.3f}",
                      summary["runs"]["auto"].get("plans"), flush=True)
    ratio = {s: [r["speedup"] for name, r in runs.items() if name.startswith(s)] for s in ("greedy", "sampled")}
    figures = {"cpu_embedded_greedy": sum(ratio["greedy"]) / len(ratio["greedy"]),
               "cpu_embedded_sampled": sum(ratio["sampled"]) / len(ratio["sampled"]),
               "choices": {f"cpu embedded {name}": [p["plan"] for p in r["plans"]] for name, r in runs.items()}}
    print(save("served-planner-cpu", {**environment(), "document_tokens": args.doc_tokens, "runs": runs,
                                      "ratios": ratio, "summary": figures}))
    print(f"planner figures merged into {merge_summary('planner', 'planner', figures)}")


NEEDLE = "needle.txt"  # the long sample a second visitor picks
SLOWER = "slower while"  # the first visitor's status while a prefill runs beside it (app.views.status_markdown)
STATUS, STATS = 0, 5  # the /triforce endpoint's outputs: its status line and its stats as a dict
TARGET_PACE = 0.7  # issue 59's bound on a lone visitor's rate beside a prefill, over alone (unless told why)


def paced(client, run: dict, second=None, trial: int = 0) -> dict:
    """One TriForce-tab run of `run`'s settings, alone or (`second`: another visitor's client) beside another
    visitor's long prompt, submitted once the run is seen prefilling: its decode figures, whether its status said
    why it slowed, and where the other visitor's run stood when it ended (which is then stopped)."""
    job = client.submit(**run, api_name="/triforce")
    other = None
    if second is not None:
        begun = ("⏳ Prefill", "▶️")  # its status once it has its seat (prefilling or decoding)
        while not job.done() and not any(frame[STATUS].startswith(begun) for frame in job.outputs()):
            time.sleep(0.05)
        other = second.submit(document=f"Copy {trial}.\n\n" + (DOCS / NEEDLE).read_text(),
                              instruction="What is the pass key?", preset_name=EMBEDDED, max_new_tokens=4,
                              api_name="/triforce")
    frames = list(job)
    stats = frames[-1][STATS]
    row = {key: stats.get(key) for key in ("tokens_per_s", "new_tokens", "decode_s", "shared_with",
                                           "prefills_beside", "prefill_beside_s")}
    row["told_why"] = any(SLOWER in frame[STATUS] for frame in frames)
    if other is not None:
        row["other_status_at_end"] = other.outputs()[-1][STATUS].split("\n")[0] if other.outputs() else None
        other.cancel()
        while not other.done():
            time.sleep(0.1)
    return row


def pace(args: argparse.Namespace) -> None:
    """A lone visitor's decode rate beside a second visitor's long prefill, over its rate alone."""
    from gradio_client import Client

    from core.batching import PACE_BESIDE_PREFILL

    run = {"document": (DOCS / DOCUMENT).read_text()[:1500], "instruction": QUESTION, "preset_name": EMBEDDED,
           "max_new_tokens": args.new_tokens, "greedy": True}
    work = Path(tempfile.mkdtemp(prefix="pace-"))
    with serving(EMBEDDED_ON_CPU, work / "app.log") as (client, _):
        client.predict(**{**run, "max_new_tokens": 4}, api_name="/triforce")  # the model loaded and warm
        second = Client(client.src, verbose=False)  # another visitor
        rows: dict[str, list[dict]] = {"alone": [], "beside": []}
        for trial in range(args.trials):  # interleaved: the machine's other work weighs on both alike
            rows["alone"].append(paced(client, run))
            rows["beside"].append(paced(client, run, second, trial))
            print(trial, {name: runs[-1] for name, runs in rows.items()}, flush=True)
    alone, beside = (statistics.median(r["tokens_per_s"] for r in rows[name]) for name in ("alone", "beside"))
    summary = {"alone_tokens_per_s": alone, "beside_prefill_tokens_per_s": beside, "ratio": beside / alone,
               "designed_ratio": PACE_BESIDE_PREFILL, "target_ratio": TARGET_PACE,
               "told_why_in_every_run_beside": all(r["told_why"] for r in rows["beside"])}
    print(summary)
    print(save("served-pace-cpu", {**environment(), "load_average": os.getloadavg(), "new_tokens": args.new_tokens,
                                   "document_chars": len(run["document"]), "second_document": NEEDLE, **rows,
                                   "summary": summary}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    g = parts.add_parser("gpu", help="first/second/sampled Compare clicks through the served app")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="model directory or hub id the app serves")
    source.add_argument("--random", choices=sorted(SHAPES),
                        help="serve random weights at this shape (with --tokenizer)")
    g.add_argument("--tokenizer", help="tokenizer for --random: a preset id (smollm2-135m), directory or hub id")
    g.add_argument("--draft", default="assets/draft")
    g.add_argument("--doc-tokens", type=int, default=8000)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--out", help="result file (default: the GPU's bench/results file)")
    s = parts.add_parser("soak", help="mixed runs through the served app, RSS sampled")
    s.add_argument("--runs", type=int, default=200)
    t = parts.add_parser("stop", help="Stop inside a CPU prefill forward, then time a short run")
    t.add_argument("--trials", type=int, default=3)
    w = parts.add_parser("slow", help="short runs while another client uploads a crafted PDF")
    w.add_argument("--runs", type=int, default=5, help="runs alone (their median is the reference)")
    w.add_argument("--pdfs", nargs="+", choices=sorted(SLOW_PDFS), default=list(SLOW_PDFS))
    w.add_argument("--max-wait", type=float, default=120.0, help="seconds of runs beside one upload at most")
    c = parts.add_parser("scale", help="summary.app_scale: the served app at a document's full length")
    source = c.add_mutually_exclusive_group()
    source.add_argument("--target", help="preset id, model directory, .gguf or hub id the app serves (default: the "
                        "embedded model)")
    source.add_argument("--random", choices=sorted(SHAPES), help="random weights at this shape (with --tokenizer)")
    c.add_argument("--random-draft", choices=sorted(SHAPES), help="with --random: a random level-1 draft at this shape")
    c.add_argument("--tokenizer", help="tokenizer for --random: a preset id (smollm2-135m), directory or hub id")
    c.add_argument("--draft", help="with --target: its level-1 draft (a preset id: that preset's target model)")
    c.add_argument("--method", choices=("auto", "triforce"), default="auto", help="the method beside AR")
    c.add_argument("--doc-tokens", type=int, default=120_000)
    c.add_argument("--new-tokens", type=int, default=128)
    c.add_argument("--clicks", type=int, default=10, help="clicks in all (the RSS growth is over these)")
    c.add_argument("--gpu-memory-gib", type=float, help="the app's GPU memory budget (TRIFORCE_GPU_MEMORY_GIB)")
    c.add_argument("--out", help="GPU result file (default: the GPU's bench/results file)")
    c.add_argument("--name", default="served-scale-cpu", help="result name off a GPU")
    n = parts.add_parser("planner", help="method auto vs AR through the served app's Compare, embedded, CPU")
    n.add_argument("--doc-tokens", type=int, default=7900)
    n.add_argument("--new-tokens", type=int, default=128)
    n.add_argument("--clicks", type=int, default=2, help="greedy and sampled clicks each, after the warm-up")
    p = parts.add_parser("pace", help="a lone visitor's decode rate beside a second visitor's long prefill")
    p.add_argument("--trials", type=int, default=3, help="runs alone and beside, interleaved (medians compared)")
    p.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    {"gpu": gpu, "soak": soak, "stop": stop, "slow": slow, "scale": scale, "planner": planner,
     "pace": pace}[args.part](args)


if __name__ == "__main__":
    main()
