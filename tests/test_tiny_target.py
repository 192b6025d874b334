"""The embedded tiny target: a real Qwen3 LM that loads offline and beats a unigram baseline."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from dflash_trainer.tiny_target import TINY_TARGET_DIR, load_tiny_target
from dflash_trainer.tiny_target.build import BuildSettings, build
from dflash_trainer.tiny_target.corpus import is_held_out, iter_stdlib_files, load_split, stdlib_root
from dflash_trainer.tiny_target.evaluate import encode_files, heldout_metrics, unigram_counts


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_target()


def test_ships_as_a_small_standard_hf_folder():
    names = {p.name for p in TINY_TARGET_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    total = sum(p.stat().st_size for p in TINY_TARGET_DIR.iterdir())
    assert total <= 25 * 1024 * 1024, f"tiny target is {total / 2**20:.1f} MiB"
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET_DIR, local_files_only=True)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.num_hidden_layers >= 6


def test_tokenizer_specials_and_chat_template(tiny):
    _, tok = tiny
    assert len(tok) <= 8192
    mask = tok.convert_tokens_to_ids("<|MASK|>")
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id == mask
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"):
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert ids == [tok.convert_tokens_to_ids(special)], special  # one token, never split
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x = 1"}], tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nx = 1<|im_end|>\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    code = "def f(x):\n    return {'a': [x, 1.5]}  # ünïcode\n"
    assert tok.decode(tok(code, add_special_tokens=False)["input_ids"]) == code  # byte-level: lossless


def test_split_is_deterministic_disjoint_and_path_based():
    files = [p.relative_to(stdlib_root()).as_posix() for p in iter_stdlib_files()]
    held = [f for f in files if is_held_out(f)]
    assert 0.02 < len(held) / len(files) < 0.10
    train_paths = {f.relpath for f in load_split("train", limit=300)}
    held_paths = {f.relpath for f in load_split("held_out", limit=30)}
    assert not train_paths & held_paths
    assert all(is_held_out(p) for p in held_paths)
    assert [f.relpath for f in load_split("held_out", limit=30)] == sorted(held_paths)
    manifest = json.loads((TINY_TARGET_DIR / "build_manifest.json").read_text())
    assert manifest["corpus"]["held_out_files"] > 0 and "sha256" in manifest["corpus"]["split_rule"]


def test_beats_unigram_baseline_on_held_out_code(tiny):
    model, tok = tiny
    held = encode_files(tok, load_split("held_out", limit=12), max_tokens_per_file=384)
    unigram = unigram_counts(encode_files(tok, load_split("train", limit=150)), len(tok))
    m = heldout_metrics(model, held, window=384, unigram=unigram)
    assert m["tokens"] > 2000
    assert m["accuracy"] > m["unigram_accuracy"] + 0.15, m
    assert m["loss"] < m["unigram_loss"] - 1.0, m


def test_greedy_generation_runs_offline(tiny):
    model, tok = tiny
    ids = tok("import os\nimport sys\n\n\ndef main(", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 12 or out[0, -1].item() in (0, tok.convert_tokens_to_ids("<|im_end|>"))
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_build_is_deterministic_given_seed(tmp_path):
    settings = BuildSettings(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        seq_len=32,
        batch_size=2,
        max_steps=3,
        warmup_steps=1,
        eval_every=2,
        eval_windows=2,
        # determinism of every stage, not quality: few files (held-out scoring was most of a build at 25)
        files_limit=6,
        threads=1,
    )
    a = build(tmp_path / "a", settings)
    b = build(tmp_path / "b", settings)
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert a["held_out"] == b["held_out"] and a["training"]["stopped_by"] == "max_steps"
    assert AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True).mask_token == "<|MASK|>"
    changed = build(tmp_path / "c", BuildSettings(**{**settings.__dict__, "seed": 1}))
    wc = load_file(tmp_path / "c" / "model.safetensors")
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert changed["settings"]["seed"] == 1
