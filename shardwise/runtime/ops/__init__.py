"""Kernels beside the model: fused operators (C19) and block-sparse attention (C20).

Each operator is a small module or function usable on its own and equal to the unfused
torch code it replaces; `shardwise.runtime.ops.model_rewrites` puts them into shardwise's GPT and
Hugging Face Llama models, which the apply stage's compile slot does from the config.
"""
