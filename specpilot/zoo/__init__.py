"""The model zoo: the recipe that builds the small target + drafter pair shipped with SpecPilot.

Pipeline (each step a ``specpilot zoo`` command, see :mod:`specpilot.zoo.cli`): corpus (stdlib source +
GSM8K train) -> byte-level BPE tokenizer -> uint16 tokens -> train ``target`` and ``drafter`` presets
(Qwen3 architecture) -> bfloat16 HF checkpoint directories with ``provenance.json``.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def bundled_target_dir() -> Path:
    """Directory of the bundled target checkpoint (``specpilot/zoo/assets/target``; may not exist yet)."""
    return ASSETS / "target"


def bundled_drafter_dir() -> Path:
    """Directory of the bundled draft model (``specpilot/zoo/assets/drafter``; may not exist yet)."""
    return ASSETS / "drafter"


def bundled_block_dir() -> Path:
    """Directory of the bundled block drafter (DFlash-style, ``specpilot/zoo/assets/block``)."""
    return ASSETS / "block"


def bundled_block_markov_dir() -> Path:
    """Directory of the bundled block drafter with a Markov head (``specpilot/zoo/assets/block_markov``)."""
    return ASSETS / "block_markov"


__all__ = ["ASSETS", "bundled_target_dir", "bundled_drafter_dir", "bundled_block_dir", "bundled_block_markov_dir"]
