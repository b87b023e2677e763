"""One model from stage checkpoints: every stage of the run exactly once, or several
peers of a stage averaged (NoLoCo replicas of a stage drift apart a little; their mean is
the natural consensus model, as the paper evaluates it) when they are at about the same
point of training (swarm_node.export.replicas). The weights exported are theta, the fast
weights the node was training with (equal to phi right after an outer round).

Checkpoints say which run, stage and parameter names they hold, so nothing but the
checkpoint directories is needed."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm_node.errors import ConfigError
from swarm_node.export.replicas import StageCheckpoint, check_stage_spread, refuse_same_peer_twice
from swarm_node.model.config import ModelConfig
from swarm_node.spec import RunSpec
from swarm_node.state.checkpoint import PREFIX, latest_checkpoint, load_checkpoint

log = logging.getLogger(__name__)


@dataclass
class AssembledModel:
    spec: RunSpec
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face Llama names (and a bottleneck's boundaries.*), fp32
    peers_per_stage: list[int]


def read_stage_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A ``ckpt-*`` directory, or a node's --checkpoint-dir (its newest intact checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"--checkpoint {path} {what}: give a node's --checkpoint-dir or one ckpt-* "
                          "directory in it")
    if path.name.startswith(PREFIX):
        return load_checkpoint(path)
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(
            f"{path} holds no checkpoint (give a node's --checkpoint-dir or one ckpt-* directory)"
        )
    return found


def assemble(paths: list[Path], *, force: bool = False) -> AssembledModel:
    """``force``: average the checkpoints of a stage even when they are far apart in
    training (replicas.SPREAD_RULE), with a warning per stage instead of a refusal."""
    weights: dict[int, list[dict[str, torch.Tensor]]] = {}
    found: list[StageCheckpoint] = []
    spec: RunSpec | None = None
    spec_path: Path | None = None
    vocab_size = None
    for path in paths:
        tensors, meta = read_stage_checkpoint(path)
        if "param_names" not in meta or "spec" not in meta:
            raise ConfigError(
                f"{path}: this checkpoint predates exports (no parameter names or run spec in it); "
                "let the node write a new one"
            )
        this_spec = RunSpec.from_dict(meta["spec"])
        if spec is not None and this_spec.spec_hash() != spec.spec_hash():
            raise ConfigError(
                f"{path} belongs to run spec {this_spec.spec_hash()} (run {this_spec.run_id!r}), {spec_path} "
                f"to {spec.spec_hash()} (run {spec.run_id!r}): give checkpoints of one run only"
            )
        spec, spec_path, vocab_size = this_spec, spec_path or path, meta["vocab_size"]
        names = meta["param_names"]
        weights.setdefault(meta["stage"], []).append({name: tensors[f"theta.{i}"]
                                                      for i, name in enumerate(names)})
        found.append(StageCheckpoint(
            path=Path(path), stage=meta["stage"], peer_id=meta.get("peer_id"),
            inner_step=int(meta.get("inner_step", meta["step"])),
            outer_round=int(meta["outer_round"]) if this_spec.method.has_outer_step and "outer_round" in meta
            else None))
    if spec is None:
        raise ConfigError("give at least one checkpoint")
    missing = sorted(set(range(spec.num_stages)) - set(weights))
    if missing:
        raise ConfigError(
            f"no checkpoint of stage(s) {', '.join(map(str, missing))}: a model needs every stage "
            f"of the run ({spec.num_stages})"
        )
    refuse_same_peer_twice(found)
    warnings = [check_stage_spread(spec, [c for c in found if c.stage == stage], force=force)
                for stage in range(spec.num_stages)]
    for warning in filter(None, warnings):
        log.warning("%s", warning)
    state_dict: dict[str, torch.Tensor] = {}
    for stage in range(spec.num_stages):
        replicas = weights[stage]
        for name in replicas[0]:
            state_dict[name] = torch.stack([r[name].float() for r in replicas]).mean(0)
        if len(replicas) > 1:
            log.info("stage %d: averaged %d peers' weights", stage, len(replicas))
    config, boundary = spec.model(vocab_size)
    if boundary is not None:
        config, state_dict = _coded(spec, config, state_dict)
    return AssembledModel(spec, config, state_dict, [len(weights[s]) for s in range(spec.num_stages)])


def _coded(spec: RunSpec, config: ModelConfig,
           state_dict: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A coded run's model in the form its export takes. A ``subspace`` model is a plain
    Llama whose weights lie in a subspace (model/boundary.py plain_state_dict multiplies
    them out); a ``bottleneck`` model keeps its boundary layers and its config's
    boundary, and is written with a modelling file of its own (export/hf.py)."""
    from swarm_node.model.boundary import plain_state_dict
    from swarm_node.model.stages import build_model

    model = build_model(config, seed=spec.seed)  # a subspace's fixed basis and table, from the run's seed
    model.load_state_dict(state_dict, strict=True)  # every boundary weight is there, and nothing else
    if config.boundary.kind == "bottleneck":
        return config, state_dict
    return dataclasses.replace(config, boundary=None), plain_state_dict(model)


def load_model(assembled: AssembledModel):
    """Our own unsplit model with the assembled weights (for sampling and for checks)."""
    from swarm_node.model.stages import build_model

    model = build_model(assembled.config, seed=assembled.spec.seed)
    model.load_state_dict(assembled.state_dict, strict=True)
    return model.eval()
