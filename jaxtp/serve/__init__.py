"""Serving a trained model: KV-cache decode, generation, sampling and held-out evaluation."""
