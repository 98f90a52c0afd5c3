"""The CPU backend: Megatron-Core on CPU-only torch, for rehearsals, tests and the demo.

Not part of the GPU path: nothing under ``megatron_flat.megatron`` imports it. It sits one
layer above the Megatron glue (``docs/architecture.md``, "Layers") and holds

- ``backend``: the declared patches that let Megatron-Core's model, dispatchers and
  optimizers run without CUDA (``enable_cpu_backend``);
- ``training``: the few Megatron-LM training-code workarounds a CPU run needs;
- ``grouped``: grouped-GEMM experts through a per-expert matmul loop;
- ``flash_attention``: Megatron's core attention through torch's CPU flash kernel, O(N)
  like transformer-engine's fused attention on a GPU, and replay-capable;
- ``context_attention`` / ``mla_attention``: that attention over a context-parallel group,
  for grouped-query and multi-latent attention.
"""
