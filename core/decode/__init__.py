"""The rounds of decoding: a level (a model on a cache), drafters, exact speculative sampling, the autoregressive
baseline and TriForce's hierarchical round loop."""
