"""Hugging Face interop: Llama-family checkpoints imported onto any layout, and exported back as
a directory ``transformers`` loads."""

from jaxtp.hf.exporter import copy_tokenizer, save_hf, with_tokenizer
from jaxtp.hf.importer import config_from_hf, load_params

__all__ = [
    "config_from_hf", "copy_tokenizer", "load_params", "save_hf", "with_tokenizer"
]
