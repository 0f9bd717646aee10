"""The built-in default: M2PO on a synthetic arithmetic task, rollouts 4 updates stale.

A small causal LM learns 1-2 digit addition from scratch on a CPU: a short supervised
warm-up makes it sometimes right, then GRPO-style RL with M2PO trains on rollouts that
were generated `rollout.max_head_offpolicyness` updates earlier.

Run:
  m2po-train                                  # this config, workdir ./runs/default
  m2po-train --config=configs/default.py --workdir=/tmp/run \
      --config.actor.m2_threshold=0.04 --config.rollout.max_head_offpolicyness=8

Every field, its default, what it allows and what it means is declared once, in
m2po_jax/common/config_schema.py; docs/configuration.md ("Every field") lists them.
"""

import ml_collections

from m2po_jax.common import config_schema, knobs


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg:  # a preset here would be ignored silently
        raise ValueError(
            f"configs/default.py: no presets (got {arg!r}); the arithmetic presets are in "
            f"configs/arith.py, e.g. --config=configs/arith.py:{arg}"
        )
    return knobs.default_configdict(config_schema.Config)
