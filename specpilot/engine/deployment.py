"""A deployment: a loaded target (+ tokenizer) and drafter weights, from which systems are built.

The pilot builds many systems (stock, candidates, the sealed one) over the same weights; a
:class:`Deployment` loads the checkpoints once and hands out :class:`~specpilot.engine.engine.Engine`s.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch

from specpilot.config import SystemConfig
from specpilot.spec.block import TOP_K as BLOCK_TOP_K
from specpilot.spec.block import BlockDrafter, is_block_dir, load_block
from specpilot.spec.calibrated import Continuations, build_calibrated
from specpilot.spec.draft_model import DraftModelDrafter
from specpilot.spec.drafter import SlotFanout
from specpilot.spec.eagle3 import Eagle3Drafter, is_eagle3_dir, load_eagle3
from specpilot.spec.ngram import NgramDrafter
from specpilot.errors import CheckpointError, DrafterError, SpecPilotError
from specpilot.model.checkpoint import load_model, load_tokenizer, read_args
from specpilot.engine.batch import BatchEngine
from specpilot.engine.engine import Engine
from specpilot.engine.load_plan import LoadPlan
from specpilot.kernels.cpu_linear import pack_by_default, pack_linears


class Deployment:
    """Target and drafter checkpoints loaded once.

    Args:
        target_dir: local HF checkpoint directory of the target.
        drafter_dir: local HF checkpoint directory of the draft model (None: no draft model); a block
            drafter directory (``"specpilot_drafter": "block"`` in its config.json) is taken as a block dir, an
            EAGLE-3 directory (ours or a public head, :func:`~specpilot.spec.eagle3.is_eagle3_dir`) as the eagle3 dir.
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        device: torch device string.
        block_dirs: block drafter directories (DFlash-style, with or without a Markov head); the first is
            the default of ``SystemConfig(drafter="block")`` without ``drafter_path``.
        pack: target, draft model and drafter networks project through oneDNN-prepacked weights
            (:mod:`specpilot.kernels.cpu_linear`); None = on the CPU in float32 (twice the projections' weight
            memory there).
        eagle3_dirs: EAGLE-3 drafter directories (ours or public heads); the first is the default of
            ``SystemConfig(drafter="eagle3")`` without ``drafter_path`` (a ``drafter_dir`` that is one comes first).
        aligned: the target's single-request passes run the batched engine's kernels
            (:attr:`~specpilot.model.transformer.KernelConfig.aligned`: a tree's top chain gets the one-row AR pass's
            bits in bf16 on CUDA); every engine built here shares it.
    Raises:
        CheckpointError: target or drafter checkpoint missing / unsupported / corrupted.
        DrafterError: the drafter's vocabulary does not fit the target's (or a block drafter's hidden size /
            vocabulary / layer indices do not fit).
    """

    def __init__(self, target_dir, drafter_dir=None, dtype: str = "float32", device: str = "cpu", block_dirs=(),
                 pack: bool | None = None, aligned: bool = False, eagle3_dirs=()):
        if not isinstance(target_dir, (str, Path)):
            raise CheckpointError(f"the target must be a checkpoint directory path, got {type(target_dir).__name__}")
        self.target_dir = Path(target_dir)
        self.drafter_dir = Path(drafter_dir) if drafter_dir else None
        self.dtype, self.device = dtype, check_device(device)
        self.target = load_model(self.target_dir, dtype, device, pack=pack)
        self.target.kernels = replace(self.target.kernels, aligned=aligned)  # before any copy shares it
        self.tokenizer = load_tokenizer(self.target_dir)  # None: the checkpoint has no tokenizer files
        self.draft_model = None
        self.block_dirs = [Path(b) for b in block_dirs]
        self._block_given_as_drafter = None
        if self.drafter_dir is not None and is_block_dir(self.drafter_dir):
            self._block_given_as_drafter = self.drafter_dir
            self.block_dirs.insert(0, self.drafter_dir)
            self.drafter_dir = None
        self.pack = pack if pack is not None else pack_by_default(self.device, dtype)
        self._blocks = {str(b.resolve()): self._packed(load_block(b, self.target)) for b in self.block_dirs}
        self.eagle3_dirs: list[Path] = [Path(d) for d in eagle3_dirs]
        if self.drafter_dir is not None and is_eagle3_dir(self.drafter_dir):
            self.eagle3_dirs.insert(0, self.drafter_dir)
            self.drafter_dir = None
        self._eagle3 = {str(d.resolve()): self._packed(load_eagle3(d, self.target)) for d in self.eagle3_dirs}
        self._w12_target = None
        self._int8: dict[int, object] = {}  # id(base target) -> that target with the certified INT8 head
        self._int8_head = None
        self._q_views: dict[tuple[int, str], object] = {}  # (id(target), q_weights) -> TLV's Q view (q_target)
        self._stacks: dict[int, object] = {}  # id(target) -> its compiled CPU stack, shared by the engines built here
        # the target's known greedy outputs, read by 'calibrated' drafters; unknown ones come from an AR run here
        self.continuations = Continuations(oracle=self._greedy)
        # the batched engine's: on a GPU its bf16 bits differ from the single-request engine's at near ties, so a
        # calibrated drafter in a batch follows the batched AR's continuation (computed for a batch run at once)
        self.batch_continuations = Continuations(batch_oracle=self._batch_greedy)
        self._ar_engine = None
        self._batch_ar = None
        if self.drafter_dir is not None:
            check_drafter_fits(self.target_dir, self.drafter_dir, self.tokenizer)
            self.draft_model = load_model(self.drafter_dir, dtype, device, pack=pack)

    def _packed(self, net):
        """``net`` (a drafter network) with its projections prepacked when :attr:`pack` (as the target's)."""
        if self.pack:
            pack_linears(net)
        return net

    def _greedy(self, prompt: list[int], n: int) -> list[int]:
        """The target's greedy continuation of ``prompt``, ``n`` tokens (no EOS stop): the oracle of
        :attr:`continuations`, an AR engine of this deployment's target built on first use."""
        if self._ar_engine is None:
            self._ar_engine = self.system(SystemConfig.ar(dtype=self.dtype), eos_ids=[])
        return list(self._ar_engine.generate(prompt, n).tokens)

    def _batch_greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """The batched engine's greedy continuations of ``prompts``, ``n`` tokens each (no EOS stop): the oracle of
        :attr:`batch_continuations`, an AR batched engine of 16 slots (graphed on CUDA) built on first use and
        rebuilt when a prompt needs a longer context. Its kernels are batch-invariant, so a request's tokens do not
        depend on the requests beside it (on a GPU in bf16 too, ``docs/batching.md``)."""
        need = max(len(p) for p in prompts) + n + 8
        if self._batch_ar is None or self._batch_ar.max_len < need:
            self._batch_ar = None  # its KV pool freed before the next one is allocated
            self._batch_ar = self.batch_system(SystemConfig.ar(dtype=self.dtype), max_num_seqs=16,
                                               max_len=max(need, 512), eos_ids=[], prefix_caching=False)
            self._batch_ar.capture_graphs()
        return [list(g.tokens) for g in self._batch_ar.generate_all(prompts, n)]

    def eos_ids(self) -> list[int]:
        """EOS ids: the target config's, else the tokenizer's eos_token_id."""
        ids = list(self.target.args.eos_token_ids)
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids = [self.tokenizer.eos_token_id]
        return ids

    def w12_target(self):
        """The target with its projections in W12 (§4.1, :func:`specpilot.w12.convert.to_w12`), built on
        first use; it shares embeddings and norms with :attr:`target` (and the LM head when that is tied to the
        embeddings; an untied head is W12 too).

        Raises:
            W12FormatError (a CheckpointError): the target's weights are not bfloat16 values.
        """
        if self._w12_target is None:
            from specpilot.w12.convert import to_w12

            self._w12_target = to_w12(self.target)
        return self._w12_target

    def int8_target(self, base):
        """``base`` (:attr:`target` or the W12 target) with the certified INT8 LM head (§4.1,
        :func:`specpilot.head.certified.with_int8_head`); one INT8 copy of the head serves both.

        The certified bound needs the exact head's GEMM to reduce in float32; the head scopes that itself around
        its own exact-head GEMMs (:func:`~specpilot.head.bound.fp32_reduction`), so no torch flag of the process
        changes.

        Raises:
            SpecPilotError: the LM head weight holds inf / NaN.
        """
        from specpilot.head.certified import CertifiedInt8Head, with_int8_head

        if self._int8_head is None:
            self._int8_head = CertifiedInt8Head(self.target.lm_head.weight)
        if id(base) not in self._int8:
            plain = base
            if base.lm_head is not self.target.lm_head:  # a W12 head: the INT8 head replaces it (and rescores
                plain = copy.copy(base)  # from the bf16 weights it was built on), so put those back
                plain._modules = dict(base._modules)
                plain.lm_head = self.target.lm_head
            self._int8[id(base)] = with_int8_head(plain, self._int8_head)
        return self._int8[id(base)]

    def block_net(self, path=None):
        """The loaded block drafter network of ``path`` (None: the first block dir), loading it once.

        Raises:
            DrafterError: no block drafter given, or it does not fit the target.
        """
        if path is None:
            if not self.block_dirs:
                raise DrafterError("drafter 'block' needs a block drafter directory (--drafter-path)")
            path = self.block_dirs[0]
        key = str(Path(path).resolve())
        if key not in self._blocks:
            self._blocks[key] = self._packed(load_block(path, self.target))
        return self._blocks[key]

    def eagle3_net(self, path=None):
        """The loaded EAGLE-3 drafter network of ``path`` (None: the deployment's eagle3 dir), loading it once.

        Raises:
            DrafterError: no eagle3 drafter given, or it is malformed or does not fit the target.
        """
        if path is None:
            if not self.eagle3_dirs:
                raise DrafterError("drafter 'eagle3' needs an EAGLE-3 drafter directory (--drafter-path)")
            path = self.eagle3_dirs[0]
        key = str(Path(path).resolve())
        if key not in self._eagle3:
            self._eagle3[key] = self._packed(load_eagle3(path, self.target))
        return self._eagle3[key]

    def system(self, config: SystemConfig, **engine_kw) -> Engine:
        """An engine running ``config`` on this deployment's weights (the W12 target when ``config.w12``; the
        certified INT8 head when ``config.lm_head_int8``).

        Raises:
            DrafterError: ``draft_model`` requested but the deployment has no draft model; a block drafter
                asked for more positions than its block size or more than 16 candidates a position.
            W12FormatError: ``config.w12`` with a target whose weights are not bfloat16 values.
            SpecPilotError: ``config`` is not a SystemConfig (a dict: ``SystemConfig(**d)``).
        """
        target = self._target(config)
        engine_kw.setdefault("eos_ids", self.eos_ids())
        engine_kw.setdefault("buckets", torch.device(self.device).type == "cuda")  # CUDA graphs per row bucket
        if config.tlv:
            engine_kw.setdefault("q_target", self.q_target(target, config.q_weights))
        # with row buckets a block drafter's step is one static pass too (a CUDA graph on CUDA)
        return Engine(target, config, self._drafter(config, target, 1, static_step=engine_kw["buckets"]), **engine_kw)

    def q_target(self, target, weights: str):
        """TLV's Q view of ``target`` (this deployment's target or one of its W12 / INT8-head copies) with
        ``weights`` (:func:`~specpilot.model.qview.q_view`), built on first use and then shared by every engine and
        recording here: each is a copy of the target's projections (12 GB as ``view8`` of a bf16 8B target), and a
        pilot builds many TLV systems. Raises SpecPilotError as ``q_view``."""
        from specpilot.model.qview import q_view

        key = (id(target), weights)
        if key not in self._q_views:
            self._q_views[key] = q_view(target, weights)
        return self._q_views[key]

    def batch_system(self, config: SystemConfig | LoadPlan, max_num_seqs: int = 8, **engine_kw) -> BatchEngine:
        """A batched engine (continuous batching, one exact pass per step) running ``config`` for up to
        ``max_num_seqs`` requests at once; its drafter holds that many requests (an n-gram index per request; a
        draft model or block drafter per slot); ``compile_cpu=True``: the target's compiled stack, one per target
        for every engine built here (it compiles once). A :class:`~specpilot.engine.load_plan.LoadPlan` runs each step's
        system by load; its systems share a drafter where they name the same one
        (:meth:`~specpilot.engine.load_plan.LoadPlan.drafter_key`). Raises as :meth:`system` (and as
        :class:`LoadPlan`), and ValueError for ``max_num_seqs < 1``."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        target = self._target(config.configs[0] if isinstance(config, LoadPlan) else config)  # one per plan
        plan = config if isinstance(config, LoadPlan) else LoadPlan.single(config)
        engine_kw.setdefault("eos_ids", self.eos_ids())
        # on a GPU a block drafter's step runs from CUDA graphs: the single engine's static step for one slot, the
        # batched static step (per requests and width bucket) for more
        static_step = torch.device(self.device).type == "cuda"
        built: dict = {}
        for i, c in enumerate(plan.configs):
            if plan.drafter_key(i) not in built:
                built[plan.drafter_key(i)] = self._drafter(c, target, max_num_seqs, batched=True,
                                                           static_step=static_step)
        drafters = [built[plan.drafter_key(i)] for i in range(len(plan))]
        if engine_kw.pop("compile_cpu", False):  # one stack per target: the pilot's engines compile it once
            engine_kw["stack"] = self.compiled_stack(target)
        return BatchEngine(target, config, drafters, max_num_seqs=max_num_seqs, **engine_kw)

    def compiled_stack(self, target=None):
        """The :class:`~specpilot.model.compiled_stack.CompiledStack` of ``target`` (default :attr:`target`), built
        on first use and shared by every batched engine built here with ``compile_cpu`` (one compile per target).
        Raises SpecPilotError: a target the stack cannot compile (off the CPU, not a dense decoder)."""
        target = self.target if target is None else target
        if id(target) not in self._stacks:
            self._stacks[id(target)] = target.compiled_stack()
        return self._stacks[id(target)]

    def _target(self, config: SystemConfig):
        if not isinstance(config, SystemConfig):
            raise SpecPilotError(f"system() takes a SystemConfig, got {type(config).__name__}"
                                 + (" (build one with SystemConfig(**d))" if isinstance(config, dict) else ""))
        target = self.w12_target() if config.w12 else self.target
        return self.int8_target(target) if config.lm_head_int8 else target

    def _drafter(self, config: SystemConfig, target, slots: int, static_step: bool = False, batched: bool = False):
        """The drafter ``config`` names, holding ``slots`` requests (None for AR); ``static_step``: a block drafter's
        steps run as static passes (:class:`~specpilot.spec.block_step.StaticBlockStep` for one slot,
        :class:`~specpilot.spec.block_batch_step.BatchBlockStep` for more, without a Markov head); ``batched``: for a
        batched engine (a calibrated drafter then reads :attr:`batch_continuations`)."""
        if config.drafter == "ngram":
            return NgramDrafter(config.ngram_max, config.ngram_min, max_matches=max(config.top_k, 1),
                                max_slots=max(slots, 1024))
        if config.drafter == "draft_model":
            if self.draft_model is None and self._block_given_as_drafter is not None:
                raise DrafterError(f"drafter 'draft_model' asked for, but {self._block_given_as_drafter} is a block "
                                   "drafter (specpilot_drafter: block in its config.json): use drafter 'block'")
            if self.draft_model is None:
                raise DrafterError("drafter 'draft_model' needs a draft model checkpoint (--drafter-path)")
            make = [DraftModelDrafter(self.draft_model, top_k=config.top_k) for _ in range(slots)]
            return make[0] if slots == 1 else SlotFanout(make)
        if config.drafter == "block":
            net = self.block_net(config.drafter_path)
            if config.depth > net.cfg.block_size or config.top_k > BLOCK_TOP_K:  # refused, not clamped
                raise DrafterError(f"the block drafter drafts at most {net.cfg.block_size} positions (its block size) "
                                   f"with at most {BLOCK_TOP_K} candidates each: depth {config.depth}, top_k "
                                   f"{config.top_k} asked for")
            # one network pass drafts every request of a batch; context buffers start small and grow
            return BlockDrafter(net, target, top_k=config.top_k, max_len=4096 if slots == 1 else 512, max_slots=slots,
                                static_step=static_step and slots == 1,
                                batch_step=static_step and slots > 1 and net.cfg.markov_rank == 0)
        if config.drafter == "eagle3":  # sequential drafting, top_k children per node, top_k nodes expanded per depth
            return Eagle3Drafter(self.eagle3_net(config.drafter_path), target, top_k=config.top_k, max_slots=slots)
        if config.drafter == "calibrated":  # simulated acceptance; feed dep.continuations from an AR run first
            store = self.batch_continuations if batched else self.continuations
            return build_calibrated(config, target, store, slots, static_step=static_step)
        return None


def check_drafter_fits(target_dir, drafter_dir, target_tokenizer=None) -> None:
    """Raise :class:`DrafterError` unless the drafter shares the target's vocabulary.

    Checks the vocab sizes in both config.json files and, when the drafter directory has tokenizer files,
    that both tokenizers map the same strings to the same ids.
    """
    ta, da = read_args(target_dir), read_args(drafter_dir)
    if ta.vocab_size != da.vocab_size:
        raise DrafterError(
            f"drafter vocabulary ({da.vocab_size} ids) does not fit the target's ({ta.vocab_size} ids)"
        )
    if target_tokenizer is not None and any(Path(drafter_dir).glob("tokenizer*.json")):
        if load_tokenizer(drafter_dir).get_vocab() != target_tokenizer.get_vocab():
            raise DrafterError("drafter tokenizer differs from the target's: token ids would not match")


def check_device(device: str) -> str:
    """``device`` if torch can use it here; else :class:`SpecPilotError` (e.g. ``cuda`` without a GPU)."""
    import torch

    from specpilot.errors import SpecPilotError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecPilotError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:1)") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise SpecPilotError(f"device {device!r} is not supported: SpecPilot runs on cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecPilotError(f"device {device!r} requested but no CUDA GPU is available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SpecPilotError(f"device {device!r} does not exist ({torch.cuda.device_count()} GPUs here)")
    return device
