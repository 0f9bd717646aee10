"""A tiny Qwen3-MoE for the routing-replay tests (tests/rollout/replay_test.py records the
experts, tests/learner/router_replay_test.py replays them): 2 layers of 6 SwiGLU experts of
width 16, top-k renormalised, and random params whose routers (and optionally experts) are
scaled up. Not collected (no `_test` suffix); tests import it by bare name, since the suite's
rootdir conftest puts tests/ on sys.path."""

import jax

from m2po_jax.models import model as model_lib
from m2po_jax.models.model_config import ModelConfig


def config(top_k: int = 2, **changes) -> ModelConfig:
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        model_type="qwen3_moe",
        qk_norm=True,
        num_experts=6,
        num_experts_per_tok=top_k,
        moe_intermediate_size=16,
        norm_topk_prob=True,
    )
    return ModelConfig(**{**fields, **changes})


def params(config: ModelConfig, seed=0, router_scale=30.0, expert_scale=1.0):
    """Random params with every router kernel x `router_scale` (well-separated routing
    probabilities: cached and uncached forwards cannot pick different experts on a float
    near-tie) and the expert kernels x `expert_scale` (their outputs, hence the routing,
    move the logits)."""
    params = model_lib.init_params(config, jax.random.key(seed))
    for i in range(config.num_layers):
        mlp = params[f"layers_{i}"]["mlp"]
        mlp["router_kernel"] = mlp["router_kernel"] * router_scale
        for name in ("gate_experts", "up_experts", "down_experts"):
            mlp[name] = mlp[name] * expert_scale
    return params
