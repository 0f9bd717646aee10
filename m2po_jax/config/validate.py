"""Typed, validated run configuration made from an `ml_collections.ConfigDict`.

`configs/*.py` hold the commented defaults; `from_configdict` turns one into the frozen
dataclasses of `config_schema`, naming any unknown key (with the closest valid one), any
missing key, and any out-of-range value with its allowed range. Fields that must equal
another field are derived from it (`DERIVED`). `validate` builds the library objects the
run will build (rejection sampling, decoding settings), so that whatever they refuse is
refused at start-up. Overrides from files and dotted keys: `m2po_jax.config.overrides`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
import warnings
from typing import Any

import ml_collections

from m2po_jax.algorithm import penalties
from m2po_jax.algorithm import rejection as rejection_lib
from m2po_jax.common.checks import check_choice, did_you_mean
from m2po_jax.common.config_schema import (
    Config,
)
from m2po_jax.common.errors import ConfigError
from m2po_jax.learner import batching, optim
from m2po_jax.models.model_config import WEIGHT_QUANTS
from m2po_jax.models.prompts import CHAT_TEMPLATE_MODES, LONG_PROMPT_MODES
from m2po_jax.models.quant import WEIGHT_DTYPES
from m2po_jax.rollout import engines

# logits / temperature: below this the float32 log-probs and their gradients (scaled by
# 1 / temperature) overflow or lose all precision; greedy=True is the argmax limit.
MIN_TEMPERATURE = 1e-3

# Storage dtypes of params and optimizer state: float16 would need loss scaling, which the
# optimizer does not do (float16 is a compute dtype only: model.dtype).
PARAM_DTYPES = ("float32", "bfloat16")

# Fields that must equal another field: left unset (None) in configs/*.py, they take its
# value; an explicit different value is an error. field -> (source field, why).
DERIVED = {
    "actor.temperature": (
        "gconfig.temperature",
        "the behaviour log-probs are recorded at the sampling temperature, and the "
        "recomputed ones must use the same",
    ),
    "actor.reward_norm.group_size": (
        "gconfig.n_samples",
        "a group is the completions of one prompt",
    ),
}


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks `value` against the annotated type `tp`, converting ints to floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _build(cls, mapping: Any, prefix: str):
    if isinstance(mapping, ml_collections.ConfigDict):
        mapping = mapping.to_dict()
    if not isinstance(mapping, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a section, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in mapping:
        if key not in names:
            full = f"{prefix}{key}"
            valid = [f"{prefix}{n}" for n in names]
            raise ConfigError(f"unknown config key {full!r}{did_you_mean(full, valid)}")
    values = {}
    for name in names:
        where = f"{prefix}{name}"
        if name not in mapping:
            raise ConfigError(f"missing config key {where!r}")
        tp = hints[name]
        if _is_dataclass_type(tp):
            values[name] = _build(tp, mapping[name], where + ".")
        else:
            values[name] = _coerce(mapping[name], tp, where)
    return cls(**values)


def _check_lora(lora, names: tuple[str, ...]) -> None:
    _check_range("model.lora.rank", lora.rank, 0)
    _check_range("model.lora.alpha", lora.alpha, 0.0, low_open=True)
    if lora.dropout != 0.0:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout!r}: only 0.0 is supported (dropout in the loss "
            "pass would make the importance ratios compare a different network with the "
            "sampler's)"
        )
    targets = [t.strip() for t in lora.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in names]
    if lora.rank and (unknown or not targets or len(set(targets)) != len(targets)):
        raise ConfigError(
            f"model.lora.targets={lora.targets!r}: expected distinct comma-separated names "
            f"among {','.join(names)}"
        )
    from m2po_jax.models.model_config import LORA_BASES

    _check_choice("model.lora.base", lora.base, LORA_BASES)
    if lora.base != "float" and not lora.rank:
        raise ConfigError(
            f"model.lora.base={lora.base!r} quantises the adapted kernels: it needs "
            "model.lora.rank > 0 (LoRA on)"
        )


def _check_range(where: str, value, low=None, high=None, low_open=False, high_open=False):
    if value is None:
        return
    lo = "-inf" if low is None else str(low)
    hi = "inf" if high is None else str(high)
    # An unbounded end is open: inf itself is never allowed.
    interval = ("(" if low_open or low is None else "[") + f"{lo}, {hi}"
    interval += ")" if high_open or high is None else "]"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}={value!r} is not a finite number; allowed {interval}")
    bad = (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and (value >= high if high_open else value > high)
    )
    if bad:
        raise ConfigError(f"{where}={value!r} is out of range; allowed {interval}")


_check_choice = functools.partial(check_choice, error=ConfigError)


def _check_m2po(cfg: Config) -> Config:
    """actor.m2po_* choices and combinations; maps mesh.m2po_per_shard=True to scope "shard"."""
    # The library's own lists; imported here so that importing this module needs no JAX.
    from m2po_jax.algorithm import masking, scopes

    a = cfg.actor
    _check_choice("actor.m2po_method", a.m2po_method, masking.METHODS)
    _check_choice("actor.m2po_second_moment", a.m2po_second_moment, masking.SECOND_MOMENTS)
    _check_choice("actor.m2po_stop_rule", a.m2po_stop_rule, scopes.M2PO_STOP_RULES)
    _check_choice("actor.m2po_candidates", a.m2po_candidates, masking.CANDIDATES)
    _check_choice("actor.m2po_scope", a.m2po_scope, scopes.M2PO_SCOPES)
    if cfg.mesh.m2po_per_shard:
        if a.m2po_scope not in ("global", "shard"):
            raise ConfigError(
                f"mesh.m2po_per_shard=True (deprecated: it means actor.m2po_scope='shard') "
                f"contradicts actor.m2po_scope={a.m2po_scope!r}: a mask has one scope; set "
                "only actor.m2po_scope"
            )
        warnings.warn(
            "mesh.m2po_per_shard is deprecated and will be removed in the next release; "
            'use actor.m2po_scope="shard"',
            DeprecationWarning,
            stacklevel=4,
        )
        a = dataclasses.replace(a, m2po_scope="shard")
        cfg = dataclasses.replace(cfg, actor=a)
    if a.m2po_stop_rule == "capped_clip" and a.m2po_scope != "global":
        raise ConfigError(
            f"actor.m2po_stop_rule='capped_clip' needs actor.m2po_scope='global', got "
            f"{a.m2po_scope!r}: its clip bound is one scalar for the whole batch, taken once "
            "per step"
        )
    if a.m2po_stop_rule == "capped_clip" and a.m2po_second_moment != "behav_prox":
        raise ConfigError(
            f"actor.m2po_stop_rule='capped_clip' needs actor.m2po_second_moment='behav_prox', "
            f"got {a.m2po_second_moment!r}: its budget is taken from the behaviour and "
            "proximal log-probs at the start of the step, before the current policy moves"
        )
    return cfg


# Long on purpose: one flat table of checks in the order of configs/default.py, one line per
# field, so that a field's rule is found by searching its name; groups of checks that relate
# fields to each other have their own function (`_check_m2po`, `_check_lora`, `_check_agent`,
# `_check_derived`).
def validate(cfg: Config) -> Config:
    """Range and consistency checks, then the library objects the run will build (whatever
    they refuse is refused here); raises ConfigError naming the field."""
    # The library's own lists; imported here so that importing this module needs no JAX.
    from m2po_jax import tasks
    from m2po_jax.algorithm import advantages, losses, proximal
    from m2po_jax.models import attention, families, model_config

    a, g, r = cfg.actor, cfg.gconfig, cfg.rollout
    _check_range("total_steps", cfg.total_steps, 0)
    _check_range("max_nonfinite_steps", cfg.max_nonfinite_steps, 1)
    # 0 would keep one token per set and stop learning; None turns M2PO off.
    _check_range("actor.m2_threshold", a.m2_threshold, 0.0, low_open=True)
    cfg = _check_m2po(cfg)  # may resolve the deprecated mesh.m2po_per_shard
    a = cfg.actor
    _check_range("actor.eps_clip", a.eps_clip, 0.0, 1.0, high_open=True)
    _check_range("actor.eps_clip_higher", a.eps_clip_higher, 0.0)
    _check_range("actor.c_clip", a.c_clip, 1.0, low_open=True)
    _check_choice("actor.loss_denominator", a.loss_denominator, losses.DENOMINATORS)
    _check_choice("actor.importance_sampling_level", a.importance_sampling_level, losses.IS_LEVELS)
    if a.eps_clip is None and a.eps_clip_higher is not None:
        raise ConfigError(
            f"actor.eps_clip_higher={a.eps_clip_higher} needs a ratio clip, but "
            "actor.eps_clip=None turns it off; set actor.eps_clip_higher=None"
        )
    _check_range("actor.sapo_tau_pos", a.sapo_tau_pos, 0.0, low_open=True)
    _check_range("actor.sapo_tau_neg", a.sapo_tau_neg, 0.0, low_open=True)
    if a.use_sapo_loss and a.use_decoupled_loss:
        raise ConfigError(
            "actor.use_sapo_loss=True cannot be combined with actor.use_decoupled_loss=True; "
            "set actor.use_decoupled_loss=False"
        )
    _check_choice("actor.prox_logp_method", a.prox_logp_method, proximal.PROX_LOGP_METHODS)
    if a.prox_logp_method != "recompute" and not a.use_decoupled_loss:
        raise ConfigError(
            f"actor.prox_logp_method={a.prox_logp_method!r} approximates the proximal policy "
            "of the decoupled loss; it needs actor.use_decoupled_loss=True "
            "(or set actor.prox_logp_method='recompute')"
        )
    if a.use_decoupled_loss and not a.recompute_logprob:
        raise ConfigError(
            "actor.use_decoupled_loss=True needs actor.recompute_logprob=True "
            "(the proximal log-probs are recomputed with the current params)"
        )
    # Finite here; the ranges (which depend on the metric) are the library's, built below.
    _check_range("actor.rejection_sampling.upper", a.rejection_sampling.upper)
    _check_range("actor.rejection_sampling.lower", a.rejection_sampling.lower)
    rc = a.rollout_correction
    _check_choice("actor.rollout_correction.is_level", rc.is_level, rejection_lib.IS_WEIGHT_LEVELS)
    _check_range("actor.rollout_correction.is_threshold", rc.is_threshold, 0.0, low_open=True)
    _check_range("actor.ppo_n_minibatches", a.ppo_n_minibatches, 1)
    _check_range("actor.mb_spec.n_mbs", a.mb_spec.n_mbs, 1)
    _check_range("actor.mb_spec.max_tokens_per_mb", a.mb_spec.max_tokens_per_mb, 0)
    _check_range("actor.logp_chunk_size", a.logp_chunk_size, 1)
    _check_range("actor.reward_scaling", a.reward_scaling, 0.0, low_open=True)
    _check_range("actor.reward_clip", a.reward_clip, 0.0, low_open=True)
    rn = a.reward_norm
    _check_choice("actor.reward_norm.mean_level", rn.mean_level, advantages.NORM_LEVELS)
    _check_choice("actor.reward_norm.std_level", rn.std_level, advantages.NORM_LEVELS)
    _check_range("actor.reward_norm.eps", rn.eps, 0.0, low_open=True)
    _check_range("actor.kl_ctl", a.kl_ctl, 0.0)
    _check_choice("actor.kl_estimator", a.kl_estimator, penalties.KL_ESTIMATORS)
    _check_choice("actor.router_replay", a.router_replay, ROUTER_REPLAY_MODES)
    o = a.optimizer
    _check_range("actor.optimizer.lr", o.lr, 0.0, low_open=True)
    _check_range("actor.optimizer.weight_decay", o.weight_decay, 0.0)
    _check_range("actor.optimizer.beta1", o.beta1, 0.0, 1.0, high_open=True)
    _check_range("actor.optimizer.beta2", o.beta2, 0.0, 1.0, high_open=True)
    _check_range("actor.optimizer.eps", o.eps, 0.0, low_open=True)
    _check_range("actor.optimizer.gradient_clipping", o.gradient_clipping, 0.0)
    _check_choice(
        "actor.optimizer.lr_scheduler_type", o.lr_scheduler_type, optim.LR_SCHEDULER_TYPES
    )
    _check_range("actor.optimizer.warmup_steps_proportion", o.warmup_steps_proportion, 0.0, 1.0)
    _check_range("actor.optimizer.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0)
    _check_range("gconfig.n_samples", g.n_samples, 1)
    _check_range("gconfig.max_new_tokens", g.max_new_tokens, 1)
    _check_range("gconfig.temperature", g.temperature, MIN_TEMPERATURE)
    _check_range("gconfig.top_p", g.top_p, 0.0, 1.0, low_open=True)
    _check_range("gconfig.top_k", g.top_k, 0)
    _check_range("rollout.batch_size", r.batch_size, 1)
    _check_range("rollout.max_head_offpolicyness", r.max_head_offpolicyness, 0)
    _check_choice("rollout.mode", r.mode, ROLLOUT_MODES)
    _check_range("rollout.reward_workers", r.reward_workers, 1)
    _check_range("rollout.worker_timeout_s", r.worker_timeout_s, 0.0, low_open=True)
    _check_choice("rollout.publish_dtype", r.publish_dtype, ("", *PARAM_DTYPES))
    _check_weight_dtype(cfg)
    _check_range("mesh.rollout_devices", cfg.mesh.rollout_devices, 0)
    _check_choice("rollout.engine", r.engine, ROLLOUT_ENGINES)
    _check_range("rollout.engine_slots", r.engine_slots, 0)
    _check_range("rollout.insert_lanes", r.insert_lanes, 0)
    _check_range("rollout.kv_pages", r.kv_pages, 0)
    _check_range("rollout.page_size", r.page_size, 1)
    _check_choice("rollout.kv_dtype", r.kv_dtype, ("", *model_config.KV_DTYPES))
    _check_range("rollout.chunk_steps", r.chunk_steps, 1)
    _check_range("rollout.stream_batches", r.stream_batches, 1)
    engine = rollout_engine(cfg)
    got = f"got mode={r.mode}, engine={r.engine}" + (f" -> {engine}" if r.engine == "auto" else "")
    in_flight = ("continuous", "paged")  # the engines that take weights between calls
    if r.stream_batches > 1 and (r.mode != "async" or engine not in in_flight):
        raise ConfigError(
            f"rollout.stream_batches={r.stream_batches} needs rollout.mode=async and "
            f"rollout.engine=continuous or paged ({got})"
        )
    if r.inflight_updates and (r.mode != "async" or engine not in in_flight):
        raise ConfigError(
            "rollout.inflight_updates=True needs rollout.mode=async and "
            f"rollout.engine=continuous or paged ({got})"
        )
    _check_agent(cfg, engine)
    rows = r.batch_size * g.n_samples
    if rows % a.ppo_n_minibatches:
        raise ConfigError(
            f"actor.ppo_n_minibatches={a.ppo_n_minibatches} must divide the rows per step "
            f"rollout.batch_size * gconfig.n_samples = {rows}"
        )
    try:
        batching.micro_batch_count(
            rows // a.ppo_n_minibatches,
            cfg.task.max_prompt_len + g.max_new_tokens,
            a.mb_spec.n_mbs,
            a.mb_spec.max_tokens_per_mb,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_derived(cfg)
    if ":" in cfg.task.name:
        try:
            tasks.task_class(cfg.task.name)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    else:
        _check_choice("task.name", cfg.task.name, tuple(tasks.TASKS))
    if cfg.task.verifier:
        _check_choice("task.verifier", cfg.task.verifier, tuple(tasks.VERIFIERS))
    if cfg.task.prompt_template:
        try:
            tasks.prompt_template_text(cfg.task.prompt_template)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check_range("rollout.reward_timeout_s", cfg.rollout.reward_timeout_s, 0.0)
    try:
        tasks.parse_eval_sets(cfg.eval.sets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_range("eval.n_samples", cfg.eval.n_samples, 1)
    _check_range("eval.temperature", cfg.eval.temperature, 0.0)
    if cfg.eval.temperature == 0 and cfg.eval.n_samples > 1:
        raise ConfigError(
            f"eval.n_samples={cfg.eval.n_samples} with eval.temperature=0 (greedy) gives "
            f"{cfg.eval.n_samples} equal completions; set eval.temperature (the paper "
            "samples at 0.6) or eval.n_samples=1"
        )
    _check_choice("eval.reward", cfg.eval.reward, ("train", "verifier"))
    _check_range("task.min_digits", cfg.task.min_digits, 1)
    _check_range("task.max_digits", cfg.task.max_digits, cfg.task.min_digits)
    _check_range("task.max_prompt_len", cfg.task.max_prompt_len, 1)
    _check_choice("task.long_prompts", cfg.task.long_prompts, LONG_PROMPT_MODES)
    _check_choice("task.chat_template", cfg.task.chat_template, CHAT_TEMPLATE_MODES)
    if not cfg.task.answer_key:
        raise ConfigError("task.answer_key: expected a column name, got ''")
    _check_range("task.format_reward", cfg.task.format_reward, 0.0, 1.0, high_open=True)
    _check_range("eval.every", cfg.eval.every, 0)
    _check_range("eval.num_examples", cfg.eval.num_examples, 1)
    _check_range("eval.batch_size", cfg.eval.batch_size, 1)
    _check_range("checkpoint.every", cfg.checkpoint.every, 0)
    _check_range("checkpoint.keep", cfg.checkpoint.keep, 1)
    _check_range("checkpoint.hf_every", cfg.checkpoint.hf_every, 0)
    _check_range("checkpoint.hf_keep", cfg.checkpoint.hf_keep, 1)
    _check_choice("checkpoint.hf_dtype", cfg.checkpoint.hf_dtype, PARAM_DTYPES)
    _check_range("sft.max_steps", cfg.sft.max_steps, 0)
    _check_range("sft.stop_at_accuracy", cfg.sft.stop_at_accuracy, 0.0, 1.0)
    m = cfg.model
    _check_choice("model.model_type", m.model_type, families.DENSE_MODEL_TYPES)
    _check_choice("model.dtype", m.dtype, tuple(model_config.DTYPES))
    _check_choice("model.param_dtype", m.param_dtype, PARAM_DTYPES)
    _check_choice("model.remat_policy", m.remat_policy, tuple(model_config.REMAT_POLICIES))
    _check_choice("model.attention", m.attention, attention.IMPLEMENTATIONS)
    _check_range("model.router_aux_loss_coef", m.router_aux_loss_coef, 0.0)
    if not m.path:  # a new model's family is known now; a checkpoint's at load (`setup`)
        check_router_replay(cfg, m.model_type, families.family(m.model_type).mlp == "moe")
    _check_lora(m.lora, model_config.LORA_TARGETS)
    _check_range("mesh.device_memory_gib", cfg.mesh.device_memory_gib, 0.0)
    for axis in ("data", "fsdp", "tensor"):
        value = getattr(cfg.mesh, axis)
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{axis}={value} must be a positive size or -1 (fill)")
    build_library_objects(cfg)
    return cfg


ROUTER_REPLAY_MODES = ("off", "rollout")  # actor.router_replay


def check_router_replay(cfg, model_type: str, is_moe: bool) -> None:
    """Refuses routing replay on a dense model (no router to replay)."""
    if cfg.actor.router_replay != "off" and not is_moe:
        raise ConfigError(
            f"actor.router_replay={cfg.actor.router_replay}: {model_type} is a dense model "
            "(no router to replay); use off"
        )


ROLLOUT_MODES = ("sync", "async")
ROLLOUT_ENGINES = ("auto", *engines.ENGINES)  # m2po_jax/rollout/engines/
# rollout.engine=auto takes the paged engine from this completion budget on. Measured on this
# project's CPU side by side (docs/benchmarks.md, benchmarks/rollout_bench.py): completions
# that all run to 32 or 64 new tokens decode 1.09-1.17x faster in the static sampler than in
# the paged engine; long-tailed lengths (mean ~40, cap 512) 2.78x faster in the paged engine
# than the static sampler and 1.17x than the continuous engine, at half the continuous
# engine's KV memory (the static sampler decodes every row until its batch's longest ends).
AUTO_PAGED_MIN_NEW_TOKENS = 128


def rollout_engine(cfg) -> str:
    """The engine a run uses: `rollout.engine`, "auto" resolved by the completion budget
    (`gconfig.max_new_tokens` >= AUTO_PAGED_MIN_NEW_TOKENS: "paged", else "static") and by
    multi-turn episodes (`agent.env`: "continuous"; `rollout.engine=paged` runs them too,
    with turns that do not stop the other sequences, but it is not measured against the
    continuous engine on episodes)."""
    engine = cfg.rollout.engine
    if engine != "auto":
        return engine
    if _get(cfg, "agent.env", ""):
        return "continuous"
    long = cfg.gconfig.max_new_tokens >= AUTO_PAGED_MIN_NEW_TOKENS
    return "paged" if long else "static"


def rollout_weight_dtype(cfg) -> str:
    """The stored weights of the training rollouts' engine (`quant.convert_weights`):
    `rollout.weight_dtype`, else `rollout.publish_dtype` (its older name: bfloat16 |
    float32); "" where that is the trained `model.param_dtype` (nothing to convert)."""
    r = cfg.rollout
    dtype = r.weight_dtype or r.publish_dtype
    return "" if dtype == cfg.model.param_dtype else dtype


def _check_weight_dtype(cfg: Config) -> None:
    r = cfg.rollout
    _check_choice("rollout.weight_dtype", r.weight_dtype, WEIGHT_DTYPES)
    if r.weight_dtype and r.publish_dtype and r.weight_dtype != r.publish_dtype:
        raise ConfigError(
            f"rollout.weight_dtype={r.weight_dtype!r} and rollout.publish_dtype="
            f"{r.publish_dtype!r} disagree (publish_dtype is weight_dtype's older name): set one"
        )
    base = cfg.model.lora.base
    if r.weight_dtype in WEIGHT_QUANTS[1:] and base != "float" and cfg.model.lora.rank:
        raise ConfigError(
            f"rollout.weight_dtype={r.weight_dtype!r} with model.lora.base={base!r}: the "
            "adapted kernels are quantised already; set rollout.weight_dtype to '' or bfloat16"
        )


ON_TOOL_ERROR = ("reply", "end")  # m2po_jax/tasks/environments.py: ToolEnv


def _check_agent(cfg: Config, engine: str) -> None:
    """The multi-turn fields; the environment, tools and parser are imported here."""
    ag = _get(cfg, "agent")
    if ag is None or not ag.env:
        return
    if ag.env != "tools" and ag.env.count(":") != 1:
        raise ConfigError(
            f"agent.env={ag.env!r}: expected '' (single-turn), 'tools' or 'package.module:Env'"
        )
    if ag.env == "tools" and not ag.tools.strip():
        raise ConfigError("agent.env='tools' needs agent.tools ('package.module:function', ...)")
    _check_range("agent.max_turns", ag.max_turns, 1)
    _check_range("agent.max_append_tokens", ag.max_append_tokens, 1)
    _check_range("agent.tool_timeout_s", ag.tool_timeout_s, 0.0, low_open=True)
    _check_choice("agent.on_tool_error", ag.on_tool_error, ON_TOOL_ERROR)
    _check_range("agent.bad_tool_call_reward", ag.bad_tool_call_reward)
    _check_range("agent.workers", ag.workers, 1)
    _check_range("agent.step_timeout_s", ag.step_timeout_s, 0.0, low_open=True)
    if ag.env == "tools" and ag.step_timeout_s <= ag.tool_timeout_s:
        raise ConfigError(
            f"agent.step_timeout_s={ag.step_timeout_s} must be above agent.tool_timeout_s="
            f"{ag.tool_timeout_s} (a step runs its turn's tool calls)"
        )
    if not engines.ENGINES[engine].multi_turn:
        turns = [name for name, c in engines.ENGINES.items() if c.multi_turn]
        raise ConfigError(
            f"agent.env={ag.env!r}: multi-turn episodes run on the {' or '.join(turns)} "
            f"engine; set rollout.engine={', '.join(turns)} or auto (got {cfg.rollout.engine!r})"
        )
    if cfg.rollout.stream_batches > 1:
        raise ConfigError(
            f"agent.env={ag.env!r}: episodes are not streamed; set rollout.stream_batches=1 "
            f"(got {cfg.rollout.stream_batches})"
        )
    budget = cfg.gconfig.max_new_tokens
    if ag.max_append_tokens >= budget:
        raise ConfigError(
            f"agent.max_append_tokens={ag.max_append_tokens} must be below "
            f"gconfig.max_new_tokens={budget} (an episode's token budget holds its turns and "
            "the environment's answers)"
        )
    from m2po_jax.tasks import environments, tool_calls, tools

    try:
        tools.load_tools(tool_names(ag.tools))
        if ag.env != "tools":
            environments.env_factory_from_name(ag.env)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if ag.parser != "auto" and ag.parser not in tool_calls.PARSERS:
        raise ConfigError(
            f"agent.parser={ag.parser!r}: expected auto or one of {sorted(tool_calls.PARSERS)}"
        )


def tool_names(text: str) -> list[str]:
    """The names of `agent.tools` (comma-separated)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def build_library_objects(cfg: Config) -> dict:
    """What the run builds from `cfg` alone, by the builders the run uses: its checks
    raise here, as ConfigError, before any work. Returns {"rejection_sampling": ...,
    "rollout_correction": ..., "sampling": ...} (the decoding settings without the
    tokenizer's stop / pad ids)."""
    from m2po_jax.rollout import sampling

    a = cfg.actor
    try:
        built = {
            "rejection_sampling": rejection_lib.build_rejection_sampling(a.rejection_sampling),
            "rollout_correction": rejection_lib.build_rollout_correction(a.rollout_correction),
            "sampling": sampling.from_gconfig(cfg.gconfig),
        }
        rejection_lib.check_composition(
            built["rollout_correction"],
            built["rejection_sampling"],
            use_decoupled_loss=a.use_decoupled_loss,
            use_sapo_loss=a.use_sapo_loss,
            prefix="actor.",
        )
        return built
    except (ValueError, TypeError) as err:  # the builders name the config field
        raise ConfigError(str(err)) from None


