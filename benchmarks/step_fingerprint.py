"""Fingerprints of the compiled train step: does a refactor change the program?

    python benchmarks/step_fingerprint.py > before.txt     # on the old tree
    python benchmarks/step_fingerprint.py > after.txt      # on the new one
    diff before.txt after.txt                             # empty: the same programs

Lowers `train_step.make_train_step` for a tiny model under each actor setting that picks
another path of the step plan (minibatches, micro-batches, the M2PO scopes, the proximal
sources, KL, the capped-clip rule, the kept denominator, no recompute), with and without
shared prompts, and prints a hash of each StableHLO text with source locations removed.
Equal hashes mean equal programs, so equal speed and memory: a stronger check than timing
a refactor with `benchmarks/step_bench.py`.
"""

from __future__ import annotations

import hashlib
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from m2po_jax import config as config_lib  # noqa: E402
from m2po_jax.common.types import PromptGroups, TrainBatch  # noqa: E402
from m2po_jax.configs import arith  # noqa: E402
from m2po_jax.learner import optim  # noqa: E402
from m2po_jax.learner import train_step as step_lib  # noqa: E402
from m2po_jax.models import model as model_lib  # noqa: E402
from m2po_jax.models.model_config import ModelConfig  # noqa: E402

MODEL = ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1
)
CASES = {
    "default": {},
    "minibatches": dict(ppo_n_minibatches=2),
    "micro-batches": dict(n_mbs=2),
    "microbatch-scope": dict(n_mbs=2, m2po_scope="microbatch"),
    "row-scope": dict(m2po_scope="row"),
    "minibatch-scope": dict(ppo_n_minibatches=2, m2po_scope="minibatch"),
    "current-policy-m2": dict(ppo_n_minibatches=2, m2po_second_moment="current_behav"),
    "loglinear": dict(prox_logp_method="loglinear", ppo_n_minibatches=2, m2_threshold=None),
    "loglinear-metrics": dict(prox_logp_method="metrics"),
    "m2po-off": dict(m2_threshold=None, n_mbs=2),
    "kl": dict(kl_ctl=0.1),
    "capped-clip": dict(m2po_stop_rule="capped_clip", eps_clip=0.2),
    "kept-denominator": dict(loss_denominator="kept", ppo_n_minibatches=2),
    "no-recompute": dict(recompute_logprob=False, use_decoupled_loss=False),
}
ROWS, PROMPT, GROUP, SEQ = 16, 5, 4, 11


def actor(changes: dict):
    c = arith.get_config("m2po").to_dict()
    changes = dict(changes)
    c["actor"]["mb_spec"]["n_mbs"] = changes.pop("n_mbs", 1)
    c["actor"].update(changes)
    return config_lib.from_configdict(c).actor


def lowered_step(model: ModelConfig, a, rows: int, seq: int, groups=None) -> str:
    """The StableHLO text of the train step for actor settings `a` on a zero batch of
    [rows, seq], source locations removed (they move with the code). Also what
    `tests/learner/actor_fields_test.py` compares."""
    tx, schedule = optim.make_optimizer(a.optimizer, 10)
    params = model_lib.init_params(model, jax.random.key(0))
    state = step_lib.init_train_state(params, tx)
    kwargs = dict(groups=groups) if groups is not None else {}
    step = step_lib.make_train_step(model, a, tx, schedule, **kwargs)
    batch = TrainBatch(
        tokens_BxT=jnp.zeros((rows, seq), jnp.int32),
        valid_BxT=jnp.ones((rows, seq), bool),
        behav_logp_BxT=jnp.zeros((rows, seq)),
        loss_mask_BxT=jnp.ones((rows, seq), bool),
        rewards_B=jnp.zeros(rows),
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros((rows, seq), jnp.int32),
    )
    ref = params if a.kl_ctl > 0 else None
    text = step.lower(state, batch, jax.random.key(0), ref).as_text()
    return re.sub(r"#loc\d*|loc\([^)]*\)", "", text)


def fingerprint(changes: dict, shared: bool) -> str:
    groups = PromptGroups(PROMPT, GROUP) if shared else None
    text = lowered_step(MODEL, actor(changes), ROWS, SEQ, groups)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> None:
    for name, changes in CASES.items():
        for shared in (False, True):
            print(f"{name:20s} shared_prompts={shared!s:5s} {fingerprint(changes, shared)}")


if __name__ == "__main__":
    main()
