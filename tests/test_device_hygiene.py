"""Device hygiene that gloo cannot check: a step whose tensors live on one device while torch's default
device is another. Any tensor created without ``device=`` lands on the default device (meta here) and
the next op that mixes it with the step's tensors fails loudly, as it would on a GPU rank."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trainer.config import load_config
from dflash_trainer.data.packing import PackedRow
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import TINY_TARGET_DIR
from dflash_trainer.training.step import draft_loss, drafter_step, produce_row_features


def test_a_step_creates_no_tensor_on_the_default_device():
    cfg = load_config(["tiny-demo"], ["loss.kl_weight=0.15", "loss.cap_weight=0.1", "data.max_anchors=6"])
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET_DIR, dtype=torch.float32)
    target = TargetModel(model)
    spec = DrafterSpec.from_target(model.config, cfg.drafter, num_features=len(target.layer_ids), mask_token_id=3)
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    g = torch.Generator().manual_seed(0)
    length = 96
    row = PackedRow(
        input_ids=torch.randint(4, 8000, (length,), generator=g),
        position_ids=torch.cat([torch.arange(60), torch.arange(36)]),
        loss_mask=torch.ones(length, dtype=torch.long),
    )
    reference = _step(target, drafter, row, cfg)
    drafter.zero_grad()
    # the guard works: a tensor made without device= is meta and mixing it with the CPU fails
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        torch.ones(3, device="cpu") + torch.ones(3)
    with torch.device("meta"):
        loss = _step(target, drafter, row, cfg)
    assert loss.device.type == "cpu" and loss.item() == reference.item()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in drafter.parameters())


def _step(target, drafter, row, cfg):
    feats = produce_row_features(target, row, 0, cfg)
    batch = drafter_step(drafter, feats, cfg)
    loss, _ = draft_loss(drafter, batch, cfg)
    loss.backward()
    return loss.detach()


MISMATCH = """
import os, sys, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
x = torch.ones(3 + rank)  # rank 1 sends a longer tensor: a bug that hangs or corrupts under NCCL
try:
    dist.all_reduce(x)
except Exception as e:
    print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    sys.exit(3)
print(f"rank {rank}: no error", flush=True)
"""


def test_detail_debug_makes_a_mismatched_collective_an_error(tmp_path):
    """What the multi-rank tests run with (test_distributed._env): a collective whose shapes differ across
    ranks is an immediate error naming the mismatch, not a hang."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(_free_port()), str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "no error" not in out.stdout
    assert "Detected mismatch between collectives on ranks" in out.stdout + out.stderr, out.stdout[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
