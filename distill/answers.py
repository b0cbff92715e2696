"""The target's answers to the training prompts: sampled in batches, saved as flat ids + offsets, read back and
matched to the prompts they answer."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import numpy as np
import torch

from distill.data import load_prompts
from distill.target import load_hf

SETTINGS = [(0.0, 1.0), (0.6, 0.9), (1.0, 1.0)]  # (temperature, top-p) of the target's answers, cycling per batch


def generate_answers(hf, prompts, split, settings, batch, max_new, eos_ids, device, time_cap, log, offset=0):
    """The target's answers to prompts (ids lists), batch by batch, settings cycling per batch from settings[offset]:
    validation prompts first, then training prompts in a random order (sorted by length within groups of 8 batches,
    less padding)."""
    rng = random.Random(0)
    train = [i for i in range(len(prompts)) if split[i] == 0]
    rng.shuffle(train)
    groups = [[i for i in range(len(prompts)) if split[i] == 1]] + \
             [train[a:a + 8 * batch] for a in range(0, len(train), 8 * batch)]
    order = [i for g in groups for i in sorted(g, key=lambda i: len(prompts[i]))]
    answers, t0 = [None] * len(prompts), time.time()
    eos = sorted(eos_ids)
    for n, a in enumerate(range(0, len(order), batch)):
        idx = order[a:a + batch]
        length = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), length), eos[0], dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, length - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, length - len(prompts[i]):] = 1
        temp, top_p = settings[(n + offset) % len(settings)]
        kw = dict(do_sample=True, temperature=temp, top_p=top_p) if temp > 0 else dict(do_sample=False)
        with torch.no_grad():
            out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                              eos_token_id=eos, pad_token_id=eos[0], top_k=0, **kw)[:, length:].tolist()
        for r, i in enumerate(idx):
            row = out[r]
            cut = next((k + 1 for k, x in enumerate(row) if x in eos_ids), len(row))
            answers[i] = (row[:cut], temp)
        log(f"  generated batch {n}: {len(idx)} x <= {length} prompt tokens, T={temp}, {time.time() - t0:.0f}s")
        if time.time() - t0 > time_cap:
            log("  generation time cap reached")
            break
    return answers


def save_answers(path: Path, prompts, answers) -> None:
    """Answers as flat ids + offsets, with the index and a digest of the prompt each answers."""
    done = [i for i, a in enumerate(answers) if a is not None]
    flat = [x for i in done for x in answers[i][0]]
    np.savez_compressed(path, index=np.array(done, dtype=np.int64), ids=np.array(flat, dtype=np.int32),
                        offsets=np.cumsum([0] + [len(answers[i][0]) for i in done]).astype(np.int64),
                        temperature=np.array([answers[i][1] for i in done], dtype=np.float32),
                        prompt_digest=np.array([hash_ids(prompts[i]) for i in done], dtype=np.int64))


def read_answers(paths: list[str], prompts) -> list[list]:
    """For each prompt, its answers saved by save_answers in these files (one per file that answers it)."""
    answers = [[] for _ in prompts]
    for path in paths:
        npz = dict(np.load(path))  # (each npz[...] would read the file again)
        off, ids, digest = npz["offsets"], npz["ids"], npz["prompt_digest"]
        for k, i in enumerate(npz["index"]):
            if i >= len(prompts) or hash_ids(prompts[i]) != digest[k]:
                raise ValueError(f"{path} answers other prompts than the data directory's (prompt {i})")
            answers[i].append((ids[off[k]:off[k + 1]].tolist(), float(npz["temperature"][k])))
    return answers


def hash_ids(ids: list[int]) -> int:
    """A 56-bit digest of token ids: which prompt an answer belongs to."""
    return int.from_bytes(hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).digest()[:7], "little")


def answers_stage(args) -> None:
    """Only sample the target's answers (GPU) and save them, for one or more later `train --answers` runs."""
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.time()
    torch.manual_seed(args.seed)
    _, _, hf, eos_ids = load_hf(args.target, dev)
    prompts, split = load_prompts(Path(args.data), args.max_prompts)
    answers = generate_answers(hf, prompts, split, SETTINGS, args.gen_batch, args.answer_tokens, eos_ids, dev,
                               args.gen_seconds, print, args.seed)
    save_answers(Path(args.out), prompts, answers)
    n = sum(len(a[0]) for a in answers if a)
    print(f"{sum(a is not None for a in answers)} answers, {n} tokens in {time.time() - t0:.0f}s -> {args.out}")
