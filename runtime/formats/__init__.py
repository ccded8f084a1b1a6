"""Exact codecs of the expert weight and activation formats (docs/runtime.md, "Run formats")."""
