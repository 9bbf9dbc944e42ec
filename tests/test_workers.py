"""Worker processes and the external agent (§3.3; candidate code must never run in the controller's
process): systems built and timed in separate processes
(one device A B B A, two devices swapped), clean errors when a worker fails, and ``--agent`` patches going
through the same controller and token forcing (scripted agent: tests/agents/scripted_agent.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from specpilot.config import SystemConfig
from specpilot.engine.deployment import Deployment
from specpilot.pilot import controller as ctl
from specpilot.pilot.agent import prepare_worktree, run_agent, write_brief
from specpilot.pilot.dispatch import AgentContext, Dispatch, agent_round, plan_dispatch, stock_commit
from specpilot.pilot.memory import Entry, Evidence, Memory, default_repo
from specpilot.pilot.setup import build_requests
from specpilot.pilot.workers import (DeploymentSpec, Worker, WorkerError, WorkerExecutor, WorkerPool, WorkerSession,
                                     WorkerSystem)
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .conftest import phase0_of, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
STOCK = SystemConfig.stock("ngram")
BEST = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)
AGENT = f"{sys.executable} {Path(__file__).parent / 'agents' / 'scripted_agent.py'}"


@pytest.fixture(scope="module")
def dep():
    return Deployment(bundled_target_dir(), bundled_drafter_dir())


@pytest.fixture(scope="module")
def spec():
    return DeploymentSpec(str(bundled_target_dir()), str(bundled_drafter_dir()))


@pytest.fixture(scope="module")
def reqs(dep):
    return [r for r in build_requests(dep, per_benchmark=2, max_new_tokens=16) if r.benchmark in ("humaneval", "mbpp")]


@pytest.fixture(scope="module")
def p0(dep, reqs):
    return phase0_of(dep, reqs, STOCK)


def one(spec, *devices):
    return WorkerExecutor(spec, devices or ("cpu",), threads=1, timeout_s=300)


def test_worker_builds_runs_and_matches_in_process(dep, spec, reqs):
    w = Worker(spec, "cpu", threads=1, timeout_s=300)
    try:
        assert Path(w.ready()["specpilot"]) == Path(ctl.__file__).parents[1]  # the stock tree
        assert w.request({"op": "build", "config": BEST.model_dump()})["outside"] == []
        local = dep.system(BEST)
        for r in reqs[:2]:
            got = w.request({"op": "run", "prompt": list(r.prompt_ids), "max_new": r.max_new_tokens})
            assert got["tokens"] == list(local.generate(list(r.prompt_ids), r.max_new_tokens).tokens)
            assert got["seconds"] > 0
        with pytest.raises(WorkerError, match="ValidationError"):  # a bad config: its error text comes back
            w.request({"op": "build", "config": {**BEST.model_dump(), "nodes": 0}})
        with pytest.raises(WorkerError, match="DrafterError"):
            w.request({"op": "build", "config": SystemConfig.stock("block").model_dump()})
        assert w.request({"op": "run", "prompt": [5, 6, 7], "max_new": 4})["tokens"]  # still usable
    finally:
        w.close()


@pytest.mark.parametrize("init, match", [("raise RuntimeError('boom in candidate')", r"RuntimeError: boom in candidate"),
                                         ("import os; os._exit(3)", r"died \(exit code 3\)")])
def test_worker_that_raises_or_dies_gives_a_clean_error(tmp_path, spec, init, match):
    (tmp_path / "specpilot").mkdir()
    (tmp_path / "specpilot" / "__init__.py").write_text(init + "\n")
    w = Worker(spec, "cpu", tree=str(tmp_path), threads=1, timeout_s=120)
    try:
        with pytest.raises(WorkerError, match=match) as e:
            w.ready()
        assert "\n" not in str(e.value)
    finally:
        w.close()



def test_a_worker_never_closed_leaves_no_process_or_log(spec):
    w = Worker(spec, "cpu", threads=1, timeout_s=300)
    proc, log = w.proc, Path(w._log.name)
    assert log.is_file() and proc.poll() is None
    del w  # dropped without close (a pool left open): the finalizer stops it and removes its log
    import gc

    gc.collect()
    assert proc.wait(timeout=10) is not None and not log.exists()


def test_dispatch_returns_a_failed_judgement_in_its_place(spec):
    def dies(ex):
        raise WorkerError("worker 1 on cpu died (exit code 3): boom")

    out = Dispatch("workers", [("cpu",), ("cpu",)], spec).map([dies, lambda ex: ex.devices])
    assert isinstance(out[0], WorkerError) and out[1] == ("cpu",)  # the pilot rejects that candidate, goes on


def test_one_device_workers_a_vs_a_is_not_approved(p0, dep, spec, reqs):
    log = []
    j = p0.controller.judge(WorkerSystem(STOCK.model_dump()), WorkerSystem(STOCK.model_dump()), reqs,
                            rng=random.Random(3), progress=lambda: log.append(1), executor=one(spec))
    assert not j.verdict.approved and len(log) == 4 * len(reqs)
    run = j.run
    assert not run.outputs_differ and not run.nondeterministic_a and run.outside_a == run.outside_b == ()
    local = dep.system(STOCK)  # the workers' tokens are the in-process engine's
    assert run.outputs_a[0][0] == tuple(local.generate(list(run.prompts[0][0]), reqs[0].max_new_tokens).tokens)


FAKE_DEPLOYMENT = """
import threading, time


