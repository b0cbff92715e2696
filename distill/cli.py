"""The command line of `python -m distill`: prepare | answers | train and their flags."""

from __future__ import annotations

import argparse

import distill
from distill.answers import answers_stage
from distill.data import DEBS, prepare
from distill.train import train


def candidate(spec: str) -> tuple[int, list[int]]:
    """'S+a,b' -> (S shared target layers, own layers initialised from target layers a, b); 'a,b' -> (0, [a, b])."""
    shared, _, own = spec.rpartition("+")
    return int(shared or 0), [int(x) for x in own.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m distill", description=distill.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    a = sub.add_parser("prepare", help="gather offline text and build prompts (CPU)")
    a.add_argument("--out", default=".carry/data")
    a.add_argument("--target", default=None, help="target whose tokenizer to use (default: the embedded one)")
    a.add_argument("--prompts", type=int, default=2048)
    a.add_argument("--val-prompts", type=int, default=64)
    a.add_argument("--min-doc", type=int, default=160)
    a.add_argument("--max-doc", type=int, default=1200)
    a.add_argument("--cap-per-group", type=int, default=1_500_000, help="characters per source group")
    a.add_argument("--deb-root", default=".carry/debs",
                   help="where `apt-get download " + " ".join(DEBS) + "` was unpacked with dpkg -x")
    a.add_argument("--head-size", type=int, default=8192, help="token ids the draft's LM head scores")
    a.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("answers", help="only sample the target's answers to the prompts and save them (GPU)")
    t = sub.add_parser("train", help="distil the draft on the target's answers (sampled first unless --answers) (GPU)")
    for x in (g, t):
        x.add_argument("--data", default=".carry/data")
        x.add_argument("--target", default=None, help="target model: .gguf, directory or hub id (default: embedded)")
        x.add_argument("--device", default=None)
        x.add_argument("--max-prompts", type=int, default=0, help="use only this many prompts (smoke tests)")
        x.add_argument("--answer-tokens", type=int, default=224)
        x.add_argument("--gen-batch", type=int, default=256)
        x.add_argument("--gen-seconds", type=float, default=90)
    g.add_argument("--out", default="out/answers.npz")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed; also shifts which prompts get which setting (another run: other answers)")
    t.add_argument("--out", default="out/draft")
    t.add_argument("--answers", nargs="+", default=None, help="answers files written by the answers stage")
    t.add_argument("--resume", default=None, help="go on training this draft directory (written by train)")
    t.add_argument("--name", default="SmolLM2-135M TriForce draft")
    t.add_argument("--init", type=candidate, nargs="+", default=[candidate("6+6,7"), candidate("6+28,29")],
                   help="candidate drafts S+a,b,..: the target's first S layers shared, then own layers initialised "
                        "from target layers a,b,..; e.g. 6+28,29 4+4,5,28,29 0,29")
    t.add_argument("--trial-steps", type=int, default=40, help="steps all candidates train before the best continues")
    t.add_argument("--sink", type=int, default=16)
    t.add_argument("--window", type=int, default=240)
    t.add_argument("--temps", type=float, nargs="+", default=[1.0, 0.6])
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--seqs", type=int, default=16, help="target sequences per step")
    t.add_argument("--windows", type=int, default=64, help="draft windows per step")
    t.add_argument("--answer-share", type=float, default=0.75)
    t.add_argument("--steps", type=int, default=0, help="0: train for --train-seconds")
    t.add_argument("--train-seconds", type=float, default=200)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--int8", action="store_true", help="store matrices as int8 + per-row scale (half the size)")
    t.add_argument("--fusion", type=int, default=0,
                   help="width of a fusion module to add (0: none): the draft then also reads the target's hidden "
                        "state that produced the last token; only the module trains (see --train-body)")
    t.add_argument("--train-body", action="store_true", help="a fusion draft's own layers train too")
    t.add_argument("--fusion-ages", type=int, default=2,
                   help="how far back that state may lie (level 1 proposes gamma1 tokens per target state)")
    t.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    {"prepare": prepare, "answers": answers_stage, "train": train}[args.stage](args)
