"""Result types shared by the engine and the pilot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Generation:
    """Output and statistics of one request.

    Attributes:
        tokens: generated token ids (the prompt excluded; a stop token that ended it included).
        steps: exact passes after the prefill (one per speculative step / AR decode step).
        accepted: tokens committed by each of those passes (len == steps; bonus included).
        rows: rows verified by each of those passes (root + tree nodes).
        stop_reason: ``eos`` | ``stop`` | ``length``.
        time_s: wall time of the whole request (prefill included), seconds.
        prefill_s: wall time of the prefill pass, seconds.
        cache_length: valid cache slots when the request ended (= prompt + kept tokens − 1, R2).
        chains: with TLV (§4.3), the length of each cycle's commit chain C (0 where draft ① proposed nothing);
            empty without TLV.
    The prefill pass commits the first token; tau counts only the ``steps`` after it.
    """

    tokens: list[int]
    steps: int
    accepted: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    stop_reason: str = "length"
    time_s: float = 0.0
    prefill_s: float = 0.0
    cache_length: int = 0
    chains: list[int] = field(default_factory=list)  # last: positional construction predates it

    @property
    def tau(self) -> float:
        """τ: mean tokens committed per exact pass after the prefill (1.0 for AR)."""
        return sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time (prefill included)."""
        return len(self.tokens) / self.time_s if self.time_s > 0 else 0.0
