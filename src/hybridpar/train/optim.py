"""Optimizers and learning-rate schedules from the config. A schedule is a pure function of the step,
so a resumed run needs no scheduler state to continue exactly."""

from __future__ import annotations

import math

import torch

from hybridpar.train.config import OptimizerConfig, ScheduleConfig


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def learning_rate(step: int, total_steps: int, base_lr: float, cfg: ScheduleConfig) -> float:
    """The rate for step ``step`` (0-based): linear warm-up, then constant, cosine or step decay."""
    if step < cfg.warmup_steps:
        return base_lr * (step + 1) / cfg.warmup_steps
    if cfg.name == "cosine":
        span = max(1, total_steps - cfg.warmup_steps - 1)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + (base_lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
    if cfg.name == "step":
        return base_lr * cfg.factor ** sum(step >= s for s in cfg.decay_steps)
    return base_lr


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
