"""Distillation data for a level-1 draft (CPU): freely licensed text available offline -> prompts in the target's chat
template, and the token ids the draft's reduced LM head scores. `python -m distill prepare` runs it.

Sources: the bundled documents except the held-out ones, Debian licences and copyright files, manual pages, Python
standard-library sources, PyPI packages' README metadata, and the documentation in the Debian packages DEBS
(downloaded from the Debian archive). Every text's origin is recorded in sources.json.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import torch

from core.io.samples import DOCS, held_out_documents
from core.io.text import html_to_text

GENERAL = [
    "Summarise the document in three sentences.", "What is the main topic of this text?",
    "List the three most important points of the document.", "Explain the document in simple terms.",
    "Write a short title for this text and explain your choice.", "What questions does this text answer?",
    "Who is the intended audience of this document, and why?", "Summarise the last paragraph.",
    "What are the key terms defined or used in this text? Explain each briefly.",
    "Rewrite the first paragraph in plain English.", "Give a one-paragraph summary.",
    "What obligations or rules does the text describe?", "Describe the tone and style of the text.",
    "Continue the text in the same style for a few sentences.", "What happens in this passage?",
    "Extract any names, dates or numbers mentioned and say what they refer to.",
    "Write three questions a reader might ask about this text, with answers.",
    "Explain the purpose of this document.", "What would be a good next section for this text?",
    "Summarise the text as a bulleted list.", "Is there anything unclear in this text? Explain.",
    "What does the author want the reader to do or understand?", "Summarise what has happened so far.",
]
CODE = [
    "Explain what this code does.", "Summarise the purpose of this module.",
    "List the functions or classes defined here and what each does.", "How would you use this code? Give an example.",
    "Are there any potential bugs or edge cases in this code?", "Explain the code to a beginner.",
    "Write documentation for the main function in this code.", "What does this code return, and when?",
]
GROUP_WEIGHTS = {"assets": 0.07, "common-licenses": 0.04, "debian-copyright": 0.05, "python-stdlib": 0.1,
                 "pypi-metadata": 0.09, "python-docs": 0.14, "debian-reference": 0.06, "man-pages": 0.06,
                 "perl-doc": 0.06, "git-doc": 0.05, "postgresql-doc": 0.06, "debian-handbook": 0.07,
                 "debian-guides": 0.05, "gnu-manuals": 0.04, "sqlite-doc": 0.06}
HEAD_FILE = "head_vocab.safetensors"
DEBS = ["python3.11-doc", "debian-reference-en", "debian-reference-common", "perl-doc", "git-doc", "postgresql-doc-15",
        "debian-handbook", "developers-reference", "debian-policy", "maint-guide", "gnu-standards", "bash-doc",
        "sqlite3-doc"]  # unpacked into --deb-root by prepare


def _text(path: Path) -> str:
    """A file's text: gzip-compressed or not, HTML reduced to its visible text."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = data.decode("utf-8")
    return html_to_text(text) if ".htm" in path.name else text


def _man(path: Path) -> str:
    """A manual page rendered to plain text by man(1), indentation removed."""
    out = subprocess.run(["man", "--nj", "--nh", "-l", str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "MANWIDTH": "100"}).stdout
    return "\n".join(line.strip() for line in re.sub(r".\x08", "", out).splitlines())


def _read(path: Path, reader, limit: int = 400_000) -> str | None:
    try:
        text = reader(path)[:limit]
    except (UnicodeDecodeError, OSError, subprocess.SubprocessError):
        return None
    return text if len(text.strip()) >= 400 else None


def unpack_debs(deb_root: Path) -> dict[str, str]:
    """Download the Debian packages DEBS not yet in deb_root (apt) and unpack them there; all their versions."""
    stamp = deb_root / "versions.json"
    versions = json.loads(stamp.read_text()) if stamp.exists() else {}
    missing = [d for d in DEBS if d not in versions]
    if missing:
        deb_root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *missing], cwd=deb_root, check=True, capture_output=True)
        for deb in sorted(deb_root.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(deb_root)], check=True)
            versions[deb.name.split("_")[0]] = deb.name.split("_")[1].replace("%3a", ":")
            deb.unlink()
        stamp.write_text(json.dumps(versions, indent=1))
    return {d: versions[d] for d in DEBS if d in versions}


