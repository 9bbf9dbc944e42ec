"""EAGLE-3-style drafter (§1.1): an :class:`~specpilot.spec.eagle3_net.Eagle3Net` bound to a target, holding many
requests in slots, drafting sequentially with a dynamic top-k expansion; and its checkpoints, ours and the public
EAGLE-3 layout (SpecForge / SafeAILab EAGLE / the heads vLLM and SGLang load).

Checkpoint: a directory with ``config.json`` (a Hugging Face Llama-style config with ``draft_vocab_size``,
optionally ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; ours adds
``"specpilot_drafter": "eagle3"``) and ``model.safetensors`` (or a public head's ``pytorch_model.bin``).

Why a :class:`~specpilot.spec.lattice.TreeLattice`: EAGLE-2/3's expansion scores only the children of the nodes it
expanded, and a child's candidates depend on its whole path (the drafter's hidden state is carried down the path),
so neither a positional lattice (one candidate list per depth) nor a Markov lattice (conditioned on the parent token
only) describes it without inventing scores. A tree lattice answers ``children(path)`` for the expanded paths and
``[]`` elsewhere, which is all every builder reads (chain, best_first, eagle2_topk, ddtree_marginal, whose marginal
equals the conditional scores here, and sequoia's rank shape); no builder needed a change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specpilot.errors import DrafterError
from specpilot.model.transformer import Transformer
from specpilot.spec.drafter import DraftRequest, SlotTable
from specpilot.spec.eagle3_net import Eagle3Config, Eagle3Net
from specpilot.spec.lattice import TreeLattice

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # what public EAGLE-3 configs declare


class _Slot:
    """One request's state: fused target features ``fused [S, hidden]`` of committed positions ``[0, n_feat)``, and
    the drafter's own K/V ``k, v [S, kv_heads, head_dim]`` of committed rows ``[0, n_kv)`` (row j: token j + 1,
    feature j)."""

    def __init__(self, cfg: Eagle3Config, size: int, dtype, device):
        self.fused = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.k = torch.zeros(size, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n_feat = self.n_kv = 0

    def reserve(self, n: int) -> None:
        """Buffers of at least ``n`` positions (doubling; held values kept)."""
        have = self.fused.shape[0]
        if n <= have:
            return
        size = max(n, 2 * have)
        for name in ("fused", "k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((size, *old.shape[1:]))
            new[:have] = old
            setattr(self, name, new)


class Eagle3Drafter:
    """EAGLE-3 drafter bound to a target (:class:`~specpilot.spec.drafter.Drafter`).

    Args:
        net: an :class:`Eagle3Net` (same dtype / device as the target).
        target: the target :class:`Transformer` (its embedding is used unless the net has its own).
        top_k: candidates kept per expanded node (≤ the draft vocabulary).
        expand: frontier nodes expanded per depth (None: ``top_k``), EAGLE-2/3's dynamic expansion.
        max_len: positions allocated per slot up front (grown on demand).
        max_slots: requests held at once.
    Raises:
        ValueError: ``max_slots < 1`` or ``top_k < 1``.

    Drafting a request of ``n`` committed tokens (features held for ``[0, n - 1)``): the committed rows not yet in
    the slot's K/V are run (their K/V kept), and the last one (token ``n - 1``, feature ``n - 2``) gives the first
    position's top-``top_k``. Then per depth the ``expand`` generated nodes of best path score Σ log p are run as one
    batch of rows, each reading its parent's pre-norm hidden and its own token, attending to the committed rows and
    to its ancestors; each gives its top-``top_k`` children. The result is a :class:`TreeLattice` of ``depth``
    positions whose first positions do not depend on the depth asked for. Requests of a batch are drafted one after
    another. Ids outside the draft vocabulary are never proposed (their probability is 0 for the drafter).
    """

    kind = "eagle3"
    max_context: int | None = None

    def __init__(self, net: Eagle3Net, target: Transformer, top_k: int = 8, expand: int | None = None,
                 max_len: int = 512, max_slots: int = 1):
        if max_slots < 1 or top_k < 1:
            raise ValueError(f"an eagle3 drafter needs max_slots >= 1 and top_k >= 1, got {max_slots}, {top_k}")
        self.net, self.target, self.cfg = net.eval(), target, net.cfg
        self.top_k = min(top_k, net.cfg.draft_vocab_size)
        self.expand = self.top_k if expand is None else max(1, expand)
        self.target_layers = tuple(net.cfg.target_layers)
        self.vocab_size = net.cfg.vocab_size
        self.max_slots = max_slots
        dtype, dev = net.fc.weight.dtype, net.fc.weight.device
        self._slots = SlotTable(max_slots, lambda: _Slot(net.cfg, max(max_len, 1), dtype, dev))

    def reset(self, slot: int = 0) -> None:
        """Forget the request held in ``slot``."""
        self._slots.get(slot)  # checks the slot
        self._slots.drop(slot)

    @torch.inference_mode()
    def observe(self, slot: int, features: torch.Tensor, start: int) -> None:
        """Fuse and keep the target features ``[k, len(target_layers) * target_hidden]`` of ``slot``'s committed
        positions ``[start, start + k)`` (any float dtype); features and drafter K/V past ``start`` are forgotten."""
        st = self._slots.get(slot)
        k = features.shape[0]
        st.reserve(start + k)
        st.fused[start : start + k] = self.net.fuse(features.to(st.fused.dtype))
        st.n_feat = start + k
        st.n_kv = min(st.n_kv, start)

    def _topk(self, prenorm: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Rows ``[R, hidden]`` -> per row the top-``top_k`` target ids and their log-probs (draft vocabulary)."""
        lp, ids = self.net.draft_logits(prenorm).log_softmax(-1).topk(self.top_k, dim=-1)
        return self.net.to_target(ids).tolist(), lp.tolist()

    def _draft(self, st: _Slot, committed: list[int], depth: int) -> TreeLattice:
        net, dev = self.net, st.fused.device
        n, embed = len(committed), self.target.model.embed_tokens
        m = n - 1  # committed rows [lo, m) are run (their K/V kept); row m - 1 is the first query
        lo = min(st.n_kv, m - 1)
        toks = torch.tensor(committed[lo + 1 : n], device=dev)
        q, k, v, res = net.project(net.embed(toks, embed), st.fused[lo:m], torch.arange(lo, m, device=dev))
        st.k[lo:m], st.v[lo:m], st.n_kv = k, v, m
        attn = net.attend(q[None, -1:], st.k[None, :m], st.v[None, :m], torch.ones(1, 1, m, dtype=torch.bool,
                                                                                    device=dev))
        hid = net.finish(attn, res[None, -1:])[0]  # [1, hidden]
        ids, lps = self._topk(hid)
        kids: dict[tuple[int, ...], list[tuple[int, float]]] = {(): list(zip(ids[0], lps[0]))}
        # generated nodes of the current depth: (path score, path, parent's hidden row, parent's tree row or -1)
        nodes = [(lp, (t,), 0, -1) for t, lp in kids[()]]
        tree_k, tree_v = [], []  # K/V of the tree rows run so far
        anc = np.zeros((0, 0), dtype=np.bool_)  # [tree rows, tree rows]: ancestor-or-self among the tree rows
        for d in range(1, depth):
            front = sorted(range(len(nodes)), key=lambda i: -nodes[i][0])[: self.expand]
            base, f = anc.shape[0], len(front)
            grown = np.zeros((base + f, base + f), dtype=np.bool_)
            grown[:base, :base] = anc
            for j, i in enumerate(front):
                if nodes[i][3] >= 0:
                    grown[base + j, :base] = grown[nodes[i][3], :base]
                grown[base + j, base + j] = True
            anc = grown
            toks = torch.tensor([nodes[i][1][-1] for i in front], device=dev)
            q, k, v, res = net.project(net.embed(toks, embed), hid[[nodes[i][2] for i in front]],
                                       torch.full((len(front),), m - 1 + d, device=dev))
            tree_k.append(k)
            tree_v.append(v)
            keys, vals = torch.cat((st.k[:m], *tree_k))[None], torch.cat((st.v[:m], *tree_v))[None]
            mask = torch.ones(1, f, m + base + f, dtype=torch.bool, device=dev)  # every row sees the committed rows
            mask[0, :, m:] = torch.from_numpy(anc[base:]).to(dev)
            hid = net.finish(net.attend(q[None], keys, vals, mask)[0], res)  # [F, hidden]
            ids, lps = self._topk(hid)
            nodes_next = []
            for j, i in enumerate(front):
                score, path = nodes[i][0], nodes[i][1]
                kids[path] = list(zip(ids[j], lps[j]))
                nodes_next += [(score + lp, path + (t,), j, base + j) for t, lp in kids[path]]
            nodes = nodes_next
        return TreeLattice(kids, depth)

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftRequest]) -> list[TreeLattice | None]:
        """Per request, a :class:`TreeLattice` of ``depth`` positions after its committed tokens (None when depth
        < 1 or no target feature is held yet, i.e. fewer than 2 committed tokens).

        Raises:
            DrafterError: a slot outside ``[0, max_slots)``, or one slot twice in the batch.
            RuntimeError: the slot's features do not end at ``len(committed) - 1`` (R11).
        """
        out: list[TreeLattice | None] = []
        seen: set[int] = set()
        for q in batch:
            st = self._slots.get(q.slot)
            if q.slot in seen:
                raise DrafterError(f"the eagle3 drafter was asked about slot {q.slot} twice in one batch")
            seen.add(q.slot)
            if st.n_feat != len(q.committed) - 1:
                raise RuntimeError(f"eagle3 drafter slot {q.slot} holds features of {st.n_feat} positions, expected "
                                   f"{len(q.committed) - 1}")
            out.append(self._draft(st, q.committed, q.depth) if q.depth >= 1 and len(q.committed) >= 2 else None)
        return out


