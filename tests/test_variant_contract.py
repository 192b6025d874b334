"""Every registered drafter variant through the same checks (issue 36's contract), the built-in ones and
``lookback``, defined in tests/probe_variant.py with no file under ``src/`` naming it:

- its settings are the config section ``drafter.<name>``, typed (a bad value is a one-line error);
- ``dflash-train train`` trains it (a few steps of the tiny target), its heads in the checkpoint;
- the trained drafter decodes losslessly, chain and DDTree, with its own drafting rule;
- the planner prices its parameters exactly (the real drafter's count) and renders its loss items;
- each export format writes it or refuses it in one line, as its ``export_refusal`` says.
"""

import json
import math
from pathlib import Path

import pytest
from cli_runs import in_process
from probe_variant import NAME as PROBE
from probe_variant import LookbackSettings, LookbackVariant
from test_distributed import train_args
from test_train import write_data

from dflash_trainer.config import TargetConfig, load_config
from dflash_trainer.drafter_folder import load_drafter
from dflash_trainer.inference.speculative import SpeculativeDecoder, target_greedy
from dflash_trainer.model.loading import load_target_model
from dflash_trainer.planner import formulas as F
from dflash_trainer.planner.report import workload_from_config
from dflash_trainer.variants import register, registered, unregister, variant_of

EOS = [0, 2]
# small settings per variant (the vocabulary-sized tables of the defaults would dominate 6 steps)
SETTINGS = {
    "dspark": ["drafter.dspark.markov_rank=8"],
    "dflash2": [
        "drafter.dflash2.selector_rank=8",
        "drafter.dflash2.selector_top_k=4",
        "drafter.dflash2.conv_group_size=8",
    ],
    PROBE: [f"drafter.{PROBE}.rank=4", f"drafter.{PROBE}.agreement_weight=0.2"],
}
NAMES = [v.name for v in registered()] + [PROBE]


@pytest.fixture(scope="module", autouse=True)
def probe():
    """The probe variant, registered for this file's tests only (a module-level registration would run
    when any xdist worker collects this file, and leave its section in every run.yaml it writes)."""
    register(PROBE, LookbackSettings, LookbackVariant)
    yield
    unregister(PROBE)


def test_the_probe_variant_is_registered_and_named_nowhere_under_src():
    assert [v.name for v in registered()] == NAMES == ["dflash", "dspark", "dflash2", PROBE]
    src = Path(__file__).resolve().parent.parent / "src"
    named = [p for p in src.rglob("*.py") if PROBE in p.read_text(encoding="utf-8")]
    assert not named, named


