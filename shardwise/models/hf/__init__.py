"""Hugging Face model families: Llama / Mistral / Qwen2 / Qwen3 (llama.py) and GPT-2
(gpt2.py), and what they share (common.py)."""
