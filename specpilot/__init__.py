"""SpecPilot: lossless greedy speculative decoding and the procedure that tunes it per deployment.

Layers (see DESIGN in the seed paper, §3–§4):

- ``specpilot.engine``: the target model, its static KV cache, AR and speculative decoding.
- ``specpilot.spec`` and ``specpilot.spec``: drafters (n-gram, draft model) and tree builders.
- ``specpilot.pilot``: Phase 0, cost model, planner, controller, token forcing, memory, seal, report.
"""

__version__ = "0.1.0"
