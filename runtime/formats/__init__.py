"""Exact codecs of the expert weight and activation formats (docs/runtime.md, "Run formats")."""

from contract import RUN_FORMATS  # noqa: F401  (the quant segment of an implementation id)
