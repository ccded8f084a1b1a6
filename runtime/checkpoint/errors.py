"""The one error type of checkpoint reading and loading.

A ValueError subclass so callers that already guard against bad input catch it; it keeps the list of
individual problems so a load that finds several reports all of them at once instead of making the
user fix and rerun one at a time.
"""
from __future__ import annotations

# Past this many lines the message summarises the rest: a checkpoint of the wrong family can produce
# thousands of problems, and the first few are what tells the user what went wrong.
_MAX_LINES = 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the build; `problems` holds one line each."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(_format(self.problems))


def _format(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    shown = problems[:_MAX_LINES]
    lines = [f"{len(problems)} problems with the checkpoint:"] + [f"  {p}" for p in shown]
    if len(problems) > len(shown):
        lines.append(f"  ... and {len(problems) - len(shown)} more")
    return "\n".join(lines)


class CheckpointConfigError(CheckpointError):
    """A checkpoint whose config.json describes another model than the one the build was generated from."""
