"""What a stage checkpoint holds of a StageWorker (state/keeper.py writes and reads it):
everything that determines how the worker continues, so a resumed node goes on
exactly where it stopped. A mixin of StageWorker, along the seam between training and
saving it."""

from __future__ import annotations

import json

import torch


class CheckpointState:
    @torch.no_grad()
    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Copies of everything that determines how this worker continues: theta (and
        gradients accumulated towards the next step), phi, momentum, the inner
        optimizer's moments, counters and the torch RNG."""
        tensors: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            tensors[f"theta.{i}"] = p.detach().clone()
            if p.grad is not None:
                tensors[f"grad.{i}"] = p.grad.detach().clone()
        if self.slow is not None:
            for i, (phi, momentum) in enumerate(zip(self.slow.phi, self.slow.momentum)):
                tensors[f"phi.{i}"] = phi.clone()
                tensors[f"momentum.{i}"] = momentum.clone()
        if self.encoder is not None:  # what earlier rounds could not send: the next round sends it
            for kind, feedback in self.encoder.feedback.items():
                for i, residual in enumerate(feedback.residual if feedback and feedback.residual else []):
                    tensors[f"feedback.{kind}.{i}"] = residual.clone()
        optimizer = self.inner.moments_state_dict()
        for index, state in optimizer["state"].items():
            for name, value in state.items():
                tensors[f"adam.{index}.{name}"] = (
                    value.clone() if torch.is_tensor(value) else torch.tensor(value)
                )
        tensors["rng.torch"] = torch.get_rng_state()
        meta = {"stage": self.stage.stage_index, "vocab_size": self.model_config.vocab_size,
                "param_names": [name for name, _ in self.stage.named_parameters()],
                "spec": json.loads(self.spec.canonical_json()),  # enough to export without the run's files
                "inner_step": self.inner.step_count, "outer_round": self.outer_round,
                "last_round_step": self.last_round_step, "round_forced": self.round_forced,
                "pending_samples": self.pending_samples, "pending_microbatches": self.pending_microbatches,
                "loss_ema": self.loss_ema, "adam_param_groups": optimizer["param_groups"]}
        return tensors, meta

    @torch.no_grad()
    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Inverse of checkpoint_state; ValueError when the state does not fit this stage."""
        try:
            for i, p in enumerate(self.params):
                theta = tensors[f"theta.{i}"]
                if theta.shape != p.shape:
                    raise ValueError(f"theta.{i} has shape {tuple(theta.shape)}, this stage needs "
                                     f"{tuple(p.shape)}")
                p.copy_(theta.to(p.device, p.dtype))
                grad = tensors.get(f"grad.{i}")
                p.grad = None if grad is None else grad.to(p.device, p.dtype).clone()
            if self.slow is not None:
                n = len(self.params)
                self.slow.load_state_dict(
                    {
                        "phi": [tensors[f"phi.{i}"].to(self.device) for i in range(n)],
                        "momentum": [tensors[f"momentum.{i}"].to(self.device) for i in range(n)],
                    }
                )
            if self.encoder is not None:
                for kind, feedback in self.encoder.feedback.items():
                    if feedback is not None and f"feedback.{kind}.0" in tensors:
                        feedback.residual = [tensors[f"feedback.{kind}.{i}"].to(self.device)
                                             for i in range(len(self.params))]
            state: dict[int, dict] = {}
            for key, value in tensors.items():
                if key.startswith("adam."):
                    _, index, name = key.split(".", 2)
                    state.setdefault(int(index), {})[name] = value
            self.inner.load_moments_state_dict({"state": state})
            self.inner.step_count = int(meta["inner_step"])
            self.outer_round = int(meta["outer_round"])
            self.last_round_step = int(meta["last_round_step"])
            self.round_forced = bool(meta["round_forced"])
            self.pending_samples = int(meta["pending_samples"])
            self.pending_microbatches = int(meta["pending_microbatches"])
            self.loss_ema = meta["loss_ema"]
            torch.set_rng_state(tensors["rng.torch"])
        except KeyError as exc:
            raise ValueError(
                f"the checkpoint lacks {exc}: it was written for another stage or model"
            ) from None
