"""AReaL experiment files (`examples/math/gsm8k_m2po.yaml` and the like) as overrides.

`--overrides=experiment.yaml` reads AReaL's own file: its `${a.b}` interpolations are
resolved (OmegaConf's syntax, on the whole document), then every key is

- mapped where it has a meaning here (`actor.path` is `model.path`, `train_dataset.batch_size`
  is `rollout.batch_size`, `actor.gradient_checkpointing` is `model.remat`, ...; keys this
  config shares by name, such as `actor.m2_threshold`, pass as they are);
- checked where this trainer derives it (`actor.group_size` must be `gconfig.n_samples`);
- accepted only at the value this trainer implements where the key would change training
  (`gconfig.min_new_tokens: 0`, `actor.optimizer.type: adam`), refused with the reason otherwise;
- or listed, in one warning line, when it only means something to AReaL's launcher and
  services (cluster, allocation, SGLang / vLLM servers, savers, tracing): by name
  (`LAUNCHER`), by what the field does in a training section (`SERVICE_FIELD`: `backend`,
  `fileroot`, `dump_to_file`, `*_spec`, `*_timeout`, ...), or as a top-level section that is
  not one of the training sections (`TRAINING`).

A key that is none of these is refused: it may change training, and silently dropping it
would train something else than the file says.
"""

from __future__ import annotations

import os
import re
from typing import Any

from m2po_jax.common.errors import ConfigError

# Keys whose presence marks a file as AReaL's experiment file (no key of this config).
_MARKERS = ("experiment_name", "trial_name", "cluster", "allocation_mode", "train_dataset")

# AReaL key -> this config's key.
RENAMED = {
    "actor.path": "model.path",
    "actor.dtype": "model.dtype",
    "actor.gradient_checkpointing": "model.remat",
    "train_dataset.batch_size": "rollout.batch_size",
    "valid_dataset.batch_size": "eval.batch_size",
    "saver.freq_steps": "checkpoint.every",
}
# AReaL key -> the key (AReaL's) it must equal: this trainer derives or shares it.
EQUAL = {
    "tokenizer_path": "actor.path",  # the tokenizer is read from the model directory
    "ref.path": "actor.path",  # the reference policy is the initial actor
    "actor.group_size": "gconfig.n_samples",
    "actor.reward_norm.group_size": "gconfig.n_samples",
    "actor.temperature": "gconfig.temperature",
    "actor.max_new_tokens": "gconfig.max_new_tokens",
    "rollout.consumer_batch_size": "train_dataset.batch_size",
    "rollout.tokenizer_path": "actor.path",
    "ref.dtype": "actor.dtype",
}
# AReaL key -> (the values implemented here, why another value is refused).
ONLY = {
    "gconfig.min_new_tokens": ((0,), "a minimum completion length is not implemented"),
    "actor.optimizer.type": (("adam",), "only AdamW ('adam') is implemented"),
    "actor.init_from_scratch": ((False,), "training starts from actor.path's weights"),
    "ref.init_from_scratch": ((False,), "the reference policy is actor.path's weights"),
    "actor.dynamic_sampling": ((False,), "dynamic sampling (DAPO) is not implemented"),
    "actor.disable_dropout": ((True,), "the model has no dropout"),
    "ref.disable_dropout": ((True,), "the model has no dropout"),
    "ref.optimizer": ((None,), "the reference policy is not trained"),
    "train_dataset.type": (("rl",), "this trainer trains RL datasets"),
    "valid_dataset.type": (("rl",), "this trainer evaluates RL datasets"),
    "train_dataset.shuffle": ((True,), "the training data is always shuffled"),
    "enable_offload": ((False,), "parameter offloading is not implemented"),
}
# Sections and keys that only AReaL's launcher, servers and services read.
LAUNCHER = (
    "experiment_name", "trial_name", "cluster", "allocation_mode", "scheduler", "sglang",
    "vllm", "launcher", "saver", "recover", "evaluator", "stats_logger", "perf_tracer",
    "total_train_epochs", "ref.mb_spec", "ref.scheduling_strategy", "ref.scheduling_spec",
    "ref.experiment_name", "ref.trial_name", "rollout.experiment_name", "rollout.trial_name",
    "rollout.max_concurrent_rollouts", "rollout.queue_size", "rollout.enable_rollout_tracing",
    "rollout.scheduling_spec", "actor.experiment_name", "actor.trial_name",
    "actor.scheduling_spec", "actor.weight_update_mode", "train_dataset.pin_memory",
    "train_dataset.num_workers", "valid_dataset.pin_memory", "valid_dataset.num_workers",
    "valid_dataset.shuffle",
)  # fmt: skip
# Sections whose keys this config shares by name (`actor.eps_clip` is `actor.eps_clip`).
SHARED = ("seed", "gconfig.", "rollout.", "actor.")
# The sections and top-level keys that say what is trained; any other top-level section
# (a dict: `cluster`, `sglang`, `perf_tracer`, one AReaL adds next) configures AReaL's
# launcher and services and is ignored in the warning line. A top-level value that is not
# a section and not known is refused.
TRAINING = (
    "seed", "enable_offload", "tokenizer_path", "total_train_epochs", "actor", "ref",
    "rollout", "gconfig", "train_dataset", "valid_dataset",
)  # fmt: skip
# Fields, by their own name in any training section, that place processes, address servers
# or write files (`rollout.backend: "sglang:d4p1t1"`, `actor.backend: "fsdp:d4p1t1"`,
# `rollout.fileroot`, `rollout.dump_to_file`, `*.scheduling_spec`, `*_timeout`): the mesh,
# the sampler and the workdir are this trainer's own.
SERVICE_FIELD = re.compile(
    r"backend|fileroot|experiment_name|trial_name|scheduling_\w+|\w+_spec|dump_\w+|\w+_dir"
    r"|\w+_tracing|\w+_timeout|\w+_retries|\w+_port|\w+_addr(ess)?|num_workers|pin_memory"
    r"|weight_update_mode|max_concurrent_rollouts|queue_size|pause_grace_period"
)

