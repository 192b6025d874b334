"""The real `dflash-train` process: bad input ends with one stderr line and a non-zero exit."""

import json
import subprocess
import sys

import pytest
import yaml
from cli_runs import in_process


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["config", "--config", "no/such/file.yaml"], "config file not found: no/such/file.yaml"),
        (["config", "--config", "BAD"], "cannot parse BAD"),
        (["config", "--set", "train.lr"], "override 'train.lr' has no '='"),
        (["config", "--set", "train.lrr=1"], "did you mean 'train.lr'?"),
        (["config", "--set", "train.lr=fast"], "invalid value for 'train.lr'"),
        (["demo", "--set", "target.path=/no/such/model"], "target.path /no/such/model is not a folder"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: 1\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    needle = needle.replace("BAD", str(bad))
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dflash-train: error: ") and needle in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing half-written by a refused run


def test_config_command_prints_resolved_yaml(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("train:\n  lr: 0.002\n")
    result = run_cli("config", "--config", "tiny-demo", "--config", str(user), "--set", "train.max_steps=7")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["name"] == "tiny-demo"
    assert resolved["train"]["lr"] == 0.002 and resolved["train"]["max_steps"] == 7


def test_presets_and_keys_listing():
    presets = run_cli("presets")
    assert presets.returncode == 0
    assert {line.split()[0] for line in presets.stdout.splitlines()} >= {
        "tiny-demo",
        "baseline-v6",
        "ddtree-experiment",
    }
    keys = run_cli("config", "--keys").stdout.split()
    assert "train.lr" in keys and "drafter.block_size" in keys and "train" not in keys


def test_a_command_imports_only_its_own_module():
    """``dflash-train config ...`` answers without importing torch (the other commands' modules import
    it), and ``--help`` still lists every command."""
    probe = (
        "import sys; from dflash_trainer.cli import main; code = main(['config', '--set', 'train.lr=0.1']); "
        "print('torch' in sys.modules, code)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False 0"
    # in this process: --help and an unknown command import every command's module (torch, transformers:
    # 5 s of CPU each as a process); what they print is argparse's, the same either way
    helped = in_process("--help")
    assert helped.returncode == 0
    for command in ("demo", "train", "prepare-data", "capture", "generate", "speculate", "eval", "plan", "export"):
        assert f"\n    {command} " in helped.stdout or f"\n    {command}\n" in helped.stdout, helped.stdout
    unknown = in_process("trian")
    assert unknown.returncode == 2 and "invalid choice: 'trian'" in unknown.stderr


def test_the_executable_freezes_what_its_start_made_and_then_collects_as_before():
    """``freeze_startup_heap`` (installed by the executable, ``entry``): what survives each of the start's
    full collections is frozen, and once they are done the collector is Python's own again: a reference
    cycle made later is freed by the next collection. ``main`` alone leaves the caller's collector be."""
    probe = """
import gc, json
from dflash_trainer.cli import freeze_startup_heap
from importlib.metadata import entry_points
assert gc.get_freeze_count() == 0
freeze_startup_heap(2)
gc.collect(1)  # not a full collection: nothing frozen
frozen = [gc.get_freeze_count()]
gc.collect()
frozen.append(gc.get_freeze_count())
gc.collect()
frozen.append(gc.get_freeze_count())
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
found = gc.collect()
unchanged = gc.get_freeze_count() == frozen[-1]
after = len(gc.callbacks)
stop = freeze_startup_heap(None)  # until stopped (tests/conftest.py)
gc.collect()
gc.collect()
running = len(gc.callbacks)
stop()
print(json.dumps([frozen, found, unchanged, [after, running, len(gc.callbacks)],
                  entry_points(group="console_scripts")["dflash-train"].value]))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    frozen, found, unchanged, callbacks, script = json.loads(done.stdout.splitlines()[-1])
    assert frozen[0] == 0 and 0 < frozen[1] <= frozen[2], frozen  # each full collection froze its survivors
    assert found >= 2 and unchanged  # then the collector freed the cycle and froze nothing
    assert callbacks == [0, 1, 0]  # gone after its collections; unbounded, there until stopped
    assert script == "dflash_trainer.cli:entry"
    # the same probe through main: no freezing in the caller's process
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc; from dflash_trainer.cli import main; main(['presets']); gc.collect(); "
            "print(gc.get_freeze_count(), len(gc.callbacks))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0 and plain.stdout.split()[-2:] == ["0", "0"], plain.stdout + plain.stderr
