"""Presets on the built-in arithmetic task, selected by the config argument.

  m2po-train --config=configs/arith.py:m2po        # the default: stale-4 rollouts, M2PO on
  m2po-train --config=configs/arith.py:grpo        # on-policy GRPO (k = 0), no M2PO
  m2po-train --config=configs/arith.py:stale_grpo  # stale-4 GRPO without M2PO
  m2po-train --config=configs/arith.py:stale_grpo,tiny   # presets combine left to right
  m2po-study --config=arith:m2po,moe ...           # a study on a tiny mixture of experts

Presets: m2po, grpo, stale_grpo, paper (the paper's variant: m2 against the current
policy, <= rule, no epsilon clip, loss over all valid tokens), authors (the authors'
code: harmful tokens, capped-mean clip range), paper_final (the published ICLR 2026 M2PO:
harmful-quadrant candidates, <= rule over the whole batch, -exp(log r) * A without clip;
m2po_jax/algorithm/variants.py), calculator (multi-turn tool use: a calculator the policy
learns to call; m2po_jax/tasks/calculator.py), moe (a Qwen3-MoE of the same shape: 8 experts,
top-2; m2po_jax/models/moe.py), tiny (a seconds-long wiring check for tests:
too small and too short to learn anything, and no plots; its held-out accuracy stays 0).
"""

import ml_collections

from m2po_jax.algorithm import variants
from m2po_jax.configs import default


def _m2po(c):
    c.actor.m2_threshold = 0.04


def _grpo(c):
    c.actor.m2_threshold = None
    c.rollout.max_head_offpolicyness = 0


def _stale_grpo(c):
    c.actor.m2_threshold = None
    c.rollout.max_head_offpolicyness = 4


def _paper(c):
    c.actor.m2_threshold = 0.04
    variants.configure(c.actor, "paper")  # no ratio clip: the loss is -A * r on the kept tokens


def _paper_final(c):
    c.actor.m2_threshold = 0.04
    variants.configure(c.actor, "paper_final")


def _authors(c):
    c.actor.m2_threshold = 0.04
    variants.configure(c.actor, "authors")


def _calculator(c):
    """Multi-turn tool use: products of 2-3 digit numbers with a calculator tool the policy
    may call, "(347*86)", whose answer is appended to the episode (m2po_jax/tasks/calculator.py).
    The warm-up shows the call in a tenth of its examples; RL learns to use it."""
    c.actor.m2_threshold = 0.04
    c.task.name = "calculator"
    c.task.ops = "*"
    c.task.min_digits = 2
    c.task.max_digits = 3
    c.task.max_prompt_len = 10  # BOS and "347*86=": 9 tokens at most
    c.task.tool_demos = 0.1
    c.gconfig.max_new_tokens = 24  # "(347*86)" EOS "29842=" "29842" EOS: 21 at most
    c.agent.env = "tools"
    c.agent.tools = "m2po_jax.tasks.calculator:calculator"
    c.agent.max_turns = 2
    c.agent.max_append_tokens = 8  # a 6-digit product and "="
    c.agent.on_tool_error = "end"  # a failed call's error text is not in the alphabet


def _moe(c):
    """A new Qwen3-MoE in place of the dense llama: every layer's MLP 8 SwiGLU experts of an
    eighth of `model.intermediate_size` (the width when this preset runs: put it after
    presets that change it), each token routed to 2 (top-k renormalised). An eighth, not
    a quarter: on CPU `ragged_dot` runs every expert on every token, masked, so the
    experts cost X x their width; a 150-step arith run then takes 1.6x the dense one's
    wall time (a quarter: 2.4x; docs/scale.md)."""
    c.model.model_type = "qwen3_moe"
    c.model.num_experts = 8
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = c.model.intermediate_size // 8


def _tiny(c):
    c.total_steps = 4
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.sft.max_steps = 4
    c.sft.batch_size = 16
    c.sft.eval_every = 2
    c.gconfig.n_samples = 4
    c.rollout.batch_size = 4
    c.rollout.max_head_offpolicyness = min(c.rollout.max_head_offpolicyness, 2)
    c.actor.ppo_n_minibatches = 2
    c.eval.every = 2
    c.eval.num_examples = 16
    c.eval.batch_size = 16
    c.checkpoint.every = 2
    c.logging.progress = False
    c.logging.plots = False


PRESETS = {
    "m2po": _m2po,
    "grpo": _grpo,
    "stale_grpo": _stale_grpo,
    "paper": _paper,
    "paper_final": _paper_final,
    "authors": _authors,
    "tiny": _tiny,
    "calculator": _calculator,
    "moe": _moe,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    for name in filter(None, (arg or "m2po").split(",")):
        if name not in PRESETS:
            raise ValueError(
                f"configs/arith.py: unknown preset {name!r}; choose from {sorted(PRESETS)}"
            )
        PRESETS[name](c)
    return c
