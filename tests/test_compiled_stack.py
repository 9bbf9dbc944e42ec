"""The batched engine's compiled CPU decoder stack (``compile_cpu``, :mod:`specpilot.model.compiled_stack`): float32
outputs equal the eager engine's token for token (AR and an n-gram chain, steps whose slots are and are not a window,
prompts riding in a step), the eager fallback runs and is counted, ``compile_shapes`` compiles every graph a run meets
(no recompile after it), an owner's table row goes with it, and a target off the CPU is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.engine.batch import BatchEngine
from specpilot.errors import SpecPilotError
from specpilot.model.batch import BatchRows
from specpilot.spec.ngram import NgramDrafter

from .conftest import run_cli

V = 64
pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(seed: int, n: int = 10):
    """Prompts of 3-20 tokens with repeats (n-gram matches), budgets 1-24: requests end at different steps, so slots
    free up out of order and later steps run over slots that are not one window."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(V) for _ in range(rng.randint(2, 8))]
        out.append(((base * rng.randint(1, 3))[: rng.randint(3, 20)], rng.choice([1, 2, 5, 13, 24])))
    return out


def _engine(target, cfg, compile_cpu, slots=6, decode_kernel=None, **kw):
    """A batched engine of ``slots``; compiled, its own stack unless ``stack`` is given (``decode_kernel``: whether its
    one-row passes take the C++ decode attention; None: where it builds)."""
    drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min, max_matches=1, max_slots=slots) if cfg.drafter else None
    if compile_cpu and "stack" not in kw:
        from specpilot.model.compiled_stack import CompiledStack

        kw["stack"] = CompiledStack(target, decode_kernel=decode_kernel)
    return BatchEngine(target, cfg, drafter, eos_ids=[], max_num_seqs=slots, compile_cpu=compile_cpu, **kw)


def _kernel_calls(monkeypatch) -> list:
    """Record each call of the C++ decode attention (its rows and requests) in the returned list."""
    from specpilot.kernels import cpu_attention

    calls, real = [], cpu_attention.tree_decode_attention
    monkeypatch.setattr(cpu_attention, "tree_decode_attention",
                        lambda q, kp, vp, layer, slots, *a: calls.append((q.shape[0], slots.numel()))
                        or real(q, kp, vp, layer, slots, *a))
    return calls


KERNEL = [False, pytest.param(True, marks=pytest.mark.skipif(
    not __import__("specpilot.kernels.cpu_attention", fromlist=["x"]).available(), reason="no C++ toolchain"))]


def _windows(eng):
    """Record whether each pass's slots formed a window (``Prepared.window``) in ``eng.windows`` (with 6 slots, two
    requests in slots 0 and 5 do not: a window holds at most as many padding slots as requests)."""
    eng.windows = []
    fb = eng.stack.forward_batch

    def spy(tokens, positions, pool, rows, *a, **k):
        eng.windows.append(rows.prepared(tokens.device).window is not None)
        return fb(tokens, positions, pool, rows, *a, **k)

    eng.stack.forward_batch = spy


@pytest.mark.parametrize("kernel", KERNEL, ids=["masked", "kernel"])
@pytest.mark.parametrize("cfg", [SystemConfig.ar(), SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4,
                                                                  top_k=1)], ids=["ar", "ngram_chain"])
def test_compiled_engine_equals_eager_token_for_token(tiny_models, cfg, kernel, monkeypatch):
    target = tiny_models[0]
    reqs = _requests(3, n=14)
    # first six at once, the middle four ending first: slots 0 and 5 left running, not one window
    gap = [(p, n) for (p, _), n in zip(_requests(4, n=6), (20, 2, 1, 3, 1, 20))]
    eager, eng = _engine(target, cfg, False), _engine(target, cfg, True, decode_kernel=kernel)
    _windows(eng)
    kernel_calls = _kernel_calls(monkeypatch)
    from torch._dynamo.utils import counters

    from specpilot.model import compiled_stack as cs

    # the stack's two graphs; the decode attention's for 2 and 4 query rows per KV head (the tiny target has 2
    # query heads a KV head), keys a window of the pool or gathered; with the C++ kernel on, it takes those passes
    # (1 and 2 rows a request)
    assert eng.compile_shapes() == 2 + (0 if kernel else 2 * 2)
    eng.stack.decode_min_requests = 2  # its default (16) is past these engines' slots
    graphs = counters["stats"]["unique_graphs"]
    entry, attended = cs._TABLES[eng.stack.owner], []
    compiled_attend = entry.attend
    entry.attend = lambda qg, *a: attended.append(qg.shape[2]) or compiled_attend(qg, *a)
    for batch in (gap, reqs):
        prompts, budgets = [p for p, _ in batch], [n for _, n in batch]
        want = [g.tokens for g in eager.generate_all(prompts, budgets)]
        assert [g.tokens for g in eng.generate_all(prompts, budgets)] == want
    assert counters["stats"]["unique_graphs"] == graphs  # compile_shapes compiled every graph the run needed
    if kernel:  # passes of up to 3 rows a request took the kernel (a single request too), wider ones the SDPA
        assert (1, 1) in kernel_calls and any(b > 1 for _, b in kernel_calls) and not attended
        if cfg.drafter:  # verification passes of several rows a request too
            assert any(r > b for r, b in kernel_calls)
    else:  # decode passes took the compiled attention, wider ones the SDPA
        assert not kernel_calls and attended and set(attended) <= {2, 4}
    assert eng.stack.passes["eager"] == 0 and eng.stack.passes["compiled"] == len(eng.windows)
    assert True in eng.windows and False in eng.windows  # slots as one window, and gathered
    if cfg.drafter:
        assert eng.exact_passes < sum(n for _, n in reqs + gap)  # drafts were accepted: steps verified several rows


