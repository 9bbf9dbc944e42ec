"""What a request must be before the engine takes it: one list of token ids that fits the context, a budget,
stop ids of the vocabulary. Each check raises :class:`~specpilot.errors.PromptError` with one line."""

from __future__ import annotations

import collections.abc
import numbers

import torch

from specpilot.errors import PromptError


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def check_prompt(prompt_ids, max_new_tokens, vocab_size: int, max_len: int) -> None:
    """Raise :class:`PromptError` for a prompt that is not one sequence of integer ids (a string, a nested list,
    a 2-D or float tensor), an empty prompt, ids outside ``[0, vocab_size)``, a ``max_new_tokens`` that is not a
    positive integer, or a prompt + ``max_new_tokens`` longer than ``max_len`` tokens."""
    if (isinstance(prompt_ids, (str, bytes, collections.abc.Set, collections.abc.Mapping))
            or not hasattr(prompt_ids, "__len__")):
        raise PromptError(f"the prompt must be a list of token ids (ints), got {type(prompt_ids).__name__}")
    if isinstance(prompt_ids, torch.Tensor) and (prompt_ids.dim() != 1 or prompt_ids.is_floating_point()):
        raise PromptError(f"a prompt tensor must be 1-D integer ids, got {prompt_ids.dim()}-D {prompt_ids.dtype}")
    if not isinstance(prompt_ids, torch.Tensor) and not all(_is_id(t) for t in prompt_ids):
        raise PromptError("the prompt must be one list of token ids (ints); generate() takes one request "
                          "(loop over prompts for several)")
    if not _is_id(max_new_tokens):
        raise PromptError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) == 0:
        raise PromptError("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise PromptError(f"prompt token ids must lie in [0, {vocab_size})")
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > max_len:
        raise PromptError(f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                          f"context of {max_len} tokens")


def stop_id_set(stop_ids, vocab_size: int) -> set[int]:
    """``stop_ids`` (None, a list / iterator / 1-D tensor or array of ids) as a set of ints.

    Raises:
        PromptError: not a 1-D collection of integer ids, or ids outside ``[0, vocab_size)`` (they could never
            occur).
    """
    if stop_ids is None:
        return set()
    if isinstance(stop_ids, torch.Tensor) and not stop_ids.is_floating_point():
        stop_ids = stop_ids.reshape(-1).tolist()
    elif hasattr(stop_ids, "tolist") and hasattr(stop_ids, "ndim"):  # a numpy array of ids
        if stop_ids.ndim != 1:
            raise PromptError(f"stop_ids must be a 1-D list of token ids, got a {stop_ids.ndim}-D array")
        stop_ids = stop_ids.tolist()
    if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
        raise PromptError(f"stop_ids must be a list of token ids (ints), got {stop_ids!r}")
    stop_ids = list(stop_ids)  # once: an iterator would be used up by the checks below
    if not all(_is_id(t) for t in stop_ids):
        raise PromptError(f"stop_ids must be a list of token ids (ints), got {stop_ids!r}")
    bad = [int(t) for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"stop_ids {bad[:5]} are outside the vocabulary [0, {vocab_size}): they can never occur")
    return {int(t) for t in stop_ids}


def keep(new: list[int], stops: set[int], eos: set[int], room: int) -> tuple[list[int], str]:
    """What a request keeps of a pass's accepted tokens ``new`` (R1, R3): up to and including the first stop id,
    and at most ``room`` tokens (its remaining ``max_new_tokens``). Returns ``(kept, reason)``: ``eos`` or ``stop``
    when a stop id was kept (an EOS id, or one of ``stops`` that is not), else ``length``."""
    kept = []
    for tok in new[:max(room, 0)]:
        kept.append(tok)
        if tok in stops:
            return kept, "eos" if tok in eos else "stop"
    return kept, "length"
