"""Integrations: thin event maps from Lightning, the HF Trainer and DeepSpeed's profiler API onto the core."""
