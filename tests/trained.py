"""Drafters trained on the tiny target's own greedy continuations, built once per test session and
shared by every test file and every pytest-xdist worker (``--dist loadfile`` runs files in separate
workers, so a module fixture would be rebuilt in each).

The cache lives in the session's ``DFLASH_TEST_TRAINED_CACHE`` (tests/conftest.py: made by the process
that starts the session, inherited by its workers, removed when it exits), one folder per drafter keyed
by its settings; a file lock makes one worker build it while the others wait, then all load it (as the
external venvs of tests/external_venvs.py are built). The greedy continuations the drafters train on
(8 unbatched target ``generate`` calls for the decoding references, one batched call for the 32
training prompts) are one shared record set.

The worker that trains a drafter returns it as loaded from the training run's last checkpoint; the
others rebuild it from its raw ``state_dict`` (``torch.save`` of that module), so that a test comparing
the round trip of the saved drafter (``ckpt``: ``save_drafter`` / ``load_drafter``) against
``trained["drafter"]`` still compares two different paths.
"""

import hashlib
import json
import os
from pathlib import Path

import torch
from filelock import FileLock

from dflash_trainer.config import load_config
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.inference.speculative import target_greedy
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import build_drafter

EOS = [0, 2]
PROMPTS = 40  # held-out prompts: 8 kept for decoding, 32 for training
NEW_TOKENS = 64  # greedy continuation per prompt


def cache_root() -> Path:
    root = Path(os.environ["DFLASH_TEST_TRAINED_CACHE"])  # tests/conftest.py
    root.mkdir(parents=True, exist_ok=True)
    return root


def held_out_prompts(tok, limit: int) -> tuple[list[str], list[list[int]]]:
    """``(user messages, prompt ids)`` asking to continue the first ``limit`` held-out modules (their
    first 8 lines shown), the chat template applied with the generation prompt."""
    users, prompts = [], []
    for f in load_split("held_out", limit=limit):
        lines = f.text.splitlines(keepends=True)
        user = f"Continue the Python module `{f.relpath}`:\n{''.join(lines[:8])}"
        ids = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True, add_generation_prompt=True)
        users.append(user)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return users, prompts


def greedy_batch(model, prompts: list[list[int]], new_tokens: int, batch: int = 32) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (cut after the first eos), ``batch`` prompts per
    Hugging Face ``generate`` call, left-padded: training data, where an fp32 near-tie decided otherwise
    than unbatched ``target_greedy`` would is of no consequence (the references stay unbatched)."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[EOS[0]] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=EOS,
                pad_token_id=EOS[0],
                top_k=None,
                top_p=None,
            )
        for row in gen[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in EOS), len(row))
            out.append(row[:cut])
    return out


def greedy_records() -> tuple[list[list[int]], list[dict], list[list[int]]]:
    """``(prompt ids, chat records, continuation ids)`` of the tiny target's greedy continuations of
    ``PROMPTS`` held-out prompts (``NEW_TOKENS`` each; the first 8, kept for decoding, by ``target_greedy``
    one at a time, the others batched), made once per session."""
    path = cache_root() / f"greedy-{PROMPTS}x{NEW_TOKENS}.json"
    if not path.is_file():
        with FileLock(str(path) + ".lock"):
            if not path.is_file():  # else made by another worker while this one waited
                cfg = load_config(["tiny-demo"])
                from dflash_trainer.model.loading import load_target

                model, tok, _ = load_target(cfg.target)
                users, prompts = held_out_prompts(tok, PROMPTS)
                # the 8 kept prompts one at a time (the exact greedy references of the decoding tests),
                # the 32 training prompts in one batched generate (training data)
                kept = [target_greedy(model, ids, NEW_TOKENS, EOS)[0] for ids in prompts[:8]]
                greedy = kept + greedy_batch(model, prompts[8:], NEW_TOKENS)
                records = []
                for user, out in zip(users, greedy):
                    reply = tok.decode(out, skip_special_tokens=True)
                    records.append(
                        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}
                    )
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"prompts": prompts, "records": records, "greedy": greedy}))
                tmp.replace(path)
    saved = json.loads(path.read_text())
    return saved["prompts"], saved["records"], saved["greedy"]


def capture_then_train(options: list[str], features: Path, what: str) -> None:
    """``dflash-train capture`` (float32 features) of the tiny-demo run with ``--set`` ``options`` into
    ``features``, then ``train`` from them, in this process: a user's training from a feature cache,
    equal to the online run bit for bit (test_offline.py). ``what`` names the drafter in a failure."""
    from dflash_trainer.cli import main

    run = ["--config", "tiny-demo", "--no-progress", *(arg for option in options for arg in ("--set", option))]
    if main(["capture", *run, "--out", str(features), "--set", "capture.dtype=float32"]) != 0:
        raise AssertionError(f"capture for {what} failed (see its output)")
    if main(["train", *run, "--set", f"data.features={features}"]) != 0:
        raise AssertionError(f"training {what} failed (see its output)")


def train_on_greedy(*overrides: str, steps: int = 150) -> dict:
    """A drafter (``overrides``: more ``--set`` settings, e.g. a variant) trained for ``steps`` on the
    tiny target's greedy continuations of 32 held-out prompts; 8 more prompts are kept for decoding.
    Built once per session for each ``(overrides, steps)``; every caller gets fresh Python objects.
    ``greedy``: the target's greedy continuation ids of the 8 kept prompts (``NEW_TOKENS``).

    Trained the way a user trains from a feature cache: ``dflash-train capture`` (float32 features of
    the 11 rows), then ``train --set data.features=``, which equals the online run bit for bit
    (test_offline.py) and does not run the target again for every step (150 steps read the same 11
    rows ~14 times each: 40% of an online step is the target's forward)."""
    key = hashlib.sha256(json.dumps([list(overrides), steps]).encode()).hexdigest()[:16]
    root = cache_root() / f"drafter-{key}"
    done, state = root / "done", root / "trained_state.pt"
    prompts, records, greedy = greedy_records()
    options = [
        f"data.train_files=[{root / 'data.jsonl'}]",
        f"output_dir={root / 'run'}",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"train.save_every={steps}",
        "data.max_eval_rows=1",
        "train.lr=3e-3",
        *overrides,
    ]
    cfg = load_config(["tiny-demo"], options)
    drafter = None
    if not done.is_file():
        with FileLock(str(root) + ".lock"):
            if not done.is_file():  # else trained by another worker while this one waited
                root.mkdir(parents=True, exist_ok=True)
                (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[8:]))
                capture_then_train(options, root / "features", f"the shared drafter {overrides}")
                target, tok, _, eval_rows, _ = prepare(cfg)
                drafter, _ = load_drafter(root / "run" / "checkpoints" / f"step-{steps:07d}", target)
                save_drafter(drafter, root / "ckpt", target=target, target_path="tiny")
                torch.save(drafter.state_dict(), state)
                done.write_text("ok\n")
    if drafter is None:
        target, tok, _, eval_rows, _ = prepare(cfg)  # the prepared rows come from the session's data cache
        drafter = build_drafter(cfg, target, tok)
        drafter.load_state_dict(torch.load(state, weights_only=True))
    return {
        "target": target,
        "drafter": drafter.eval(),
        "prompts": prompts[:8],
        "tok": tok,
        "ckpt": root / "ckpt",
        "records": records[:8],
        # target_greedy of each kept prompt, NEW_TOKENS long: the greedy of fewer tokens is its prefix
        "greedy": greedy[:8],
        "root": root,
        "eval_rows": eval_rows,
    }
