"""Hugging Face interop: Llama-family checkpoints imported onto any layout, and exported back as
a directory ``transformers`` loads."""
