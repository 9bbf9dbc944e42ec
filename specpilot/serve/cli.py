"""``specpilot serve``: a batched speculative system behind the OpenAI-compatible API (:mod:`specpilot.serve.app`).

The main app registers :func:`serve` as a command (``specpilot.cli``). The system is either given by options
(``--target``, ``--drafter``, ``--tree``, ...; as ``specpilot generate`` takes them) or read from a system sealed by
``specpilot pilot`` (``--system system.json``, or a ``pilot --batch`` output directory served as one system per
batch size; :mod:`specpilot.serve.system_file`). Bad options are a
:class:`~specpilot.errors.SpecPilotError` (one line, exit status 2), raised before anything is loaded where they can
be. Safe by default: it listens on 127.0.0.1 unless ``--host`` says otherwise; ``--api-key`` (or the environment
variable ``SPECPILOT_API_KEY``) makes every ``/v1`` request without ``Authorization: Bearer KEY`` a 401.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from specpilot.errors import SpecPilotError, validation_message

if TYPE_CHECKING:
    from specpilot.config import SystemConfig
    from specpilot.engine.load_plan import LoadPlan


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` before the model loads, so a busy port fails at once; it listens only
    once the model is loaded (:func:`run_server`, just before serving), so a client that connects while the model
    loads or compiles is refused at once instead of hanging until then.

    Raises:
        SpecPilotError: the address cannot be resolved or bound (one line).
    """
    if not 0 <= port <= 65535:
        raise SpecPilotError(f"--port must lie in 0-65535, got {port}")
    sock = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise SpecPilotError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _stack_state(stack) -> str:
    """The start line's words for the compiled stack (``--compile``): which decode attention it runs."""
    if stack is None:
        return ""
    return f"compiled stack ({'C++' if stack.decode_kernel else 'PyTorch'} decode attention), "


def _prefix_state(engine, asked: bool | None) -> str:
    """The startup line's prefix reuse: ``on``, or ``off`` and why (``asked``: ``--[no-]enable-prefix-caching``)."""
    if engine.prefix is not None:
        return "on"
    if asked is False:
        return "off (--no-enable-prefix-caching)"
    if engine.feature_layers:
        return "off (the drafter reads every prompt row's target features)"
    if not engine.pool.prefix_reuse:
        return "off (a hybrid target's recurrent state is not per position)"
    return "off (the default on CUDA's batch-invariant path; --enable-prefix-caching turns it on)"


