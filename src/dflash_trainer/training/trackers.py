"""Experiment trackers (``train.trackers``): every record the writer appends to ``metrics.jsonl`` also
goes to TensorBoard, Weights & Biases, MLflow and trackio, any subset at once, from the writer rank
only (rank 0 of the drafter ranks).

Each tracker is an optional extra (``pip install 'dflash-trainer[wandb]'``); a tracker named in the
config whose package is missing is refused before anything loads, in one line naming the extra. Every
tracker gets the run's name and its resolved config. A resumed run (``--resume``) continues the same
tracker runs: their ids are kept in ``OUT/trackers.json``, which a fresh run replaces.

Where each one writes (nothing leaves the machine unless the user points a tracker at a server):

- tensorboard: ``OUT/tensorboard``; on resume, ``purge_step`` drops the events of the steps run again.
- wandb: ``OUT/wandb``, online or offline as ``WANDB_MODE`` says (offline on an air-gapped node, then
  ``wandb sync OUT/wandb/offline-run-*``), project ``train.tracker_project``.
- mlflow: ``MLFLOW_TRACKING_URI`` when set, else MLflow's own default store, a SQLite database, placed in
  the run's folder (``OUT/mlflow.db``) rather than the working directory; experiment
  ``train.tracker_project``.
- trackio: trackio's local store (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``; ``trackio
  show`` opens it), project ``train.tracker_project``.

A record is flattened into scalars: lists become ``key/0, key/1, ...`` (``eval_slot_acceptance/0`` is
slot 1), nested dicts ``key/sub``; ``step`` is each tracker's step axis. The steps a resumed run runs
again (between its checkpoint and the kill) are logged again; a bit-identical resume logs the same
values, and readers keep the last value per step (wandb itself ignores the repeats).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import UserError
from ..io import atomic_write_json

STATE_FILE = "trackers.json"


def installed(name: str) -> bool:
    """Whether tracker ``name``'s package (of the same name, installed by the extra of that name) imports."""
    return importlib.util.find_spec(name) is not None


def resolve_trackers(names: Iterable[str] | None) -> list[str]:
    """The trackers a run logs to: ``names`` as configured, each checked to be installed (one line
    naming the extra otherwise); ``None`` (the default) is TensorBoard where it is installed, else none."""
    if names is None:
        return ["tensorboard"] if installed("tensorboard") else []
    chosen = list(dict.fromkeys(names))  # once each, in the order given
    for name in chosen:
        if not installed(name):
            raise UserError(
                f"train.trackers names {name}, which is not installed here: pip install 'dflash-trainer[{name}]'"
            )
    return chosen


def tracker_run_name(cfg) -> str:
    """The name trackers show: the config's ``name``, or the output folder's when ``name`` is left at
    its default ("run": every run would be called that)."""
    return cfg.name if cfg.name != "run" else Path(cfg.output_dir).name


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics.jsonl ``record`` (not its ``step``), flattened: ``{"a": [x, y]}`` ->
    ``{"a/0": x, "a/1": y}``, ``{"a": {"b": x}}`` -> ``{"a/b": x}``; strings and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key == "step":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, (bool, int, float)):
            out[name] = float(value)
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, f"{name}/"))
        elif isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
    return out


def _flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": "0.001"}``: MLflow's parameters are flat strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


# Each tracker: (out folder, run name, project, config, its entry of trackers.json, resume step or None);
# ``state`` is what a resumed run needs to reopen the same tracker run.


class _TensorBoard:
    def __init__(self, out_dir: Path, name: str, project: str, config: dict, state: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: on reload, TensorBoard drops the events of the steps this run logs again
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)
        if resume_step is None:
            import yaml

            self.writer.add_text("config", f"run `{name}`\n\n```yaml\n{yaml.safe_dump(config, sort_keys=False)}```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():  # float64 on disk: read back, it equals metrics.jsonl
            self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out_dir: Path, name: str, project: str, config: dict, state: dict, resume_step: int | None):
        import wandb

        state.setdefault("id", secrets.token_hex(4))  # wandb ids: 8 characters of [a-z0-9]
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                id=state["id"],
                resume="allow",
                dir=str(out_dir),
                config=config,
                settings=wandb.Settings(console="off"),
            )
        except wandb.errors.UsageError as exc:
            raise UserError(
                f"wandb: {str(exc).splitlines()[0]}; run `wandb login`, or set WANDB_MODE=offline "
                "and `wandb sync` the run folder later"
            ) from None

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out_dir: Path, name: str, project: str, config: dict, state: dict, resume_step: int | None):
        from mlflow.tracking import MlflowClient

        default = f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        uri = state.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or default
        state["tracking_uri"] = uri
        self.client = MlflowClient(tracking_uri=uri)
        if "run_id" in state:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = state["run_id"] = self.client.create_run(experiment_id, run_name=name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in _flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, out_dir: Path, name: str, project: str, config: dict, state: dict, resume_step: int | None):
        import trackio

        # resume="allow": the run of this name in this project continues, so trackers.json needs nothing
        self.run = trackio.init(
            project=project,
            name=name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow, "trackio": _Trackio}


class Trackers:
    """The run's trackers, opened by the writer rank when the loop starts and closed when it ends.

    ``names``: from ``resolve_trackers``. ``config``: the resolved config (``RunConfig.model_dump``).
    ``resume_step``: the step the run resumes from, or None for a fresh run (a fresh run starts new
    tracker runs; a resumed one reopens those ``OUT/trackers.json`` names)."""

    def __init__(self, names: list[str], out_dir: Path, name: str, project: str, config: dict, resume_step: int | None):
        self.out_dir = Path(out_dir)
        path = self.out_dir / STATE_FILE
        states: dict = {}
        if resume_step is not None and path.is_file():
            states = json.loads(path.read_text())
        self.open: dict = {}
        try:
            for tracker in names:
                state = states.setdefault(tracker, {})
                self.open[tracker] = _OPEN[tracker](self.out_dir, name, project, config, state, resume_step)
        except BaseException:
            self.close()
            raise
        if names:
            atomic_write_json(path, states)

    def log(self, record: dict) -> None:
        """Send one metrics.jsonl ``record`` (with its ``step``) to every open tracker."""
        if not self.open:
            return
        values = scalars(record)
        for tracker in self.open.values():
            tracker.log(values, record["step"])

    def close(self) -> None:
        for tracker in self.open.values():
            tracker.close()
        self.open = {}
