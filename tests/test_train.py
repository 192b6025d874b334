"""The trainer on the tiny target: it learns, resumes bit-identically after SIGKILL, saves on
SIGTERM, skips corrupted checkpoints and non-finite steps."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import tolerances
import torch

from dflash_trainer.config import load_config
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.checkpoint import find_resume_checkpoint, verify_checkpoint
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.step import draft_loss, drafter_step, produce_row_features
from dflash_trainer.training.trainer import Trainer


def write_data(path, n=40, chars=900):
    records = []
    for f in load_split("train", limit=n):
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"Continue `{f.relpath}`:\n"},
                    {"role": "assistant", "content": f.text[:chars]},
                ]
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SMALL = [
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.seq_len=256",
    "data.max_anchors=8",
    "train.max_steps=24",
    "train.save_every=6",
    "train.eval_every=12",
    "train.lr=2e-3",
    "data.max_eval_rows=2",
]


def config(tmp_path, data, *extra):
    return load_config(["tiny-demo"], [*SMALL, f"data.train_files=[{data}]", f"output_dir={tmp_path / 'run'}", *extra])


def train_cli(cfg_args, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_trainer.cli",
            "train",
            "--config",
            "tiny-demo",
            "--no-progress",
            *[a for s in cfg_args for a in ("--set", s)],
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_training_reduces_loss_and_writes_a_checkpoint(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    cfg = config(tmp_path, data, "train.max_steps=30", "train.eval_every=30", "train.save_every=30")
    target, tok, train_rows, eval_rows, report = prepare(cfg)
    trainer = Trainer(
        cfg, target, tok, train_rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False
    )
    before = trainer.evaluate()
    after = trainer.fit()
    steps = losses(tmp_path / "run")
    first, last = sum(steps[s] for s in range(1, 6)) / 5, sum(steps[s] for s in range(26, 31)) / 5
    assert last < first - 0.5, (first, last)
    assert after["tau"] > before["tau"]
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000030"
    assert verify_checkpoint(ckpt) is None
    assert {"drafter.safetensors", "drafter_config.json", "trainer_state.pt", "run.yaml"} <= set(os.listdir(ckpt))


def fused_and_reference_in_float64(target, drafter, row, cfg, params):
    """One real step's loss and the gradients of ``params`` (parameters of ``drafter``), fused and
    reference, with the target (its features, the frozen head the drafter shares) and the drafter in
    float64, asserting that they agree within rounding; returns the fused loss's metrics.

    Both paths compute the same network and loss on the same float64 inputs in another operation order
    (chunked, fused epilogue vs the dense reference), so they differ by rounding alone:
    ``tolerances.float64_forward_error`` of the drafter's layers (the loss as one more) with the widest
    reduction (the vocabulary, or the rows, or 5 H), relative to the magnitudes compared. A wrong or
    missing loss term moves them by 1e-3 relative or more."""
    target.model.double()  # in place: the drafter's shared embedding and head follow
    drafter = drafter.double()
    feats = produce_row_features(target, row, 0, cfg)
    batch = drafter_step(drafter, feats, cfg, train=True)
    fused, metrics = draft_loss(drafter, batch, cfg)
    g_fused = torch.autograd.grad(fused, params, retain_graph=True)
    ref, _ = draft_loss(drafter, batch, cfg, reference=True)
    g_ref = torch.autograd.grad(ref, params)
    assert fused.dtype == ref.dtype == torch.float64
    inner = max(drafter.lm_head_weight.shape[0], batch.labels.numel(), 5 * drafter.spec.hidden_size)
    bound = tolerances.float64_forward_error(layers=drafter.spec.num_layers + 1, inner=inner)
    assert abs(fused.item() - ref.item()) <= bound * abs(ref.item())
    for a, r in zip(g_fused, g_ref):
        assert r.abs().max() > 0
        assert torch.allclose(a, r, atol=bound * r.abs().max().item(), rtol=0)
    return metrics


@pytest.mark.parametrize(
    "recipe", [(), ("loss.position_weights=dpace",), ("loss.position_weights=dpace", "loss.tv_weight=0.4")]
)
def test_fused_and_reference_losses_agree_on_a_real_step(tmp_path, recipe):
    data = write_data(tmp_path / "data.jsonl", n=8)
    cfg = config(tmp_path, data, "loss.kl_weight=0.15", "loss.cap_weight=0.1", *recipe)
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    fused_and_reference_in_float64(target, trainer.drafter, rows[0], cfg, [trainer.drafter.fc.weight])


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    full = [*SMALL, f"data.train_files=[{data}]", f"output_dir={tmp_path / 'full'}"]
    proc = train_cli(full)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    reference = losses(tmp_path / "full")
    assert len(reference) == 24

    cut = [*SMALL, f"data.train_files=[{data}]", f"output_dir={tmp_path / 'cut'}"]
    proc = train_cli(cut)
    ckpt = tmp_path / "cut" / "checkpoints" / "step-0000012"
    deadline = time.time() + 600
    while not (ckpt / "checksums.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(losses(tmp_path / "cut"))
    assert killed_at < 24
    proc = train_cli(cut, "--resume", "auto")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "resumed from" in out
    resumed = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    start = int(out.split("at step ")[1].split()[0])
    after_resume = {r["step"]: r["loss"] for r in resumed[killed_at:] if "loss" in r}
    assert min(after_resume) == start + 1 and max(after_resume) == 24
    for step, value in after_resume.items():
        assert value == reference[step], (step, value, reference[step])  # bit-identical


def test_sigterm_saves_a_checkpoint(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    args = [
        *SMALL,
        "train.max_steps=100000",
        "train.save_every=100000",
        f"data.train_files=[{data}]",
        f"output_dir={tmp_path / 'run'}",
    ]
    proc = train_cli(args)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert "SIGTERM: saved" in out
    saved = find_resume_checkpoint(tmp_path / "run")
    assert saved is not None and verify_checkpoint(saved) is None


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=8)
    cfg = config(tmp_path, data, "train.max_steps=6", "train.eval_every=6")
    target, tok, rows, eval_rows, _ = prepare(cfg)

    def make():
        return Trainer(
            cfg,
            target,
            tok,
            rows,
            eval_rows,
            out_dir=tmp_path / "run",
            target_path="tiny",
            progress=False,
        )

    make().fit()
    with pytest.raises(UserError, match="already holds checkpoints: continue with --resume auto"):
        make().fit()
    make().fit(overwrite=True)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 6  # one run's log, not two


def test_corrupted_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    data = write_data(tmp_path / "data.jsonl", n=8)
    cfg = config(tmp_path, data, "train.max_steps=12", "train.eval_every=12")
    target, tok, rows, eval_rows, _ = prepare(cfg)
    Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False).fit()
    newest = tmp_path / "run" / "checkpoints" / "step-0000012"
    with open(newest / "drafter.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 16)
    found = find_resume_checkpoint(tmp_path / "run")
    err = capsys.readouterr().err
    assert found.name == "step-0000006"
    assert "skipping checkpoint" in err and "step-0000012" in err and "does not match its checksum" in err


def test_non_finite_losses_are_skipped_then_stop_the_run(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=8)
    cfg = config(tmp_path, data, "train.max_consecutive_nonfinite=3")
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    with torch.no_grad():
        trainer.drafter.norm.weight.fill_(float("nan"))
    assert trainer.train_step() is None and trainer.c.skipped_nonfinite == 1
    assert trainer.train_step() is None
    with pytest.raises(UserError, match="3 consecutive steps had a non-finite loss"):
        trainer.train_step()
    assert torch.equal(trainer.drafter.fc.weight, before["fc.weight"])  # no update from a NaN step


def test_gradient_accumulation_averages_rows(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=12)
    cfg = config(tmp_path, data, "train.grad_accum=3")
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    out = trainer.train_step()
    assert trainer.c.rows_consumed == 3 and out["tokens"] == 3 * cfg.data.seq_len
    assert out["loss"] > 0 and math.isfinite(out["grad_norm"])


def test_bf16_autocast_training_keeps_fp32_master_weights_and_tracks_fp32(tmp_path):
    """train.dtype=bfloat16 on the CPU: autocast drafter, bf16 head GEMMs in the loss, fp32 weights,
    gradients and optimizer states; the step's loss and gradient stay close to the fp32 step's."""
    data = write_data(tmp_path / "data.jsonl", n=8)
    cfg32 = config(tmp_path, data, "loss.kl_weight=0.15", "loss.cap_weight=0.1", "train.dtype=float32")
    cfg16 = cfg32.model_copy(update={"train": cfg32.train.model_copy(update={"dtype": "bfloat16"})})
    target, tok, rows, eval_rows, _ = prepare(cfg32)
    trainer = Trainer(cfg16, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    feats = produce_row_features(target, rows[0], 0, cfg32)
    grads, values = {}, {}
    for name, cfg in (("fp32", cfg32), ("bf16", cfg16)):
        batch = drafter_step(trainer.drafter, feats, cfg, train=True)
        loss, _ = draft_loss(trainer.drafter, batch, cfg)
        (grads[name],) = torch.autograd.grad(loss, trainer.drafter.fc.weight)
        values[name] = loss.item()
    assert grads["bf16"].dtype == torch.float32
    assert abs(values["bf16"] - values["fp32"]) < 0.02 * abs(values["fp32"])
    rel = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert 1e-4 < rel < 0.1, rel.item()  # bf16 really ran, and only rounds (8-bit mantissa)
    first = trainer.train_step()["loss"]
    for _ in range(11):
        last = trainer.train_step()["loss"]
    assert last < first - 0.3, (first, last)
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters() if p.requires_grad)
    states = [s for st in trainer.optimizers.state() for s in st.values() if torch.is_tensor(s) and s.dim()]
    assert states and all(s.dtype == torch.float32 for s in states)


def test_preferred_train_dtype_follows_the_cpu(monkeypatch):
    from dflash_trainer.precision import cpu_has_bf16_gemm, preferred_train_dtype

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    native = any(f in flags.split() for f in ("avx512_bf16", "amx_bf16")) or " bf16" in flags
    for isa, allowed in ((None, True), ("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True)):
        if isa is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:  # oneDNN held below bf16 instructions emulates them on any CPU
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        assert cpu_has_bf16_gemm() == (native and allowed), isa
        assert preferred_train_dtype("cpu") == ("bfloat16" if native and allowed else "float32"), isa
