"""A compact decoder for Llama-family checkpoints (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) with GQA.

Attention reads and extends a cache (see kvcache.py) holding whatever part of the context a level sees: the full
context, a retrieved subset, or a StreamingLLM window; core.model.ops chooses the operators for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from core.config import UnusableModelError
from core.model.ops import TORCH, AttentionCache, TorchOps, ops_for

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class Step:
    """What every layer of one forward shares: RoPE cos/sin, the cache, and where to record the group-summed
    queries of the last `record` rows (retrieval scores chunks with them)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: AttentionCache | None  # None: plain causal attention over the input alone (training)
    record: int = 0
    queries: list[torch.Tensor] = field(default_factory=list)


def _sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window if the model attends through one (any layer), else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses = config.model_type == "mistral" or "sliding_attention" in layer_types
    return window if window and uses else None


@dataclass
class ModelArgs:
    """Shape of a decoder, read from a transformers config."""

    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_position: int
    attention_window: int | None = None  # sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window)

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "ModelArgs":
        model_type = config.model_type
        if model_type not in SUPPORTED_TYPES:
            raise UnusableModelError(f"model type {model_type!r} is not supported (supported: "
                                     f"{', '.join(SUPPORTED_TYPES)})")
        n_heads = config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position=config.max_position_embeddings,
            attention_window=_sliding_window(config),
        )


class Rotary(nn.Module):
    """Rotary position embedding with every scaling type transformers knows (default, linear, dynamic, yarn, llama3)."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        self.config = config
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_type = params.get("rope_type", "default")
        self.theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.head_dim = head_dim
        self.original_max = config.max_position_embeddings
        self.inv_freq, self.scaling = self._init(None)  # a plain float32 tensor: model.to(dtype) must not cast it

    def _init(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            dims = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device="cpu") / self.head_dim
            return 1.0 / (self.theta**dims), 1.0
        with torch.device("cpu"):  # also when the model is built on the meta device
            return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, torch.device("cpu"), seq_len=seq_len)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [n, head_dim] for integer positions [n]."""
        inv_freq = self.inv_freq
        if self.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > self.original_max:
                inv_freq = self._init(seq_len)[0]
        if inv_freq.device != positions.device:
            inv_freq = inv_freq.to(positions.device)
            if self.rope_type != "dynamic":
                self.inv_freq = inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; theirs become views of it (no copy kept)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])  # detached: no autograd node keeps the originals
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    a = 0
    for lin in linears:
        b = a + lin.out_features
        lin.weight = nn.Parameter(weight[a:b], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[a:b], requires_grad=False)
        a = b
    return weight, bias


class Attention(nn.Module):
    """Grouped-query attention over a cache (the ops rotate, store and attend) or over the input alone."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)
        self.wqkv: torch.Tensor | None = None  # fused q/k/v weight (Transformer.fuse_projections)
        self.bqkv: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, norm: RMSNorm, step: Step, layer: int, ops: TorchOps) -> torch.Tensor:
        """x + attention output of norm(x), x [..., n, dim]."""
        lead = x.shape[:-1]
        a = self.args
        if self.wqkv is not None:
            sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
            q, k, v = ops.normed_linear(x, norm.weight, norm.eps, self.wqkv, self.bqkv).split(sizes, dim=-1)
        else:  # through the ops, as the fused projection is (on a CPU they pack each weight once)
            h = norm(x, ops)
            q, k, v = (ops.linear(h, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(*lead, a.n_heads, a.head_dim)
        k = k.view(*lead, a.n_kv_heads, a.head_dim)
        v = v.view(*lead, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        if step.cache is None:  # plain causal attention over the input (a training batch)
            q, k = ops.rope_heads(q, step.cos, step.sin), ops.rope_heads(k, step.cos, step.sin)
            out = F.scaled_dot_product_attention(q, k, v.transpose(-3, -2), is_causal=True,
                                                 enable_gqa=a.n_heads != a.n_kv_heads)
        else:
            out, q = ops.attend(step.cache, layer, q, k, v, step.cos, step.sin)  # [n_heads, n, head_dim]
            if step.record:  # the group-summed queries of the last rows: [Hkv, rows, D]
                rows = q[:, -step.record:]
                step.queries.append(rows.reshape(a.n_kv_heads, -1, *rows.shape[1:]).sum(1))
        out = out.transpose(-3, -2).reshape(*lead, a.n_heads * a.head_dim)
        return ops.linear_add(x, out, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.w13: torch.Tensor | None = None  # fused gate/up weight (Transformer.fuse_projections)

    def forward(self, x: torch.Tensor, norm: RMSNorm, ops: TorchOps) -> torch.Tensor:
        """x + feed-forward output of norm(x), x [..., n, dim]."""
        if self.w13 is not None:
            return ops.mlp(x, norm.weight, norm.eps, self.w13, self.down_proj.weight)
        h = norm(x, ops)
        gate, up = ops.linear(h, self.gate_proj.weight), ops.linear(h, self.up_proj.weight)
        return ops.linear_add(x, F.silu(gate) * up, self.down_proj.weight)


class Block(nn.Module):
    """Pre-norm decoder layer."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, step: Step, layer: int, ops: TorchOps) -> torch.Tensor:
        x = self.self_attn(x, self.input_layernorm, step, layer, ops)
        return self.mlp(x, self.post_attention_layernorm, ops)


