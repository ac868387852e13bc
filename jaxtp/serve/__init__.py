"""Serving a trained model: KV-cache decode, generation, sampling and held-out evaluation."""

from jaxtp.serve.evaluation import evaluate
from jaxtp.serve.generate import Generation, Generator
from jaxtp.serve.sampling import SamplerArgs

__all__ = [
    "Generation", "Generator", "SamplerArgs", "evaluate"
]