def test_three_query_heads_a_kv_head_compile_nothing_after_warm_up(tmp_path):
    """A Llama target (no q/k norms: the queries are a slice of the fused projection, not contiguous) with SmolLM2's
    grouping of 3 query heads a KV head: after ``compile_shapes`` a run of 1, then 5 requests compiles no graph (the
    decode attention's query rows once came with other strides than the warm-up's, and Dynamo compiled it again in
    a served step: 4 s in the first 8-request round on SmolLM2), tokens as the eager engine's."""
    from torch._dynamo.utils import counters

    from specpilot.model.checkpoint import load_model

    from .conftest import save_tiny

    target = load_model(save_tiny(tmp_path / "g3", "llama", hidden=96, layers=2, heads=6, kv_heads=2, seed=3))
    cfg = SystemConfig.ar()
    eager, eng = _engine(target, cfg, False), _engine(target, cfg, True, decode_kernel=False)
    assert eng.compile_shapes() == 2 + 2  # the stack's two graphs; 3 rows a KV head, keys a window or gathered
    eng.stack.decode_min_requests = 2
    graphs = counters["stats"]["unique_graphs"]
    from specpilot.model import compiled_stack as cs

    entry, calls = cs._TABLES[eng.stack.owner], []
    compiled_attend = entry.attend
    entry.attend = lambda *a: calls.append(1) or compiled_attend(*a)
    for reqs in (_requests(6, n=1), _requests(7, n=5)):
        prompts, budgets = [p for p, _ in reqs], [n for _, n in reqs]
        want = [g.tokens for g in eager.generate_all(prompts, budgets)]
        assert [g.tokens for g in eng.generate_all(prompts, budgets)] == want
    assert calls and counters["stats"]["unique_graphs"] == graphs


def test_engines_of_other_sizes_share_one_stack_and_compile_it_once(tiny_models):
    """A pilot builds an engine per system and batch size: given one stack (``Deployment.batch_system`` shares one
    per target), engines of 2, 5 and 9 slots (other pool shapes) after the first's ``compile_shapes`` compile no
    graph of the stack, tokens as the eager engine's."""
    from torch._dynamo.utils import counters

    target = tiny_models[0]
    first = _engine(target, SystemConfig.ar(), True, slots=3)
    first.compile_shapes()
    graphs = counters["stats"]["unique_graphs"]
    cfg = SystemConfig(drafter="ngram", tree="chain", nodes=3, depth=3, top_k=1)
    for slots in (2, 5, 9):
        eng, eager = _engine(target, cfg, False, slots=slots, stack=first.stack), _engine(target, cfg, False, slots)
        assert eng.stack is first.stack
        reqs = _requests(slots, n=6)
        prompts, budgets = [p for p, _ in reqs], [n for _, n in reqs]
        assert [g.tokens for g in eng.generate_all(prompts, budgets)] == \
            [g.tokens for g in eager.generate_all(prompts, budgets)]
    assert counters["stats"]["unique_graphs"] == graphs and first.stack.passes["compiled"] > 0
    with pytest.raises(ValueError, match="another target"):
        _engine(tiny_models[1], SystemConfig.ar(), False, stack=first.stack)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_masked_attention_equals_the_sdpa(compiled):
    """The decode attention against the masked SDPA on a pool-like view: padding slots that see one key, requests
    of several lengths, rows that see their own keys only up to themselves."""
    import torch.nn.functional as F

    from specpilot.model.compiled_stack import masked_attention

    g = torch.Generator().manual_seed(0)
    w, kvh, rows, s, d = 5, 3, 4, 19, 16
    pool = torch.randn(7, 2, 24, kvh, d, generator=g)  # [slots, layers, slot_len, KVH, D]
    idx = torch.tensor([6, 0, 3, 2, 4])  # the requests' slots, not one window: gathered
    qg = torch.randn(w, kvh, rows, d, generator=g)
    lens = torch.tensor([19, 7, 1, 12, 16])
    mask = (torch.arange(s)[None, None, :] < (lens[:, None, None] - rows + 1 + torch.arange(rows)[None, :, None]))
    mask = (mask | (torch.arange(s) == 0))[:, None]  # the padding slot (length 1) sees key 0
    keys, vals = pool[idx, 0, :s], pool[idx, 1, :s]
    want = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask)
    fn = torch.compile(masked_attention, dynamic=True) if compiled else masked_attention
    torch.testing.assert_close(fn(qg, keys, vals, mask), want, rtol=1e-5, atol=1e-6)  # gathered
    window = pool[1:6, 0, :s], pool[1:6, 1, :s]  # a view of the pool
    want = F.scaled_dot_product_attention(qg, window[0].transpose(1, 2), window[1].transpose(1, 2), attn_mask=mask)
    torch.testing.assert_close(fn(qg, *window, mask), want, rtol=1e-5, atol=1e-6)


