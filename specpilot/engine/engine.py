"""The decoding engine: AR greedy and speculative decoding with chain or tree verification (§1.1, §4.2).

One request at a time. Invariant between steps: the target cache holds the K/V of every committed token
but the last (``cache.length == len(committed) - 1``), so that a step's root row feeds the last committed
token. A speculative step:

1. the drafter proposes a lattice from the committed tokens; a tree builder picks at most N nodes;
2. one exact pass runs the rows [root] + nodes with position ids prefix_len + depth and an ancestor mask;
3. greedy acceptance walks from the root to the child whose token equals the row's argmax, then appends
   the argmax of the last accepted row (the bonus); one host read per step;
4. the accepted path's K/V are moved into place (the cache equals a fresh prefill of the committed tokens);
5. EOS, stop ids and max_new_tokens are checked on every accepted token; output ends at the first stop.
"""

from __future__ import annotations

import collections.abc
import numbers
import time
from typing import Callable

import torch

from specpilot.config import SystemConfig
from specpilot.errors import PromptError, SpecPilotError
from specpilot.spec.trees import Tree, build_tree
from specpilot.model.transformer import Transformer, region
from specpilot.engine.types import Generation


class Engine:
    """A target, an optional drafter and a :class:`SystemConfig`.

    Args:
        target: the target :class:`Transformer` (its weights are the exact pass).
        config: which drafter / tree builder / budget to use.
        drafter: an object with ``reset()`` and ``propose(committed, depth) -> Lattice | None``; None = AR.
        eos_ids: token ids that end a request (default: the target config's eos_token_id).
        max_len: context length in tokens (default: the target's max_position_embeddings, at most 4096).
        logits_hook: test-only: a function applied to the exact pass's logits ``[R, V]`` before the
            argmax (used to plant defects the controller and token forcing must catch); captured with the
            pass in the row-bucket graphs when those are on.
        buckets: run decode passes padded to row buckets through the static path, replayed as CUDA
            graphs on CUDA (:mod:`specpilot.engine.runner`); rows above the largest bucket run eagerly. The
            prefill then runs in chunks of the largest bucket (:meth:`BucketRunner.prefill`).

    Attributes:
        step_hook: test-only: called as ``step_hook(engine, committed)`` after every exact pass, with
            the cache holding every committed token but the last (used to check R8 / R11).
    """

    def __init__(
        self,
        target: Transformer,
        config: SystemConfig,
        drafter=None,
        eos_ids: list[int] | None = None,
        max_len: int | None = None,
        logits_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
        buckets: bool = False,
    ):
        self.target, self.config, self.drafter = target, config, drafter
        self.eos_ids = set(target.args.eos_token_ids if eos_ids is None else eos_ids)
        self.max_len = max_len or min(target.args.max_position_embeddings, 4096)
        from specpilot.engine.runner import BUCKETS, BucketRunner

        self.cache = target.new_cache(self.max_len + max(config.nodes + 1, BUCKETS[-1]))
        self.runner = None
        if buckets and not getattr(drafter, "target_layers", None):
            self.runner = BucketRunner(target, self.cache, BUCKETS, graphs=True, output="argmax",
                                       logits_hook=logits_hook)
            self.runner.capture_all()  # every bucket (verify, prefill chunks) now, not in a timed request
        self.logits_hook = logits_hook
        self.step_hook = None
        # a drafter that reads target hidden states (block drafters, §1.1) names the layers it wants
        self.feature_layers = tuple(getattr(drafter, "target_layers", ()) or ())
        self._feats: list[torch.Tensor] = []

    def _observe(self, rows: torch.Tensor | None, start: int) -> None:
        """Hand the drafter the target features of newly committed cache slots ``[start, start + k)``.

        ``rows`` are the pass's row indices of those slots (None: all rows, as in the prefill). The features
        are ``[k, len(feature_layers) * hidden]``; only drafters with ``target_layers`` receive them.
        """
        if not self.feature_layers:
            return
        f = torch.cat(self._feats, dim=-1)
        self.drafter.observe(f if rows is None else f[rows.to(f.device)], start)

    # -- one pass ---------------------------------------------------------------------------------
    def _argmax(self, tokens, positions, start, mask, prof) -> torch.Tensor:
        self._feats = []
        hidden = self.target.forward(tokens, positions, self.cache, start, mask, prof,
                                     features=self._feats, feature_layers=self.feature_layers)
        if self.logits_hook is None and getattr(self.target, "int8_head", None) is not None:
            with region(prof, "lm_head"):  # the certified INT8 head (§4.1): the same argmax
                return self.target.greedy(hidden)
        logits = self.target.logits(hidden, prof)
        if self.logits_hook is not None:
            logits = self.logits_hook(logits)
        with region(prof, "other"):
            return logits.argmax(dim=-1)

    def _verify(self, tok_list: list[int], pos_list: list[int], start: int, tree: Tree, prof) -> torch.Tensor:
        """The exact pass of one step: rows ``[root] + tree`` at prefix ``start``; returns their argmax ``[R]``
        long on the device. Padded to a row bucket (a CUDA graph replay on CUDA) when one fits, else eager."""
        out = None
        if self.runner is not None:  # padded static pass, profiled as a whole
            with region(prof, "exact_pass"):
                out = self.runner.run(tok_list, pos_list, start, tree.ancestor_mask() if len(tree) else None)
        if out is None:
            dev, r = self.target.device, len(tok_list)
            with region(prof, "other"):
                tokens = torch.tensor(tok_list, device=dev)
                positions = torch.tensor(pos_list, device=dev)
                mask = None
                if len(tree):
                    mask = torch.ones(r, start + r, dtype=torch.bool, device=dev)
                    mask[:, start:] = tree.ancestor_mask(dev)
            out = self._argmax(tokens, positions, start, mask, prof)
        return out

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Raise :class:`PromptError` for a prompt that is not one sequence of integer ids (a string, a nested
        list, a 2-D or float tensor), an empty prompt, bad ids, a ``max_new_tokens`` that is not a positive
        integer, or a request that does not fit the context."""
        if (isinstance(prompt_ids, (str, bytes, collections.abc.Set, collections.abc.Mapping))
                or not hasattr(prompt_ids, "__len__")):
            raise PromptError(f"the prompt must be a list of token ids (ints), got {type(prompt_ids).__name__}")
        if isinstance(prompt_ids, torch.Tensor) and (prompt_ids.dim() != 1 or prompt_ids.is_floating_point()):
            raise PromptError(f"a prompt tensor must be 1-D integer ids, got {prompt_ids.dim()}-D {prompt_ids.dtype}")
        if not isinstance(prompt_ids, torch.Tensor) and not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt_ids):
            raise PromptError("the prompt must be one list of token ids (ints); generate() takes one request "
                              "(loop over prompts for several)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise PromptError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt_ids) == 0:
            raise PromptError("the prompt is empty")
        vocab = self.target.args.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise PromptError(f"prompt token ids must lie in [0, {vocab})")
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.max_len:
            raise PromptError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"context of {self.max_len} tokens"
            )

    # -- a request --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: list[int] | None = None,
        prof=None,
    ) -> Generation:
        """Greedy decoding of one request; lossless: output == AR greedy (exactly, in float32 on the CPU).

        Args:
            prompt_ids: prompt token ids (non-empty).
            max_new_tokens: most tokens to generate (≥ 1).
            stop_ids: extra ids that end the request (kept in the output, like EOS).
            prof: optional step profiler (``region(name)``) of the decode steps, for the cost model (§3.2).
        Returns:
            :class:`Generation` with tokens, steps, per-step accepted counts, stop reason, wall times (s).
        Raises:
            PromptError: a malformed or empty prompt (see :meth:`check_prompt`), ids out of range, prompt +
                max_new_tokens beyond the context, or ``stop_ids`` that are not integer ids of the vocabulary.
            SpecPilotError: ``prof`` without a ``region(name)`` method.
        """
        self.check_prompt(prompt_ids, max_new_tokens)
        if isinstance(stop_ids, torch.Tensor) and not stop_ids.is_floating_point():
            stop_ids = stop_ids.reshape(-1).tolist()
        elif hasattr(stop_ids, "tolist") and hasattr(stop_ids, "ndim"):  # a numpy array of ids
            if stop_ids.ndim != 1:
                raise PromptError(f"stop_ids must be a 1-D list of token ids, got a {stop_ids.ndim}-D array")
            stop_ids = stop_ids.tolist()
        if stop_ids is not None and not isinstance(stop_ids, (str, bytes)) and hasattr(stop_ids, "__iter__"):
            stop_ids = list(stop_ids)  # once: an iterator would be used up by the checks below
        if stop_ids is not None and (isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__") or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in stop_ids)):
            raise PromptError(f"stop_ids must be a list of token ids (ints), got {stop_ids!r}")
        vocab = self.target.args.vocab_size
        bad = [int(t) for t in (stop_ids or ()) if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"stop_ids {bad[:5]} are outside the vocabulary [0, {vocab}): they can never occur")
        if prof is not None and not callable(getattr(prof, "region", None)):
            raise SpecPilotError(f"prof must be a step profiler with a region(name) method, got {type(prof).__name__}")
        stops = self.eos_ids | {int(t) for t in (stop_ids or ())}
        dev = self.target.device
        t0 = time.perf_counter()
        self.cache.length = 0
        if self.drafter is not None:
            self.drafter.reset()
        p = len(prompt_ids)
        if self.runner is not None:  # chunks through the row-bucket graphs (not part of a step's profile)
            first = self.runner.prefill(list(prompt_ids))
        else:
            first = self._argmax(  # the prefill is not part of a decode step's profile
                torch.as_tensor(prompt_ids, device=dev), torch.arange(p, device=dev), 0, None, None
            )[-1].item()
        self.cache.length = p
        self._observe(None, 0)
        committed = list(prompt_ids) + [first]
        out = Generation(tokens=[first], steps=0)
        out.prefill_s = time.perf_counter() - t0
        if first in stops:
            out.stop_reason = "eos" if first in self.eos_ids else "stop"
        if self._pipelined_ar(prof) and out.stop_reason == "length" and len(out.tokens) < max_new_tokens:
            self._generate_ar(committed, out, max_new_tokens, stops)
        while out.stop_reason == "length" and len(out.tokens) < max_new_tokens:
            new, rows = self._step(committed, max_new_tokens - len(out.tokens), prof)
            kept = []
            for tok in new:
                kept.append(tok)
                if tok in stops:
                    out.stop_reason = "eos" if tok in self.eos_ids else "stop"
                    break
                if len(out.tokens) + len(kept) >= max_new_tokens:
                    break
            committed += kept
            out.tokens += kept
            out.steps += 1
            out.accepted.append(len(kept))
            out.rows.append(rows)
            self.cache.length = min(self.cache.length, len(committed) - 1)
            if self.step_hook is not None:
                self.step_hook(self, committed)
        out.time_s = time.perf_counter() - t0
        out.cache_length = self.cache.length
        self.cache.length = 0  # the request's slots are free again (R14)
        return out

    def _pipelined_ar(self, prof) -> bool:
        """AR through the row-bucket runner with steps queued ahead (:meth:`BucketRunner.ar_tokens`): no
        drafter, no profiler (the cost model profiles plain steps). With the certified INT8 head a flagged
        step is redone and settled there."""
        return self.runner is not None and self.drafter is None and prof is None

    def _generate_ar(self, committed: list[int], out: Generation, max_new_tokens: int, stops: set[int]) -> None:
        """Pipelined AR steps until a stop or ``max_new_tokens``; same bookkeeping as the step loop."""
        gen = self.runner.ar_tokens(committed[-1], len(committed) - 1, max_new_tokens - len(out.tokens))
        for tok in gen:
            committed.append(tok)
            out.tokens.append(tok)
            out.steps += 1
            out.accepted.append(1)
            out.rows.append(1)
            self.cache.length = len(committed) - 1
            if self.step_hook is not None:
                self.step_hook(self, committed)
            if tok in stops:
                out.stop_reason = "eos" if tok in self.eos_ids else "stop"
                break
        gen.close()

    def _step(self, committed: list[int], remaining: int, prof) -> tuple[list[int], int]:
        """One exact pass; returns (accepted draft tokens + the bonus, before the stop checks; rows)."""
        cfg = self.config
        start = len(committed) - 1
        assert self.cache.length == start, "cache must hold every committed token but the last"
        tree = Tree()
        if self.drafter is not None and remaining > 1:
            with region(prof, "drafter"):
                depth = min(cfg.depth, remaining - 1)
                lattice = self.drafter.propose(committed, depth)
            if lattice is not None:
                with region(prof, "other"):
                    tree = build_tree(cfg.tree, lattice, cfg.nodes)
        r = len(tree) + 1
        tok_list = [committed[-1]] + tree.tokens
        pos_list = [start] + [start + d for d in tree.depths]
        argmax = self._verify(tok_list, pos_list, start, tree, prof).tolist()  # the one host read
        if self.runner is not None and self.runner.packed and max(argmax) >= self.target.args.vocab_size:
            argmax = self.runner.full_head(r)  # certified INT8 head: a flagged row (§4.1)
        with region(prof, "other"):
            kids = tree.child_maps()
            path, row = [0], 0
            while argmax[row] in kids[row]:
                row = kids[row][argmax[row]]
                path.append(row)
            new = [tree.tokens[i - 1] for i in path[1:]] + [argmax[row]]
            if path[-1] == len(path) - 1:  # rows 0..k-1 (a path's rows increase): their K/V are in place
                self.cache.length = start + len(path)
            else:
                self.cache.keep_path(start, torch.tensor(path))
            if self.feature_layers:
                self._observe(torch.tensor(path), start)
        return new, r
