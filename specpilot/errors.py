"""User-facing errors.

Every error a user can cause by bad input (a missing checkpoint, an unsupported model type, an empty or
too-long prompt, an incompatible drafter, a corrupted file) is raised as :class:`SpecPilotError` with a
one-line message. The CLI prints it as ``error: <message>`` and exits with status 2, without a traceback;
the engine that raised it stays usable.
"""


class SpecPilotError(Exception):
    """A clear, one-line error caused by the user's input or environment (not a bug in SpecPilot)."""


class CheckpointError(SpecPilotError):
    """A checkpoint directory is missing, incomplete, corrupted, or of an unsupported model type."""


class PromptError(SpecPilotError):
    """A prompt is empty or does not fit the model's context."""


class DrafterError(SpecPilotError):
    """A drafter does not fit the target (vocabulary, tokenizer) or is unknown."""


def validation_message(e: ValueError, flags: bool = True) -> str:
    """One line for a pydantic ``ValidationError`` (or any ValueError), naming each invalid field and what it should
    be: ``--nodes: Input should be >= 1; --w12: Input should be a valid boolean`` with ``flags`` (the field as its
    command-line option), ``nodes: ...`` without (a field of a file). Any other ValueError: its first line."""
    errors = getattr(e, "errors", None)
    if not callable(errors):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    out = []
    for err in errors():
        loc = ".".join(map(str, err["loc"]))
        name = f"--{loc.replace('_', '-')}" if flags else loc
        out.append((f"{name}: " if loc else "") + err["msg"].removeprefix("Value error, "))
    return "; ".join(out)
