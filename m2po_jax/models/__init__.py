"""The Flax causal LM and what loads it: attention, rope, Hugging Face files and configs,
public architectures, tokenizers, chat templates, prompt encoding.

Imports only `common`.
"""
