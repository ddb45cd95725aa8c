"""Kernels beside the model: fused operators (C19) and block-sparse attention (C20).

Each operator is a small module or function usable on its own and equal to the unfused
torch code it replaces; each model family puts them into its models (shardwise/models/)
when the `KernelPolicy` asks.
"""
