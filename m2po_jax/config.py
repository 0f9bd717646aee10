"""Typed, validated run configuration made from an `ml_collections.ConfigDict`.

`configs/*.py` hold the commented defaults; `from_configdict` turns one into frozen
dataclasses, naming any unknown key (with the closest valid one), any missing key,
and any out-of-range value with its allowed range.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import ml_collections

from m2po_jax import batching
from m2po_jax.errors import M2poError
from m2po_jax.prompts import CHAT_TEMPLATE_MODES, LONG_PROMPT_MODES


class ConfigError(M2poError, ValueError):
    """A config key or value is invalid."""

    what = "config error"


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str
    param_dtype: str
    remat: bool
    remat_policy: str
    scan_layers: bool
    attention: str


@dataclasses.dataclass(frozen=True)
class TaskSection:
    name: str
    seed: int
    min_digits: int
    max_digits: int
    ops: str
    train_path: str
    eval_path: str
    eval_size: int
    question_key: str
    answer_key: str
    max_prompt_len: int
    long_prompts: str
    chat_template: str
    enable_thinking: bool | None
    reward_fn: str
    format_reward: float


@dataclasses.dataclass(frozen=True)
class SftSection:
    max_steps: int
    batch_size: int
    lr: float
    stop_at_accuracy: float
    eval_every: int


@dataclasses.dataclass(frozen=True)
class GenerationSection:
    n_samples: int
    max_new_tokens: int
    temperature: float
    greedy: bool
    top_p: float
    top_k: int


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    batch_size: int
    max_head_offpolicyness: int


@dataclasses.dataclass(frozen=True)
class RejectionSamplingSection:
    enabled: bool
    level: str
    action: str
    metric: str
    agg: str
    upper: float
    lower: float | None


@dataclasses.dataclass(frozen=True)
class RewardNormSection:
    mean_level: str | None
    std_level: str | None
    group_size: int
    mean_leave1out: bool
    std_unbiased: bool
    eps: float


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    gradient_clipping: float
    lr_scheduler_type: str
    warmup_steps_proportion: float
    min_lr_ratio: float


@dataclasses.dataclass(frozen=True)
class MicroBatchSection:
    n_mbs: int
    max_tokens_per_mb: int


@dataclasses.dataclass(frozen=True)
class ActorSection:
    m2_threshold: float | None
    m2po_method: str
    m2po_second_moment: str
    m2po_stop_rule: str
    m2po_candidates: str
    m2po_scope: str
    eps_clip: float
    eps_clip_higher: float | None
    c_clip: float | None
    use_decoupled_loss: bool
    recompute_logprob: bool
    loss_denominator: str
    rejection_sampling: RejectionSamplingSection
    importance_sampling_level: str
    use_sapo_loss: bool
    sapo_tau_pos: float
    sapo_tau_neg: float
    ppo_n_minibatches: int
    mb_spec: MicroBatchSection
    logp_chunk_size: int
    reward_scaling: float
    reward_bias: float
    reward_clip: float
    reward_norm: RewardNormSection
    adv_norm: bool
    kl_ctl: float
    kl_estimator: str
    temperature: float
    optimizer: OptimizerSection


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int
    num_examples: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool
    wandb_project: str
    progress: bool
    plots: bool


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int
    fsdp: int
    tensor: int
    m2po_per_shard: bool  # deprecated alias of actor.m2po_scope="shard"; validate resolves it
    device_memory_gib: float


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int
    total_steps: int
    max_nonfinite_steps: int
    model: ModelSection
    task: TaskSection
    sft: SftSection
    gconfig: GenerationSection
    rollout: RolloutSection
    actor: ActorSection
    eval: EvalSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    mesh: MeshSection


# logits / temperature: below this the float32 log-probs and their gradients (scaled by
# 1 / temperature) overflow or lose all precision; greedy=True is the argmax limit.
MIN_TEMPERATURE = 1e-3


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


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
            raise ConfigError(f"unknown config key {full!r}{_closest(full, valid)}")
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


def _check_choice(where: str, value, choices):
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not one of {list(choices)}")


def _check_m2po(cfg: Config) -> Config:
    """actor.m2po_* choices and combinations; maps mesh.m2po_per_shard=True to scope "shard"."""
    # The library's own lists; imported here so that importing this module needs no JAX.
    from m2po_jax import masking, scopes

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


def validate(cfg: Config) -> Config:
    """Range and consistency checks; raises ConfigError naming the field."""
    a, g, r = cfg.actor, cfg.gconfig, cfg.rollout
    _check_range("total_steps", cfg.total_steps, 0)
    _check_range("max_nonfinite_steps", cfg.max_nonfinite_steps, 1)
    _check_range("actor.m2_threshold", a.m2_threshold, 0.0)
    cfg = _check_m2po(cfg)  # may resolve the deprecated mesh.m2po_per_shard
    a = cfg.actor
    _check_range("actor.eps_clip", a.eps_clip, 0.0, 1.0, high_open=True)
    _check_range("actor.eps_clip_higher", a.eps_clip_higher, 0.0)
    _check_range("actor.c_clip", a.c_clip, 1.0, low_open=True)
    _check_choice("actor.loss_denominator", a.loss_denominator, ("kept", "valid"))
    _check_choice(
        "actor.importance_sampling_level", a.importance_sampling_level, ("token", "sequence")
    )
    if a.use_sapo_loss and a.use_decoupled_loss:
        raise ConfigError(
            "actor.use_sapo_loss=True cannot be combined with actor.use_decoupled_loss=True; "
            "set actor.use_decoupled_loss=False"
        )
    if a.use_decoupled_loss and not a.recompute_logprob:
        raise ConfigError(
            "actor.use_decoupled_loss=True needs actor.recompute_logprob=True "
            "(the proximal log-probs are recomputed with the current params)"
        )
    rs = a.rejection_sampling
    _check_choice("actor.rejection_sampling.level", rs.level, ("token", "sequence"))
    _check_choice("actor.rejection_sampling.action", rs.action, ("mask", "clamp"))
    _check_choice(
        "actor.rejection_sampling.metric", rs.metric, ("ratio", "kl_k1", "kl_k2", "kl_k3")
    )
    _check_choice("actor.rejection_sampling.agg", rs.agg, ("sum", "mean", "max"))
    _check_range("actor.rejection_sampling.upper", rs.upper, 0.0, low_open=True)
    _check_range("actor.rejection_sampling.lower", rs.lower, 0.0)
    _check_range("actor.ppo_n_minibatches", a.ppo_n_minibatches, 1)
    _check_range("actor.mb_spec.n_mbs", a.mb_spec.n_mbs, 1)
    _check_range("actor.mb_spec.max_tokens_per_mb", a.mb_spec.max_tokens_per_mb, 0)
    _check_range("actor.logp_chunk_size", a.logp_chunk_size, 1)
    _check_range("actor.reward_scaling", a.reward_scaling, 0.0, low_open=True)
    _check_range("actor.reward_clip", a.reward_clip, 0.0, low_open=True)
    rn = a.reward_norm
    _check_choice("actor.reward_norm.mean_level", rn.mean_level, ("group", "batch", None))
    _check_choice("actor.reward_norm.std_level", rn.std_level, ("group", "batch", None))
    _check_range("actor.reward_norm.eps", rn.eps, 0.0, low_open=True)
    _check_range("actor.kl_ctl", a.kl_ctl, 0.0)
    _check_choice("actor.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    _check_range("actor.temperature", a.temperature, MIN_TEMPERATURE)
    o = a.optimizer
    _check_range("actor.optimizer.lr", o.lr, 0.0, low_open=True)
    _check_range("actor.optimizer.weight_decay", o.weight_decay, 0.0)
    _check_range("actor.optimizer.beta1", o.beta1, 0.0, 1.0, high_open=True)
    _check_range("actor.optimizer.beta2", o.beta2, 0.0, 1.0, high_open=True)
    _check_range("actor.optimizer.eps", o.eps, 0.0, low_open=True)
    _check_range("actor.optimizer.gradient_clipping", o.gradient_clipping, 0.0)
    _check_choice(
        "actor.optimizer.lr_scheduler_type", o.lr_scheduler_type, ("constant", "linear", "cosine")
    )
    _check_range("actor.optimizer.warmup_steps_proportion", o.warmup_steps_proportion, 0.0, 1.0)
    _check_range("actor.optimizer.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0)
    _check_range("gconfig.n_samples", g.n_samples, 1)
    _check_range("gconfig.max_new_tokens", g.max_new_tokens, 1)
    _check_range("gconfig.temperature", g.temperature, MIN_TEMPERATURE)
    _check_range("gconfig.top_p", g.top_p, 0.0, 1.0, low_open=True)
    _check_range("gconfig.top_k", g.top_k, 0)
    if abs(a.temperature - g.temperature) > 1e-9:
        raise ConfigError(
            f"actor.temperature={a.temperature} must equal gconfig.temperature={g.temperature}: "
            "the behaviour log-probs are recorded at the sampling temperature"
        )
    _check_range("rollout.batch_size", r.batch_size, 1)
    _check_range("rollout.max_head_offpolicyness", r.max_head_offpolicyness, 0)
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
    if rn.group_size != g.n_samples:
        raise ConfigError(
            f"actor.reward_norm.group_size={rn.group_size} must equal gconfig.n_samples="
            f"{g.n_samples} (a group is the completions of one prompt)"
        )
    _check_choice("task.name", cfg.task.name, ("arith", "gsm8k"))
    _check_range("task.min_digits", cfg.task.min_digits, 1)
    _check_range("task.max_digits", cfg.task.max_digits, cfg.task.min_digits)
    _check_range("task.max_prompt_len", cfg.task.max_prompt_len, 1)
    _check_choice("task.long_prompts", cfg.task.long_prompts, LONG_PROMPT_MODES)
    _check_choice("task.chat_template", cfg.task.chat_template, CHAT_TEMPLATE_MODES)
    for key in ("question_key", "answer_key"):
        if not getattr(cfg.task, key):
            raise ConfigError(f"task.{key}: expected a column name, got ''")
    _check_range("task.format_reward", cfg.task.format_reward, 0.0, 1.0, high_open=True)
    _check_range("eval.every", cfg.eval.every, 0)
    _check_range("eval.num_examples", cfg.eval.num_examples, 1)
    _check_range("eval.batch_size", cfg.eval.batch_size, 1)
    _check_range("checkpoint.every", cfg.checkpoint.every, 0)
    _check_range("checkpoint.keep", cfg.checkpoint.keep, 1)
    _check_range("sft.max_steps", cfg.sft.max_steps, 0)
    _check_range("sft.stop_at_accuracy", cfg.sft.stop_at_accuracy, 0.0, 1.0)
    m = cfg.model
    _check_choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _check_choice("model.param_dtype", m.param_dtype, ("float32", "bfloat16"))
    # The library's own lists; imported here so that importing this module needs no JAX.
    from m2po_jax import attention, model_config

    _check_choice("model.remat_policy", m.remat_policy, tuple(model_config.REMAT_POLICIES))
    _check_choice("model.attention", m.attention, attention.IMPLEMENTATIONS)
    _check_range("mesh.device_memory_gib", cfg.mesh.device_memory_gib, 0.0)
    for axis in ("data", "fsdp", "tensor"):
        value = getattr(cfg.mesh, axis)
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{axis}={value} must be a positive size or -1 (fill)")
    return cfg


def from_configdict(config: ml_collections.ConfigDict | dict) -> Config:
    """Typed, validated `Config` from a ConfigDict (or plain nested dict)."""
    return validate(_build(Config, config, ""))


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict, prefix: str = "") -> None:
    """Overlays a nested dict (from YAML/JSON) onto `config`, rejecting unknown keys."""
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if key not in config:
            valid = [f"{prefix}{k}" for k in config.keys()]
            raise ConfigError(f"unknown config key {full!r} in overrides{_closest(full, valid)}")
        current = config[key]
        if isinstance(current, ml_collections.ConfigDict):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a section (mapping), got {value!r}")
            apply_overrides(current, value, full + ".")
        else:
            try:
                with config.unlocked():
                    config[key] = value
            except (TypeError, ValueError):
                # ConfigDict refuses a value of another type than the default's.
                kind = type(current).__name__
                raise ConfigError(f"{full}: expected a {kind}, got {value!r}") from None


def apply_dotted(config: ml_collections.ConfigDict, values: dict) -> None:
    """`apply_overrides` for {"section.field": value} keys, as the command line writes them."""
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        nested: dict = {leaf: value}
        for name in reversed(parents):
            nested = {name: nested}
        apply_overrides(config, nested)


def load_overrides(path: str) -> dict:
    """Reads a YAML or JSON overrides file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--overrides: file {path!r} does not exist")
    if file.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"--overrides: {path!r} must end in .yaml, .yml or .json")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--overrides: {path!r} must hold a mapping at the top level")
    return data
