"""How one forward runs: the transformer, the operators it computes with (PyTorch or Triton kernels), tensor
parallelism."""
