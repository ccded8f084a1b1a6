"""What generated builds run on: formats, routers, experts implementations, model ops, checkpoints.

Imports torch only (cupy lazily inside GPU implementations); never registry, codegen or pydantic.
See docs/runtime.md for the contracts between its parts.
"""
