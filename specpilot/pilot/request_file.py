"""A deployment's own requests as the pilot's and the bench's request set (``--prompts FILE``).

The bundled benchmarks (GSM8K, HumanEval, MBPP, MT-Bench) stand for a mix nobody serves exactly; which speculative
system wins, and at which batch size it stops paying, depends on the text (§2.2, §5.1). A user who logged their
server's traffic can tune on it instead: ``FILE`` is JSON Lines, one OpenAI request body per line, as a client sends
it to ``specpilot serve`` (or to vLLM):

- a chat body, ``{"messages": [...], ...}``: rendered through the target tokenizer's chat template exactly as the
  server renders it (:func:`specpilot.serve.chat.render_chat`), so the pilot measures the token ids the server
  would run;
- a completion body, ``{"prompt": "text" | [ids] | ["text", ...] | [[ids], ...], ...}``: each prompt one request
  (a list of prompts is a batch of them, as the server takes it).

Both are validated as the server validates them (unknown fields and sampling settings refused: the server would
refuse them too, so they are not the deployment's requests). ``max_tokens`` (or ``max_completion_tokens``), when a
body gives it, is that request's budget, capped by the pilot's ``--max-new-tokens`` (which bounds the run's time);
otherwise the pilot's budget applies; stop strings are not applied (each request runs to its budget or EOS, as the
bundled prompts do). One field beyond OpenAI's is read and removed before validation:
``"group"``, a name for the request's stratum. Gains are geometric means over groups, and the paired bootstrap
resamples within each (§5.1), as it does per benchmark; without it every request of the file is in one group named
after the file. A target without a tokenizer (random weights, timing only) takes token-id prompts, and text as
UTF-8 byte ids as for the bundled prompts; chat needs a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.errors import PromptError, SpecPilotError
from specpilot.pilot.paired import Req


def load_request_file(path: str | Path, tokenizer, vocab_size: int, max_new_tokens: int,
                      byte_id_offset: int = 256) -> list[Req]:
    """The requests of ``path`` (module doc), in file order, as :class:`Req` (``benchmark`` = the group, ``index`` =
    the request's place within its group).

    Args:
        path: a JSON Lines file of OpenAI request bodies. tokenizer: the target's (None: no tokenizer).
        vocab_size: the target's; token ids must lie below it. max_new_tokens: the default budget and the cap of a
            body's own ``max_tokens``. byte_id_offset: where text's byte ids start on a target without a tokenizer.
    Raises:
        SpecPilotError: the file cannot be read or holds no request; a line that is not a JSON object, a body the
            server would refuse (its 400 message), a chat body for a target without a tokenizer, an empty prompt or
            token ids outside the vocabulary: one line naming ``path`` and the line number.
    """
    from specpilot.serve.chat import choose_template
    from specpilot.serve.protocol import APIError

    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecPilotError(f"--prompts {p}: cannot be read as UTF-8 text ({type(e).__name__}: {e})") from None
    template = choose_template(tokenizer)[0] if tokenizer is not None else None
    reqs: list[Req] = []
    counts: dict[str, int] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {p} line {no}"
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecPilotError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(body, dict):
            raise SpecPilotError(f"{where}: each line must be a JSON object (an OpenAI request body), got "
                                 f"{type(body).__name__}")
        group = body.pop("group", p.stem)
        if not isinstance(group, str) or not group.strip():
            raise SpecPilotError(f"{where}: \"group\" must be a non-empty string, got {group!r}")
        try:
            prompts, budget = _prompts(body, tokenizer, template, byte_id_offset)
        except (APIError, PromptError) as e:
            raise SpecPilotError(f"{where}: {e}") from None
        for ids in prompts:
            if not ids:
                raise SpecPilotError(f"{where}: an empty prompt (no token to start from)")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SpecPilotError(f"{where}: token id {bad[0]} outside the target's vocabulary of {vocab_size}")
            k = counts.get(group, 0)
            counts[group] = k + 1
            reqs.append(Req(group, k, tuple(ids), min(budget or max_new_tokens, max_new_tokens)))
    if not reqs:
        raise SpecPilotError(f"--prompts {p}: no request in it (one OpenAI request body per line)")
    return reqs


def _prompts(body: dict, tokenizer, template, byte_id_offset: int) -> tuple[list[list[int]], int | None]:
    """Prompt token ids of one body and its own budget (None: not given). Raises APIError as the server would."""
    from specpilot.serve.chat import render_chat
    from specpilot.serve.protocol import APIError, ChatRequest, CompletionRequest, check_greedy, parse
    from specpilot.text import check_text

    if "messages" in body:
        req = parse(ChatRequest, body)
        check_greedy(req)
        if tokenizer is None:
            raise APIError(400, "a chat request needs the target's tokenizer (its chat template); this target has "
                                "none: give token ids as {\"prompt\": [ids]}")
        return [render_chat(tokenizer, template, req.messages, req.add_generation_prompt)], req.max_new()
    if "prompt" not in body:
        raise APIError(400, "neither \"messages\" (a chat body) nor \"prompt\" (a completion body)")
    explicit = "max_tokens" in body  # a completion's default of 16 is the server's, not this deployment's budget
    req = parse(CompletionRequest, body)
    check_greedy(req)
    raw = req.prompt
    items = [raw] if isinstance(raw, str) or not raw or isinstance(raw[0], int) else list(raw)  # [] is one, empty
    out = []
    for item in items:
        if isinstance(item, list):
            out.append(list(item))
        elif tokenizer is None:
            out.append([byte_id_offset + b for b in check_text(item).encode("utf-8")])
        else:
            out.append(tokenizer(check_text(item), add_special_tokens=False)["input_ids"])
    return out, (req.max_tokens if explicit else None)


__all__ = ["load_request_file"]
