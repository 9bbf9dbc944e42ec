"""The batched engine: continuous batching with one exact pass per step for every running request (§2.2, §4.4).

Requests wait in a queue until a KV slot is free; admitted ones are prefilled together in one pass; then each
step drafts for every running request (one :meth:`Drafter.propose` call for the batch), builds each request's
tree, and runs ONE exact pass over all their ``[root] + tree`` rows (:meth:`Transformer.forward_batch`: GEMMs
over every row, attention per request over its own slot). Acceptance, KV compaction, stop checks and commits are
per request, exactly as in :class:`~specpilot.engine.engine.Engine`, so a request's output does not depend on what
shares its batch (R12, R18): in float32 it equals its batch-1 output and AR greedy. A request that ends (stop,
length, abort) frees its slot at once (R14). This module alone commits the lengths of the pool's caches.

Decode passes run padded to (requests, rows) buckets through :class:`~specpilot.engine.batch_runner.BatchRunner` (one
CUDA graph per bucket, the Triton batched tree attention) on CUDA; prefill passes, steps past the largest bucket run
the eager pass through the same kernels (prefills round as decode steps do); the CPU (unless ``padded``) runs masked
SDPA unless the target's ``batch_kernel``. On the fused path every GEMM is batch-invariant (the target's
``KernelConfig.batch_invariant``) and the attention is per request, so in bf16 too a request's output is bit for bit
its batch-1 output from this engine, whatever shares its steps (given a drafter whose proposals do not depend on the
batch: n-gram always). Row selection (§4.4; only the verified rows change, never the output): ``per_request`` builds
each request's own tree of ``nodes`` nodes; ``shared_budget`` fills one budget of ``config.step_budget(n)`` nodes for
the step's n requests best-first across their lattices (:func:`~specpilot.spec.trees_batch.build_shared`; a slot and
the padded runner hold a request of the largest budget). ``prompt_admission``: prompts admitted while requests run
ride in that step's exact pass (causal rows over their own slots) when their rows fit the cap. A prefilled prompt
starts from the longest prefix another slot holds (:mod:`specpilot.engine.prefix`; by default not on the
batch-invariant path). ``drafter_block``: each request asks the drafter for one of the allowed depths, picked from
its own history (:mod:`specpilot.spec.drafter_block`); a block drafter drafts the batch in one pass and cuts each
request's lattice to its own depth. Given a :class:`~specpilot.engine.load_plan.LoadPlan` (one sealed system per
batch size), each step runs the system of the size nearest its number of running requests; a step whose system
does not draft with the plan's feature-reading drafter does not feed it (eagerly, per request: a plan's AR steps ran
0.33x AR at 16 requests on an H100 with it), and the requests of that step stay undrafted to their end (lossless).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch_runner import BatchRunner, runs_padded
from specpilot.engine.load_plan import LoadPlan, bind_drafters
from specpilot.engine.prefix import PrefixCache
from specpilot.engine.requests import check_prompt, keep, stop_id_set
from specpilot.engine.types import Generation, Request, StepOutput, run_to_end  # noqa: F401  (re-exported)
from specpilot.errors import DrafterError, PromptError, SpecPilotError
from specpilot.model.batch import BatchRows
from specpilot.model.transformer import Transformer
from specpilot.spec.drafter import Drafter, DraftRequest, draft_depth
from specpilot.spec.drafter_block import BlockHistory
from specpilot.spec.trees import Tree, build_tree
from specpilot.spec.trees_batch import build_shared


@dataclass
class _Running:
    req: Request
    slot: int
    committed: list[int]
    stops: set[int]
    generated: int = 0
    history: BlockHistory = field(default_factory=BlockHistory)  # the drafter block's inputs (§4.4)
    depth: int = 0  # draft positions asked this step
    blind: bool = False  # a plan's step ran without the feature drafter: its context stopped, it drafts no more


class BatchEngine:
    """A target, an optional drafter and a :class:`SystemConfig`, serving many requests at once.

    Args:
        target: the target :class:`Transformer`.
        config: tree builder, budget and depth (as for :class:`~specpilot.engine.engine.Engine`), or a
            :class:`~specpilot.engine.load_plan.LoadPlan` (one system per batch size, module doc).
        drafter: a :class:`~specpilot.spec.drafter.Drafter` with at least ``max_num_seqs`` slots (None: AR); with a
            plan, one per system (the same object where systems share it; None where a system is AR).
        eos_ids: ids that end a request (default: the target config's).
        max_len: context in tokens (default: ``max_position_embeddings``, at most 4096).
        max_num_seqs: requests running at once (KV slots); more wait.
        max_prefill_rows: prompt rows prefilled in one pass (at least one whole prompt is always admitted).
        padded: decode passes padded to buckets through a :class:`BatchRunner` (CUDA graphs on CUDA); default: on
            CUDA with Triton, without the certified INT8 head (it settles rows on the host), not on a hybrid's pool.
        spec_max_requests: draft only in steps with at most this many running requests; in larger steps every
            request verifies its root alone, an AR step (vLLM's ``disable_by_batch_size``). None: always draft.
        prefix_caching: prefill a prompt from the longest prefix a slot holds (:mod:`specpilot.engine.prefix`;
            dense targets, drafters that read no target features). None: on, except where the decode passes are
            batch-invariant (CUDA's fused path): a reused prefix is read in another order than a prefill's.
        compile_cpu: passes run the target's decoder stack as one ``torch.compile`` graph, :attr:`stack` (CPU only).
        stack: a :class:`~specpilot.model.compiled_stack.CompiledStack` of ``target`` to run instead of building one
            (engines of one target share it: it compiles once; passes are not thread-safe, one engine at a time).
    Raises:
        DrafterError: a drafter does not fit the target or holds fewer slots than ``max_num_seqs``; two drafters
            that read target features.
        SpecPilotError: ``padded`` on a hybrid target; ``config.tlv`` (single requests only); a plan whose
            systems do not share the target (:class:`~specpilot.engine.load_plan.LoadPlan`); ``compile_cpu`` off CPU.
        ValueError: ``max_num_seqs`` or ``spec_max_requests`` below 1; a plan and a drafter list of other lengths; a
            ``stack`` of another target.

    Attributes:
        plan: the :class:`LoadPlan` (one system at every load when ``config`` is a :class:`SystemConfig`).
        config / drafter: the system of the plan's smallest size and the plan's first drafter (None: none drafts).
        drafters: every distinct drafter of the plan. plan_steps: decode steps run by each system of the plan.
        exact_passes / prefill_passes: decode-step and prefill passes run so far (one decode pass per step).
        step_hook: test-only: ``step_hook(engine)`` after every decode pass, each running cache committed.
        stack: the ``compile_cpu`` :class:`~specpilot.model.compiled_stack.CompiledStack` (``passes``), or None.
    """

    def __init__(self, target: Transformer, config: SystemConfig | LoadPlan, drafter: Drafter | list | None = None,
                 eos_ids: list[int] | None = None, max_len: int | None = None, max_num_seqs: int = 8,
                 max_prefill_rows: int = 2048, padded: bool | None = None, spec_max_requests: int | None = None,
                 prefix_caching: bool | None = None, compile_cpu: bool = False, stack=None):
        if min(max_num_seqs, 1 if spec_max_requests is None else spec_max_requests) < 1:
            raise ValueError(f"max_num_seqs and spec_max_requests must be at least 1, got {max_num_seqs}, "
                             f"{spec_max_requests}")
        if isinstance(config, SystemConfig) and config.tlv:  # its Q pass cost more than it saved in batching (§6)
            raise SpecPilotError("tlv runs single requests only (in batching its Q pass costs more than it saves)")
        if stack is not None and stack.target is not target:
            raise ValueError("the compiled stack given belongs to another target")
        self.stack = stack or (target.compiled_stack() if compile_cpu else None)  # refused off the CPU, before the pool
        self.plan = config if isinstance(config, LoadPlan) else LoadPlan.single(config)
        self._drafter_of, self.drafters, self.feature_drafter = bind_drafters(self.plan, drafter, target, max_num_seqs)
        self.target, self.config, self.drafter = target, self.plan.configs[0], (self.drafters or [None])[0]
        self.eos_ids = set(target.args.eos_token_ids if eos_ids is None else eos_ids)
        self.max_len = max_len or min(target.args.max_position_embeddings, 4096)
        self.num_slots, self.max_prefill_rows, self.spec_max_requests = (max_num_seqs, max_prefill_rows,
                                                                         spec_max_requests)
        drafts = [d is not None for d in self._drafter_of]
        tree_rows = self.plan.tree_rows(max_num_seqs, drafts)  # one request's most nodes (a shared budget: all)
        # one slot more than requests: the scratch slot, where padding rows of a bucketed pass write their K/V
        self.pool = target.new_pool(max_num_seqs + 1, self.max_len + tree_rows + 1)  # KVPool, or a hybrid's
        self.feature_layers = tuple(self.feature_drafter.target_layers) if self.feature_drafter else ()
        padded = runs_padded(target, self.pool) if padded is None else padded
        plain = any(d is not self.feature_drafter for d in self._drafter_of)  # steps that do not feed it
        self.runner = BatchRunner(target, self.pool, max_num_seqs, 1 + tree_rows, self.feature_layers,
                                  step_extra_rows=self.plan.step_extra_rows(max_num_seqs, drafts),
                                  plain_steps=plain) if padded else None
        if prefix_caching is None:
            prefix_caching = not (self.runner is not None and target.kernels.batch_invariant)
        reuse = prefix_caching and self.pool.prefix_reuse and not self.feature_layers
        self.prefix = PrefixCache(self.pool) if reuse else None
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Running] = {}
        self.exact_passes = self.prefill_passes = 0
        self.plan_steps = [0] * len(self.plan)
        self.step_hook = None

    # -- the queue -----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue ``req``. Raises PromptError: a malformed or too long request, bad stop ids, a duplicate id."""
        check_prompt(req.prompt_ids, req.max_new_tokens, self.target.args.vocab_size, self.max_len)
        stop_id_set(req.stop_ids, self.target.args.vocab_size)
        if req.request_id in self._running or any(w.request_id == req.request_id for w in self._waiting):
            raise PromptError(f"request id {req.request_id!r} is already in the engine")
        self._waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        """Drop a waiting or running request and free its slot (nothing when it is unknown or finished)."""
        self._waiting = deque(w for w in self._waiting if w.request_id != request_id)
        if request_id in self._running:
            self._release(self._running.pop(request_id))

    def has_work(self) -> bool:
        """Whether a request waits or runs."""
        return bool(self._waiting or self._running)

    def free_slots(self) -> int:
        """KV slots no request holds (``num_slots`` when every request ended, R14)."""
        return len(self._free)

    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def reset(self) -> None:
        """Drop every request, waiting or running, and free every slot: the way back to a known state after
        :meth:`step` raised (a step may have failed between taking a request's slot and recording it)."""
        self._waiting.clear()
        self._running.clear()
        for s in range(self.num_slots):
            self.pool.cache(s).commit(0)
            for d in self.drafters:
                d.reset(s)
        self._free = list(range(self.num_slots - 1, -1, -1))
        if self.prefix is not None:
            self.prefix.clear()

    def capture_graphs(self) -> int:
        """Capture the CUDA graphs of every (requests, rows) bucket a step of this engine can meet, now rather than
        inside a timed or served step. Returns how many the runner holds (0 on the CPU or without a runner)."""
        return len(self.runner.capture_all(self.num_slots)) if self.runner is not None else 0

    def compile_shapes(self) -> int:
        """Compile the stack (``compile_cpu``) for each shape class a step can meet, now, not in a served step."""
        return self.stack.warm_up(self.pool, self.num_slots) if self.stack else 0  # in the scratch slot

    def _by_slot(self) -> list[_Running]:
        """The running requests in slot order (a pass over consecutive slots reads their K/V as one view)."""
        return sorted(self._running.values(), key=lambda r: r.slot)

    def _resident(self) -> list[tuple[int, list[int]]]:
        """``(slot, tokens whose K/V it holds)`` of every running request (prefix reuse's sources)."""
        return [(x.slot, x.committed[: self.pool.cache(x.slot).length]) for x in self._running.values()]

    def _release(self, r: _Running) -> None:
        if self.prefix is not None:  # its K/V stay in the slot until a new request takes it
            self.prefix.release(r.slot, r.committed[: self.pool.cache(r.slot).length])
        self.pool.cache(r.slot).commit(0)
        for d in self.drafters:
            d.reset(r.slot)
        self._free = sorted(self._free + [r.slot], reverse=True)  # lowest last: requests stay in a short slot range

    # -- a step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit and prefill waiting requests while slots are free, then one exact pass for every running request.
        Returns the outputs of every request touched ([] when idle)."""
        admitted = self._admit()
        cap = self.plan.config_for(max(len(self._running), 1)).prompt_admission
        if admitted and self._running and sum(len(r.committed) for r in admitted) <= cap:
            if self.prefix is not None:  # these prefill from 0: what their slots kept is overwritten
                for r in admitted:
                    self.prefix.claim(r.slot)
            return self._decode(self._by_slot(), admitted)  # the prompts ride in the step's pass
        out = self._prefill(admitted)
        if self._running:
            out += self._decode(self._by_slot())
        return out

    def _admit(self) -> list[_Running]:
        admitted, rows, resident = [], 0, None
        while self._waiting and self._free:
            n = len(self._waiting[0].prompt_ids)
            if admitted and rows + n > self.max_prefill_rows:
                break
            if admitted and self.prefix is not None:
                resident = self._resident() if resident is None else resident
                if self.prefix.waits(self._waiting[0].prompt_ids, [a.committed for a in admitted], resident):
                    break  # next step it copies the prefix an admitted prompt is about to compute
            req = self._waiting.popleft()
            slot = self.prefix.pick(req.prompt_ids, self._free) if self.prefix is not None else self._free[-1]
            self._free.remove(slot)
            r = _Running(req, slot, list(req.prompt_ids), self.eos_ids | set(req.stop_ids))
            for d in self.drafters:
                d.reset(r.slot)
            admitted.append(r)
            rows += n
        return admitted

    def _pass(self, rs: list[_Running], tokens: list[list[int]], positions: list[list[int]], starts: list[int],
              masks: list, read: list[int] | None = None, bucketed: bool = False,
              features: bool = True) -> tuple[list[int], torch.Tensor | None]:
        """One exact pass over the requests' rows; returns the argmax of the rows ``read`` (None: every row; one
        host read) and the target features of every row (None without a feature-reading drafter, or on the
        bucketed path when ``features`` is False). ``bucketed``: through the :class:`BatchRunner` when there is one
        and the step fits a bucket (a decode step)."""
        dev = self.target.device
        if bucketed and self.runner is not None:
            got = self.runner.run([r.slot for r in rs], starts, tokens, positions, masks, features)
            if got is not None:
                ids, feats = got
                return ids.tolist(), (feats.clone() if feats is not None else None)
        rows = BatchRows([r.slot for r in rs], starts, [len(t) for t in tokens], masks)
        feats: list = []
        kernel = True if self.runner is not None else self.target.kernels.batch_kernel
        fwd = (self.stack or self.target).forward_batch  # the compiled stack (compile_cpu) or the eager pass
        hidden = fwd(torch.tensor(sum(tokens, []), device=dev), torch.tensor(sum(positions, []), device=dev),
                     self.pool, rows, features=feats, feature_layers=self.feature_layers, kernel=kernel)
        if read is not None:
            hidden = hidden[torch.tensor(read, device=hidden.device)]
        return self.target.batch_greedy(hidden, kernel).tolist(), (torch.cat(feats, dim=-1) if feats else None)

    def _prefill(self, rs: list[_Running]) -> list[StepOutput]:
        if not rs:
            return []
        resident, starts = self._resident() if self.prefix is not None else [], []
        for r in rs:  # a slot that now holds a reused prefix is a source for the prompts after it in this pass
            starts.append(self.prefix.reuse(r.slot, r.committed, resident) if self.prefix else 0)
            resident += [(r.slot, r.committed[: starts[-1]])] if starts[-1] else []
        ends = torch.tensor([len(r.committed) - s for r, s in zip(rs, starts)]).cumsum(0).tolist()
        first, feats = self._pass(rs, [r.committed[s:] for r, s in zip(rs, starts)],
                                  [list(range(s, len(r.committed))) for r, s in zip(rs, starts)], starts,
                                  [None] * len(rs), read=[e - 1 for e in ends])
        self.prefill_passes += 1
        out, feeds = [], feats is not None and self._feeds(len(self._running) + len(rs))
        for r, tok, end in zip(rs, first, ends):
            if feeds:
                self.feature_drafter.observe(r.slot, feats[end - len(r.committed):end], 0)
            r.blind = feats is not None and not feeds
            self._running[r.req.request_id] = r
            out.append(self._commit(r, [tok], 0, 0))
        return out

    def _feeds(self, m: int) -> bool:
        """Whether a pass over ``m`` requests feeds the feature drafter: the system of that load drafts with it."""
        return self._drafter_of[self.plan.index_for(m)] is self.feature_drafter

    def _draft(self, rs: list[_Running]) -> tuple[list[Tree], SystemConfig]:
        """Each request's tree under the plan's system for ``len(rs)`` requests, and that system: one propose call
        for the batch (requests with one token left draft nothing); under ``shared_budget`` the step's budget for
        ``len(rs)`` requests is shared across their lattices (§4.4)."""
        k = self.plan.index_for(len(rs))
        trees, cfg, drafter = [Tree() for _ in rs], self.plan.configs[k], self._drafter_of[k]
        self.plan_steps[k] += 1
        for r in rs:
            r.depth = 0
        if drafter is None or len(rs) > (self.spec_max_requests or len(rs)):  # spec off at this load: AR
            return trees, cfg
        asks = []
        for i, r in enumerate(rs):
            room = r.req.max_new_tokens - r.generated
            want = r.history.pick(cfg.drafter_block) if cfg.drafter_block else cfg.depth
            blind = r.blind and drafter is self.feature_drafter
            r.depth = 0 if blind else max(0, draft_depth(drafter, len(r.committed), min(want, room - 1)))
            if r.depth >= 1:
                asks.append((i, DraftRequest(r.slot, r.committed, r.depth)))
        if not asks:
            return trees, cfg
        lats = drafter.propose([q for _, q in asks])
        if cfg.drafter_block:
            for (i, q), lat in zip(asks, lats):
                rs[i].history.drafted(lat, q.depth)
        if cfg.row_selection == "shared_budget":
            placed = dict(zip((i for i, _ in asks), lats))  # None where a request asked for none
            return build_shared([placed.get(i) for i in range(len(rs))], cfg.step_budget(len(rs))), cfg
        for (i, _), lat in zip(asks, lats):
            if lat is not None:
                trees[i] = build_tree(cfg.tree, lat, cfg.nodes)
        return trees, cfg

    def _decode(self, rs: list[_Running], admitted: list[_Running] = ()) -> list[StepOutput]:
        """One exact pass over the running requests' trees, and over the prompt rows of ``admitted`` requests
        (prompt admission: each reads its last row's argmax, its first token, as :meth:`_prefill` does)."""
        trees, cfg = self._draft(rs)
        trees = [t.chain_first() for t in trees]  # top chain at its positions (Tree.chain_first)
        starts = [len(r.committed) - 1 for r in rs]
        tokens = [[r.committed[-1]] + t.tokens for r, t in zip(rs, trees)]
        positions = [[s] + [s + d for d in t.depths] for s, t in zip(starts, trees)]
        masks = [t.ancestor_mask() if len(t) else None for t in trees]
        read = None
        if admitted:
            n_rows = sum(len(t) for t in tokens)
            ends = torch.tensor([len(r.committed) for r in admitted]).cumsum(0).add(n_rows).tolist()
            read = list(range(n_rows)) + [e - 1 for e in ends]
            tokens += [r.committed for r in admitted]
            positions += [list(range(len(r.committed))) for r in admitted]
            starts, masks = starts + [0] * len(admitted), masks + [None] * len(admitted)
        feeding = self.feature_drafter is not None and self._feeds(len(rs))  # they drafted with it at this load
        argmax, feats = self._pass(rs + list(admitted), tokens, positions, starts, masks, read=read,
                                   bucketed=not admitted, features=feeding)
        self.exact_passes += 1
        observing = feeding and feats is not None
        out, end = [], 0
        for r, t, s in zip(rs, trees, starts):
            first, end = end, end + len(t) + 1
            path, new = t.accept(argmax[first:end])
            moved, fed = path[-1] != len(path) - 1, observing and not r.blind  # rows 0..k-1 are in place already
            rows = torch.tensor(path) if moved or fed else None  # an AR step's request needs neither (host time)
            if moved:
                self.pool.cache(r.slot).compact(s, rows)
            if fed:
                self.feature_drafter.observe(r.slot, feats[first:end][rows.to(feats.device)], s)
            r.blind |= self.feature_drafter is not None and not observing
            if cfg.drafter_block and r.depth >= 1:
                r.history.accepted(len(path) - 1)
            out.append(self._commit(r, new, len(t), len(path) - 1))
        feeds = feats is not None and self._feeds(len(rs) + len(admitted))  # the admitted ones' next load
        for k, r in enumerate(admitted):
            if feeds:
                self.feature_drafter.observe(r.slot, feats[end:end + len(r.committed)], 0)
            r.blind = feats is not None and not feeds
            end += len(r.committed)
            self._running[r.req.request_id] = r
            out.append(self._commit(r, [argmax[len(argmax) - len(admitted) + k]], 0, 0))
        if self.step_hook is not None:
            self.step_hook(self)
        return out

    def _commit(self, r: _Running, new: list[int], drafted: int, accepted: int) -> StepOutput:
        """Keep what the request keeps of ``new``, commit its cache, end it at a stop or its length."""
        kept, reason = keep(new, r.stops, self.eos_ids, r.req.max_new_tokens - r.generated)
        r.committed, r.generated = r.committed + kept, r.generated + len(kept)
        self.pool.cache(r.slot).commit(len(r.committed) - 1)
        finished = reason != "length" or r.generated >= r.req.max_new_tokens
        if finished:
            del self._running[r.req.request_id]
            self._release(r)
        acc = min(accepted, len(kept))
        return StepOutput(r.req.request_id, kept, finished, ("stop" if reason != "length" else "length") if finished
                          else None, drafted, acc, [1] * acc, r.depth)

    # -- convenience ---------------------------------------------------------------------------
    def generate_all(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                     stop_ids: list[int] | None = None) -> list[Generation]:
        """Run ``prompts`` through the queue to the end (all at once, as many as the slots hold at a time); one
        :class:`Generation` per prompt, in order (``steps``, ``accepted``, ``rows`` per decode step of that request;
        ``time_s`` the whole run's). Raises PromptError for a bad request (none is queued then)."""
        return run_to_end(self, prompts, max_new_tokens, stop_ids)