class Fusion(nn.Module):
    """A draft's late fusion of the target: its own normed hidden state h plus an MLP of (h, the target's normed
    hidden state `age` positions back), before the head. Zero `down` weights leave the draft as it was."""

    def __init__(self, dim: int, hidden: int, ages: int):
        super().__init__()
        self.up = nn.Linear(2 * dim, hidden, bias=False)
        self.age = nn.Embedding(ages, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor, feature: torch.Tensor, age: int) -> torch.Tensor:
        """h [..., D], feature [..., D] (broadcast to h), age >= 1 (clamped to the ages trained)."""
        bias = self.age.weight[min(max(age, 1), self.age.num_embeddings) - 1]  # no host tensor per draft step
        z = self.up(torch.cat([h, feature.to(h.dtype).expand_as(h)], -1)) + bias
        return h + self.down(F.silu(z))


class Transformer(nn.Module):
    """Decoder-only LM; parameter names follow transformers' (without the `model.` prefix)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.args = args = ModelArgs.from_config(config)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, args.head_dim)
        self.vocab_ids: torch.Tensor | None = None  # the token ids lm_head scores when it covers only some of them
        self.fusion: Fusion | None = None  # a draft's late fusion of the target's hidden states (distill)
        self._ops: TorchOps | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def ops(self) -> TorchOps:
        """How it computes: core.model.ops.ops_for its device unless set (e.g. cuBLAS projections, to compare)."""
        return self._ops or ops_for(self.device)

    @ops.setter
    def ops(self, ops: TorchOps | None) -> None:
        self._ops = ops

    def forward(self, ids: torch.Tensor, cache: AttentionCache, n_logits: int | None = None) -> torch.Tensor:
        """Run tokens ids [n] through the model with `cache`; return float32 logits of the last n_logits positions
        (all when None, none when 0)."""
        cache.begin(ids.shape[0])
        return self.head(self.step(ids, cache, n_logits)[0])

    def step(self, ids: torch.Tensor, cache: AttentionCache, n_rows: int | None = None, record: int = 0,
             between: Callable[[], None] | None = None, ops: TorchOps | None = None
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward after cache.begin, up to the final norm: the normed hidden states [n_rows, D] of the last n_rows
        positions (all when None), and per layer the group-summed rotated queries [Hkv, record, D] of the last
        `record` positions (none when 0). Device work only, so a CUDA graph can capture it; `between` (eager calls
        only) runs before each layer, e.g. to stop a long prefill forward by raising; `ops`: other operators than
        the model's own (a drafting level's)."""
        ops = ops or self.ops
        cos, sin = self.rotary.cos_sin(cache.positions(), self.dtype)
        step = Step(cos, sin, cache, record)
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            if between is not None:
                between()
            x = layer(x, step, i, ops)
        cache.end()
        if n_rows is not None:
            x = x[x.shape[0] - n_rows:]
        return (self.norm(x, ops) if n_rows != 0 else x), step.queries

    def causal_states(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B, T, D] of a plain causal forward over a batch ids [B, T], without a cache,
        through PyTorch operators (differentiable: training)."""
        cos, sin = self.rotary.cos_sin(torch.arange(ids.shape[-1], device=ids.device), self.dtype)
        step = Step(cos, sin, None)
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, step, i, TORCH)
        return self.norm(x, TORCH)

    def step_weight_bytes(self) -> int:
        """Bytes of the weights one decode forward reads: every parameter but the embedding table (of which it reads
        a row a token), unless that table is also the LM head."""
        embedding = self.embed_tokens.weight
        total = sum(p.nbytes for p in self.parameters())
        return total if self.lm_head.weight is embedding else total - embedding.nbytes

    def head(self, hidden: torch.Tensor, ops: TorchOps | None = None) -> torch.Tensor:
        """Float32 logits of normed hidden states (through `ops`, default the model's own)."""
        return (ops or self.ops).logits(hidden, self.lm_head.weight)

    def restrict_head(self, ids: torch.Tensor) -> None:
        """Score only the token ids `ids` (a draft's reduced head): logits come in that order, `vocab_ids` maps them
        back. The rows are copied; the embedding (maybe tied to the old head) is untouched."""
        self.vocab_ids = ids.to(self.device)
        weight = self.lm_head.weight.detach()[self.vocab_ids].clone()
        self.lm_head = nn.Linear(self.args.dim, len(ids), bias=False, device=self.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)

    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up per layer (fewer, larger kernels for decoding on a GPU)."""
        for block in self.layers:
            att, mlp = block.self_attn, block.mlp
            if att.wqkv is not None:  # a layer shared with (and already fused by) the target
                continue
            att.wqkv, att.bqkv = fuse_linears(att.q_proj, att.k_proj, att.v_proj)
            mlp.w13, _ = fuse_linears(mlp.gate_proj, mlp.up_proj)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take weights from a transformers *ForCausalLM state dict (tensors are shared, not copied)."""
        own = {k.removeprefix("model."): v for k, v in state.items()}
        if self.args.tie_embeddings:
            own.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.args.tie_embeddings)]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
