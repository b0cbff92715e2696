"""How one forward runs: the transformer, the operators it computes with (PyTorch or Triton kernels), tensor
parallelism."""

from __future__ import annotations

from core.model.transformer import ModelArgs, Transformer
from core.model.ops import TORCH, TorchOps, TritonOps, ops_for, rotate
from core.model.parallel import TensorParallel, joined, parallelize

__all__ = ["ModelArgs", "Transformer", "TORCH", "TorchOps", "TritonOps", "ops_for", "rotate", "TensorParallel",
           "joined", "parallelize"]
