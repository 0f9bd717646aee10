"""Config fields declared once (`knob`): the defaults, the checks and the manual's tables
all come from the declaration, and each declared choice list is its library's."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import typing
from pathlib import Path

import pytest

from m2po_jax import config as config_lib
from m2po_jax.common import config_schema, knobs
from m2po_jax.common.config_schema import ActorSection, Config
from m2po_jax.common.knobs import knob, section

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _hooks():
    """docs/hooks.py, the MkDocs hook that renders the Configuration page's tables."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The worked example of docs/contributing.md ("Adding a config field"): one declaration.
@dataclasses.dataclass(frozen=True)
class ActorWithEntropy(ActorSection):
    entropy_coef: float = knob(0.0, "weight of the entropy bonus in the loss", low=0.0)


@dataclasses.dataclass(frozen=True)
class ConfigWithEntropy(Config):
    actor: ActorWithEntropy = section(ActorWithEntropy)


def test_a_new_field_is_one_declaration():
    c = knobs.default_configdict(ConfigWithEntropy)
    assert c.actor.entropy_coef == 0.0  # the default, in configs/default.py's ConfigDict
    c.actor.entropy_coef = 0.01
    assert config_lib.from_configdict(c, ConfigWithEntropy).actor.entropy_coef == 0.01
    c.actor.entropy_coef = -0.01  # refused in one line naming the field and its range
    with pytest.raises(
        config_lib.ConfigError,
        match=r"^actor\.entropy_coef=-0\.01 is out of range; allowed \[0\.0, inf\)$",
    ):
        config_lib.from_configdict(c, ConfigWithEntropy)
    row = (
        "| `actor.entropy_coef` | `float` | `0.0` | `[0.0, inf)` "
        "| weight of the entropy bonus in the loss |"
    )
    page = _hooks().render_fields(ConfigWithEntropy)
    assert row in page.splitlines()
    fields = len(list(knobs.knobs(Config)))
    assert f"{fields + 1} fields in 18 sections." in page  # one more than Config's
    assert "entropy_coef" not in _hooks().render_fields()


def test_every_field_has_a_doc_and_a_default_of_its_type():
    """A default of the wrong type would lock the ConfigDict field to it (an int default
    refuses `--config.x=0.5`); a None default is a placeholder of the annotated type."""
    c = knobs.default_configdict(Config)
    hints = {}
    for path, f in knobs.fields(Config):
        if "section" in f.metadata:
            hints[path] = typing.get_type_hints(f.default_factory)
            continue
        spec, parent, leaf = f.metadata["knob"], *path.rpartition(".")[::2]
        tp = hints[parent][leaf] if parent else typing.get_type_hints(Config)[leaf]
        allowed = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        assert spec.doc.strip(), f"{path}: no doc"
        node = c
        for part in path.split(".")[:-1]:
            node = node[part]
        if f.default is None:
            assert node._fields[leaf].get_type() is allowed[0], path
        else:
            assert type(f.default) in allowed, (path, f.default, tp)
            assert node[leaf] == f.default
    knobs.check_declared(Config())  # every default is allowed by its own declaration


@pytest.mark.parametrize(
    "spec, good, bad, message",
    [
        (knobs.Knob("d", low=0.0, low_open=True), 1e-12, 0.0, r"^x=0\.0 .*allowed \(0\.0, inf\)$"),
        (knobs.Knob("d", low=0.0), 0.0, -1e-12, r"^x=-1e-12 .*allowed \[0\.0, inf\)$"),
        (knobs.Knob("d", high=1.0, high_open=True), 0.999, 1.0, r"allowed \(-inf, 1\.0\)$"),
        (knobs.Knob("d", low=0, high=2), 2, 3, r"^x=3 is out of range; allowed \[0, 2\]$"),
        (knobs.Knob("d"), -1e300, float("nan"), r"^x=nan is not a finite number"),
        (knobs.Knob("d", choices=("a", None)), None, "b", r"^x='b' is not one of \['a', None\]$"),
    ],
)
def test_a_knob_allows_its_range_or_choices(spec, good, bad, message):
    spec.check("x", good)
    with pytest.raises(config_lib.ConfigError, match=message):
        spec.check("x", bad)


def test_allowed_is_written_as_the_errors_write_it():
    assert knobs.Knob("d", low=0.0, high=1.0, high_open=True).allowed() == "[0.0, 1.0)"
    assert knobs.Knob("d", low=1.0, low_open=True).allowed() == "(1.0, inf)"
    assert knobs.Knob("d", choices=("", "bfloat16")).allowed() == '"" | bfloat16'
    assert knobs.Knob("d").allowed() == ""


def test_declared_choices_are_the_librarys():
    from m2po_jax.algorithm import (
        advantages,
        losses,
        masking,
        penalties,
        proximal,
        rejection,
        scopes,
    )
    from m2po_jax.learner import optim
    from m2po_jax.models import attention, families, model_config, moe, prompts, quant
    from m2po_jax.rollout import engines

    library = {
        "model.model_type": tuple(families.FAMILIES),
        "model.dtype": tuple(model_config.DTYPES),
        "model.remat_policy": tuple(model_config.REMAT_POLICIES),
        "model.attention": attention.IMPLEMENTATIONS,
        "model.lora.base": model_config.LORA_BASES,
        "task.long_prompts": prompts.LONG_PROMPT_MODES,
        "task.chat_template": prompts.CHAT_TEMPLATE_MODES,
        "rollout.weight_dtype": quant.WEIGHT_DTYPES,
        "rollout.kv_dtype": ("", *model_config.KV_DTYPES),
        "actor.m2po_method": masking.METHODS,
        "actor.m2po_second_moment": masking.SECOND_MOMENTS,
        "actor.m2po_stop_rule": scopes.M2PO_STOP_RULES,
        "actor.m2po_candidates": masking.CANDIDATES,
        "actor.m2po_scope": scopes.M2PO_SCOPES,
        "actor.prox_logp_method": proximal.PROX_LOGP_METHODS,
        "actor.loss_denominator": losses.DENOMINATORS,
        "actor.rollout_correction.is_level": rejection.IS_WEIGHT_LEVELS,
        "actor.importance_sampling_level": losses.IS_LEVELS,
        "actor.reward_norm.mean_level": advantages.NORM_LEVELS,
        "actor.reward_norm.std_level": advantages.NORM_LEVELS,
        "actor.kl_estimator": penalties.KL_ESTIMATORS,
        "actor.optimizer.lr_scheduler_type": optim.LR_SCHEDULER_TYPES,
        "mesh.expert_axis": moe.EXPERT_AXES,
    }
    declared = {path: spec.choices for path, spec in knobs.knobs(Config) if spec.choices}
    for path, choices in library.items():
        assert declared[path] == tuple(choices), path
    assert sorted(declared["rollout.engine"]) == sorted(["auto", *engines.ENGINES])
    # The rest are the config's own: the modes, the checkpoint and storage dtypes.
    own = set(declared) - set(library) - {"rollout.engine"}
    assert own == {
        "model.param_dtype",
        "rollout.mode",
        "rollout.publish_dtype",
        "agent.on_tool_error",
        "eval.reward",
        "checkpoint.hf_dtype",
        "actor.router_replay",
    }
    assert declared["checkpoint.hf_dtype"] == config_schema.PARAM_DTYPES