def hf_config(cfg: Eagle3Config) -> dict:
    """The ``config.json`` of ``cfg`` in the public EAGLE-3 layout (+ ``"specpilot_drafter": "eagle3"``): a
    one-layer Llama config with ``draft_vocab_size``, ``target_hidden_size`` and the aux layer ids (our target
    layers + 1: the public ids name the layer whose *input* is read)."""
    return {"specpilot_drafter": "eagle3", "architectures": [ARCHITECTURES[0]], "model_type": "llama",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden, "tie_word_embeddings": False,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layers],
                             "use_aux_hidden_state": True},
            "target_num_layers": cfg.target_num_layers, "target_model_type": cfg.target_model_type}


def save_eagle3(net: Eagle3Net, out: str | Path, extra: dict | None = None, dtype=torch.bfloat16) -> Path:
    """Write ``config.json`` (:func:`hf_config` + ``extra``) and ``model.safetensors`` (float weights in ``dtype``;
    ``d2t`` long, ``t2d`` bool) of ``net`` to ``out``; returns the directory."""
    from specpilot.fileio import save_safetensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**hf_config(net.cfg), **(extra or {})}, indent=2) + "\n")
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in net.state_dict().items()}
    save_safetensors(sd, out / "model.safetensors")
    return out


def is_eagle3_dir(path) -> bool:
    """True when ``path/config.json`` declares ``"specpilot_drafter": "eagle3"`` or a public EAGLE-3 architecture."""
    p = Path(path) / "config.json"
    try:
        raw = json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    archs = raw.get("architectures") or []
    return raw.get("specpilot_drafter") == "eagle3" or any(a in ARCHITECTURES for a in archs)


