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


def resolve_recorded(path: str | Path) -> Path:
    """A checkpoint directory as recorded by an earlier run (``system.json``, a memory entry), found again: the
    path itself when it exists, else, for a bundled model recorded under another install of SpecPilot (another
    venv, a reinstall: ``.../specpilot/zoo/assets/<name>``), the same bundled model of this install. Any other
    path comes back unchanged (the caller's "not found" error then names it)."""
    p = Path(path)
    if p.exists() or p.parent.name != "assets" or p.parent.parent.name != "zoo":
        return p
    here = ASSETS / p.name
    return here if here.exists() else p


__all__ = ["ASSETS", "bundled_target_dir", "bundled_drafter_dir", "bundled_block_dir", "bundled_block_markov_dir",
           "resolve_recorded"]
