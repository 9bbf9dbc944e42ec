"""The model-zoo recipe on a tiny CPU run: corpus -> tokenizer -> tokens -> train -> loadable checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from specpilot.errors import SpecPilotError
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir
from specpilot.zoo.cli import app
from specpilot.zoo.corpus import EOS, DEFAULT_GSM8K, build_corpus, stdlib_files

TINY = ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=2",
        "num_key_value_heads=1", "head_dim=32"]
PROV_FIELDS = ["command", "data", "tokens", "seed", "steps", "batch_size", "seq_len", "final_train_loss",
               "train_wall_s", "device", "torch_version", "transformers_version", "git_commit"]


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    """A small GSM8K-format train file (the test does not depend on ../shared)."""
    p = tmp_path_factory.mktemp("g") / "gsm8k_train.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
             "answer": f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3}.\n#### {2 * i + 3}"}
            for i in range(300)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory, gsm8k_file):
    """Run the split pipeline through the CLI with a tiny model; returns the work directory."""
    w = tmp_path_factory.mktemp("zoo")
    r = CliRunner()

    def ok(args):
        res = r.invoke(app, args)
        assert res.exit_code == 0, (res.output, res.exception)
        return res

    ok(["corpus", "--out", str(w), "--gsm8k", str(gsm8k_file), "--max-chars", "400000"])
    ok(["tokenizer", "--corpus", str(w / "corpus.txt"), "--out", str(w / "tokenizer"), "--vocab-size", "512"])
    ok(["tokenize", "--corpus", str(w / "corpus.txt"), "--tokenizer", str(w / "tokenizer"), "--out", str(w / "tokens.npy")])
    args = ["train", "--preset", "target", "--tokens", str(w / "tokens.npy"), "--tokenizer", str(w / "tokenizer"),
            "--out", str(w / "target"), "--steps", "40", "--batch-size", "8", "--seq-len", "64", "--device", "cpu",
            "--eval-every", "20", "--quiet"]
    for o in TINY:
        args += ["--override", o]
    ok(args)
    return w


def test_corpus_deterministic_and_recorded(gsm8k_file):
    t1, m1 = build_corpus(gsm8k=gsm8k_file, seed=3, max_chars=50_000)
    t2, m2 = build_corpus(gsm8k=gsm8k_file, seed=3, max_chars=50_000)
    assert t1 == t2 and m1["sha256"] == m2["sha256"] and len(t1) == 50_000
    assert m1["python_version"] and m1["stdlib_files"] > 100 and m1["gsm8k_documents"] == 300
    files = stdlib_files()
    assert all(not ({"test", "tests", "idlelib", "lib2to3", "site-packages"} & set(f.parts)) for f in files)
    with pytest.raises(SpecPilotError):
        build_corpus(gsm8k=gsm8k_file.parent / "missing.jsonl")


def test_corpus_never_holds_eval_prompts(gsm8k_file):
    from specpilot.data import load_requests

    text, _ = build_corpus(gsm8k=gsm8k_file, seed=0)
    for r in load_requests("humaneval", 5) + load_requests("gsm8k", 5):
        assert r.text.strip()[:200] not in text


def test_default_gsm8k_path_points_to_shared():
    assert DEFAULT_GSM8K.name == "gsm8k_train.jsonl" and DEFAULT_GSM8K.parent.name == "corpus"


def test_tokenizer_roundtrip_and_chat(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built / "tokenizer"))
    assert tok.eos_token == EOS and tok.pad_token == EOS
    s = "class A:\n\tdef f(self, x):\n        return  x  # é ✓\n\n\n"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    arr = np.load(built / "tokens.npy")
    assert arr.dtype == np.uint16 and arr.max() < len(tok)
    assert json.loads((built / "tokens.json").read_text())["corpus"]["sha256"]


def test_checkpoint_loads_and_matches_transformers(built):
    from transformers import AutoModelForCausalLM

    from specpilot.model.checkpoint import load_model, load_tokenizer

    d = built / "target"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["eos_token_id"] == 0 and cfg["tie_word_embeddings"]
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ours = load_model(d, "float32")
    ids = torch.from_numpy(np.load(built / "tokens.npy")[:48].astype(np.int64))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
        got = ours.logits(ours(ids, torch.arange(len(ids)), ours.new_cache(len(ids)), 0))
    assert (ref - got).abs().max().item() < 1e-4
    assert load_tokenizer(d).eos_token_id == 0


def test_provenance_and_loss(built):
    d = built / "target"
    prov = json.loads((d / "provenance.json").read_text())
    for k in PROV_FIELDS:
        assert k in prov, k
    c = prov["data"]["corpus"]
    assert c["python_version"] and len(c["sha256"]) == 64 and c["stdlib_files"] > 100
    assert prov["steps_done"] == 40 and prov["saved_dtype"] == "bfloat16"
    assert prov["final_train_loss"] < prov["initial_train_loss"] - 0.3
    assert (d / "loss.png").stat().st_size > 1000
    assert (d / "tokenizer.json").is_file() and (d / "model.safetensors").is_file()


def test_presets_fit_size_budget():
    from transformers import Qwen3ForCausalLM

    from specpilot.zoo.train import make_config

    with torch.device("meta"):
        n = {p: sum(x.numel() for x in Qwen3ForCausalLM(make_config(p, 4096, 0)).parameters()) for p in ("target", "drafter")}
    assert 4e6 < n["target"] < 8e6 and n["drafter"] < n["target"] / 3
    assert 2 * (n["target"] + n["drafter"]) < 30e6  # bf16 bytes
    with pytest.raises(SpecPilotError):
        make_config("huge", 4096, 0)


def test_path_command():
    r = CliRunner()
    res = r.invoke(app, ["path"])
    assert res.exit_code == 0
    assert f"target: {bundled_target_dir()}" in res.output and f"drafter: {bundled_drafter_dir()}" in res.output
    j = json.loads(r.invoke(app, ["path", "--json"]).output)
    assert j["target"].endswith("zoo/assets/target") and j["drafter"].endswith("zoo/assets/drafter")