def serve(
    target: Optional[Path] = typer.Option(None, help="Target checkpoint directory (default: the bundled target; "
                                          "with --system, its deployment's target, which --target replaces)."),
    drafter: Optional[str] = typer.Option(None, help="none | ngram | draft_model | block | eagle3 (default ngram; "
                                          "eagle3 has no bundled drafter: give its --drafter-path)."),
    drafter_path: Optional[Path] = typer.Option(None, help="Draft model, block or EAGLE-3 drafter checkpoint "
                                                "directory."),
    tree: Optional[str] = typer.Option(None, help="chain | best_first | ddtree_marginal | eagle2_topk | sequoia "
                                       "(default chain)."),
    nodes: Optional[int] = typer.Option(None, help="Tree budget N (drafted nodes per request per exact pass; "
                                        "default 6)."),
    depth: Optional[int] = typer.Option(None, help="Draft positions per step (default 6)."),
    top_k: Optional[int] = typer.Option(None, help="Candidates per draft position (a chain takes 1; default 4)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default float32)."),
    device: Optional[str] = typer.Option(None, help="torch device (default cpu; with --system, its deployment's)."),
    system: Optional[Path] = typer.Option(None, help="A system sealed by `specpilot pilot` (its system.json), or "
                                          "the output directory of `specpilot pilot --batch`: its per-size systems, "
                                          "each step running the one sealed nearest its load. Serves them on their "
                                          "deployment (--target may replace its target path); not with the other "
                                          "system options. A config that does not match its file's seal is refused."),
    allow_edited_system: bool = typer.Option(False, help="With --system: serve a file whose config does not match "
                                             "its seal (edited after sealing, or unsealed), with a warning."),
    max_num_seqs: Optional[int] = typer.Option(None, help="Requests decoded at once (engine slots); more wait in a "
                                               "queue (default 16; with --system, the batch size it was sealed "
                                               "for where the file names one: system_n4.json, 4; a directory: the "
                                               "largest)."),
    max_model_len: Optional[int] = typer.Option(None, help="Context per request in tokens, prompt + output (default: "
                                                "the target's, at most 4096). Every slot's K/V cache is allocated "
                                                "for it at start: float32 SmolLM2, 32 slots x 4096 is 6 GB."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (default: this machine only)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, envvar="SPECPILOT_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1 requests (/health "
                                               "and /metrics stay open)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model name of the API (default: the target "
                                                    "directory's name; specpilot-bundled for the bundled target)."),
    chat_template: Optional[Path] = typer.Option(None, help="A Jinja chat template file (default: the tokenizer's; "
                                                 "without one, a plain 'role: content' fallback, named in "
                                                 "/v1/models)."),
    max_body_bytes: int = typer.Option(8 << 20, help="Largest request body accepted (bytes); larger ones get a 413."),
    log_level: str = typer.Option("info", help="uvicorn's log level (critical, error, warning, info, debug)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: as `generate` picks them: 1 on a "
                                          "CPU device with <= 2 cores, else torch's default)."),
    speculative_disable_by_batch_size: Optional[int] = typer.Option(
        None, help="Draft only in steps with at most this many running requests; larger steps decode as AR (vLLM's "
                   "disable_by_batch_size). Default: always draft."),
    enable_prefix_caching: Optional[bool] = typer.Option(
        None, "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Start a prompt from the K/V of the longest prefix a running or finished request left (>= 16 tokens; "
             "dense targets, drafters that read no target features). Default: on, except on CUDA's batch-invariant "
             "fused path, where a reused prefix would change the later rows' bits."),
    compile_cpu: bool = typer.Option(False, "--compile", help="CPU only: run each batched pass's decoder stack as one "
                                     "torch.compile graph (norms, RoPE, SiLU and residuals fused; the same tokens). "
                                     "Its two graphs compile at start: about a minute for SmolLM2 on 2 cores. Needs a "
                                     "C++ compiler; its decode attention is a C++ kernel built on first use (~20 s, "
                                     "cached; needs ninja, else PyTorch's attention)."),
):
    """Serve a speculative system over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics).
    Greedy only: temperature > 0, n > 1 and other sampling fields get a 400."""
    from specpilot.cli import CHECKPOINT_DRAFTERS
    from specpilot.config import SystemConfig
    from specpilot.spec.trees import BUILDERS

    if max_num_seqs is not None and max_num_seqs < 1:
        raise SpecPilotError(f"--max-num-seqs must be at least 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 2:
        raise SpecPilotError(f"--max-model-len must be at least 2, got {max_model_len}")
    if max_body_bytes < 1024:
        raise SpecPilotError(f"--max-body-bytes must be at least 1024, got {max_body_bytes}")
    if api_key is not None and not api_key.strip():
        raise SpecPilotError("--api-key (or SPECPILOT_API_KEY) is empty")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        raise SpecPilotError(f"--log-level: unknown level {log_level!r}")
    if threads is not None and threads < 1:
        raise SpecPilotError(f"--threads must be at least 1, got {threads}")
    if speculative_disable_by_batch_size is not None and speculative_disable_by_batch_size < 1:
        raise SpecPilotError(f"--speculative-disable-by-batch-size must be at least 1, got "
                             f"{speculative_disable_by_batch_size}")
    if compile_cpu and (device or "cpu").split(":")[0] != "cpu":
        raise SpecPilotError(f"--compile compiles the CPU pass only, not {device}'s (CUDA runs its graphs per bucket)")
    if system is not None:
        given = [f"--{n}" for n, v in (("drafter", drafter), ("drafter-path", drafter_path),
                                        ("tree", tree), ("nodes", nodes), ("depth", depth), ("top-k", top_k),
                                        ("dtype", dtype)) if v is not None]
        if given:
            raise SpecPilotError(f"--system gives the whole system: drop {', '.join(given)}")
        from specpilot.serve.system_file import load_sealed
        from specpilot.zoo import bundled_target_dir

        sealed = load_sealed(system, target, allow_edited_system, max_num_seqs, device)
        cfg, tdir, ddir, device, max_num_seqs = (sealed.config, sealed.tdir, sealed.ddir, sealed.device,
                                                 sealed.max_num_seqs)
        print(f"specpilot serve: target {tdir} ({sealed.source})", file=sys.stderr)
        if tdir == bundled_target_dir():
            served_model_name = served_model_name or "specpilot-bundled"
    else:
        from specpilot.cli import _default_dirs

        if allow_edited_system:
            raise SpecPilotError("--allow-edited-system is for --system FILE (a sealed system's file)")

        drafter, tree = drafter or "ngram", tree or "chain"
        if drafter not in ("none", "ngram", *CHECKPOINT_DRAFTERS):
            raise SpecPilotError(f"unknown drafter {drafter!r} (choose none, ngram, draft_model, block or eagle3)")
        if tree not in BUILDERS:
            raise SpecPilotError(f"unknown tree builder {tree!r} (choose {', '.join(BUILDERS)})")
        if drafter == "none" and tree != "chain":
            raise SpecPilotError(f"--tree {tree} needs a drafter: --drafter none is plain AR decoding")
        if drafter_path is not None and drafter in ("none", "ngram"):
            raise SpecPilotError(f"--drafter-path is for --drafter draft_model, block or eagle3; drafter "
                                 f"{drafter!r} reads no checkpoint")
        if drafter_path is not None and not drafter_path.is_dir():  # before the target loads, naming the option
            raise SpecPilotError(f"--drafter-path {drafter_path}: not a directory (a {drafter} drafter checkpoint)")
        try:
            cfg = SystemConfig(drafter=drafter, tree=tree, nodes=6 if nodes is None else nodes,
                               depth=6 if depth is None else depth,
                               top_k=1 if tree == "chain" else (4 if top_k is None else top_k),
                               dtype=dtype or "float32")
        except ValueError as e:
            raise SpecPilotError(f"invalid option: {validation_message(e)}") from None
        bundled = target is None
        tdir, ddir = _default_dirs(target, drafter, drafter_path)
        if ddir is not None:
            cfg = cfg.model_copy(update={"drafter_path": str(ddir)})
        device = device or "cpu"
        served_model_name = served_model_name or ("specpilot-bundled" if bundled else None)
        max_num_seqs = 16 if max_num_seqs is None else max_num_seqs
    sock = _listen(host, port)
    try:
        import torch

        from specpilot.pilot.setup import available_cores, choose_threads

        n_threads = choose_threads(device, threads, available_cores(), torch.get_num_threads())[0]
        if device.split(":")[0] == "cpu" and threads is not None and threads >= available_cores():
            print(f"specpilot serve: warning: {threads} torch threads on {available_cores()} cores: every parallel op "
                  "waits for all of them, so another job on this machine can slow the server 10x or more (the default "
                  "on <= 2 cores is 1 thread)", file=sys.stderr)
        torch.set_num_threads(n_threads)
        run_server(sock, tdir, ddir, cfg, device, max_num_seqs, api_key, served_model_name or tdir.resolve().name,
                   chat_template, max_body_bytes, log_level, host, max_model_len, speculative_disable_by_batch_size,
                   enable_prefix_caching, compile_cpu)
    finally:
        sock.close()


def in_passing_thread(fn):
    """``fn()`` run in a thread that ends when it returns; its result returned, its exception raised here.

    Why: the engine steps in its own thread (:class:`~specpilot.serve.driver.EngineDriver`). Torch work in this
    (main) thread would leave an OpenMP team alive beside the engine thread's, and with more OpenMP threads than
    cores libgomp stops spin-waiting, so each of the engine's parallel regions wakes its workers through the kernel:
    SmolLM2 on 2 cores, 32 requests, 2 threads, in-process: 236 tok/s stepped from the thread that loaded it, 160 from
    another thread (CPU/wall 1.99 vs 1.44), 183-186 when the loading thread had ended. A thread's team ends with it."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="specpilot-load")
    t.start()
    try:
        t.join()
    except KeyboardInterrupt:  # Ctrl-C while loading: the loader sits in torch's C++ and cannot be stopped, and an
        # interpreter shutting down around it dies in std::terminate (exit 134); nothing is served yet, so leave now
        print("interrupted while loading the model; exiting", file=sys.stderr, flush=True)
        os._exit(130)
    if "err" in box:
        raise box["err"]
    return box["out"]


def run_server(sock, tdir, ddir, cfg: SystemConfig | LoadPlan, device, max_num_seqs, api_key, name, chat_template,
               max_body_bytes, log_level, host, max_len: int | None = None, spec_max_requests: int | None = None,
               prefix_caching: bool | None = None, compile_cpu: bool = False) -> None:
    """Load the deployment, build the batched system (``cfg``: one system, or a plan of one per batch size), and
    serve on ``sock`` until interrupted. ``max_len``: the
    engine's context in tokens (None: the target's ``max_position_embeddings``, at most 4096); ``spec_max_requests``,
    ``prefix_caching`` and ``compile_cpu``: the engine's (:class:`~specpilot.engine.batch.BatchEngine`; with
    ``compile_cpu`` its graphs are compiled before the socket serves, :meth:`~specpilot.engine.batch.BatchEngine.
    compile_shapes`).

    Raises:
        SpecPilotError: a checkpoint that cannot be loaded, a target without tokenizer files, ``max_len`` past the
            target's positions, a system the batched engine cannot build, an unreadable chat template (one line each).
    """
    from specpilot.engine.deployment import Deployment, check_device
    from specpilot.engine.load_plan import LoadPlan
    from specpilot.serve.app import Server, create_app
    from specpilot.serve.chat import choose_template
    from specpilot.serve.driver import EngineDriver
    from specpilot.serve.metrics import ServerMetrics
    from specpilot.serve.run import ServeContext

    first = cfg.configs[0] if isinstance(cfg, LoadPlan) else cfg  # a plan's systems share the target's dtype
    label = f"by load: {cfg.describe()}" if isinstance(cfg, LoadPlan) else cfg.label()

    def load():
        dep = Deployment(tdir, ddir, dtype=first.dtype, device=check_device(device))
        if dep.tokenizer is None:
            raise SpecPilotError(f"{tdir} has no tokenizer files: the server needs one to read and write text")
        if max_len is not None and max_len > dep.target.args.max_position_embeddings:
            raise SpecPilotError(f"--max-model-len {max_len} is past the target's "
                                 f"{dep.target.args.max_position_embeddings} positions")
        engine = dep.batch_system(cfg, max_num_seqs, max_len=max_len, spec_max_requests=spec_max_requests,
                                  prefix_caching=prefix_caching, compile_cpu=compile_cpu)
        engine.capture_graphs()  # CUDA graphs of every bucket before the first request, not inside it
        if compile_cpu:
            print("specpilot serve: compiling the batched pass (--compile) ...", file=sys.stderr, flush=True)
            try:
                engine.compile_shapes()  # its graphs before the first request, not inside it
            except Exception as e:  # Inductor's CPU backend without a working C++ compiler: one line, not its trace
                if "C++ compiler" not in str(e) and "CxxCompiler" not in type(e).__name__ + str(e):
                    raise
                raise SpecPilotError("--compile needs a working C++ compiler (torch.compile's CPU backend; g++ or "
                                     "CXX): none was found; serve without --compile") from None
        return dep, engine

    dep, engine = in_passing_thread(load)
    template, source = choose_template(dep.tokenizer, chat_template)
    metrics = ServerMetrics(name)
    ctx = ServeContext(driver=EngineDriver(engine, metrics), tokenizer=dep.tokenizer, model_name=name,
                       max_len=int(engine.max_len), vocab_size=int(dep.target.args.vocab_size),
                       eos_ids=frozenset(dep.eos_ids()), metrics=metrics, chat_template=template, chat_source=source,
                       api_key=api_key, max_body_bytes=max_body_bytes)
    addr = sock.getsockname()
    try:  # now, not in uvicorn's start (a traceback there): another server may have started on the port meanwhile
        sock.listen(2048)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        ctx.driver.stop()
        raise SpecPilotError(f"cannot listen on {host}:{addr[1]}: another process started listening on it while the "
                             "model loaded") from None
    drafting = "" if spec_max_requests is None else f" (drafting while at most {spec_max_requests} run)"
    slots = f"{engine.num_slots} slot{'s' if engine.num_slots != 1 else ''}"
    print(f"specpilot serve: {name!r} ({label}) at http://{host}:{addr[1]}/v1, {slots}"
          f"{drafting}, prefix reuse {_prefix_state(engine, prefix_caching)}, "
          f"{_stack_state(engine.stack)}"
          f"context {engine.max_len} tokens, chat template: {source}, API key: {'required' if api_key else 'off'}",
          file=sys.stderr)
    if source == "fallback":
        print("specpilot serve: the tokenizer has no chat template; chat requests use the plain 'role: content' "
              "fallback (pass --chat-template FILE for the model's own)", file=sys.stderr)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"specpilot serve: warning: listening on {host} without --api-key: anyone who can reach this port can "
              "use it", file=sys.stderr)
    try:
        Server(create_app(ctx), ctx, log_level=log_level).run(sockets=[sock])
    finally:  # a forced quit (a second Ctrl-C) skips the app's shutdown, which stops the engine thread: stop it
        ctx.driver.stop()  # here, or the interpreter exits inside one of its torch calls and aborts (exit 134)