_REF = re.compile(r"\$\{([^}]*)\}")


def is_areal_file(data: dict) -> bool:
    """True for an AReaL experiment file (it has keys no config of this trainer has)."""
    return any(key in data for key in _MARKERS)


def resolve(data: dict, source: str = "overrides") -> dict:
    """The document with every `${a.b}` replaced by the value at `a.b` (OmegaConf's rule:
    a value that is one interpolation keeps the target's type; inside text, its text)."""

    def lookup(dotted: str, where: str, seen: tuple[str, ...]) -> Any:
        if ":" in dotted:
            raise ConfigError(
                f"{source}: {where}: the resolver ${{{dotted}}} is not supported "
                f"(only ${{section.key}} references)"
            )
        if dotted in seen:
            raise ConfigError(f"{source}: circular interpolation {' -> '.join((*seen, dotted))}")
        node: Any = data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"{source}: {where}: ${{{dotted}}} names no key")
            node = node[part]
        return walk(node, dotted, (*seen, dotted))

    def walk(node: Any, where: str, seen: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else k, seen) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, where, seen) for v in node]
        if isinstance(node, str):
            seen = seen or (where,)
            whole = _REF.fullmatch(node.strip())
            if whole:
                return lookup(whole.group(1).strip(), where, seen)
            return _REF.sub(lambda m: str(lookup(m.group(1).strip(), where, seen)), node)
        return node

    return walk(data, "", ())


def _flat(node: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted not in ("actor.adv_norm",):
            out.update(_flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def translate(data: dict, known: set[str], source: str = "overrides") -> tuple[dict, list[str]]:
    """(dotted overrides of this config, the launcher-only keys ignored) for an AReaL file.

    `known`: this config's dotted keys (a key AReaL shares by name must be one of them).
    """
    flat = _flat(resolve(data, source))
    out: dict[str, Any] = {}
    ignored, refused = [], []
    for key, value in flat.items():
        if key in RENAMED and value is not None:
            out[RENAMED[key]] = value
        elif key in EQUAL:
            other = EQUAL[key]
            if other in flat and flat[other] != value:
                refused.append(
                    f"{key}={value!r} must equal {other}={flat[other]!r} (derived from it here)"
                )
        elif key in ONLY:
            allowed, why = ONLY[key]
            if value not in allowed:
                refused.append(f"{key}={value!r}: {why}")
        elif key == "actor.adv_norm":
            out["actor.adv_norm"] = _adv_norm(value, refused)
        elif key == "actor.behav_imp_weight_cap":
            # AReaL's older name for token-level behaviour rejection: ratio > cap is masked.
            out["actor.rejection_sampling.enabled"] = value is not None
            if value is not None:
                for field, setting in (
                    ("level", "token"),
                    ("action", "mask"),
                    ("metric", "ratio"),
                    ("upper", value),
                ):
                    out[f"actor.rejection_sampling.{field}"] = setting
        elif key == "train_dataset.max_length":
            out["task.max_prompt_len"] = value  # AReaL drops longer prompts; so does "filter"
            out["task.long_prompts"] = "filter"
        elif key in ("train_dataset.path", "valid_dataset.path"):
            ours = "task.train_path" if key.startswith("train") else "task.eval_path"
            if isinstance(value, str) and os.path.exists(value):
                out[ours] = value
            else:
                ignored.append(f"{key} ({value!r} is not a local file: set {ours})")
        elif _under(key, LAUNCHER):
            ignored.append(key)
        elif key.startswith(SHARED) and key in known:
            out[key] = value
        elif (service := _service(key, data)) is not None:
            ignored.append(service)
        else:
            refused.append(f"{key}: no counterpart in this trainer")
    if refused:
        raise ConfigError(f"{source}: AReaL keys this trainer cannot honour: {'; '.join(refused)}")
    return out, _collapse(ignored)


def _service(key: str, data: dict) -> str | None:
    """The launcher / service entry `key` belongs to (what the warning line names), or None
    when the key may say something about training."""
    parts = key.split(".")
    if parts[0] not in TRAINING:
        return parts[0] if isinstance(data.get(parts[0]), dict) else None
    for i, part in enumerate(parts[1:], start=2):
        if SERVICE_FIELD.fullmatch(part):
            return ".".join(parts[:i])
    return None


def _adv_norm(value: Any, refused: list[str]) -> bool:
    """AReaL's `adv_norm` section: batch mean and std (whitened advantages), or none."""
    if value in (None, False, {}):
        return False
    if value is True or (
        isinstance(value, dict)
        and value.get("mean_level") == "batch"
        and value.get("std_level") == "batch"
        and not value.get("mean_leave1out", False)
    ):
        return True
    refused.append(
        f"actor.adv_norm={value!r}: only batch mean and std normalisation is implemented"
    )
    return False


def _collapse(keys: list[str]) -> list[str]:
    """The launcher entries matched ("sglang" for sglang.*), other notes as they are."""
    out: list[str] = []
    for key in keys:
        name = next((p for p in LAUNCHER if key == p or key.startswith(p + ".")), key)
        if name not in out:
            out.append(name)
    return out
