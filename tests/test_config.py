"""Config resolution: precedence, presets, and the errors a user sees."""

import pytest
import yaml

from dflash_trainer.config import ConfigError, RunConfig, dump_config, load_config, preset_names, write_resolved_config
from dflash_trainer.config.loader import parse_override


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_file_then_override_precedence(tmp_path):
    base = write(tmp_path, "base.yaml", {"train": {"lr": 1e-3, "max_steps": 50}, "drafter": {"block_size": 8}})
    top = write(tmp_path, "top.yaml", {"train": {"lr": 2e-3}})
    cfg = load_config([base, top], ["train.lr=3e-4"])
    assert cfg.train.lr == pytest.approx(3e-4)  # --set beats every file
    assert cfg.train.max_steps == 50  # from base.yaml; top.yaml merges, it does not replace the section
    assert cfg.drafter.block_size == 8
    assert cfg.train.grad_clip == RunConfig().train.grad_clip  # untouched keys keep schema defaults
    assert load_config([base, top]).train.lr == pytest.approx(2e-3)  # later file beats earlier


def test_override_values_are_typed(tmp_path):
    cfg = load_config(
        [],
        [
            "drafter.sliding_window_layers=[0, 2]",
            "drafter.noise=gaussian",
            "target.layer_ids=null",
            "name=123",
            "train.dtype=float32",
        ],
    )
    assert cfg.drafter.sliding_window_layers == [0, 2]
    assert cfg.drafter.noise == "gaussian"
    assert cfg.target.layer_ids is None
    assert cfg.name == "123"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.lrr=1"], "unknown config key 'train.lrr' (from --set train.lrr=1); did you mean 'train.lr'?"),
        (["lr=1"], "did you mean 'train.lr'?"),
        (["trian.lr=1"], "unknown config key 'trian' (from --set trian.lr=1); did you mean 'train'?"),
        (["drafter.blok_size=4"], "did you mean 'drafter.block_size'?"),
    ],
)
def test_unknown_key_names_it_and_suggests(overrides, expected):
    with pytest.raises(ConfigError) as exc:
        load_config([], overrides)
    assert expected in str(exc.value)


def test_unknown_key_in_file_names_file(tmp_path):
    path = write(tmp_path, "run.yaml", {"loss": {"kl_wieght": 0.1}})
    with pytest.raises(
        ConfigError, match=r"unknown config key 'loss.kl_wieght' \(from .*run.yaml\); did you mean 'loss.kl_weight'\?"
    ):
        load_config([path])


def test_wrong_type_names_field_and_value(tmp_path):
    path = write(tmp_path, "run.yaml", {"train": {"max_steps": "many"}})
    with pytest.raises(ConfigError) as exc:
        load_config([path])
    message = str(exc.value)
    assert "'train.max_steps'" in message and "'many'" in message and "run.yaml" in message
    with pytest.raises(ConfigError, match=r"invalid value for 'drafter.noise'.*'pink'"):
        load_config([], ["drafter.noise=pink"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match=r"sliding_window_layers \[5\] are outside 0..4"):
        load_config([], ["drafter.sliding_window_layers=[5]"])
    with pytest.raises(ConfigError, match="layer_ids has 2 ids but num_feature_layers is 5"):
        load_config([], ["target.layer_ids=[1, 2]"])
    with pytest.raises(ConfigError, match="block_size 64 exceeds data.seq_len 32"):
        load_config([], ["data.seq_len=32", "drafter.block_size=64"])
    dpace_and_dpard = ["loss.position_weights=dpace", "drafter.variant=dspark", "drafter.dspark.position_weights=dpard"]
    with pytest.raises(ConfigError, match="both replace the slot weights by a block credit: choose one"):
        load_config([], dpace_and_dpard)
    with pytest.raises(ConfigError, match="position_weights"):
        load_config([], ["loss.position_weights=dpard"])  # D-PARD is DSpark's setting, not the loss's
    with pytest.raises(ConfigError, match="dpace_alpha"):
        load_config([], ["loss.dpace_alpha=0"])


@pytest.mark.parametrize("item", ["train.lr", "", "=3", "train..lr=1"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError):
        parse_override(item)


def test_setting_inside_a_value_is_an_error():
    with pytest.raises(ConfigError, match="'target.path' is a value, not a section"):
        load_config([], ["target.path.x=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config([str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*bad.yaml at line \d+, column \d+"):
        load_config([str(bad)])
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must contain a mapping"):
        load_config([str(listy)])


def test_presets_carry_design_numbers():
    assert set(preset_names()) >= {"tiny-demo", "baseline-v6", "ddtree-experiment"}
    base = load_config(["baseline-v6"])
    assert (base.data.max_anchors, base.drafter.block_size, base.loss.gamma) == (512, 16, 4.0)
    assert base.data.seq_len == 65536 and base.target.layer_ids == [1, 16, 31, 46, 61]
    assert base.loss.kl_weight == 0 and base.loss.cap_weight == 0
    dd = load_config(["ddtree-experiment"])
    assert dd.data.max_anchors * dd.drafter.block_size == 24_576
    assert dd.loss.gamma == 10.0 and dd.loss.kl_weight == pytest.approx(0.15) and dd.loss.cap_weight > 0
    assert dd.drafter.sliding_window_layers == [0, 1, 2, 3] and dd.drafter.num_layers == 5
    assert dd.drafter.noise == "uniform" and dd.drafter.noise_scale > 0
    tiny = load_config(["tiny-demo"])
    assert tiny.target.path == "tiny"
    # A preset plus overrides: the override wins.
    assert load_config(["ddtree-experiment"], ["data.max_anchors=768"]).data.max_anchors == 768


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["ddtree-experiment"], ["train.lr=1e-4", "target.path=/models/x"])
    path = write_resolved_config(cfg, tmp_path / "out")
    assert path.name == "run.yaml"
    assert load_config([str(path)]) == cfg
    assert dump_config(load_config([str(path)])) == path.read_text()


@pytest.mark.parametrize("variant", ["dspark", "dflash2"])
def test_the_variant_demo_presets_are_the_tiny_demo_with_the_variant(variant):
    """`--config tiny-demo-VARIANT` is `tiny-demo` with `drafter.variant=VARIANT` (and its own name and
    output folder), so the demos compare the variants and nothing else."""
    preset = load_config([f"tiny-demo-{variant}"]).model_dump()
    plain = load_config(
        ["tiny-demo"],
        [f"drafter.variant={variant}", f"name=tiny-demo-{variant}", f"output_dir=runs/tiny-demo-{variant}"],
    ).model_dump()
    assert preset == plain
    assert preset["drafter"]["variant"] == variant