@pytest.fixture(scope="module")
def target():
    return load_target_model(TargetConfig(path="tiny", dtype="float32"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract") / "data.jsonl"
    write_data(path, n=16, chars=700)
    return path


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Each variant's SMALL training run (6 steps), trained once for the checks below."""
    done = {}

    def run(name: str) -> Path:
        if name not in done:
            out = tmp_path_factory.mktemp(f"run-{name}")
            result = in_process(*train_args(out, data, f"drafter.variant={name}", *SETTINGS.get(name, [])))
            assert result.returncode == 0, result.stderr[-3000:]
            done[name] = out
        return done[name]

    return run


def checkpoint(out: Path) -> Path:
    return max((out / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("name", NAMES)
def test_its_settings_are_a_typed_config_section(name):
    settings = variant_of(name).settings_type
    cfg = load_config(["tiny-demo"], [f"drafter.variant={name}"])
    assert isinstance(cfg.drafter.variant_settings, settings)
    if not settings.model_fields:
        return
    key = next(iter(settings.model_fields))
    with pytest.raises(ValueError, match=rf"drafter\.{name}\.{key}"):
        load_config(["tiny-demo"], [f"drafter.variant={name}", f"drafter.{name}.{key}=not-a-value"])


@pytest.mark.parametrize("name", NAMES)
def test_it_trains_and_decodes_losslessly(name, runs, target):
    model, tok = target
    drafter, meta = load_drafter(checkpoint(runs(name)), model)
    variant = variant_of(drafter.spec)
    assert variant.name == name == meta["spec"].get("variant", "dflash")
    names = [n for n, _ in drafter.named_parameters()]
    for head in variant.head_names:
        assert any(n.startswith(head) for n in names) or name == "dspark" and head == "confidence_head", head
    if name == PROBE:  # zero at init: trained, the adapter changes what the drafter drafts
        assert drafter.lookback_adapter.up.weight.abs().max() > 0
        steps = [json.loads(line) for line in (runs(name) / "metrics.jsonl").read_text().splitlines()]
        agreement = [row["agreement"] for row in steps if "agreement" in row]
        assert len(agreement) >= 6 and all(math.isfinite(x) and x >= 0 for x in agreement)
    decoder = SpeculativeDecoder(model, drafter, EOS)
    prompt = tok.apply_chat_template([{"role": "user", "content": "def main():"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    greedy, _ = target_greedy(model.model, prompt, 24, EOS)
    for mode in ("chain", "ddtree"):
        out = decoder.generate(prompt, 24, mode=mode, budget=8)
        assert out.tokens == greedy, mode


@pytest.mark.parametrize("name", NAMES)
def test_the_planner_prices_it(name, runs, target):
    model, _ = target
    drafter, _ = load_drafter(checkpoint(runs(name)), model)
    cfg = load_config([str(runs(name) / "run.yaml")], [])
    w = workload_from_config(cfg)
    s = drafter.spec
    dims = F.DrafterDims(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size, s.vocab_size)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    planned = F.drafter_param_count(dims, w.drafter_layers, w.num_features) + F.variant_head_params(w, dims)[0]
    assert planned == trainable
    plan = in_process("plan", "--config", str(runs(name) / "run.yaml"))
    assert plan.returncode == 0, plan.stderr
    for item in F.variant_loss_items(w, dims):
        assert item in plan.stdout, item
    if name == PROBE:
        assert F.variant_loss_items(w, dims)


@pytest.mark.parametrize("name", NAMES)
def test_each_export_format_writes_it_or_refuses_it_in_one_line(name, runs, tmp_path):
    ckpt = checkpoint(runs(name))
    spec = load_drafter(ckpt, load_target_model(TargetConfig(path="tiny", dtype="float32"))[0])[0].spec
    for fmt in ("zlab", "speculators"):
        refusal = variant_of(name).export_refusal(fmt, spec)
        done = in_process("export", "--format", fmt, str(ckpt), str(tmp_path / fmt))
        if refusal:
            assert done.returncode == 2 and done.stderr.strip().splitlines() == [
                f"dflash-train: error: cannot export as {fmt}: {refusal}"
            ]
            assert not (tmp_path / fmt).exists()
        else:
            assert done.returncode == 0, done.stderr
            assert (tmp_path / fmt / "config.json").is_file()
    if name == PROBE:
        assert variant_of(name).export_refusal("zlab", spec) and variant_of(name).export_refusal("speculators", spec)


def test_registering_adds_a_typed_section_and_unregistering_removes_it():
    from pydantic import Field

    from dflash_trainer.config import valid_keys
    from dflash_trainer.config.variants import VariantSettings

    class ScratchSettings(VariantSettings):
        width: int = Field(3, ge=1)

    register("scratch", ScratchSettings, LookbackVariant)
    try:
        keys = valid_keys()
        # after the other variants' sections, before the drafter's own settings: one key order in run.yaml
        assert keys.index("drafter.variant") < keys.index(f"drafter.{PROBE}.rank") < keys.index("drafter.scratch.width")
        assert keys.index("drafter.scratch.width") < keys.index("drafter.num_layers")
        cfg = load_config(["tiny-demo"], ["drafter.variant=scratch", "drafter.scratch.width=5"])
        assert cfg.drafter.variant_settings.width == 5
        with pytest.raises(ValueError, match="registered already"):
            register("scratch", VariantSettings, LookbackVariant)
        with pytest.raises(TypeError, match="its code's name or settings differ"):
            variant_of("scratch")  # LookbackVariant says it is lookback
    finally:
        unregister("scratch")
    assert "drafter.scratch.width" not in valid_keys()
    with pytest.raises(ValueError, match="unknown config key 'drafter.scratch'"):
        load_config(["tiny-demo"], ["drafter.scratch.width=5"])
    with pytest.raises(ValueError, match="unknown drafter variant 'scratch'"):
        load_config(["tiny-demo"], ["drafter.variant=scratch"])
