"""The decoding engine: AR greedy and speculative decoding with chain or tree verification (§1.1, §4.2).

One request at a time. Invariant between exact passes: the target cache has committed the K/V of every
committed token but the last (``cache.length == len(committed) - 1``), so that a step's root row feeds the last
committed token. This module alone commits the target cache's length (:meth:`KVCache.commit`). A step:

1. the drafter proposes a lattice from the committed tokens; a tree builder picks at most N nodes;
2. one exact pass runs the rows [root] + nodes with position ids prefix_len + depth and an ancestor mask;
3. greedy acceptance walks from the root to the child whose token equals the row's argmax, then appends
   the argmax of the last accepted row (the bonus); one host read per step;
4. the accepted path's K/V are moved into place (the cache equals a fresh prefill of the committed tokens);
5. EOS, stop ids and max_new_tokens are checked on every accepted token; output ends at the first stop, and
   only what is kept is committed.

AR is the same loop with one-row passes; on CUDA its passes are queued ahead (:meth:`BucketRunner.ar_tokens`), except
on a hybrid target, whose recurrent state must be committed before the next pass runs.
With ``tlv`` (§4.3) step 1 is a TLV cycle's two drafts around a Q pass (:mod:`specpilot.engine.tlv`); steps 2–5
are unchanged, so TLV changes which rows the exact pass verifies, never what it commits.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from specpilot.config import SystemConfig
from specpilot.engine.requests import check_prompt, keep, stop_id_set
from specpilot.engine.runner import BUCKETS, BucketRunner
from specpilot.engine.tlv import QPass, two_level_tree
from specpilot.engine.types import Generation
from specpilot.errors import SpecPilotError
from specpilot.model.hybrid_cache import HybridCache
from specpilot.model.layers import region
from specpilot.model.transformer import Transformer
from specpilot.spec.calibrated import CalibratedDrafter
from specpilot.spec.calibrated_q import simulated_q
from specpilot.spec.drafter import Drafter, check_fits, draft_depth, propose_one
from specpilot.spec.trees import Tree, build_tree


class Engine:
    """A target, an optional drafter and a :class:`SystemConfig`.

    Args:
        target: the target :class:`Transformer` (its weights are the exact pass).
        config: which tree builder / budget / depth to use.
        drafter: a :class:`~specpilot.spec.drafter.Drafter` (slot 0 serves the request); None = AR.
        eos_ids: token ids that end a request (default: the target config's eos_token_id).
        max_len: context length in tokens (default: the target's max_position_embeddings, at most 4096).
        logits_hook: test-only: a function applied to the exact pass's logits ``[R, V]`` before the
            argmax (used to plant defects the controller and token forcing must catch); captured with the
            pass in the row-bucket graphs when those are on.
        buckets: run decode passes padded to row buckets through the static path, replayed as CUDA graphs
            on CUDA (:mod:`specpilot.engine.runner`); rows above the largest bucket run eagerly. The prefill
            then runs in chunks of the largest bucket (a hybrid target's stays one eager pass). The target features a drafter reads are captured inside
            those graphs (:attr:`BucketRunner.features`).
        q_target: with ``config.tlv``, the Q view to run the Q pass over (:func:`~specpilot.model.qview.q_view` of
            ``target`` with ``config.q_weights``); None: built here. A deployment hands every TLV engine its one
            copy (a view8 encoding of an 8B bf16 target is about 12 GB).
    Raises:
        DrafterError: the drafter does not fit the target (vocabulary, target layers; R16).
        SpecPilotError: ``config.tlv`` without a drafter, or on a target the Q view does not cover (hybrids).

    Attributes:
        step_hook: test-only: called as ``step_hook(engine, committed)`` after every exact pass, with
            the cache holding every committed token but the last (used to check R8 / R11).
    """

    def __init__(self, target: Transformer, config: SystemConfig, drafter: Drafter | None = None,
                 eos_ids: list[int] | None = None, max_len: int | None = None,
                 logits_hook: Callable[[torch.Tensor], torch.Tensor] | None = None, buckets: bool = False,
                 q_target=None):
        if drafter is not None:
            check_fits(drafter, target.args.vocab_size, target.args.num_layers)
        self.target, self.config, self.drafter = target, config, drafter
        self.eos_ids = set(target.args.eos_token_ids if eos_ids is None else eos_ids)
        self.max_len = max_len or min(target.args.max_position_embeddings, 4096)
        self.cache = target.new_cache(self.max_len + max(config.nodes + 1, BUCKETS[-1]))
        # a hybrid target's state holds only the committed tokens: its prefill runs eagerly (one pass, the chunked
        # delta rule) and its AR steps one by one, each committed before the next; its verify passes use the buckets
        self._recurrent = isinstance(self.cache, HybridCache)
        # a drafter that reads target hidden states (block drafters, §1.1) names the layers it wants
        self.feature_layers = tuple(drafter.target_layers) if drafter is not None else ()
        self.runner = None
        if buckets:
            self.runner = BucketRunner(target, self.cache, BUCKETS, graphs=True, output="argmax",
                                       logits_hook=logits_hook, feature_layers=self.feature_layers)
            self.runner.capture_all()  # every bucket (verify, prefill chunks) now, not in a timed request
        self.last_chain = 0  # |C| of the last TLV cycle
        self.tlv = None  # TLV's Q pass (§4.3), over the Q view of the target named by config.q_weights
        if config.tlv:
            if drafter is None:
                raise SpecPilotError("tlv needs a drafter: its cycle drafts twice around a Q pass")
            # imported here: the Q view pulls in W12 and so Triton, which a process that does not use them (the CPU
            # lm-head bench picks Triton's interpreter before its first import) must be able to import the engine without
            from specpilot.model.qview import q_view

            # a calibrated drafter whose calibration measured the Q agreement: the real Q pass runs (its time),
            # its argmax along the known greedy path is the simulated one (specpilot.spec.calibrated_q)
            q = q_target if q_target is not None else q_view(target, config.q_weights)
            self.tlv = simulated_q(QPass(q, self.cache, self.feature_layers, buckets, config.nodes + 1), drafter,
                                   config.q_weights)
        self.logits_hook = logits_hook
        self.step_hook = None
        self._feats: torch.Tensor | None = None  # the last pass's target features [R, F] (drafters that read them)

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Raise :class:`~specpilot.errors.PromptError` unless the request fits this engine
        (:func:`specpilot.engine.requests.check_prompt`)."""
        check_prompt(prompt_ids, max_new_tokens, self.target.args.vocab_size, self.max_len)

    # -- a request --------------------------------------------------------------------------------
    def prepare(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Untimed work before a timed request, for simulations only: a simulated drafter (``calibrated``) learns
        the target's greedy continuation of ``prompt_ids`` from its deployment's AR run
        (:meth:`~specpilot.spec.calibrated.CalibratedDrafter.prepare`). Nothing for every real drafter: the pilot's
        timers call it before their clock starts, so it must never hold a real system's work."""
        if isinstance(self.drafter, CalibratedDrafter):
            self.drafter.prepare(prompt_ids, max_new_tokens)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None,
                 prof=None) -> Generation:
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
        stops = self.eos_ids | stop_id_set(stop_ids, self.target.args.vocab_size)
        if prof is not None and not callable(getattr(prof, "region", None)):
            raise SpecPilotError(f"prof must be a step profiler with a region(name) method, got {type(prof).__name__}")
        t0 = time.perf_counter()
        self.cache.commit(0)
        if self.drafter is not None:
            self.drafter.reset(0)
        committed = list(prompt_ids)
        first = self._prefill(committed)
        committed.append(first)
        self.cache.commit(len(committed) - 1)
        out = Generation(tokens=[first], steps=0)
        out.prefill_s = time.perf_counter() - t0
        out.stop_reason = keep([first], stops, self.eos_ids, 1)[1]
        passes = self._ar_passes(committed, out, max_new_tokens) if self._pipelined_ar(prof) else \
            self._spec_passes(committed, out, max_new_tokens, prof)
        try:
            while out.stop_reason == "length" and len(out.tokens) < max_new_tokens:
                new, rows = next(passes)
                kept, out.stop_reason = keep(new, stops, self.eos_ids, max_new_tokens - len(out.tokens))
                committed += kept  # in place: the passes read the committed tokens from this list
                out.tokens += kept
                out.steps += 1
                out.accepted.append(len(kept))
                out.rows.append(rows)
                if self.tlv is not None:
                    out.chains.append(self.last_chain)
                self.cache.commit(len(committed) - 1)
                if self.step_hook is not None:
                    self.step_hook(self, committed)
        finally:
            passes.close()
        out.time_s = time.perf_counter() - t0
        out.cache_length = self.cache.length
        self.cache.commit(0)  # the request's slots are free again (R14)
        return out

    def _prefill(self, prompt: list[int]) -> int:
        """The prompt's exact pass (K/V to slots ``[0, P)``); returns the first generated token. Not part of a
        decode step's profile."""
        if self.runner is not None and not self._recurrent:  # chunks through the row-bucket graphs, features observed
            observe = (lambda f, start: self.drafter.observe(0, f, start)) if self.feature_layers else None
            return self.runner.prefill(prompt, observe)
        dev = self.target.device
        first = self._argmax(torch.as_tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), 0,
                             None, None)[-1].item()
        self._observe(None, 0)
        return first

    def _pipelined_ar(self, prof) -> bool:
        """AR through the row-bucket runner with steps queued ahead (:meth:`BucketRunner.ar_tokens`): no
        drafter, no profiler (the cost model profiles plain steps), not a hybrid target (its steps commit one by
        one). With the certified INT8 head a flagged
        step is redone and settled there."""
        return self.runner is not None and self.drafter is None and prof is None and not self._recurrent

    def _ar_passes(self, committed: list[int], out: Generation, max_new_tokens: int) -> Iterator[tuple[list[int], int]]:
        """Pipelined AR: ``([token], 1)`` per one-row exact pass, queued on the device ahead of the host read."""
        gen = self.runner.ar_tokens(committed[-1], len(committed) - 1, max_new_tokens - len(out.tokens))
        try:
            for tok in gen:
                yield [tok], 1
        finally:
            gen.close()

    def _spec_passes(self, committed: list[int], out: Generation, max_new_tokens: int,
                     prof) -> Iterator[tuple[list[int], int]]:
        """One exact pass per step (:meth:`_step`): ``(accepted draft tokens + the bonus, rows)``."""
        while True:
            yield self._step(committed, max_new_tokens - len(out.tokens), prof)

    # -- one pass ---------------------------------------------------------------------------------
    def _observe(self, rows: torch.Tensor | None, start: int) -> None:
        """Hand the drafter the target features of newly committed cache slots ``[start, start + k)``.

        ``rows`` are the pass's row indices of those slots (None: all rows, as in the prefill). The features
        are ``[k, len(feature_layers) * hidden]``, from the last pass (graphed or eager); only drafters with
        ``target_layers`` receive them.
        """
        if not self.feature_layers:
            return
        f = self._feats
        if rows is not None:  # the accepted path: rows 0..k-1 in place (a view), else gathered
            f = f[: len(rows)] if int(rows[-1]) == len(rows) - 1 else f[rows.to(f.device)]
        self.drafter.observe(0, f, start)

    def _argmax(self, tokens, positions, start: int, mask, prof) -> torch.Tensor:
        """The eager exact pass: the argmax ``[R] long`` of the rows (the target's features kept for the drafter)."""
        feats: list[torch.Tensor] = []
        hidden = self.target.forward(tokens, positions, self.cache, start, mask, prof=prof, features=feats,
                                     feature_layers=self.feature_layers)
        self._feats = torch.cat(feats, dim=-1) if feats else None
        if self.logits_hook is None and self.target.int8_head is not None:
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
            if out is not None and self.feature_layers:
                self._feats = self.runner.features[: len(tok_list)]
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

    def _draft(self, committed: list[int], remaining: int, prof, nodes: int | None = None) -> Tree:
        """A tree of at most ``nodes`` nodes (default: the config's N): the drafter's lattice for ``min(depth,
        remaining − 1)`` positions (within the drafter's own context), shaped by the configured builder; empty for
        AR or when nothing is proposed."""
        cfg, tree = self.config, Tree()
        depth = draft_depth(self.drafter, len(committed), min(cfg.depth, remaining - 1)) if self.drafter else 0
        if depth < 1:
            return tree
        with region(prof, "drafter"):
            lattice = propose_one(self.drafter, committed, depth)
        if lattice is not None:
            with region(prof, "other"):
                tree = build_tree(cfg.tree, lattice, cfg.nodes if nodes is None else nodes)
        return tree

    def _tree(self, committed: list[int], remaining: int, prof) -> Tree:
        """The rows of this step's exact pass: the drafter's tree, or with TLV the cycle's C + subtree (§4.3)."""
        if self.tlv is None:
            return self._draft(committed, remaining, prof)
        start, root = len(committed) - 1, committed[-1]

        def q_pass(tree: Tree) -> list[int]:
            return self.tlv.run([root] + tree.tokens, [start] + [start + d for d in tree.depths], start, tree, prof,
                                committed=committed)

        def observe(rows: list[int]) -> None:  # the Q pass's features of C's committed-to-be slots
            self.drafter.observe(0, self.tlv.features[torch.tensor(rows, device=self.tlv.features.device)], start)

        tree, self.last_chain = two_level_tree(committed, remaining, self.config.nodes,
                                               lambda ctx, rem, n: self._draft(ctx, rem, prof, n), q_pass,
                                               observe if self.feature_layers else None)
        return tree

    def _step(self, committed: list[int], remaining: int, prof) -> tuple[list[int], int]:
        """One exact pass; returns (accepted draft tokens + the bonus, before the stop checks; rows)."""
        start = len(committed) - 1
        assert self.cache.length == start, "cache must hold every committed token but the last"
        # top chain first, at its own positions: accepting along it moves no K/V, and an aligned pass
        # (KernelConfig.aligned) gives its rows AR's bits
        tree = self._tree(committed, remaining, prof).chain_first()
        r = len(tree) + 1
        tok_list = [committed[-1]] + tree.tokens
        pos_list = [start] + [start + d for d in tree.depths]
        argmax = self._verify(tok_list, pos_list, start, tree, prof).tolist()  # the one host read
        if self.runner is not None and any(self.runner.needs_full_head()):
            argmax = self.runner.full_head(r)  # certified INT8 head: a flagged row (§4.1)
        with region(prof, "other"):
            path, new = tree.accept(argmax)
            rows = torch.tensor(path)
            if path[-1] != len(path) - 1:  # rows 0..k-1 (a path's rows increase) are in place already
                self.cache.compact(start, rows)
            self._observe(rows, start)
        return new, r