class _Args:
    vocab_size = 50


class _Target:
    args = _Args()


class _Gen:
    def __init__(self, tokens):
        self.tokens = tokens


class _System:
    def __init__(self, cfg):
        self.cfg, self.calls = cfg, 0

    def generate(self, prompt, max_new):
        self.calls += 1
        if self.cfg["mode"] == "thread":  # work left running after the call returns
            threading.Thread(target=time.sleep, args=(3,), name="helper", daemon=True).start()
        tok = self.calls % 50 if self.cfg["mode"] == "random" else sum(prompt) % 50
        return _Gen([tok] * max_new)


class Deployment:
    def __init__(self, *args, **kw):
        self.target = _Target()

    def system(self, cfg):
        return _System(cfg)
"""


def fake_tree(root: Path) -> str:
    """A source tree whose ``specpilot`` is the fake deployment above; returns its path."""
    pkg = root / "specpilot"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def SystemConfig(**kw):\n    return kw\n")
    (pkg / "engine" / "deployment.py").write_text(FAKE_DEPLOYMENT)
    return str(root)


def test_worker_reports_threads_left_running_and_nondeterminism(tmp_path):
    fake_tree(tmp_path)
    rs = [ctl.Req("b", i, (1 + i, 2, 3), 4) for i in range(2)]
    run = ctl.paired_run(WorkerSystem({"mode": "thread"}, str(tmp_path)), WorkerSystem({"mode": "random"}, str(tmp_path)),
                         rs, 50, rng=random.Random(0), executor=one(DeploymentSpec("unused")))
    assert run.outside_a == ("helper",) and run.outside_b == ()  # seen in the worker, reported back
    assert run.nondeterministic_b and not run.nondeterministic_a  # the recheck ran in the worker
    assert "threads running" in ctl.approve(run, 0.0, True).reason


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_systems_of_one_tree_share_a_worker_per_device(tmp_path, devices):
    x, y = fake_tree(tmp_path / "x"), fake_tree(tmp_path / "y")
    ex = one(DeploymentSpec("unused"), *devices)
    same = ex.open({"a": WorkerSystem({"mode": "same"}, x), "b": WorkerSystem({"mode": "random"}, x)})
    other = ex.open({"a": WorkerSystem({"mode": "same"}, x), "b": WorkerSystem({"mode": "same"}, y)})
    try:
        assert len(same.workers) == len(devices) and len(other.workers) == 2 * len(devices)
        for s in (same, other):
            assert set(s.build()) == {f"{n}@{i}" for n in "ab" for i in range(len(devices))}
        # one worker, one system per key: b counts its own calls, a answers from the prompt
        assert [same.run([("b", "b@0")], [1, 2], 3)[0][0] for _ in range(2)] == [(1, 1, 1), (2, 2, 2)]
        assert same.run([("a", "a@0")], [1, 2], 3)[0][0] == (3, 3, 3)
        if len(devices) == 2:  # the other device's worker has its own b
            assert same.run([("a", "a@0"), ("b", "b@1")], [1, 2], 3)[1][0] == (1, 1, 1)
    finally:
        same.close()
        other.close()


def test_two_devices_swapped_paired_run(p0, spec, reqs):
    ex = one(spec, "cpu", "cpu")
    s = object.__new__(WorkerSession)
    s.names, s.swapped = ["a", "b"], True
    assert s.schedule(0) == [[("a", "a@0"), ("b", "b@1")]] and s.schedule(1) == [[("a", "a@1"), ("b", "b@0")]]
    rs = reqs[:2]
    run = ctl.paired_run(WorkerSystem(STOCK.model_dump()), WorkerSystem(BEST.model_dump()), rs,
                         p0.controller.vocab_size, rng=random.Random(4), executor=ex)
    assert not run.outputs_differ and not run.nondeterministic_a and not run.nondeterministic_b  # lossless, both devices
    assert len(run.tps_a) == len(rs) and all(t > 0 for t in run.tps_a + run.tps_b) and run.gain > 0
    assert all(len(v) == 2 for v in run.prompts)  # one variant on each placement


def test_dispatch_rule():
    assert plan_dispatch("cpu").mode == "local"
    spec = DeploymentSpec("t")
    d = plan_dispatch("cpu", ("cpu", "cpu"), cpu_threads=2, dep=spec)
    assert d.mode == "workers" and d.slots == [("cpu", "cpu")] and d.threads == 1  # two devices: one paired slot
    d = plan_dispatch("cpu", ("cpu", "cpu", "cpu"), paired=False, dep=spec)
    assert d.slots == [("cpu",)] * 3
    assert plan_dispatch("cuda:0", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), dep=spec).slots == [(f"cuda:{i}",) for i in range(4)]
    assert plan_dispatch("cpu", agent=True, dep=spec).mode == "workers"
    assert plan_dispatch("cuda:0", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"), paired=True,
                         dep=spec).slots == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    with pytest.raises(Exception, match="even number of devices"):  # an odd device is not silently dropped
        plan_dispatch("cuda:0", ("cuda:0", "cuda:1", "cuda:2"), paired=True, dep=spec)
    with pytest.raises(Exception, match="local"):
        plan_dispatch("cpu", ("cpu", "cpu"), executor="local")


# -- the external agent ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_code(tmp_path_factory):
    """A code incumbent: stock + a planted 4 ms sleep per exact pass, made by the scripted agent, as a
    patch entry (the test's "earlier round")."""
    repo = default_repo()
    commit, _ = stock_commit(repo)
    work = tmp_path_factory.mktemp("slow")
    base = prepare_worktree(repo, commit, [], work / "tree")
    p = run_agent(AGENT + " slow {brief} {worktree}", write_brief(work, {}), work / "tree", base, 60)
    ev = Evidence(gain=1.0, lower_bound=1.0, bar=0.01, sigma=0.0)
    entry = Entry(id="r0-slow", title="planted slowdown", mechanism="test", kind="patch", delta=p.patch,
                  evidence=ev, base={"commit": commit}, system={"tree": p.tree})
    return repo, commit, entry, str(work / "tree")


def ctx(p0, reqs, tmp_path, mode, slow_code=None, timeout=120):
    repo, commit = default_repo(), stock_commit(default_repo())[0]
    code, tree = ([slow_code[2]], slow_code[3]) if slow_code else ([], None)
    return AgentContext(f"{AGENT} {mode} {{brief}} {{worktree}}", timeout, tmp_path / "agent" / "round-1", repo,
                        commit, code, [e.id for e in code], STOCK, tree, p0.controller, reqs, p0.controller.sigma,
                        {"cost_model": {"factors": {"tree": 1.5}}, "gap": 1.5}, {"device": "cpu"})


def test_agent_patch_approved_and_reproduced_by_memory_check(p0, spec, reqs, tmp_path, slow_code, monkeypatch, capsys):
    res = agent_round(1, ctx(p0, reqs, tmp_path, "unslow", slow_code), plan_dispatch("cpu", agent=True, dep=spec))
    assert res.row["approved"], res.row["reason"]
    assert res.row["outputs_differ"] is False and res.row["gain"] > 1.1
    assert res.entry.kind == "patch" and res.entry.requires == ["r0-slow"]
    assert res.patch.files == ("specpilot/engine/engine.py",)
    assert (tmp_path / "agent" / "round-1" / "brief.md").is_file()
    mem = Memory(tmp_path / "memory")
    mem.add(slow_code[2])
    mem.add(res.entry)
    code, out, _ = run_cli(monkeypatch, capsys, "memory", "check", str(tmp_path / "memory"), "--json")
    assert code == 0 and [r["status"] for r in __import__("json").loads(out)] == ["reproduced", "reproduced"]


def test_agent_allowlist_is_the_package_layout_never_the_pilot():
    """An agent may patch the engine, the model, the drafters / lattices / trees, W12, the certified head and the
    shared kernels (every one a directory of the package), never the pilot (controller, forcing, workers, memory)."""
    import specpilot
    from specpilot.pilot.agent import ALLOWED, FORBIDDEN

    root = Path(specpilot.__file__).parents[1]
    assert set(ALLOWED) == {f"specpilot/{d}/" for d in ("engine", "model", "spec", "w12", "head", "kernels")}
    assert all((root / p).is_dir() for p in ALLOWED), [p for p in ALLOWED if not (root / p).is_dir()]
    assert FORBIDDEN == ("specpilot/pilot/",) and not any(p.startswith(FORBIDDEN) for p in ALLOWED)


@pytest.mark.parametrize("mode, timeout, reason", [
    ("controller", 60, "outside the allowlist: specpilot/pilot/controller.py"),
    ("nothing", 60, "empty patch"),
    ("fail", 60, "agent failed (exit code 3): scripted agent: giving up"),
    ("hang", 2, "agent timed out after 2 s"),
])
def test_agent_rejected_before_any_run(p0, spec, reqs, tmp_path, mode, timeout, reason):
    res = agent_round(1, ctx(p0, reqs, tmp_path, mode, timeout=timeout), plan_dispatch("cpu", agent=True, dep=spec))
    assert not res.row["approved"] and res.entry is None and reason in res.row["reason"]
    assert res.row["gain"] is None  # never judged


def test_agent_patch_biasing_logits_is_rejected_by_token_forcing(p0, spec, reqs, tmp_path):
    res = agent_round(1, ctx(p0, reqs, tmp_path, "bias"), plan_dispatch("cpu", agent=True, dep=spec))
    assert res.row["outputs_differ"] is True and res.row["forcing_passed"] is False
    assert not res.row["approved"] and "token forcing failed" in res.row["reason"] and res.entry is None


@pytest.mark.parametrize("args, msg", [
    (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': give comma-separated devices"),
    (["--devices", "cpu,cuda:7"], "device 'cuda:7' requested but no CUDA GPU"),
    (["--agent", "my-agent {brief}"], "--agent must be a command template containing {worktree}"),
    (["--agent", "a {worktree}", "--agent-timeout", "0"], "--agent-timeout must be positive"),
    (["--executor", "local", "--devices", "cpu,cpu"], "--executor local runs one device in-process"),
    (["--executor", "fast"], "--executor must be auto, local or workers"),
])
def test_pilot_cli_bad_device_or_agent_flags_are_one_line_errors(monkeypatch, capsys, tmp_path, args, msg):
    import torch

    if "cuda:7" in args[1] and torch.cuda.is_available():
        pytest.skip("a GPU machine")
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--out", str(tmp_path / "r"), *args)
    assert code == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_pool_reuses_stock_workers_across_runs_and_drops_failed_ones(p0, spec, reqs):
    """Two paired runs through one :class:`WorkerPool` load the deployment once (A and B, both stock code,
    share a worker), not twice; a session that failed returns nothing to the pool; ``close`` stops the idle
    workers."""
    pool = WorkerPool()
    ex = WorkerExecutor(spec, ("cpu",), 1, 600.0, pool)
    rs = reqs[:1]
    pids = []
    for seed in (5, 6):
        ctl.paired_run(WorkerSystem(STOCK.model_dump()), WorkerSystem(BEST.model_dump()), rs,
                       p0.controller.vocab_size, rng=random.Random(seed), executor=ex)
        idle = [w for ws in pool._idle.values() for w in ws]
        assert len(idle) == 1
        pids.append(sorted(w.proc.pid for w in idle))
    assert pids[0] == pids[1]  # the same process served both runs
    taken = [w.proc for ws in pool._idle.values() for w in ws]
    bad = WorkerSystem({**STOCK.model_dump(), "nodes": 0})  # invalid config: the build fails in the worker
    with pytest.raises(WorkerError):
        ctl.paired_run(WorkerSystem(STOCK.model_dump()), bad, rs, p0.controller.vocab_size,
                       rng=random.Random(7), executor=ex)
    assert not any(pool._idle.values()) and all(p.poll() is not None for p in taken)  # failed session: closed
    ctl.paired_run(WorkerSystem(STOCK.model_dump()), WorkerSystem(STOCK.model_dump()), rs, p0.controller.vocab_size,
                   rng=random.Random(8), executor=ex)
    idle = [w.proc for ws in pool._idle.values() for w in ws]
    assert len(idle) == 1 and all(p.poll() is None for p in idle)
    pool.close()
    assert all(p.poll() is not None for p in idle) and not any(pool._idle.values())
