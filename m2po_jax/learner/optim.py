"""The RL optimizer: AdamW with global-norm clipping and a warm-up + decay learning rate."""

from __future__ import annotations

import optax

from m2po_jax.common.config_schema import OptimizerSection

# The learning-rate schedules after warm-up (`actor.optimizer.lr_scheduler_type`).
LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")


def make_schedule(opt: OptimizerSection, total_updates: int) -> optax.Schedule:
    """Learning rate per optimizer update: linear warm-up, then constant / linear / cosine."""
    total_updates = max(int(total_updates), 1)
    warmup = int(opt.warmup_steps_proportion * total_updates)  # truncated, as AReaL's engines
    decay = max(total_updates - warmup, 1)
    end = opt.lr * opt.min_lr_ratio
    if opt.lr_scheduler_type == "constant":
        main = optax.constant_schedule(opt.lr)
    elif opt.lr_scheduler_type == "linear":
        main = optax.linear_schedule(opt.lr, end, decay)
    elif opt.lr_scheduler_type == "cosine":
        main = optax.cosine_decay_schedule(opt.lr, decay, alpha=opt.min_lr_ratio)
    else:
        raise ValueError(
            f"lr_scheduler_type={opt.lr_scheduler_type!r}; expected constant, linear or cosine"
        )
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, opt.lr, warmup), main], [warmup])


def make_optimizer(opt: OptimizerSection, total_updates: int):
    """AdamW with global-norm clipping; returns (tx, schedule)."""
    schedule = make_schedule(opt, total_updates)
    parts = []
    if opt.gradient_clipping > 0:
        parts.append(optax.clip_by_global_norm(opt.gradient_clipping))
    parts.append(
        optax.adamw(
            schedule, b1=opt.beta1, b2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay
        )
    )
    return optax.chain(*parts), schedule
