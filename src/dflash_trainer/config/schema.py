"""The typed schema of a run: the single source of truth for every setting.

A run is configured by YAML files (``--config``, built-in preset names allowed) and dotted
overrides (``--set train.lr=3e-4``); see ``loader.py``. Every model here forbids unknown keys so a
typo is an error, never a silently ignored setting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from ..errors import UserError
from .gpus import gpu_memory
from .variants import VariantSettings

TINY_TARGET = "tiny"  # value of target.path that selects the embedded tiny target


class Section(BaseModel):
    # allow_inf_nan=False: ``train.lr=.inf`` or ``nan`` is an error here, not a run of NaN steps later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False)


class TargetConfig(Section):
    """The frozen target LLM whose hidden states condition the drafter."""

    path: str | None = Field(
        TINY_TARGET,
        description="local Hugging Face model folder, or 'tiny' for the embedded tiny target; "
        "null in presets for real targets (set it with --set target.path=...)",
    )
    num_feature_layers: int = Field(5, ge=1, description="k: how many target layers feed the drafter")
    layer_ids: list[int] | None = Field(
        None,
        description="z-lab layer ids (id l = output of decoder layer l); null = the default rule "
        "round(1 + i*(n-4)/(k-1)) for an n-layer target",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="dtype the target runs in")

    @model_validator(mode="after")
    def _layer_ids_match_k(self) -> TargetConfig:
        if self.layer_ids is not None:
            if len(self.layer_ids) != self.num_feature_layers:
                raise ValueError(
                    f"layer_ids has {len(self.layer_ids)} ids but num_feature_layers is {self.num_feature_layers}"
                )
            if any(i < 0 for i in self.layer_ids) or len(set(self.layer_ids)) != len(self.layer_ids):
                raise ValueError(f"layer_ids must be distinct and non-negative, got {self.layer_ids}")
        return self


class RopeScalingConfig(Section):
    """Drafter RoPE scaling for long context (``model/rope.py``), as transformers reads ``rope_parameters``."""

    rope_type: Literal["linear", "yarn"] = Field(
        description="linear (position interpolation) or yarn (NTK-by-parts with attention scaling)"
    )
    factor: float = Field(gt=1.0, description="context extension: positions are interpolated by this factor")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, description="yarn: the context length the RoPE base was trained for (required for yarn)"
    )
    beta_fast: float = Field(32.0, gt=0.0, description="yarn: dimensions turning faster than this keep their frequency")
    beta_slow: float = Field(1.0, gt=0.0, description="yarn: dimensions turning slower than this are interpolated")
    attention_factor: float | None = Field(None, gt=0.0, description="yarn: cos/sin scale; null = 0.1 ln(factor) + 1")
    truncate: bool = Field(True, description="yarn: round the ramp's boundaries to whole dimensions")

    @model_validator(mode="after")
    def _yarn_needs_original_length(self) -> RopeScalingConfig:
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError(
                "rope_type yarn needs original_max_position_embeddings (the context the base was trained for)"
            )
        if self.rope_type == "yarn" and self.beta_slow >= self.beta_fast:
            raise ValueError(f"yarn: beta_slow {self.beta_slow} must be below beta_fast {self.beta_fast}")
        return self

    def as_rope_parameters(self) -> dict:
        """The ``rope_parameters`` entries (without ``rope_theta``) an export writes and the drafter reads."""
        keep = ("rope_type", "factor") if self.rope_type == "linear" else tuple(type(self).model_fields)
        return {k: v for k, v in self.model_dump().items() if k in keep and v is not None}


class DrafterConfig(Section):
    """The DFlash drafter: a few Qwen3-style decoder layers with KV injection of target features."""

    variant: str = Field(
        "dflash",
        description="the drafter variant (variants/): dflash, or a registered one; its settings are the "
        "section of its name (drafter.dspark, drafter.dflash2)",
    )
    # one section per registered variant with settings, inserted here by add_variant_section
    num_layers: int = Field(5, ge=1, description="decoder layers of the drafter")
    block_size: int = Field(16, ge=2, description="B: anchor slot plus B-1 mask slots")
    intermediate_size: int | None = Field(
        None,
        ge=1,
        description="width of the drafter's dense SwiGLU MLP; null = the target's intermediate_size, or "
        "3 x hidden_size for an MoE target without one (Qwen3.5-MoE)",
    )
    sliding_window_layers: list[int] = Field(
        default_factory=list, description="drafter layers (0-based) that see only the last W context rows"
    )
    sliding_window: int = Field(2048, ge=1, description="W: context rows a sliding-window layer sees")
    causal_in_block_sliding: bool = Field(False, description="sliding-window layers are causal inside the block")
    rope_scaling: RopeScalingConfig | None = Field(
        None,
        description="RoPE scaling of the drafter for long context, e.g. {rope_type: yarn, factor: 4, "
        "original_max_position_embeddings: 32768}; null = default RoPE with the target's base",
    )
    noise: Literal["none", "uniform", "gaussian"] = Field(
        "none", description="noise on context features (training only)"
    )
    noise_scale: float = Field(0.0, ge=0.0, description="s: uniform in [-s, s] or Gaussian std s")
    mask_token_id: int | None = Field(None, ge=0, description="null = the tokenizer's <|MASK|> token")
    init_from: str | None = Field(
        None,
        description="a drafter folder to start from instead of a random init (warm start, fine-tuning): this "
        "project's checkpoint or export, a z-lab or speculators folder; it must fit this run's target and "
        "drafter settings (refused in one line otherwise); --resume still wins",
    )
    attention_backend: Literal["dense", "flex"] = Field(
        "dense", description="dense boolean mask + SDPA (CPU, small cases) or FlexAttention BlockMask (GPU, compiled)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each drafter layer in the backward pass instead of keeping its activations"
    )

    @field_validator("variant")
    @classmethod
    def _registered_variant(cls, name: str) -> str:
        if name not in VARIANT_SETTINGS:
            raise ValueError(f"unknown drafter variant {name!r}: the registered ones are {', '.join(VARIANT_SETTINGS)}")
        return name

    @model_validator(mode="after")
    def _no_settings_of_another_variant(self) -> DrafterConfig:
        # Compared with the defaults, not with what was set: a resolved run.yaml holds every section.
        for name, settings in VARIANT_SETTINGS.items():
            if name == self.variant or name not in type(self).model_fields:
                continue
            section = getattr(self, name)
            changed = [k for k in settings.model_fields if getattr(section, k) != getattr(settings(), k)]
            if changed:
                raise ValueError(
                    f"drafter.{name}.{changed[0]} is set but drafter.variant is {self.variant}, which ignores it: "
                    f"set drafter.variant={name}, or drop the drafter.{name} settings"
                )
        return self

    @property
    def variant_settings(self) -> VariantSettings:
        """The typed settings of ``variant``: its section (a default one for a variant without fields)."""
        if self.variant in type(self).model_fields:
            return getattr(self, self.variant)
        return VARIANT_SETTINGS[self.variant]()

    @property
    def block_span(self) -> int:
        """Tokens of the row one block covers: B, plus the variant's label shift (DSpark's
        sample_from_anchor: the last slot predicts the token at anchor + B)."""
        return self.block_size + self.variant_settings.label_shift

    @model_validator(mode="after")
    def _sliding_layers_in_range(self) -> DrafterConfig:
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_window_layers {bad} are outside 0..{self.num_layers - 1}")
        return self


# data.columns keys: the record-level columns a record may have, and the keys of a "messages" turn.
DATA_COLUMN_KEYS = ("messages", "conversations", "input_ids", "loss_mask", "role", "content")


class DataConfig(Section):
    """Training and held-out data, packed into rows of seq_len tokens."""

    train_files: list[str] = Field(
        default_factory=list,
        description="JSONL / Parquet / Arrow files, folders, datasets' save_to_disk or cache folders",
    )
    eval_files: list[str] = Field(
        default_factory=list, description="held-out data files; empty = eval_fraction of train_files"
    )
    seq_len: int = Field(4096, ge=2, description="tokens per packed row")
    max_anchors: int = Field(512, ge=1, description="anchors (blocks) sampled per packed row")
    max_bad_fraction: float = Field(0.05, ge=0.0, le=1.0, description="stop when more records are bad")
    eval_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="held-out share of train_files when eval_files is empty"
    )
    max_eval_rows: int = Field(16, ge=1, description="packed rows scored at each evaluation")
    max_record_bytes: int = Field(
        16 << 20, ge=1, description="a JSONL line longer than this is skipped and counted as a bad record"
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="our column name -> the data's, for other names (keys: " + ", ".join(DATA_COLUMN_KEYS) + ")",
    )
    prepared: str | None = Field(
        None, description="a folder written by `dflash-train prepare-data`; null = prepare on first use, cached"
    )
    cache_dir: str | None = Field(
        None, description="where prepared data is cached; null = $DFLASH_DATA_CACHE or ~/.cache/dflash-trainer/data"
    )
    num_workers: int | None = Field(None, ge=1, description="tokenizing processes when preparing; null = the cores")
    prepare_timeout_s: float = Field(
        14400.0, gt=0, description="with torchrun: how long the other ranks wait for rank 0 to prepare the data"
    )
    features: str | None = Field(
        None,
        description="a feature cache written by `dflash-train capture`: train from it, without the target body; "
        "null = run the target online",
    )
    feature_window: int | None = Field(
        None,
        ge=2,
        description="read data.features as a window of at most this many training shards on disk while `capture` "
        "(same config) writes it: shards in order, rows shuffled within each, capture waiting when the window is "
        "full, shards released at each checkpoint; null = a complete cache read in any order",
    )
    feature_window_keep: bool = Field(
        False, description="with data.feature_window: keep released shards on disk (else they are deleted)"
    )
    feature_window_timeout_s: float = Field(
        3600.0, gt=0, description="with data.feature_window: how long training waits for a shard, capture for room"
    )

    @model_validator(mode="after")
    def _one_source_of_rows(self) -> DataConfig:
        if self.features and self.prepared:
            # a feature cache holds its own rows (captured from its prepared data): data.prepared would be ignored
            raise ValueError(
                "data.features and data.prepared are both set: a feature cache trains on the rows it was captured "
                "from; drop data.prepared"
            )
        return self

    @model_validator(mode="after")
    def _known_columns(self) -> DataConfig:
        unknown = sorted(set(self.columns) - set(DATA_COLUMN_KEYS))
        if unknown:
            raise ValueError(f"data.columns keys {unknown} are not among {list(DATA_COLUMN_KEYS)}")
        return self


class LossConfig(Section):
    """L = sum_i w_i [(1-a) CE + a T^2 KL(q^T || p^T) + tv TV(p, q)] / sum_i w_i + lambda * CAP (DESIGN.md section 3)."""

    position_weights: Literal["exp_decay", "dpace"] = Field(
        "dpace",
        description="w_i of a block's slots: exp_decay (DFlash's exp(-(k-1)/gamma)) or dpace (D-PACE: the block "
        "credit sum_{k>=t} prod_{i<=k} (alpha + (1-alpha) p_i(y_i)) of the student's detached label probabilities)",
    )
    gamma: float = Field(7.0, gt=0.0, description="slot weights w_k = exp(-(k-1)/gamma) (position_weights exp_decay)")
    dpace_alpha: float = Field(0.5, gt=0.0, le=1.0, description="alpha of D-PACE's smoothed confidence")
    tv_weight: float = Field(
        0.0, ge=0.0, description="weight of the total variation 0.5 sum_v |p_v - q_v| between student and teacher"
    )
    kl_weight: float = Field(0.0, ge=0.0, le=1.0, description="a: share of soft KL blended with CE")
    temperature: float = Field(1.0, gt=0.0, description="T of the soft KL")
    cap_weight: float = Field(0.0, ge=0.0, description="lambda of the CAP confidence loss")
    cap_temperature: float = Field(1.0, gt=0.0, description="temperature of the CAP entropy")
    labels: Literal["data", "teacher"] = Field("data", description="data tokens or the teacher's argmax")
    chunk_size: int | None = Field(None, ge=1, description="rows per loss chunk; null = derived from memory")


class CaptureVllmConfig(Section):
    """vLLM as the feature producer (``capture.engine: vllm``; docs/large-targets.md)."""

    servers: list[str] = Field(
        default_factory=list,
        description="URLs of running vLLM servers started with the command `capture --print-server-command` "
        "prints (their files must be readable here); empty = one vllm.LLM in a subprocess of DFLASH_VLLM_PYTHON",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the target is sharded over (vLLM's tensor parallel)")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages of the target (vLLM's pipeline parallel)")
    quantization: str | None = Field(None, description="vLLM's quantization method (fp8, ...); null = the checkpoint's")
    max_model_len: int | None = Field(None, ge=1, description="vLLM's context length; null = data.seq_len + 1")
    engine_args: dict = Field(
        default_factory=dict,
        description="further vllm.LLM / `vllm serve` arguments, by their Python names (gpu_memory_utilization, ...)",
    )


class CaptureConfig(Section):
    """What ``dflash-train capture`` stores per token (docs/offline.md: the feature cache)."""

    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="what runs the target: transformers in this process (one GPU per process), or vLLM "
        "(any size it serves: tensor/pipeline parallel, quantized; capture.vllm)",
    )
    vllm: CaptureVllmConfig = Field(default_factory=CaptureVllmConfig)

    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3"] | None = Field(
        None,
        description="storage dtype of the features; null = target.dtype; float8_e4m3 adds a float32 scale per token",
    )
    teacher: bool | None = Field(
        None,
        description="store the final-normed last hidden state of training rows; null = when the loss needs it "
        "(soft KL, teacher labels); held-out rows always keep it",
    )
    shard_bytes: int = Field(1 << 30, ge=1, description="rows are grouped into shards of at most this many bytes")
    timeout_s: float = Field(
        86400.0, gt=0, description="with torchrun: how long the ranks wait for each other at the end of a capture"
    )


class TrainConfig(Section):
    """Optimizer, schedule and bookkeeping (``training/optim.py``). The defaults (Muon, WSD, with
    ``loss.position_weights=dpace``) are the recipe that measured best (benchmarks/results/recipes.md)."""

    seed: int = Field(0, description="seeds the weights, the row order (train.seed, epoch) and the anchors")
    optimizer: Literal["adamw", "muon"] = Field(
        "muon",
        description="adamw, or muon: torch.optim.Muon on the drafter's hidden matrices (learning rate matched "
        "to AdamW's update RMS), AdamW on the rest (norms, biases, vocabulary-sized tensors)",
    )
    lr: float = Field(6e-4, gt=0.0, description="peak learning rate (Muon's matrices and AdamW's tensors alike)")
    schedule: Literal["cosine", "linear", "wsd"] = Field(
        "wsd",
        description="after the warmup: cosine or linear decay to min_lr_ratio, or wsd (warmup-stable-decay: "
        "constant, then linear decay over the last decay_ratio of the steps)",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="the schedule ends at lr * min_lr_ratio")
    decay_ratio: float = Field(0.2, gt=0.0, le=1.0, description="wsd: share of the steps spent decaying")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's decoupled weight decay on its matrices")
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0, description="muon: Nesterov momentum of its matrices")
    muon_weight_decay: float = Field(0.1, ge=0.0, description="muon: decoupled weight decay of its matrices")
    warmup_ratio: float = Field(0.04, ge=0.0, le=1.0, description="share of the steps spent warming up linearly")
    max_steps: int = Field(1000, ge=1, description="optimizer steps of the run (train.epochs, when set, decides)")
    epochs: float | None = Field(
        None,
        gt=0.0,
        description="train this many passes over the training rows instead of max_steps (max_steps is then "
        "ceil(epochs * rows / grad_accum), recorded in run.yaml)",
    )
    grad_accum: int = Field(
        1, ge=1, description="packed rows per optimizer step, split among data-parallel drafter ranks"
    )
    grad_clip: float = Field(1.0, gt=0.0, description="clip the gradient's global norm to this")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="autocast dtype of the drafter")
    log_every: int = Field(10, ge=1, description="steps between lines of progress and metrics.jsonl")
    eval_every: int = Field(200, ge=1, description="steps between held-out evaluations (loss, tau)")
    save_every: int = Field(500, ge=1, description="steps between checkpoints (the last step is always saved)")
    max_consecutive_nonfinite: int = Field(10, ge=1, description="stop after this many non-finite steps in a row")
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] | None = Field(
        None,
        description="experiment trackers that get every metrics.jsonl record, any subset (each an extra: pip "
        "install 'dflash-trainer[wandb]'); null = tensorboard where installed, [] = none (training/trackers.py)",
    )
    tracker_project: str = Field(
        "dflash-trainer", min_length=1, description="the wandb / trackio project and the MLflow experiment"
    )
    stage: Literal["sft", "on_policy"] = Field(
        "sft",
        description="sft: imitation of the data's text; on_policy: the drafter's own rollouts, verified by the "
        "target (Draft-OPD; settings in on_policy.*, start from a trained drafter with drafter.init_from)",
    )


class OnPolicyConfig(Section):
    """``train.stage=on_policy``: rollouts of the drafter on the training rows' prompts, trained on
    (``training/on_policy.py``; start from an SFT drafter with ``drafter.init_from``)."""

    temperature: float = Field(
        0.0, ge=0.0, description="the rollouts' verification: 0 = greedy, T > 0 = lossless speculative sampling at T"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="the rollouts' nucleus at temperature > 0")
    max_new_tokens: int = Field(64, ge=1, description="tokens each rollout generates after its prompt")
    kl_temperature: float = Field(1.0, gt=0.0, description="temperature of the forward KL on accepted slots")
    rollout: Literal["chain", "ddtree"] = Field(
        "chain",
        description="the rollouts' verification: chain (the block's greedy drafts) or ddtree (a tree of "
        "on_policy.budget nodes; a round's accepted slots are the accepted path's)",
    )
    budget: int = Field(16, ge=1, description="DDTree nodes per round with on_policy.rollout=ddtree")
    teacher: Literal["text", "verified"] = Field(
        "text",
        description="each slot's teacher: text = the target's state along the decoded text (what acceptance "
        "is judged on); verified = the verification pass's, after the drafts before the slot, accepted or not",
    )


class TopologyConfig(Section):
    """Where the run's pieces live: read by the launcher (``torchrun ... dflash-train train``), the memory
    planner (``dflash-train plan``) and the preflight, so that they never disagree."""

    gpu: str = Field(
        "auto",
        description="memory of each GPU: a preset (rtx-pro-6000, h100, h200, a100-80gb, l40s) or GB, "
        "e.g. 95; auto = the device this process trains on",
    )
    target_ranks: int = Field(
        0,
        ge=0,
        description="processes (GPUs) running target replicas, ranks [0, T) of a torchrun launch; 0 = one "
        "process runs the target and the drafter",
    )
    drafter_ranks: int = Field(
        1, ge=1, description="processes (GPUs) training the drafter, ranks [T, T+D); more than one are data-parallel"
    )
    prefetch: int = Field(2, ge=1, description="rows a target rank may run ahead of the drafter rank it feeds")
    timeout_s: float = Field(
        600.0, gt=0, description="a rank that sends or receives nothing for this long is reported dead or hung"
    )
    target_model: str | None = Field(
        None,
        description="what the planner prices when target.path is not set: a built-in target "
        "(qwen3.6-27b, qwen3-8b), a model folder or a config.json",
    )
    allocator_margin: float = Field(
        0.05, ge=0.0, le=1.0, description="share of the tensor peak kept for allocator fragmentation"
    )
    preflight: bool = Field(True, description="dflash-train train refuses a run the planner predicts will not fit")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        if value != "auto":
            try:
                gpu_memory(value)
            except UserError as exc:
                raise ValueError(str(exc)) from None
        return value


class ExportConfig(Section):
    """How the drafter will be served: training warns at startup about settings these formats cannot serve."""

    formats: list[Literal["zlab", "speculators"]] = Field(
        default_factory=lambda: ["zlab", "speculators"],
        description="export formats this drafter is meant for (docs/serving.md: semantics per format); [] = no warning",
    )


class RunConfig(Section):
    """A whole run. ``output_dir`` receives the resolved ``run.yaml`` and everything the run writes."""

    name: str = Field("run", description="the run's name, recorded in run.yaml")
    output_dir: str = Field("runs/run", description="where checkpoints, metrics.jsonl and run.yaml go")
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    on_policy: OnPolicyConfig = Field(default_factory=OnPolicyConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)

    @model_validator(mode="after")
    def _anchors_fit_row(self) -> RunConfig:
        if self.drafter.block_span > self.data.seq_len:
            raise ValueError(f"drafter.block_size {self.drafter.block_size} exceeds data.seq_len {self.data.seq_len}")
        return self

    @model_validator(mode="after")
    def _on_policy_runs_here(self) -> RunConfig:
        if self.train.stage != "on_policy":
            return self
        if self.drafter.variant != "dflash":
            raise ValueError(
                f"train.stage=on_policy trains DFlash drafters, not drafter.variant={self.drafter.variant}"
            )
        if self.data.features:
            raise ValueError(
                "train.stage=on_policy decodes with the target as it trains: not from a feature cache (data.features)"
            )
        if self.topology.target_ranks and self.topology.drafter_ranks > 1:
            raise ValueError(
                "train.stage=on_policy with target ranks trains on one drafter rank: set topology.drafter_ranks=1 "
                f"(got {self.topology.drafter_ranks}; data-parallel drafter ranks are not built for this stage)"
            )
        if self.on_policy.rollout == "ddtree" and self.on_policy.teacher == "verified":
            raise ValueError(
                "on_policy.teacher=verified reads a chain's verification states (past the first rejected slot a "
                "tree has no single draft to condition on): use on_policy.teacher=text with on_policy.rollout=ddtree"
            )
        return self

    @model_validator(mode="after")
    def _one_block_credit(self) -> RunConfig:
        credit = self.drafter.variant_settings.block_credit
        if credit and self.loss.position_weights == "dpace":
            raise ValueError(
                f"loss.position_weights=dpace and drafter.{self.drafter.variant}.{credit} both replace the slot "
                "weights by a block credit: choose one"
            )
        return self


def add_variant_section(name: str, settings: type[VariantSettings]) -> None:
    """Make ``drafter.variant=name`` valid and, when ``settings`` has fields, ``drafter.<name>`` its typed
    section (placed after ``variant``, in registration order: ``run.yaml`` keeps one key order).
    Registering a name again with the same settings changes nothing; with other settings it is refused."""
    known = VARIANT_SETTINGS.get(name)
    if known is not None:
        if known is not settings:
            raise ValueError(f"drafter variant {name!r} is registered already, with {known.__name__}")
        return
    if not name.isidentifier() or name in DrafterConfig.model_fields:
        raise ValueError(f"drafter variant name {name!r} is no identifier, or a drafter setting's name")
    VARIANT_SETTINGS[name] = settings
    if not settings.model_fields:
        return
    fields = DrafterConfig.__pydantic_fields__
    before = list(fields)
    place = before.index("variant") + sum(1 for n in VARIANT_SETTINGS if n in fields) + 1
    moved = {k: fields.pop(k) for k in before[place:]}
    fields[name] = FieldInfo(annotation=settings, default_factory=settings, description=f"settings of variant {name}")
    fields.update(moved)
    DrafterConfig.model_rebuild(force=True)
    RunConfig.model_rebuild(force=True)


def remove_variant_section(name: str) -> None:
    """Undo ``add_variant_section`` (a variant registered for a while: a test's)."""
    VARIANT_SETTINGS.pop(name, None)
    if DrafterConfig.__pydantic_fields__.pop(name, None) is not None:
        DrafterConfig.model_rebuild(force=True)
        RunConfig.model_rebuild(force=True)


# the registered variants' settings, by name (the schema's variant choices); dflash: the base, no fields
VARIANT_SETTINGS: dict[str, type[VariantSettings]] = {"dflash": VariantSettings}
