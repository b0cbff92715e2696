"""Distillation: windows shaped like level 1's StreamingLLM cache, the target's soft labels, the KL loss, and the
training run that writes a draft directory."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.io.draftdir import WEIGHTS_FILE, write_draft
from distill.answers import SETTINGS, generate_answers, read_answers, save_answers
from distill.data import load_head_ids, load_prompts
from distill.draft import add_fusion, ages, make_draft, own_parameters, resumed
from distill.target import as_transformer, load_hf


def sample_windows(seqs, rng, per_seq, sink, window, answer_share):
    """(sequence index, end e): the draft sees seq[:sink] + seq[e-window:e] and learns the target at those
    window positions; ends fall in the answer with probability answer_share, else in the document."""
    out = []
    for s, (ids, start) in enumerate(seqs):
        for _ in range(per_seq):
            lo = start + 1 if rng.random() < answer_share and start + 1 < len(ids) else sink + 32
            out.append((s, rng.randint(min(lo, len(ids)), len(ids))))
    return out


def batch_tensors(seqs, wins, sink, window, device):
    """Target ids [B, T] (right-padded), draft ids [W, sink + window], and for each window the target positions
    [W, window] and a validity mask [W, window] (positions of the draft input are sink..sink+window-1)."""
    used = sorted({s for s, _ in wins})
    row = {s: r for r, s in enumerate(used)}
    tlen = max(len(seqs[s][0]) for s in used)
    tgt = torch.zeros(len(used), tlen, dtype=torch.long)
    for s in used:
        tgt[row[s], :len(seqs[s][0])] = torch.tensor(seqs[s][0])
    n = sink + window
    dids = torch.zeros(len(wins), n, dtype=torch.long)
    tpos = torch.zeros(len(wins), window, dtype=torch.long)
    trow = torch.zeros(len(wins), dtype=torch.long)
    valid = torch.zeros(len(wins), window, dtype=torch.bool)
    for w, (s, e) in enumerate(wins):
        ids = seqs[s][0]
        if e <= n:  # the whole prefix fits: positions sink..e-1 are learned
            dids[w, :e] = torch.tensor(ids[:e])
            tpos[w, :max(e - sink, 0)] = torch.arange(sink, max(e, sink))
            valid[w, :max(e - sink, 0)] = True
        else:
            dids[w] = torch.tensor(ids[:sink] + ids[e - window:e])
            tpos[w] = torch.arange(e - window, e)
            valid[w] = True
        trow[w] = row[s]
    return tgt.to(device), dids.to(device), trow.to(device), tpos.to(device), valid.to(device)


def soft_labels(target, head_ids, batch, temps, ages=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The target's log-probabilities of the head's ids at each window position, per temperature [T, W, window, H]
    (normalised over the WHOLE vocabulary: ids outside the head keep their mass, which the draft cannot propose),
    the target's argmax over the whole vocabulary [W, window], and (ages > 0) the target's normed hidden states
    1..ages positions before each window position [ages, W, window, D] (what a fusion draft is given)."""
    tgt, _, trow, tpos, _ = batch
    with torch.no_grad():
        hidden = target.causal_states(tgt)
        logits = (hidden[trow[:, None], tpos] @ target.lm_head.weight.T).float()
        lp = torch.stack([(logits / t)[..., head_ids] - torch.logsumexp(logits / t, -1, keepdim=True) for t in temps])
        feats = torch.stack([hidden[trow[:, None], (tpos - a).clamp_min(0)] for a in range(1, ages + 1)]) \
            if ages else None
        return lp, logits.argmax(-1), feats