def gather_texts(cap_per_group: int, deb_root: Path, seed: int) -> list[dict]:
    """Offline, freely licensed texts: [{group, path, licence, text}], each group's files in a seeded random order
    up to cap_per_group characters, the held-out documents left out and any text quoting them dropped. deb_root
    holds the Debian packages DEBS unpacked (documentation not installed on this machine)."""
    holdout = held_out_documents()
    holdout_text = [(DOCS / n).read_text() for n in holdout]
    probes = [t[i:i + 60] for t in holdout_text for i in range(0, len(t) - 60, 400)]
    stdlib = Path(os.__file__).parent
    site = Path(np.__file__).parent.parent
    python_docs = deb_root / "usr/share/doc/python3.11/html/_sources"
    doc = deb_root / "usr/share/doc"
    man = [Path(p) for s in (1, 5, 7, 8) for p in glob.glob(f"/usr/share/man/man{s}/*.gz")]
    candidates = [
        ("assets", [p for p in DOCS.glob("*.txt") if p.name not in holdout], _text, "see assets/docs/SOURCES.md"),
        ("common-licenses", list(Path("/usr/share/common-licenses").glob("*")), _text,
         "the licence texts themselves"),
        ("debian-copyright", [Path(p) for p in glob.glob("/usr/share/doc/*/copyright")], _text,
         "Debian copyright files"),
        ("python-stdlib", list(stdlib.glob("*.py")), _text, "PSF-2.0 (CPython standard library)"),
        ("pypi-metadata", [Path(p) for p in glob.glob(str(site / "*.dist-info" / "METADATA"))], _text,
         "each package's own licence (named in its METADATA)"),
        # the Python documentation's sources, minus the socket HOWTO (held out) and the socket module's reference
        ("python-docs", [p for p in python_docs.rglob("*.rst.txt") if "socket" not in p.name], _text,
         "PSF-2.0 (Debian package python3.11-doc)"),
        ("debian-reference", list((deb_root / "usr/share/debian-reference").glob("*.en.html")), _text,
         "GPL-2+ (Debian package debian-reference-en)"),
        ("man-pages", man, _man, "each Debian package's own licence (/usr/share/doc/<package>/copyright)"),
        ("perl-doc", list(deb_root.glob("usr/share/perl/*/pod/*.pod")), _text,
         "GPL-1+ or Artistic (Debian package perl-doc)"),
        ("git-doc", list((doc / "git-doc").rglob("*.txt")), _text, "GPL-2 (Debian package git-doc)"),
        ("postgresql-doc", list((doc / "postgresql-doc-15/html").glob("*.html")), _text,
         "PostgreSQL licence (Debian package postgresql-doc-15)"),
        ("debian-handbook", list((doc / "debian-handbook/html/en-US").glob("*.html")), _text,
         "GPL-2+ or CC-BY-SA-3.0 (Debian package debian-handbook)"),
        ("debian-guides", list((deb_root / "usr/share/developers-reference").glob("*.html"))
         + list((doc / "debian-policy").glob("*.txt.gz")) + list((doc / "maint-guide").glob("*.en.txt.gz")),
         _text, "GPL-2 / GPL-2+ / GPL-2+ or MIT (Debian packages developers-reference, debian-policy, maint-guide)"),
        ("gnu-manuals", list((doc / "gnu-standards").glob("*.text.gz")) + [doc / "bash/bashref.html"], _text,
         "GFDL-1.3+ / GPL-3+ (Debian packages gnu-standards / bash-doc)"),
        ("sqlite-doc", list((doc / "sqlite3").glob("*.html")), _text, "public domain (Debian package sqlite3-doc)"),
    ]
    rng = random.Random(seed)
    out, seen = [], set()
    for group, paths, reader, licence in candidates:
        total = 0
        paths = sorted(paths)
        rng.shuffle(paths)
        for path in paths:
            if total >= cap_per_group:
                break
            text = _read(path, reader, cap_per_group)
            if text is None:
                continue
            digest = hashlib.sha1(text.encode()).hexdigest()
            if digest in seen or any(p in text for p in probes):
                continue
            seen.add(digest)
            total += len(text)
            out.append({"group": group, "path": str(path), "licence": licence, "text": text})
    return out


def _prompts_from(texts, tok, n, min_doc, max_doc, rng, instructions_for, split):
    from core.io.prompting import build_prompt
    pool = {}
    for t in texts:
        ids = tok(t["text"], add_special_tokens=False)["input_ids"]
        a = 0
        while a < len(ids) - min_doc // 2:
            b = a + rng.randint(min_doc, max_doc)
            pool.setdefault(t["group"], []).append((t, ids[a:b]))
            a = b
    groups = sorted(pool)
    weights = [GROUP_WEIGHTS.get(g, 0.2) for g in groups]
    prompts = []
    for _ in range(n):
        t, ids = rng.choice(pool[rng.choices(groups, weights)[0]])
        instruction = rng.choice(instructions_for(t))
        p = build_prompt(tok, tok.decode(ids), instruction, 8192, 256, "truncate")
        prompts.append({"ids": p.ids, "path": t["path"], "group": t["group"], "instruction": instruction,
                        "split": split})
    return prompts


