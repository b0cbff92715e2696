"""Distil a tiny level-1 draft for a target (default: the embedded SmolLM2-135M-Instruct).

The draft is a Llama-architecture model of the target's width: the target's first layers, shared as they are, then
a few layers of its own; it SHARES the target's token embedding and tied LM head (the shipped file holds only its
own layers and final norm; the loader takes the rest from the target), and its head scores a reduced vocabulary (the
most frequent token ids of the training prompts). It is trained on the target's own next-token distributions,
KL(target || draft) over the head's ids at one or more temperatures, over windows shaped like level 1's StreamingLLM
cache: the prompt's first `sink` tokens followed by the `window` tokens before a position, while the target sees the
whole sequence (prompt + answer).

Stages, all seeded:

  python -m distill prepare --out .carry/data     # CPU: offline text -> prompts, head ids, sources.json
  python -m distill answers --data .carry/data --target model.gguf --out a.npz     # GPU: the target's answers
  python -m distill train --data .carry/data --target model.gguf [--answers a.npz] [--resume DIR] --out DIR

`prepare` (distill/data.py) gathers freely licensed text available offline, cuts it into documents of random
length and wraps each with an instruction in the target's chat template. `answers` (distill/answers.py, or `train`
without --answers) samples the target's answers to those prompts (greedy, T=0.6/top-p 0.9, T=1); `train`
(distill/train.py) distils, from the target's layers or from an earlier draft (--resume).
"""