def test_prompts_riding_in_a_step_and_a_second_owner(tiny_models):
    """Prompt admission (prompts in a decode step's pass) through the compiled stack of a second engine on the same
    target: its own owner and graphs, the same tokens as eager."""
    target = tiny_models[0]
    cfg = SystemConfig(drafter="ngram", tree="chain", nodes=3, depth=3, top_k=1, prompt_admission=64)
    reqs = _requests(11, n=8)
    prompts, budgets = [p for p, _ in reqs], [n for _, n in reqs]
    want = [g.tokens for g in _engine(target, cfg, False, slots=3).generate_all(prompts, budgets)]
    a, b = _engine(target, cfg, True, slots=3), _engine(target, cfg, True, slots=3)
    assert a.stack.owner != b.stack.owner
    assert [g.tokens for g in b.generate_all(prompts, budgets)] == want
    assert b.stack.passes["compiled"] > 0 and a.stack.passes == {"compiled": 0, "eager": 0}


def test_one_pass_equals_the_eager_pass_and_writes_the_same_kv(tiny_models):
    """Hidden states and K/V of single passes (a window of slots, and slots 0 and 3 of 2 requests, gathered) against
    the eager pass on a copy of the pool."""
    from specpilot.model.compiled_stack import CompiledStack

    target = tiny_models[0]
    stack = CompiledStack(target)
    g = torch.Generator().manual_seed(0)
    for rows in (BatchRows([0, 1], [0, 0], [3, 5], [None, None]), BatchRows([0, 3], [0, 0], [4, 2], [None, None])):
        pool_a, pool_b = target.new_pool(5, 16), target.new_pool(5, 16)
        r = sum(rows.counts)
        tokens = torch.randint(0, V, (r,), generator=g)
        positions = torch.cat([torch.arange(c) for c in rows.counts])
        with torch.inference_mode():
            want = target.forward_batch(tokens, positions, pool_a, rows, kernel=False)
            got = stack.forward_batch(tokens, positions, pool_b, BatchRows(*[list(x) for x in (
                rows.slots, rows.starts, rows.counts, rows.masks)]), kernel=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fused norms and RoPE: float32 rounding
        torch.testing.assert_close(pool_b.k, pool_a.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool_b.v, pool_a.v, rtol=1e-5, atol=1e-5)
    assert stack.passes == {"compiled": 2, "eager": 0}


def test_passes_the_stack_cannot_take_run_eagerly_and_are_counted(tiny_models):
    """A block drafter reads target features from inside the stack: every pass falls back to the eager one (counted),
    outputs as the eager engine's; a profiled pass falls back too."""
    from specpilot.model.compiled_stack import CompiledStack
    from specpilot.spec.block import BlockDrafter, BlockNet

    from .blockutil import tiny_config

    target = tiny_models[0]
    torch.manual_seed(0)
    net = BlockNet(tiny_config(target))
    cfg = SystemConfig(drafter="block", tree="best_first", nodes=4, depth=3, top_k=2)
    reqs = _requests(5, n=5)
    prompts, budgets = [p for p, _ in reqs], [n for _, n in reqs]
    outs = []
    for compiled in (False, True):
        d = BlockDrafter(net, target, top_k=2, max_len=16, max_slots=3)
        eng = BatchEngine(target, cfg, d, eos_ids=[], max_num_seqs=3, compile_cpu=compiled)
        outs.append([g.tokens for g in eng.generate_all(prompts, budgets)])
    assert outs[0] == outs[1]
    assert eng.stack.passes["compiled"] == 0 and eng.stack.passes["eager"] == eng.exact_passes + eng.prefill_passes > 0

    class Prof:
        def region(self, name):
            import contextlib

            return contextlib.nullcontext()

    stack = CompiledStack(target)
    with torch.inference_mode():
        stack.forward_batch(torch.tensor([1, 2]), torch.arange(2), target.new_pool(2, 8),
                            BatchRows([0], [0], [2], [None]), prof=Prof())
    assert stack.passes == {"compiled": 0, "eager": 1}


def test_an_owner_row_goes_with_close_and_with_the_owner(tiny_models):
    from specpilot.model import compiled_stack as cs

    stack = cs.CompiledStack(tiny_models[0])
    key = stack.owner
    assert len(cs._TABLES[key].forwards) == 4 * tiny_models[0].args.num_layers
    stack.close()
    assert key not in cs._TABLES
    with pytest.raises(KeyError), torch.inference_mode():
        stack.forward_batch(torch.tensor([1]), torch.arange(1), tiny_models[0].new_pool(1, 4),
                            BatchRows([0], [0], [1], [None]))
    stack = cs.CompiledStack(tiny_models[0])
    key = stack.owner
    del stack
    import gc

    gc.collect()
    assert key not in cs._TABLES


def test_off_the_cpu_is_refused_in_one_line(tiny_dirs, monkeypatch, capsys):
    """A target off the CPU (the meta device stands in for CUDA here) is refused by the engine; ``serve --compile``
    on a CUDA device is refused before anything loads."""
    from specpilot.model.checkpoint import build_model, read_args

    with torch.device("meta"):
        meta = build_model(read_args(tiny_dirs[0])).fuse_projections()
    with pytest.raises(SpecPilotError, match=r"compiles the CPU pass only \(the target is on meta"):
        BatchEngine(meta, SystemConfig.ar(), None, eos_ids=[], max_num_seqs=1, max_len=8, compile_cpu=True)
    code, out, err = run_cli(monkeypatch, capsys, "serve", "--compile", "--device", "cuda", "--port", "0")
    assert code == 2 and "--compile compiles the CPU pass only" in err and len(err.strip().splitlines()) == 1


def test_serve_compile_builds_warms_and_serves_the_compiled_engine(monkeypatch, capsys):
    """run_server with ``compile_cpu`` (``serve --compile``): the engine's graphs compiled before it serves, its
    start line says which decode attention it runs, and its outputs equal the eager engine's (the bundled target,
    AR)."""
    import socket

    import uvicorn

    from specpilot.engine.deployment import Deployment
    from specpilot.serve import app as serve_app
    from specpilot.serve.cli import run_server
    from specpilot.zoo import bundled_target_dir

    seen = {}
    monkeypatch.setattr(serve_app, "create_app", lambda ctx: seen.update(ctx=ctx) or object())
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)
    with socket.socket() as sock:
        run_server(sock, bundled_target_dir(), None, SystemConfig.ar(), "cpu", 2, None, "m", None, 8 << 20, "warning",
                   "127.0.0.1", 128, compile_cpu=True)
    eng = seen["ctx"].driver.engine
    assert eng.stack is not None and eng.stack.passes == {"compiled": 2, "eager": 0}  # compile_shapes ran
    kind = "C++" if eng.stack.decode_kernel else "PyTorch"
    assert f"compiled stack ({kind} decode attention)" in capsys.readouterr().err
    prompts = [[5, 17, 300, 42, 9, 11], [1000, 7, 7, 7, 250]]
    want = [g.tokens for g in Deployment(bundled_target_dir()).batch_system(SystemConfig.ar(), 2, max_len=128)
            .generate_all(prompts, 8)]
    assert [g.tokens for g in eng.generate_all(prompts, 8)] == want


def test_serve_compile_without_a_cxx_compiler_is_one_line(monkeypatch):
    """Inductor's CPU backend needs a C++ compiler: where it finds none, ``serve --compile`` stops with one line
    saying so, not Inductor's traceback."""
    import socket

    from specpilot.serve.cli import run_server
    from specpilot.zoo import bundled_target_dir

    class InvalidCxxCompiler(RuntimeError):  # Inductor's exception, by name and message
        pass

    def no_compiler(self):
        raise InvalidCxxCompiler("No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, 'c++')")

    monkeypatch.setattr(BatchEngine, "compile_shapes", no_compiler)
    with socket.socket() as sock, pytest.raises(SpecPilotError, match="--compile needs a working C\\+\\+ compiler"):
        run_server(sock, bundled_target_dir(), None, SystemConfig.ar(), "cpu", 2, None, "m", None, 8 << 20, "warning",
                   "127.0.0.1", 128, compile_cpu=True)
