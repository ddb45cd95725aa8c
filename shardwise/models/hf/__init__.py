"""Hugging Face model families: Llama / Mistral / Qwen2 / Qwen3 (llama.py), GPT-2 (gpt2.py),
and those found by their module names: Gemma / Phi-3 / Mixtral-style decoders
(decoders.py), Falcon (falcon.py), BERT-style encoders (encoders.py), T5-style
encoder-decoders (seq2seq.py); what they share
(common.py)."""