def read_config(raw: dict, target_args, where: str) -> Eagle3Config:
    """:class:`Eagle3Config` of a parsed EAGLE-3 ``config.json`` for a target of ``target_args`` (ModelArgs).

    Aux layer ids (``eagle_config.eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)`` as vLLM's
    Llama) name the target layer whose input is read, so our ``target_layers`` are those ids minus one.

    Raises:
        DrafterError: a missing or invalid field, a layout this loader does not run (more than one layer, biases,
            an unsupported rope type), or a drafter that does not fit the target.
    """
    from specpilot.model.args import ModelArgs, rope_inv_freq

    def fail(msg):
        raise DrafterError(f"eagle3 drafter {where}: {msg}")

    try:
        a = ModelArgs.from_hf({"model_type": "llama", "num_hidden_layers": 1, **raw})
    except KeyError as e:
        fail(f"config.json lacks the field {e.args[0]!r}")
    except (TypeError, ValueError) as e:
        fail(f"config.json has an invalid field ({str(e)[:80]})")
    if raw.get("num_hidden_layers", 1) != 1:
        fail(f"num_hidden_layers is {raw['num_hidden_layers']}; this loader runs one-layer EAGLE-3 heads")
    if a.attention_bias or a.mlp_bias or raw.get("hidden_act", "silu") != "silu":
        fail("attention / MLP biases or an activation other than silu are not supported")
    try:
        rope_inv_freq(a)
    except (ValueError, KeyError) as e:
        fail(f"rope_scaling not supported ({str(e)[:80]})")
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict) or eagle.get("use_aux_hidden_state", True) is not True:
        fail("eagle_config must be an object with use_aux_hidden_state true (EAGLE-3 fuses target layers)")
    n = target_args.num_layers
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", [2, n // 2, n - 3])
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not ids:
        fail(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if min(ids) < 1 or max(ids) > n:
        fail(f"aux layer ids {ids} do not fit the target's {n} layers (1 to {n}: the input of layer i, the output of "
             "layer i - 1; id 0, the embedding output, is not captured)")
    dv = raw.get("draft_vocab_size", a.vocab_size)
    if not isinstance(dv, int) or not 1 <= dv <= a.vocab_size:
        fail(f"draft_vocab_size {dv!r} must be an integer in [1, vocab_size {a.vocab_size}]")
    cfg = Eagle3Config(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, heads=a.n_heads,
                       kv_heads=a.n_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size, draft_vocab_size=dv,
                       target_hidden=int(raw.get("target_hidden_size", a.hidden_size)),
                       target_layers=[i - 1 for i in ids], norm_before_residual=bool(raw.get("norm_before_residual")),
                       rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                       target_num_layers=n, target_model_type=target_args.model_type)
    if cfg.heads % cfg.kv_heads or cfg.head_dim % 2:
        fail(f"{cfg.heads} heads over {cfg.kv_heads} kv heads of dim {cfg.head_dim} is not a valid attention")
    if cfg.vocab_size != target_args.vocab_size or cfg.target_hidden != target_args.hidden_size:
        fail(f"built for vocab {cfg.vocab_size} / target hidden {cfg.target_hidden}, the target has vocab "
             f"{target_args.vocab_size} / hidden {target_args.hidden_size}")
    return cfg


def _read_weights(p: Path) -> dict:
    if (p / "model.safetensors").is_file():
        from specpilot.fileio import load_safetensors

        return load_safetensors(p / "model.safetensors", DrafterError)
    if (p / "pytorch_model.bin").is_file():
        return torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise DrafterError(f"eagle3 drafter {p}: no model.safetensors or pytorch_model.bin")


def load_eagle3(path, target: Transformer) -> Eagle3Net:
    """Load an EAGLE-3 drafter directory (ours or a public head) for ``target`` (its dtype / device).

    Reads ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d`` (both optional when the draft vocabulary
    is the target's: identity) and ``embed_tokens`` (optional: the target's embedding is shared when absent).

    Raises:
        DrafterError: not an EAGLE-3 directory, a malformed config, missing / unexpected / mis-shaped tensors,
            a ``d2t`` mapping outside the target's vocabulary or not one-to-one, a ``t2d`` that disagrees with
            ``d2t``, or a drafter that does not fit the target.
    """
    p = Path(path)
    if not is_eagle3_dir(p):
        raise DrafterError(f"{p} is not an eagle3 drafter directory (a config.json with \"specpilot_drafter\": "
                           f"\"eagle3\" or architectures {list(ARCHITECTURES)})")
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DrafterError(f"eagle3 drafter {p}: unreadable config.json ({str(e)[:80]})") from None
    cfg = read_config(raw, target.args, str(p))
    sd = _read_weights(p)
    cfg.own_embedding = "embed_tokens.weight" in sd
    if not cfg.own_embedding and cfg.hidden_size != target.args.hidden_size:
        raise DrafterError(f"eagle3 drafter {p}: hidden size {cfg.hidden_size} differs from the target's "
                           f"{target.args.hidden_size} and the checkpoint has no embed_tokens of its own")
    with torch.device("meta"):  # no initialisation (the weights are loaded next; it would draw from torch's RNG)
        net = Eagle3Net(cfg)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping unless given
        sd.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    sd.setdefault("t2d", None)
    missing = [k for k in expected if k not in sd]
    extra = [k for k in sd if k not in expected]
    if missing or extra:
        what = f"lacks the tensor {missing[0]!r}" if missing else f"holds a tensor this layout does not have: {extra[0]!r}"
        raise DrafterError(f"eagle3 drafter {p}: the checkpoint {what}")
    for k, shape in expected.items():
        if sd[k] is not None and tuple(sd[k].shape) != tuple(shape):
            raise DrafterError(f"eagle3 drafter {p}: tensor {k!r} has shape {tuple(sd[k].shape)}, its config says "
                               f"{tuple(shape)}")
    ids = torch.arange(cfg.draft_vocab_size) + sd["d2t"].long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(set(ids.tolist())) != len(ids):
        raise DrafterError(f"eagle3 drafter {p}: d2t maps draft ids outside the target's vocabulary or two onto one")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    if sd["t2d"] is not None and not torch.equal(sd["t2d"].bool(), t2d):
        raise DrafterError(f"eagle3 drafter {p}: t2d disagrees with d2t (they must mark the same target ids)")
    sd["d2t"], sd["t2d"] = sd["d2t"].long(), t2d
    net = net.to_empty(device="cpu")
    net.load_state_dict(sd)
    return net.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
