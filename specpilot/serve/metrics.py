"""Prometheus metrics of the server, named ``specpilot:<vLLM's name>`` with vLLM's meanings.

Every metric has vLLM's suffix and meaning behind a ``specpilot:`` prefix (``vllm:spec_decode_num_drafts_total``
is ``specpilot:spec_decode_num_drafts_total``), so a vLLM dashboard or PromQL query works after swapping the
prefix, and the two never mix on one Prometheus. Labels: ``model_name`` (the served model name); ``position`` on
the per-position counter; ``finished_reason`` (``stop`` | ``length`` | ``abort`` | ``error``) on finished requests.

- ``num_requests_running`` / ``num_requests_waiting`` (gauges): requests holding an engine slot / queued for one.
- ``kv_cache_usage_perc`` (gauge, 0-1): the fraction of the engine's request slots in use.
- ``request_success_total{finished_reason}``: requests ended, by reason (an abort is a client gone or a stop string
  cut; an error is an engine failure answered with a 500).
- ``prompt_tokens_total`` / ``generation_tokens_total``: prompt tokens admitted; tokens the engine committed.
- ``time_to_first_token_seconds``, ``inter_token_latency_seconds`` (the gap between two outputs of one request,
  once per engine step that gave it tokens, as vLLM v1 observes it), ``e2e_request_latency_seconds`` (histograms).
- ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``: prompt tokens looked up in the resident prefixes
  (:mod:`specpilot.engine.prefix`) / of those, reused instead of prefilled (vLLM's counters, in tokens).
- ``spec_decode_num_drafts_total``: request-steps that verified at least one drafted token;
  ``..._num_draft_tokens_total``: drafted tokens verified (tree nodes); ``..._num_accepted_tokens_total``: of those,
  accepted (the bonus token excluded); ``..._num_accepted_tokens_per_pos_total{position}``: accepted at draft
  position ``position`` (0-based). Acceptance rate = accepted / draft tokens; mean acceptance length (bonus
  included) = 1 + accepted / drafts.
- ``load_plan_steps_total{sealed_size}`` (ours; vLLM has none): decode steps run by the system sealed at that batch
  size when the server follows a load plan (``serve --system PILOT_DIR``; one series for a single system).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "specpilot:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers may share a process, e.g. in tests).

    Thread-safe (prometheus_client's metrics are): the engine thread counts steps, the event loop the rest.

    Args:
        model_name: the ``model_name`` label (the served model name).
    """

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name
        self.running = Gauge(P + "num_requests_running", "Requests holding an engine slot.", lab, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for an engine slot.", lab, registry=r)
        self.usage = Gauge(P + "kv_cache_usage_perc", "Fraction of the engine's request slots in use (0-1).", lab,
                           registry=r)
        self.finished = Counter(P + "request_success", "Finished requests, by finished_reason.",
                                lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted.", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens committed by the engine.", lab, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token (s).", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between two outputs of a request (s).", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to end (s).", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Request-steps that verified drafted tokens.", lab,
                              registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Drafted tokens verified.", lab, registry=r)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Drafted tokens accepted (bonus excluded).",
                                lab, registry=r)
        self.accepted_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens accepted, by draft position (0-based).", lab + ["position"],
                                    registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in resident prefixes.",
                                      lab, registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens reused from resident prefixes.", lab,
                                   registry=r)
        self.plan_steps = Counter(P + "load_plan_steps", "Decode steps run by the system sealed at sealed_size.",
                                  lab + ["sealed_size"], registry=r)
        self._prefix_seen, self._plan_seen = (0, 0), {}
        for reason in REASONS:  # every series exists from the start (a rate() over a new series misses its start)
            self.finished.labels(model_name, reason)
        for m in (self.running, self.waiting, self.usage, self.prompt_tokens, self.generation_tokens, self.ttft,
                  self.itl, self.e2e, self.drafts, self.draft_tokens, self.accepted, self.prefix_queries,
                  self.prefix_hits):
            m.labels(model_name)

    def step(self, outputs) -> None:
        """Count one engine step's :class:`StepOutput` s: generation tokens and the speculative counters."""
        m = self.model  # summed over the step first: one counter update each, not one per request (32 a step)
        tokens = sum(len(o.new_tokens) for o in outputs)
        if tokens:
            self.generation_tokens.labels(m).inc(tokens)
        drafted = [o for o in outputs if o.drafted > 0]
        if not drafted:
            return
        self.drafts.labels(m).inc(len(drafted))
        self.draft_tokens.labels(m).inc(sum(o.drafted for o in drafted))
        self.accepted.labels(m).inc(sum(o.accepted for o in drafted))
        by_pos: dict[int, int] = {}
        for o in drafted:
            for pos, n in enumerate(o.accepted_by_pos):
                by_pos[pos] = by_pos.get(pos, 0) + n
        for pos, n in by_pos.items():
            if n:
                self.accepted_pos.labels(m, str(pos)).inc(n)

    def prefix(self, queried: int, hits: int) -> None:
        """Bring the prefix-cache counters up to the engine's running totals (tokens queried, tokens reused)."""
        q0, h0 = self._prefix_seen
        self.prefix_queries.labels(self.model).inc(max(0, queried - q0))
        self.prefix_hits.labels(self.model).inc(max(0, hits - h0))
        self._prefix_seen = (max(q0, queried), max(h0, hits))

    def plan(self, sizes, steps) -> None:
        """Bring ``load_plan_steps_total`` up to the engine's running totals: ``steps[i]`` decode steps run by the
        system sealed at ``sizes[i]``."""
        for n, total in zip(sizes, steps):
            seen = self._plan_seen.get(n, 0)
            if total > seen:
                self.plan_steps.labels(self.model, str(n)).inc(total - seen)
                self._plan_seen[n] = total

    def queue(self, running: int, waiting: int, num_slots: int) -> None:
        """Set the request gauges (requests in slots, waiting, and the fraction of ``num_slots`` in use)."""
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)
        self.usage.labels(self.model).set(running / num_slots if num_slots else 0.0)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