def distil_loss(draft, head_ids, batch, labels, temps, sink):
    """Mean KL(target || draft) over valid window positions, the draft scoring the head's ids only (as it does when
    decoding), averaged over temperatures (and, for a fusion draft, over the ages of the target's hidden state it
    is given, and without it); plus top-1 agreement and sum min(p, q) (the expected acceptance of one sampled draft
    token) at T=1 and 0.6, per age for a fusion draft (suffix _age1, ...; unsuffixed: without the target's state)."""
    dids, valid = batch[1], batch[4]
    lp, top, feats = labels
    m = valid.float()
    with torch.autocast("cuda", torch.bfloat16, enabled=dids.is_cuda):
        h = draft.causal_states(dids)[:, sink:]
        variants = {"": h}
        if draft.fusion is not None:
            variants.update({f"_age{a}": draft.fusion(h, feats[a - 1], a) for a in range(1, len(feats) + 1)})
    loss, stats = 0.0, {}
    for name, x in variants.items():
        with torch.autocast("cuda", torch.bfloat16, enabled=dids.is_cuda):
            dl = (x @ draft.lm_head.weight[head_ids].T).float()
        for i, t in enumerate(temps):
            lq = F.log_softmax(dl / t, -1)
            loss = loss + ((lp[i].exp() * (lp[i] - lq)).sum(-1) * m).sum() / m.sum()
        with torch.no_grad():
            stats["top1" + name] = ((top == head_ids[dl.argmax(-1)]).float() * m).sum() / m.sum()
            for t in (1.0, 0.6):
                if t in temps:
                    p = lp[temps.index(t)].exp()
                    q = (dl / t).softmax(-1)
                    stats[f"overlap_T{t}{name}"] = (torch.minimum(p, q).sum(-1) * m).sum() / m.sum()
    return loss / (len(temps) * len(variants)), {k: v.item() for k, v in stats.items()}


