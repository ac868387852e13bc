"""Transformer layers in the global view; each parameter carries its logical axis names."""

from jaxtp.layers.attention import positional, rope_tables
from jaxtp.layers.transformer import Transformer, embed_tokens, scan_layers, token_losses_of

__all__ = [
    "Transformer", "embed_tokens", "positional", "rope_tables", "scan_layers", "token_losses_of"
]
