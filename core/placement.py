"""Where one generation's caches live: all on the device, or the full KV cache in CPU memory (streamed layer by
layer) when it does not fit the device's memory budget. Decided before anything is allocated."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from core.config import GenerationConfig, TriForceError
from core.model import Transformer

GiB = 2**30


def parameter_bytes(*models: Transformer | None) -> int:
    """Bytes of the models' parameters, each shared tensor counted once."""
    seen: dict[int, int] = {}
    for m in models:
        for p in m.parameters() if m is not None else ():
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def host_available() -> int:
    """Bytes of host memory available: TRIFORCE_HOST_MEMORY_GIB when set (for machines whose memory grows on demand
    and reports too little up front), else MemAvailable, or a large number where /proc/meminfo is missing."""
    if os.environ.get("TRIFORCE_HOST_MEMORY_GIB"):
        return int(float(os.environ["TRIFORCE_HOST_MEMORY_GIB"]) * GiB)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 1 << 62


@dataclass
class Placement:
    """The plan of one generation: whether the full cache is offloaded, whether the chunk index stays on the device,
    the bytes each part takes on the device and on the host, and the device budget it was planned against."""

    offloaded: bool
    index_on_device: bool
    device: dict[str, int]
    host: dict[str, int]
    budget: int

    def describe(self) -> dict[str, dict]:
        """Each cache and what it takes, by where it lives (plain data, for events)."""
        out = {name: {"where": "GPU", "bytes": n} for name, n in self.device.items()}
        out.update({name: {"where": "CPU", "bytes": n} for name, n in self.host.items()})
        return out


def plan(model: Transformer, draft: Transformer | None, capacity: int, prompt_tokens: int, cfg: GenerationConfig,
         budget: int | None, host_held: int = 0) -> tuple[Placement, GenerationConfig]:
    """The placement for a full cache of `capacity` tokens over a prompt of `prompt_tokens`, and the settings resolved
    for it (offloaded runs default to the paper's budget 8192 and γ2 12). `budget`: device bytes (None: no limit,
    e.g. a CPU run); `host_held`: host bytes the engine holds in a kept offloaded cache, reused or given back before
    this run allocates, so counted as available. Raises TriForceError when it fits neither way, or the host lacks
    memory for the offloaded cache."""
    a = model.args
    kv_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * model.dtype.itemsize
    weights = parameter_bytes(model, draft)
    working = max(GiB, budget // 12) if budget else 0  # activations, logits, the draft's cache, allocator slack

    def parts(offloaded: bool) -> tuple[dict[str, int], dict[str, int], GenerationConfig]:
        c = cfg.resolved(offloaded)
        device = {"weights": weights, "working memory": working}
        host: dict[str, int] = {}
        if offloaded:
            device["full KV cache staging (2 layers)"] = 2 * capacity * kv_token // a.n_layers
            host["full KV cache"] = capacity * kv_token
        else:
            device["full KV cache"] = capacity * kv_token
        # TriForce's retrieval cache and chunk index are counted for AR too, so that both methods get the same
        # placement for the same input: a comparison of the two is like for like
        extra = c.max_new_tokens + c.gamma1 + c.gamma2 + 2
        device["retrieval cache"] = (min(c.budget, prompt_tokens) + c.chunk_size + extra) * kv_token
        device["chunk index"] = prompt_tokens // c.chunk_size * kv_token // 2
        return device, host, c

    if budget is None:  # a CPU run: "on" exercises the streaming code, "auto" never offloads
        offloaded = cfg.offload == "on"
        device, host, c = parts(offloaded)
        return Placement(offloaded, True, device, host, budget or 0), c
    device, host, c = parts(False)
    if cfg.offload == "off" or (cfg.offload == "auto" and sum(device.values()) <= budget):
        if sum(device.values()) > budget and cfg.offload == "off":
            raise TriForceError(f"the run needs {sum(device.values()) / GiB:.1f} GiB of GPU memory "
                                f"({_listing(device)}) but the budget is {budget / GiB:.1f} GiB: allow offloading "
                                "(offload auto or on), shorten the document or lower the budget")
        return Placement(False, True, device, host, budget), c
    device, host, c = parts(True)
    index_on_device = sum(device.values()) <= budget
    if not index_on_device:  # kept in host memory, brought over one layer at a time when chunks are selected
        host["chunk index"] = device.pop("chunk index")
    if sum(device.values()) > budget:
        raise TriForceError(f"the run needs {sum(device.values()) / GiB:.1f} GiB of GPU memory even with the KV cache "
                            f"offloaded ({_listing(device)}) but the budget is {budget / GiB:.1f} GiB: shorten the "
                            "document, lower the retrieval budget or pick a smaller model")
    available = host_available() + host_held
    if sum(host.values()) > 0.9 * available:
        raise TriForceError(f"offloading needs {sum(host.values()) / GiB:.1f} GiB of CPU memory ({_listing(host)}) "
                            f"but {available / GiB:.1f} GiB are available: shorten the document")
    return Placement(True, index_on_device, device, host, budget), c


def _listing(parts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n / GiB:.1f}" for name, n in parts.items())


def device_budget(device: torch.device, gib: float | None) -> int | None:
    """The device memory a run may plan on: `gib` when given (enforced on CUDA as this process's share of the GPU, so
    a large GPU behaves like a smaller card), else the GPU's total memory; None on a CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if gib is None:
        return total
    budget = int(gib * GiB)
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    return budget