def train(args) -> None:
    """The train stage: distil a draft and write its directory (core.io.draftdir) and training.json to args.out."""
    from core.io.loading import vocab_digest
    t_start = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    src, tok, hf, eos_ids = load_hf(args.target, dev)
    target = as_transformer(hf)
    log(f"target {src.name} loaded on {dev} in {time.time() - t_start:.0f}s")
    data = Path(args.data)
    prompts, split = load_prompts(data, args.max_prompts)
    t0 = time.time()
    if args.answers:
        answers = read_answers(args.answers, prompts)
    else:
        generated = generate_answers(hf, prompts, split, SETTINGS, args.gen_batch, args.answer_tokens, eos_ids, dev,
                                     args.gen_seconds, log, args.seed)
        save_answers(out / "answers.npz", prompts, generated)
        answers = [[a] if a else [] for a in generated]
    gen_s = time.time() - t0
    seqs = {0: [], 1: []}
    for pr, own, s in zip(prompts, answers, split):
        seqs[int(s)] += [(pr + a[0], len(pr)) for a in own]
    n_ans = sum(len(a[0]) for own in answers for a in own)
    log(f"answers: {len(seqs[0])} train / {len(seqs[1])} val sequences, {n_ans} answer tokens in {gen_s:.0f}s")

    # candidates: each init trains on the same batches for --trial-steps; the lowest recent loss continues
    runs = []
    if args.resume:  # it keeps its own head ids
        draft, shared, layers, head_ids = resumed(target, Path(args.resume))
        inits = [(draft, shared, layers)]
    else:
        head_ids = load_head_ids(data)
        inits = [(make_draft(target, layers, shared), shared, layers) for shared, layers in args.init]
    head_ids = head_ids.to(dev)
    for d, shared, layers in inits:
        if args.fusion and d.fusion is None:
            add_fusion(d, args.fusion, args.fusion_ages)
        # a fusion draft trains only its fusion module (without the target's state it proposes as before), unless
        # --train-body
        fusion_only = d.fusion is not None and not args.train_body
        if fusion_only:
            d.requires_grad_(False)
            d.fusion.requires_grad_(True)
        ps = list(d.fusion.parameters() if fusion_only else own_parameters(d, shared).values())
        runs.append({"shared": shared, "layers": layers, "draft": d, "params": ps, "losses": [],
                     "opt": torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)})
    val_wins = sample_windows(seqs[1], random.Random(1), 2, args.sink, args.window, 0.75)

    def evaluate(draft):
        draft.eval()
        stats = []
        with torch.no_grad():
            for a in range(0, len(val_wins), args.windows):
                b = batch_tensors(seqs[1], val_wins[a:a + args.windows], args.sink, args.window, dev)
                stats.append(distil_loss(draft, head_ids, b, soft_labels(target, head_ids, b, [1.0, 0.6], ages(draft)),
                                         [1.0, 0.6], args.sink))
        draft.train()
        return {"kl": float(np.mean([l.item() for l, _ in stats])),
                **{k: float(np.mean([s[k] for _, s in stats])) for k in stats[0][1]}}

    for r in runs:
        r["val_before"] = evaluate(r["draft"])
        log(f"draft: target layers 0..{r['shared'] - 1} shared + {sum(p.numel() for p in r['params']) / 1e6:.2f}M "
            f"own params{' resumed from ' + args.resume if args.resume else ''} (init: target layers {r['layers']}):"
            f" val {r['val_before']}")
    per_seq = max(1, args.windows // args.seqs)
    t1, step, history = time.time(), 0, []
    while True:
        elapsed = time.time() - t1
        if (args.steps and step >= args.steps) or (not args.steps and elapsed > args.train_seconds):
            break
        if step == args.trial_steps and len(runs) > 1:
            runs.sort(key=lambda r: np.mean(r["losses"][-10:]))
            log("trial: " + ", ".join(f"{r['shared']}+{r['layers']} loss {np.mean(r['losses'][-10:]):.3f}"
                                      for r in runs))
            runs = runs[:1]
        frac = step / args.steps if args.steps else elapsed / args.train_seconds
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1))))
        picked = [seqs[0][i] for i in rng.sample(range(len(seqs[0])), min(args.seqs, len(seqs[0])))]
        wins = sample_windows(picked, rng, per_seq, args.sink, args.window, args.answer_share)
        b = batch_tensors(picked, wins, args.sink, args.window, dev)
        labels = soft_labels(target, head_ids, b, args.temps, ages(runs[0]["draft"]))
        for r in runs:
            for g in r["opt"].param_groups:
                g["lr"] = lr
            loss, st = distil_loss(r["draft"], head_ids, b, labels, args.temps, args.sink)
            r["opt"].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(r["params"], 1.0)
            r["opt"].step()
            r["losses"].append(loss.item())
        step += 1
        if step % args.log_every == 0:
            history.append({"step": step, "seconds": round(time.time() - t1, 1), "lr": lr, "loss": loss.item(), **st})
            log(f"  step {step} {time.time() - t1:.0f}s loss {loss.item():.3f} "
                + " ".join(f"{k} {v:.3f}" for k, v in st.items() if k.startswith("top1")))
    best = min(runs, key=lambda r: np.mean(r["losses"][-10:]))
    draft, before, init_layers, shared = best["draft"], best["val_before"], best["layers"], best["shared"]
    own = own_parameters(draft, shared)
    n_params = sum(v.numel() for v in own.values())
    train_s = time.time() - t1
    after = evaluate(draft)
    log(f"trained {step} steps in {train_s:.0f}s; val after: {after}")

    config = hf.config.to_dict()
    config.update(num_hidden_layers=shared + len(init_layers), torch_dtype="bfloat16", dtype="bfloat16")
    head_meta = json.loads((data / "sources.json").read_text())["head_vocab"]
    meta = {
        "name": args.name, "shares_target_embedding": True, "target": src.name, "vocab_sha256": vocab_digest(tok),
        "shared_layers": shared, "init_layers": init_layers, "own_parameters": n_params,
        "sink": args.sink, "window": args.window, "temperatures": args.temps, "steps": step, "seed": args.seed,
        "int8": args.int8, "resumed_from": args.resume, "head_vocab": head_meta}
    if draft.fusion is not None:
        meta["fusion"] = {
            "hidden": draft.fusion.up.out_features, "ages": ages(draft),
            "feature": "the target's final-normed hidden state that produced the last token, `age` positions back"}
    write_draft(out, config, meta, own, head_ids)
    report = {"command": " ".join(sys.argv), "args": vars(args), "device": torch.cuda.get_device_name() if
              dev.type == "cuda" else "cpu", "torch": torch.__version__, "generation_seconds": round(gen_s, 1),
              "train_seconds": round(train_s, 1), "steps": step, "answer_tokens": n_ans,
              "train_sequences": len(seqs[0]), "val_sequences": len(seqs[1]), "val_before": before,
              "val_after": after, "history": history, "log": log_lines}
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"saved {out}: {(out / WEIGHTS_FILE).stat().st_size / 1e6:.1f} MB, total {time.time() - t_start:.0f}s")
