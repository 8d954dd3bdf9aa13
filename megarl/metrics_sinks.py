"""Where per-step metrics go: TensorBoard, Weights & Biases, MLflow (``logging.sinks``).

Every sink receives the same ``{name: float}`` dict at the same step, so a metric has the same
name everywhere (``reward/mean``, ``routing/agreement_layer03``, ...). Nothing here needs a
network: W&B runs offline by default (files under ``OUTPUT_DIR/wandb``, uploadable later with
``wandb sync``) and MLflow writes a local file store (``OUTPUT_DIR/mlruns``) unless
``logging.mlflow_uri`` names a server. The W&B and MLflow packages are imported only when their
sink is chosen (they are optional: ``pip install wandb mlflow-skinny``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

SINKS = ("tensorboard", "jsonl", "wandb", "mlflow")


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class JsonlSink:
    """``OUTPUT_DIR/metrics.jsonl``: one line per logged step, ``{"step": S, "name": value, ...}``,
    appended across resumes (a resumed run's line of a step it redid comes after the first run's).
    Floats are written exactly (``repr``), so two runs can be compared bit for bit without a
    tracking server; ``benchmarks/soak.py`` does."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class WandbSink:
    """One W&B run per megarl run; system-stats sampling, console capture and code/git upload
    off (they cost CPU on trainer nodes and are not metrics)."""

    def __init__(self, run_dir: Path, project: str, name: str, mode: str, config: Optional[dict] = None):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("logging.sinks has wandb but the wandb package is not installed "
                               "(pip install wandb)") from err
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False)
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config or {},
                              settings=settings, reinit="create_new")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment ``project``; a ``file:`` store is allowed explicitly (MLflow 3
    refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``; it is the one store that needs no server
    and no database package)."""

    def __init__(self, uri: str, project: str, name: str, params: Optional[dict] = None):
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError("logging.sinks has mlflow but the mlflow package is not installed "
                               "(pip install mlflow-skinny)") from err
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        if params:
            from mlflow.entities import Param

            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):   # MLflow's limit of params per log_batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):   # MLflow's log_batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flat_config(cfg: Any) -> dict[str, Any]:
    """``a.b.c -> value`` of a dataclass config (the run's parameters in W&B / MLflow)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value
    walk("", dataclasses.asdict(cfg))
    return out


def build_sinks(cfg: Any, out_dir: Path) -> list[Sink]:
    """The sinks ``cfg.logging.sinks`` names, writing under ``out_dir`` by default."""
    lg = cfg.logging
    sinks: list[Sink] = []
    for kind in lg.sinks:
        if kind == "tensorboard":
            sinks.append(TensorBoardSink(Path(lg.tensorboard_dir or out_dir / "tensorboard")))
        elif kind == "jsonl":
            sinks.append(JsonlSink(out_dir / "metrics.jsonl"))
        elif kind == "wandb":
            sinks.append(WandbSink(Path(lg.wandb_dir or out_dir), lg.project, cfg.name, lg.wandb_mode,
                                   dataclasses.asdict(cfg)))
        elif kind == "mlflow":
            uri = lg.mlflow_uri or (out_dir / "mlruns").resolve().as_uri()
            sinks.append(MlflowSink(uri, lg.project, cfg.name, flat_config(cfg)))
        else:
            raise ValueError(f"logging.sinks: unknown sink {kind!r} (choose from {', '.join(SINKS)})")
    return sinks
