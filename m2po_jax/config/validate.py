"""Typed, validated run configuration made from an `ml_collections.ConfigDict`.

`configs/*.py` hold the presets over the declared defaults; `from_configdict` turns one
into the frozen dataclasses of `config_schema`, naming any unknown key (with the closest
valid one), any missing key, and any value its declaration does not allow (its range or
choices, from the schema). Here are the checks no single declaration can make: those that
relate fields to each other, and those that need a library registry or a file. Fields that
must equal another field are derived from it (`DERIVED`). `validate` builds the library
objects the run will build (rejection sampling, decoding settings), so that whatever they
refuse is refused at start-up. Overrides from files and dotted keys:
`m2po_jax.config.overrides`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
import warnings
from typing import Any

import ml_collections

from m2po_jax.algorithm import rejection as rejection_lib
from m2po_jax.common import knobs
from m2po_jax.common.checks import check_choice, check_range, did_you_mean
from m2po_jax.common.config_schema import Config
from m2po_jax.common.errors import ConfigError
from m2po_jax.learner import batching
from m2po_jax.models import families
from m2po_jax.models.model_config import WEIGHT_QUANTS
from m2po_jax.rollout import engines

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
    if lora.base != "float" and not lora.rank:
        raise ConfigError(
            f"model.lora.base={lora.base!r} quantises the adapted kernels: it needs "
            "model.lora.rank > 0 (LoRA on)"
        )


def _check_m2po(cfg: Config) -> Config:
    """actor.m2po_* combinations; maps mesh.m2po_per_shard=True to scope "shard"."""
    a = cfg.actor
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
    """Every field against its declaration (`knobs.check_declared`), then the checks
    that relate fields to each other, then the library objects the run will build
    (whatever they refuse is refused here); raises ConfigError naming the field."""
    knobs.check_declared(cfg)
    cfg = _check_m2po(cfg)  # may resolve the deprecated mesh.m2po_per_shard
    _check_loss(cfg.actor)
    engine = rollout_engine(cfg)
    _check_rollout(cfg, engine)
    _check_agent(cfg, engine)
    _check_batching(cfg)
    _check_derived(cfg)
    _check_task(cfg)
    _check_eval(cfg.eval)
    _check_model(cfg)
    build_library_objects(cfg)
    return cfg


def _check_loss(a) -> None:
    """The actor's loss options that only work together."""
    if a.eps_clip is None and a.eps_clip_higher is not None:
        raise ConfigError(
            f"actor.eps_clip_higher={a.eps_clip_higher} needs a ratio clip, but "
            "actor.eps_clip=None turns it off; set actor.eps_clip_higher=None"
        )
    if a.use_sapo_loss and a.use_decoupled_loss:
        raise ConfigError(
            "actor.use_sapo_loss=True cannot be combined with actor.use_decoupled_loss=True; "
            "set actor.use_decoupled_loss=False"
        )
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


def _check_rollout(cfg: Config, engine: str) -> None:
    """The rollout options that depend on the mode and the engine the run uses."""
    r = cfg.rollout
    _check_weight_dtype(cfg)
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
    _check_engine_fields(r, engine)


# The rollout fields that size an engine, and the engines they size: set on another
# engine they reach nothing.
_ENGINE_FIELDS = {
    "engine_slots": ("continuous", "paged"),
    "insert_lanes": ("continuous", "paged"),
    "kv_pages": ("paged",),
    "page_size": ("paged",),
}


def _check_engine_fields(r, engine: str) -> None:
    """Refuses an engine's size set (off its declared default) for a run on another
    engine."""
    defaults = {f.name: f.default for f in dataclasses.fields(r)}
    for name, sized in _ENGINE_FIELDS.items():
        value = getattr(r, name)
        if engine in sized or value == defaults[name]:
            continue
        resolved = f" (rollout.engine=auto -> {engine}: by gconfig.max_new_tokens)"
        raise ConfigError(
            f"rollout.{name}={value} sizes the {' or '.join(sized)} engine; this run's "
            f"engine is {engine}{resolved if r.engine == 'auto' else ''}: set "
            f"rollout.engine={sized[-1]} or leave rollout.{name} at {defaults[name]}"
        )


def _check_batching(cfg: Config) -> None:
    """The rows of a step split into minibatches, and each into micro-batches."""
    a, g = cfg.actor, cfg.gconfig
    rows = cfg.rollout.batch_size * g.n_samples
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


