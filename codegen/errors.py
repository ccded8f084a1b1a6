"""The generator's own error: a template rendered something invalid, a claim failed, or a file could not be written."""

from __future__ import annotations

from registry.errors import MoegenError


class GenerationError(MoegenError):
    """A template rendered something that is not valid Python or breaks a claim, or a file could not be written."""