def prepare(args) -> None:
    """The prepare stage: prompts.npz, the head ids and sources.json in args.out."""
    from safetensors.torch import save_file

    from core.io.loading import load_tokenizer
    rng = random.Random(args.seed)
    tok = load_tokenizer(args.target)
    debs = unpack_debs(Path(args.deb_root))
    texts = gather_texts(args.cap_per_group, Path(args.deb_root), args.seed)
    kind = lambda t: CODE if t["path"].endswith(".py") else GENERAL
    train = _prompts_from(texts, tok, args.prompts, args.min_doc, args.max_doc, rng, kind, 0)
    holdout = held_out_documents()
    held = [{"group": "holdout", "path": str(DOCS / n), "licence": "validation only", "text": (DOCS / n).read_text()}
            for n in holdout]
    val = _prompts_from(held, tok, args.val_prompts, args.min_doc, args.max_doc, rng, lambda t: GENERAL, 1)
    prompts = train + val
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flat = np.concatenate([np.asarray(p["ids"], dtype=np.uint16) for p in prompts])
    offsets = np.cumsum([0] + [len(p["ids"]) for p in prompts]).astype(np.int64)
    np.savez_compressed(out / "prompts.npz", ids=flat, offsets=offsets, split=np.array([p["split"] for p in prompts]))
    used = sorted({p["path"] for p in train})
    sources = {"holdout_documents_not_trained_on": holdout, "seed": args.seed, "debian_packages": debs,
               "prompts": len(train), "validation_prompts": len(val), "prompt_tokens": int(offsets[-1]),
               "groups": {g: sum(1 for p in train if p["group"] == g) for g in GROUP_WEIGHTS},
               "licences": {t["group"]: t["licence"] for t in texts},
               "files": [{"path": t["path"], "group": t["group"], "chars": len(t["text"])}
                         for t in texts if t["path"] in used]}
    head, covered = head_vocab([np.asarray(p["ids"]) for p in train], tok, args.head_size)
    save_file({"ids": torch.from_numpy(head)}, out / HEAD_FILE)
    sources["head_vocab"] = {"size": args.head_size, "train_token_coverage": round(covered, 4),
                             "source": "the most frequent token ids of the training prompts + the tokenizer's "
                                       "special tokens (distill prepare)"}
    (out / "sources.json").write_text(json.dumps(sources, indent=1))
    print(f"{len(texts)} texts, {len(train)} train + {len(val)} val prompts, {int(offsets[-1])} prompt tokens -> {out}")


def head_vocab(prompts: list[np.ndarray], tok, size: int) -> tuple[np.ndarray, float]:
    """A reduced LM head for the draft: the `size` most frequent token ids of the training prompts plus the
    tokenizer's special tokens (a level-1 step on a CPU spent about half its time in the full 49K-row head), sorted;
    and the share of the prompts' tokens it covers."""
    train = np.concatenate(prompts).astype(np.int64)
    counts = np.bincount(train, minlength=len(tok))
    counts[tok.all_special_ids] = counts.max() + 1  # always scored (end of turn, chat markers)
    head = np.sort(np.argsort(-counts, kind="stable")[:size])
    return head, float(np.isin(train, head).mean())


def load_head_ids(data: Path) -> torch.Tensor:
    """The token ids prepare picked for the draft's head, from a prepared data directory."""
    from safetensors.torch import load_file
    return load_file(data / HEAD_FILE)["ids"]


def load_prompts(data: Path, max_prompts: int) -> tuple[list[list[int]], np.ndarray]:
    """The prompts of a prepared data directory and their split (0 train, 1 validation)."""
    npz = np.load(data / "prompts.npz")
    off, split, flat = npz["offsets"], npz["split"], npz["ids"]
    prompts = [flat[off[i]:off[i + 1]].astype(np.int64).tolist() for i in range(len(split))]
    if max_prompts:
        keep = [i for i in range(len(split)) if split[i] == 0][:max_prompts] + \
               [i for i in range(len(split)) if split[i] == 1][:max(2, max_prompts // 8)]
        prompts, split = [prompts[i] for i in keep], split[keep]
    return prompts, split
