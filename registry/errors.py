"""The error types of the selection engine, each with the exit code the CLI turns it into.

Every refusal in RULES.md is one of these, raised with a message that says what was asked, why it
is refused and what to change. The CLI prints the message (never a traceback) and exits with
`exit_code`; tests assert the messages exactly.
"""


class MoegenError(Exception):
    """Base of every error a user can cause; `exit_code` is what the CLI exits with."""

    exit_code = 2


class RegistryError(MoegenError):
    """`registry/impls.toml` breaks an identity rule (RULES ID1-ID4): a bug in the registry itself."""


class TacticError(MoegenError):
    """A tactic refused when parsed (RULES TA2, TA4, RQ4)."""


class SelectionError(MoegenError):
    """A backend literal or deployment selection that cannot be turned into a request (RQ1, RQ4, DR4)."""


class ResolutionError(MoegenError):
    """A selection refused for a model's layers (FN2-FN5, LR3, DR5)."""


class DeclarationError(MoegenError):
    """A model declaration file that does not validate; the message names file, line and field."""


class NotHonoredError(MoegenError):
    """Under `require`, no target honors the selection (RULES TG5)."""
