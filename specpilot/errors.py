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
