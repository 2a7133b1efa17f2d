"""Batched Llama runtime, engine, server and CLI."""

__all__: list[str] = []
