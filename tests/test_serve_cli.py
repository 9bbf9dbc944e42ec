"""``specpilot serve``'s system options: an EAGLE-3 drafter served by the batched engine (``--drafter eagle3``, or a
sealed system naming one); ``--system`` files whose config does not match their seal refused (or served with a
warning under ``--allow-edited-system``); ``--target`` replacing a system file's recorded target path."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from specpilot.config import SystemConfig
from specpilot.model.checkpoint import read_args
from specpilot.zoo import bundled_target_dir

from .conftest import run_cli


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    """An untrained EAGLE-3 drafter for the bundled target (reading its layers 0, 2 and 5; draft vocabulary the first
    512 ids): serving is lossless whatever it drafts."""
    from specpilot.spec.eagle3 import save_eagle3
    from specpilot.spec.train_eagle3 import new_eagle3_net

    torch.manual_seed(0)
    net = new_eagle3_net(read_args(bundled_target_dir()), (0, 2, 5), torch.arange(512))
    return save_eagle3(net, tmp_path_factory.mktemp("eagle3") / "e3", dtype=torch.float32)


def _capture(monkeypatch):
    from specpilot.serve import cli as serve_cli

    seen = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda sock, tdir, ddir, cfg, device, *a: seen.update(
        tdir=tdir, ddir=ddir, cfg=cfg, device=device))
    return seen


def test_serve_drafter_eagle3_options(monkeypatch, capsys, eagle3_dir, tmp_path):
    """--drafter eagle3 takes its directory (--drafter-path) as generate does; without one, or with another kind of
    drafter directory, it is one line before anything loads; a sealed eagle3 system keeps its drafter directory."""
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--drafter", "eagle3")
    assert code == 2 and "--drafter eagle3 needs --drafter-path DIR" in err and err.count("\n") == 1, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--drafter", "eagle3", "--drafter-path",
                           str(bundled_target_dir().parent / "drafter"))
    assert code == 2 and "use --drafter draft_model" in err and err.count("\n") == 1, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--drafter", "bogus")
    assert code == 2 and "draft_model, block or eagle3" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--drafter", "eagle3", "--drafter-path",
                           str(tmp_path / "missing"))
    assert code == 2 and "--drafter-path" in err and "not a directory" in err and err.count("\n") == 1, err
    seen = _capture(monkeypatch)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--drafter", "eagle3", "--drafter-path", str(eagle3_dir),
                           "--tree", "best_first", "--nodes", "8", "--depth", "4", "--top-k", "3", "--port", "0")
    assert code == 0, err
    assert (seen["tdir"], seen["ddir"], seen["cfg"].drafter, seen["cfg"].drafter_path) == \
        (bundled_target_dir(), eagle3_dir, "eagle3", str(eagle3_dir))
    cfg = SystemConfig(drafter="eagle3", tree="best_first", nodes=8, depth=4, top_k=3, drafter_path=str(eagle3_dir))
    f = tmp_path / "system.json"
    f.write_text(json.dumps({"config": cfg.model_dump(), "seal": cfg.seal(), "deployment": {
        "target": str(bundled_target_dir()), "drafter": str(eagle3_dir), "device": "cpu"}}))
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0, err
    assert (seen["ddir"], seen["cfg"]) == (eagle3_dir, cfg)


def test_the_served_eagle3_engine_equals_ar(monkeypatch, capsys, eagle3_dir):
    """run_server builds the batched engine with the EAGLE-3 drafter (prefix reuse off: it reads target features,
    as the startup line says), and its outputs equal plain AR decoding."""
    import uvicorn

    from specpilot.engine.deployment import Deployment
    from specpilot.serve import app as serve_app
    from specpilot.serve.cli import run_server

    seen = {}
    monkeypatch.setattr(serve_app, "create_app", lambda ctx: seen.update(ctx=ctx) or object())
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)
    cfg = SystemConfig(drafter="eagle3", tree="best_first", nodes=6, depth=3, top_k=2, drafter_path=str(eagle3_dir))
    with socket.socket() as sock:
        run_server(sock, bundled_target_dir(), eagle3_dir, cfg, "cpu", 2, None, "m", None, 8 << 20, "warning",
                   "127.0.0.1", 256)
    eng = seen["ctx"].driver.engine
    assert eng.drafter.kind == "eagle3" and eng.prefix is None
    assert "prefix reuse off (the drafter reads every prompt row's target features)" in capsys.readouterr().err
    prompts = [[5, 17, 300, 42, 9, 11], [1000, 7, 7, 7, 250]]
    ar = Deployment(bundled_target_dir()).batch_system(SystemConfig.ar(), 2, max_len=256)
    want = [g.tokens for g in ar.generate_all(prompts, 12)]
    assert [g.tokens for g in eng.generate_all(prompts, 12)] == want


def _system_file(path, cfg: SystemConfig, **over) -> None:
    """A system file as `specpilot pilot` writes it (config, label, seal, deployment), with ``over`` applied."""
    d = {"config": cfg.model_dump(), "label": cfg.label(), "seal": cfg.seal(),
         "deployment": {"target": str(bundled_target_dir()), "drafter": "ngram", "device": "cpu", "batch": 1}}
    path.write_text(json.dumps({**d, **over}))


def test_serve_system_checks_its_seal(monkeypatch, capsys, tmp_path):
    """A config edited after sealing (another nodes) or a file without a seal is refused in one line naming the file,
    unless --allow-edited-system (then a warning, and the config served as it is now)."""
    seen = _capture(monkeypatch)
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)
    f = tmp_path / "system.json"
    _system_file(f, cfg)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0 and seen["cfg"] == cfg and "warning" not in err, err
    edited = cfg.apply({"nodes": 16})
    _system_file(f, cfg, config=edited.model_dump())  # the seal of nodes=8 kept
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--system {f} has a config that does not match its seal" in err and "--allow-edited-system" in err, err
    seen.clear()
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0", "--allow-edited-system")
    assert code == 0 and seen["cfg"] == edited, err
    assert "warning" in err and "does not match its seal" in err and edited.label() in err, err
    _system_file(f, cfg, seal=None)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 2 and "has no 'seal'" in err and str(f) in err and err.count("\n") == 1, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--allow-edited-system", "--port", "0")
    assert code == 2 and "--allow-edited-system is for --system" in err, err


def test_serve_system_target_can_be_replaced(monkeypatch, capsys, tmp_path):
    """--target with --system serves the file's config on that target instead of the recorded absolute path (a
    file from another machine); the served target is logged either way; the other system options stay refused."""
    seen = _capture(monkeypatch)
    cfg = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)
    f = tmp_path / "system.json"
    moved = tmp_path / "models" / "target"
    _system_file(f, cfg, deployment={"target": str(moved), "drafter": "ngram", "device": "cpu"})
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 0 and seen["tdir"] == moved and f"specpilot serve: target {moved} (from {f})" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--target", str(bundled_target_dir()),
                           "--port", "0")
    assert code == 0 and (seen["tdir"], seen["cfg"]) == (bundled_target_dir(), cfg), err
    assert f"specpilot serve: target {bundled_target_dir()} (--target; {f} names {moved})" in err, err
    _system_file(f, cfg, deployment={"device": "cpu"})
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--port", "0")
    assert code == 2 and "names no target" in err and "--target DIR" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--target", str(bundled_target_dir()),
                           "--port", "0")
    assert code == 0 and seen["tdir"] == bundled_target_dir(), err
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(f), "--target", str(bundled_target_dir()),
                           "--drafter", "ngram")
    assert code == 2 and "drop --drafter" in err and "--target" not in err.split("drop", 1)[1], err


def test_ctrl_c_while_loading_exits_130_with_one_line(tmp_path):
    """Ctrl-C while the server loads the model: the loader thread is in torch's C++ and cannot be stopped, and an
    interpreter shutting down around it used to die in std::terminate (exit 134). Now: one line, exit 130, at once."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import time\nfrom specpilot.serve.cli import in_passing_thread\nprint('loading', flush=True)\n"
            "in_passing_thread(lambda: time.sleep(60))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "loading"
    time.sleep(0.3)
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and time.time() - t0 < 10
    assert err.strip() == "interrupted while loading the model; exiting"


