"""Flax Llama / Qwen2 models and weight loading (installed as `jcascade.models`)."""