def _get(tree: Any, dotted: str, default: Any = None) -> Any:
    """`tree.a.b` (attributes or dict keys) for "a.b"; `default` where a part is missing."""
    for part in dotted.split("."):
        if isinstance(tree, dict):
            tree = tree.get(part, default)
        else:
            tree = getattr(tree, part, default)
    return tree


def _derive(mapping: dict) -> dict:
    """Fills each derived field that is unset (None or absent) from its source field."""
    for field, (source, _) in DERIVED.items():
        *parents, leaf = field.split(".")
        section = _get(mapping, ".".join(parents))
        value = _get(mapping, source)
        if isinstance(section, dict) and section.get(leaf) is None and value is not None:
            section[leaf] = value
    return mapping


def _check_derived(cfg: Config) -> None:
    """A derived field set explicitly must equal its source: no run needs another value."""
    for field, (source, why) in DERIVED.items():
        value, wanted = _get(cfg, field), _get(cfg, source)
        if abs(value - wanted) > 1e-9:
            raise ConfigError(
                f"{field}={value} differs from {source}={wanted}; {field} is derived from "
                f"{source} ({why}): leave it unset or set {source}"
            )


def from_configdict(config: ml_collections.ConfigDict | dict) -> Config:
    """Typed, validated `Config` from a ConfigDict (or plain nested dict); derived fields
    that are unset take their source's value (`DERIVED`)."""
    if isinstance(config, ml_collections.ConfigDict):
        mapping = config.to_dict()
    else:
        mapping = copy.deepcopy(config)
    return validate(_build(Config, _derive(mapping), ""))