def test_serve_a_batch_pilot_directory_follows_the_load(monkeypatch, capsys, tmp_path):
    """--system DIR (a `pilot --batch` output): every system_n<N>.json becomes one system of a load plan, the slots
    default to the largest size, each file's seal is checked; files naming other targets, two drafter checkpoints or
    an empty directory are refused in one line. A directory holding only system.json serves that file."""
    from specpilot.engine.load_plan import LoadPlan

    seen = _capture(monkeypatch)
    monkeypatch.setattr("specpilot.serve.cli.run_server", lambda sock, tdir, ddir, cfg, device, slots, *a: seen.update(
        tdir=tdir, ddir=ddir, cfg=cfg, device=device, slots=slots))
    one = SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)
    d = tmp_path / "pilot"
    d.mkdir()
    for n, cfg in ((1, one), (16, SystemConfig.ar()), (4, SystemConfig.stock("ngram", depth=4))):
        _system_file(d / f"system_n{n}.json", cfg, batch_size=n)
    _system_file(d / "system.json", one)  # the smallest size's copy, as the pilot writes it: not read
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 0, err
    plan = seen["cfg"]
    assert isinstance(plan, LoadPlan) and plan.sizes == (1, 4, 16) and seen["slots"] == 16
    assert plan.configs == (one, SystemConfig.stock("ngram", depth=4), SystemConfig.ar())
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0", "--max-num-seqs", "8")
    assert code == 0 and seen["slots"] == 8 and "warning: 8 slots" in err and "(16) never run" in err, err
    _system_file(d / "system_n04.json", SystemConfig.ar(), batch_size=4)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "system_n04.json and system_n4.json" in err, err
    (d / "system_n04.json").unlink()
    _system_file(d / "system_n4.json", SystemConfig.stock("ngram", depth=4), batch_size=16)  # another size's content
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "says batch_size 16 but is named for 4" in err, err
    _system_file(d / "system_n4.json", one.apply({"nodes": 4}), seal=one.seal(), batch_size=4)  # edited
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "system_n4.json has a config that does not match" in err, err
    _system_file(d / "system_n4.json", SystemConfig.stock("ngram", depth=4), batch_size=4,
                 deployment={"target": "/elsewhere", "drafter": "ngram", "device": "cpu"})
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "different targets" in err, err
    _system_file(d / "system_n4.json", SystemConfig(dtype="bfloat16"), batch_size=4)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "dtype values differ" in err, err
    for n in (1, 4, 16):
        (d / f"system_n{n}.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 0 and seen["cfg"] == one and seen["slots"] == 16, err  # the lone system.json
    (d / "system.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--system", str(d), "--port", "0")
    assert code == 2 and err.count("\n") == 1 and "without system_n<N>.json" in err, err


def test_the_served_plan_runs_each_size_and_equals_ar(monkeypatch):
    """run_server builds the batched engine from a plan (the start line names each size's system) and its outputs
    equal plain AR decoding."""
    import uvicorn

    from specpilot.engine.deployment import Deployment
    from specpilot.engine.load_plan import LoadPlan
    from specpilot.serve import app as serve_app
    from specpilot.serve.cli import run_server

    seen = {}
    monkeypatch.setattr(serve_app, "create_app", lambda ctx: seen.update(ctx=ctx) or object())
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)
    plan = LoadPlan.from_sizes({1: SystemConfig(drafter="ngram", tree="best_first", nodes=6, depth=4, top_k=2),
                                3: SystemConfig.ar()})
    with socket.socket() as sock:
        run_server(sock, bundled_target_dir(), None, plan, "cpu", 3, None, "m", None, 8 << 20, "warning",
                   "127.0.0.1", 256)
    eng = seen["ctx"].driver.engine
    assert eng.plan == plan and [d.kind for d in eng.drafters] == ["ngram"]
    prompts = [[5, 17, 300, 42, 9, 11] * 3, [1000, 7, 7, 7, 250] * 3, [3, 4, 5] * 4]
    ar = Deployment(bundled_target_dir()).batch_system(SystemConfig.ar(), 1, max_len=256)
    want = [g.tokens for g in ar.generate_all(prompts, 12)]
    assert [g.tokens for g in eng.generate_all(prompts, 12)] == want


def test_the_port_is_taken_before_loading_but_refuses_connections_until_serving():
    """``serve`` binds its port first (a busy port fails at once, one line) but listens only when it serves: a client
    connecting while the model loads is refused, not left hanging."""
    from specpilot.errors import SpecPilotError
    from specpilot.serve.cli import _listen

    sock = _listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        sock.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(SpecPilotError, match=f"cannot listen on 127.0.0.1:{port}"):
            _listen("127.0.0.1", port)
    finally:
        sock.close()
