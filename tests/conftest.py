"""Shared fixtures: tiny random checkpoints (float32, CPU) saved in HF layout and loaded by our loader."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels are tested in Triton's interpreter on the CPU; the switch must be set before triton is
    # first imported anywhere (tests/test_tree_attention.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fix_interpreter_index() -> bool:
    """Make Triton 3.6's CPU interpreter usable with numpy >= 2.4, for this test process only (idempotent).

    The interpreter turns a runtime loop bound (a loaded or reduced scalar, a one-element array) into a Python int
    with ``int(array)``, which numpy >= 2.4 refuses for arrays of shape ``(1,)`` ("only 0-dimensional arrays can be
    converted to Python scalars"; triton-lang/triton#9171, fixed upstream by #9172). The W12 kernels have such loops
    (the escape epilogue), so without this their interpreter runs fail with a current numpy. The patch makes the
    interpreter's tensor ``__index__`` read the one element instead. It lives here, not in the package: importing
    specpilot must not change Triton for the whole process (no product path runs a W12 kernel in the interpreter;
    the certified head's CPU smoke run, ``specpilot bench --suite lm-head --device cpu``, has no such loop).
    Returns True when the patch is in place, False when Triton or the patched hook is absent (another Triton
    version: left alone)."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    orig = getattr(it, "_patch_lang_tensor", None)
    if orig is None:
        return False
    if getattr(orig, "_specpilot_shim", False):
        return True

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._specpilot_shim = True
    it._patch_lang_tensor = patched
    return True


if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
    fix_interpreter_index()


def save_tiny(path, model_type="qwen3", vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, **kw):
    """Save a tiny random HF causal LM of ``model_type`` to ``path``; returns ``path`` (str)."""
    import transformers as tf

    cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[model_type]
    torch.manual_seed(seed)
    cfg = cls[0](vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                 max_position_embeddings=512, **kw)
    cls[1](cfg).eval().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """``(target_dir, drafter_dir)``: a 2-layer target and a 1-layer drafter, vocab 64."""
    root = tmp_path_factory.mktemp("tiny")
    t = save_tiny(root / "target", hidden=64, layers=2, seed=1)
    d = save_tiny(root / "drafter", hidden=32, layers=1, heads=2, kv_heads=1, seed=2)
    return t, d


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """``(target, drafter)`` :class:`Transformer` s in float32."""
    from specpilot.model.checkpoint import load_model

    return load_model(tiny_dirs[0]), load_model(tiny_dirs[1])


def random_prompts(n, vocab=64, length=12, seed=0):
    """``n`` random prompts (lists of ids) of ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_cli(monkeypatch, capsys, *args):
    """Run ``specpilot *args`` in-process; returns ``(exit code, stdout, stderr)``."""
    import sys

    from specpilot import cli

    monkeypatch.setattr(sys, "argv", ["specpilot", *args])
    capsys.readouterr()  # drop what fixtures printed
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a shared 2-core machine two threads make paired runs and tiny
    scorer passes several times slower (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def phase0_of(dep, reqs, stock):
    """Phase 0 (AR vs ``stock`` and stock A/A, §3.3) of the controller on deployment ``dep``, seeded."""
    import random

    from specpilot.config import SystemConfig
    from specpilot.pilot import controller as ctl
    from specpilot.pilot.forcing import Scorer

    avoid = set(dep.eos_ids()) | set(dep.tokenizer.all_special_ids)
    return ctl.phase0(lambda: dep.system(SystemConfig.ar()), lambda: dep.system(stock), reqs, Scorer(dep.target),
                      dep.target.args.vocab_size, avoid_ids=avoid, rng=random.Random(0))