def _check_task(cfg: Config) -> None:
    """The task's names and files: the task registry (or a task class of the user's), the
    verifiers, the prompt template, the held-out sets; and the operand digits."""
    # The library's own registries; imported here so that importing this module needs no JAX.
    from m2po_jax import tasks

    t = cfg.task
    if ":" in t.name:
        try:
            tasks.task_class(t.name)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    else:
        check_choice("task.name", t.name, tuple(tasks.TASKS), error=ConfigError)
    if t.verifier:
        check_choice("task.verifier", t.verifier, tuple(tasks.VERIFIERS), error=ConfigError)
    if t.prompt_template:
        try:
            tasks.prompt_template_text(t.prompt_template)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        tasks.parse_eval_sets(cfg.eval.sets)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not t.answer_key:
        raise ConfigError("task.answer_key: expected a column name, got ''")
    check_range("task.max_digits", t.max_digits, t.min_digits, error=ConfigError)


def _check_eval(e) -> None:
    if e.temperature == 0 and e.n_samples > 1:
        raise ConfigError(
            f"eval.n_samples={e.n_samples} with eval.temperature=0 (greedy) gives "
            f"{e.n_samples} equal completions; set eval.temperature (the paper "
            "samples at 0.6) or eval.n_samples=1"
        )


def _check_model(cfg: Config) -> None:
    """LoRA's targets and base, and the mesh's axis sizes."""
    from m2po_jax.models import model_config

    _check_lora(cfg.model.lora, model_config.LORA_TARGETS)
    _check_experts(cfg.model, families.family(cfg.model.model_type).mlp == "moe")
    if not cfg.model.path:  # a new model's family is known now; a checkpoint's at load (`setup`)
        moe = families.family(cfg.model.model_type).mlp == "moe"
        check_moe_settings(cfg, cfg.model.model_type, moe)
    for axis in ("data", "fsdp", "tensor"):
        value = getattr(cfg.mesh, axis)
        if value == 0 or value < -1:
            raise ConfigError(f"mesh.{axis}={value} must be a positive size or -1 (fill)")


def check_moe_settings(cfg, model_type: str, is_moe: bool) -> None:
    """Refuses the mixture-of-experts settings on a dense model, where they reach nothing:
    routing replay (no router to replay), `mesh.expert_axis` (no experts to split),
    `model.router_aux_loss_coef` (no router to balance)."""
    if is_moe:
        return
    if cfg.actor.router_replay != "off":
        raise ConfigError(
            f"actor.router_replay={cfg.actor.router_replay}: {model_type} is a dense model "
            "(no router to replay); use off"
        )
    if cfg.mesh.expert_axis:
        raise ConfigError(
            f"mesh.expert_axis={cfg.mesh.expert_axis!r}: {model_type} is a dense model (no "
            "experts to split); leave it ''"
        )
    if cfg.model.router_aux_loss_coef:
        raise ConfigError(
            f"model.router_aux_loss_coef={cfg.model.router_aux_loss_coef}: {model_type} is a "
            "dense model (no router to balance); leave it 0"
        )


def _check_experts(m, moe: bool) -> None:
    """A new model's mixture-of-experts fields: set for a "moe" model_type (qwen3_moe), 0
    for a dense one and with model.path (a checkpoint's config.json gives its experts)."""
    sizes = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    given = [name for name in sizes if getattr(m, name)]
    if given and (m.path or not moe):
        whose = "model.path's config.json gives a checkpoint's"
        if not m.path:
            whose = f"model.model_type={m.model_type!r} is dense; experts need qwen3_moe"
        raise ConfigError(f"model.{given[0]}={getattr(m, given[0])}: {whose} (leave it 0)")
    if m.path or not moe:
        return
    for name in ("num_experts", "moe_intermediate_size"):
        if not getattr(m, name):
            raise ConfigError(f"model.{name}=0: model.model_type={m.model_type!r} needs it >= 1")
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok={m.num_experts_per_tok}: expected 1..model.num_experts "
            f"({m.num_experts})"
        )


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


def from_configdict(
    config: ml_collections.ConfigDict | dict, schema: type[Config] = Config
) -> Config:
    """Typed, validated `Config` from a ConfigDict (or plain nested dict); derived fields
    that are unset take their source's value (`DERIVED`). `schema`: `Config` or a subclass
    that declares more fields (tests/common/knobs_test.py adds one)."""
    if isinstance(config, ml_collections.ConfigDict):
        mapping = config.to_dict()
    else:
        mapping = copy.deepcopy(config)
    return validate(_build(schema, _derive(mapping), ""))
