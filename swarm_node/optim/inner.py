"""The inner optimizer: Adam/AdamW with gradient clipping over the worker's own stage
and a linear warm-up + cosine decay schedule that follows the worker's own step
counter (so a late joiner continues the schedule where its stage is)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InnerHyper:
    lr: float = 6e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # <= 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_at(step: int, hyper: InnerHyper) -> float:
    """Learning rate for inner step ``step`` (0-based)."""
    if step < hyper.warmup_steps:
        return hyper.lr * (step + 1) / hyper.warmup_steps
    decay_steps = max(1, hyper.total_steps - hyper.warmup_steps)
    progress = min(1.0, (step - hyper.warmup_steps) / decay_steps)
    floor = hyper.lr * hyper.min_lr_ratio
    return floor + 0.5 * (hyper.lr - floor) * (1 + math.cos(math.pi * progress))


def moment_bound(betas: tuple[float, float]) -> float | None:
    """C with exp_avg**2 <= C * exp_avg_sq for any gradients (Cauchy-Schwarz over the two
    EMAs' weights (1 - b1) b1**k and (1 - b2) b2**k): (1 - b1)**2 / (1 - b2) / (1 - b1**2 / b2);
    52.9 for the default (0.9, 0.999). None where b1**2 >= b2 (no bound)."""
    beta1, beta2 = betas
    if beta1 ** 2 >= beta2 or beta2 >= 1:
        return None
    return (1 - beta1) ** 2 / (1 - beta2) / (1 - beta1 ** 2 / beta2)


def fused_by_default(device: torch.device) -> bool:
    """Whether parameters on ``device`` step through torch's fused AdamW kernel: on CUDA,
    where the foreach path's dozen kernel launches per parameter group and its
    temporaries cost a visible share of a step; elsewhere the foreach path, which is
    bit-identical to ``torch.optim.AdamW(foreach=True)``."""
    return device.type == "cuda" and hasattr(torch, "_fused_adamw_")


class InnerOptimizer:
    """AdamW with decoupled weight decay, written out in torch's foreach kernels: the
    same operations in the same order as ``torch.optim.AdamW(foreach=True)``, so its
    steps are bit-identical to it (tests/unit/test_inner.py checks), and its state
    dict has torch's layout (checkpoints written with torch.optim load as they were).

    On CUDA (``fused_by_default``) the update goes through ``torch._fused_adamw_``, the
    kernel of ``torch.optim.AdamW(fused=True)``: the same update in one kernel launch,
    equal to the foreach path to fp32 rounding (tests/unit/test_inner.py compares them
    on the CPU, where torch has the kernel too; tests/gpu on the card). The state dict
    is the same either way: step counts stay CPU tensors and go to the device as one
    small copy a step.

    Not torch.optim itself: every call into a ``torch.optim.Optimizer`` imports
    torch._dynamo and sympy, about 800 modules, 1.4 s of CPU and 70 MB in every node
    process, which otherwise never needs them."""

    def __init__(self, params: Iterable[torch.nn.Parameter], hyper: InnerHyper, fused: bool | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.hyper = hyper
        # None: fused where the parameters live on CUDA (fused_by_default)
        self.fused = (
            fused if fused is not None else bool(self.params) and fused_by_default(self.params[0].device)
        )
        self.step_count = 0
        # per parameter index, made at its first gradient as torch does: a parameter that
        # has had none keeps no moments and takes no weight decay
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.hyper)

    # -- the moments as a joiner downloads them (state/sync.py) ----------------------------
    def moment_tensors(self) -> list[torch.Tensor]:
        """exp_avg per parameter, exp_avg_sq per parameter, then one tensor of the step
        counts (zeros for a parameter that has had no gradient yet), on the CPU in fp32."""
        def moment(i: int, name: str) -> torch.Tensor:
            state = self.state.get(i)
            return torch.zeros(self.params[i].shape) if state is None else state[name].float().cpu().clone()

        n = len(self.params)
        steps = torch.tensor([float(self.state[i]["step"]) if i in self.state else 0.0 for i in range(n)])
        return [moment(i, "exp_avg") for i in range(n)] + [moment(i,
                                                                  "exp_avg_sq") for i in range(n)] + [steps]

    def moments_problem(self, tensors: list[torch.Tensor]) -> str | None:
        """Why ``tensors`` (as ``moment_tensors`` lays them out) are moments no Adam of
        these hyperparameters could have made, or None. Beside shapes and finite values:
        exp_avg_sq is never negative, a step count is a whole number, and |exp_avg| is at
        most sqrt(C * exp_avg_sq), the Cauchy-Schwarz bound of two EMAs of the same
        gradients (``moment_bound``): moments forged to make a joiner's steps large cannot
        hide in them. (A step count is not
        held to the state's inner step: a joiner adopts its witnesses' counters, which may
        be below its donor's, and keeps the moments' counts. Bias correction scales a
        step by sqrt(1 - b2**t) / (1 - b1**t), at most 1 for the default betas, at the
        largest t.)"""
        n = len(self.params)
        if len(tensors) != 2 * n + 1:
            return f"optimizer moments have {len(tensors)} tensors, this stage needs {2 * n + 1}"
        steps = tensors[-1]
        if steps.shape != (n,) or not steps.is_floating_point() or not bool(torch.isfinite(steps).all()):
            return "optimizer step counts do not fit this stage"
        if bool((steps < 0).any() | (steps != steps.round()).any()):
            return "optimizer step counts negative or not whole"
        bound = moment_bound(self.hyper.betas)
        for i, p in enumerate(self.params):
            m, v = tensors[i], tensors[n + i]
            if (
                m.shape != p.shape
                or v.shape != p.shape
                or not m.is_floating_point()
                or not v.is_floating_point()
            ):
                return f"optimizer moments of shape {tuple(m.shape)} do not fit {tuple(p.shape)}"
            m, v = m.double(), v.double()
            if not (bool(torch.isfinite(m).all()) and bool(torch.isfinite(v).all())) or bool((v < 0).any()):
                return "optimizer moments with non-finite or negative values"
            if bound is not None and bool((m * m > bound * v * (1 + 1e-4) + 1e-30).any()):
                return "optimizer moments no Adam makes (|exp_avg| above its bound by exp_avg_sq)"
        return None

    def load_moment_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Adopt moments ``moments_problem`` passed; a parameter at step 0 keeps none."""
        n = len(self.params)
        steps = tensors[-1].tolist()
        self.state = {i: {"step": torch.tensor(float(steps[i])),
                          "exp_avg": tensors[i].to(p.device, p.dtype).clone(),
                          "exp_avg_sq": tensors[n + i].to(p.device, p.dtype).clone()}
                      for i, p in enumerate(self.params) if steps[i] > 0}

    def step(self) -> float:
        """Clip, step at the scheduled lr, clear gradients; returns the pre-clip grad norm."""
        if self.hyper.clip_norm > 0:
            # foreach=None: torch takes its foreach kernels on CPU and CUDA and refuses
            # foreach=True on devices without them (MPS).
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.hyper.clip_norm, foreach=None))
        else:
            norm = float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
        self._adamw(self.lr)
        for p in self.params:
            p.grad = None
        self.step_count += 1
        return norm

    @torch.no_grad()
    def _adamw(self, lr: float) -> None:
        active = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not active:
            return
        for i in active:
            if i not in self.state:
                p = self.params[i]
                self.state[i] = {"step": torch.tensor(0.0),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        params = [self.params[i] for i in active]
        grads = [p.grad for p in params]
        states = [self.state[i] for i in active]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        beta1, beta2 = self.hyper.betas
        for s in states:
            s["step"] += 1
        if self.fused:
            self._fused_adamw(params, grads, exp_avgs, exp_avg_sqs, states, lr)
            return
        if self.hyper.weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * self.hyper.weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        steps = [s["step"].item() for s in states]
        step_sizes = [-(lr / (1 - beta1 ** t)) for t in steps]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2 ** t) ** 0.5 for t in steps])
        torch._foreach_add_(denominators, self.hyper.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)

    def _fused_adamw(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                     exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], states: list[dict[str, torch.Tensor]],
                     lr: float) -> None:
        """The same update in torch's fused kernel; it reads each parameter's step count
        (already advanced) from the parameters' device. The state dict does not say which
        path stepped: both keep the same moments."""
        steps = torch.tensor([float(s["step"]) for s in states], dtype=torch.float32).to(params[0].device)
        beta1, beta2 = self.hyper.betas
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], list(steps.unbind()), amsgrad=False,
                            lr=lr,
                            beta1=beta1, beta2=beta2, weight_decay=self.hyper.weight_decay,
                            eps=self.hyper.eps,
                            maximize=False)

    def moments_state_dict(self) -> dict:
        """The moments in torch.optim's state-dict layout: ``state`` by parameter index
        (``step``, ``exp_avg``, ``exp_avg_sq``) and one ``param_groups`` entry."""
        h = self.hyper
        group = {"lr": self.lr, "betas": h.betas, "eps": h.eps, "weight_decay": h.weight_decay,
                 "amsgrad": False,
                 "maximize": False, "foreach": True, "capturable": False, "differentiable": False,
                 "fused": None,
                 "decoupled_weight_decay": True, "params": list(range(len(self.params)))}
        return {"state": {i: dict(s) for i, s in self.state.items()}, "param_groups": [group]}

    def load_moments_state_dict(self, saved: dict) -> None:
        """Inverse of moments_state_dict, also for one torch.optim.AdamW wrote; ValueError
        when its moments do not fit these parameters."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, entry in saved["state"].items():
            index = int(index)
            if not 0 <= index < len(self.params):
                raise ValueError(f"optimizer state for parameter {index}; this stage has {len(self.params)}")
            p = self.params[index]
            for name in ("exp_avg", "exp_avg_sq"):
                if tuple(entry[name].shape) != tuple(p.shape):
                    raise ValueError(
                        f"optimizer {name} of parameter {index} has shape {tuple(entry[name].shape)},"
                        f" the parameter {tuple(p.shape)}"
                    )
            step = torch.as_tensor(entry["step"])
            if step.numel() != 1 or not torch.isfinite(step).all() or step.item() < 0:
                raise ValueError(f"optimizer step count of parameter {index} is {entry['step']!r}")
            state[index] = {"step": torch.tensor(float(step.item())),
                            "exp_avg": entry["exp_avg"].to(p.device, p.dtype).clone(),
                            "exp_avg_sq": entry["exp_avg_sq"].to(p.device, p.dtype).clone()}
        self.state = state

    def state_dict(self) -> dict:
        return {"optimizer": self.moments_state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.load_moments_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
