"""AReaL experiment files as overrides: AReaL's GSM8K M2PO example, mapped, checked, refused."""

import copy
from pathlib import Path

import pytest
import yaml

from m2po_jax import config
from m2po_jax.common.errors import ConfigError
from m2po_jax.config import areal, overrides
from m2po_jax.configs import gsm8k

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "areal_gsm8k_m2po.yaml"


def _translate(data):
    return areal.translate(data, overrides.dotted_keys(gsm8k.get_config()), "x.yaml")


def test_arealsgsm8k_m2po_example_trains_what_it_says():
    base = gsm8k.get_config()
    # Settings the file's behav_imp_weight_cap derives: set otherwise first, so that the
    # mapping, not the defaults, must give them.
    rs = base.actor.rejection_sampling
    rs.level, rs.action, rs.metric, rs.upper = "sequence", "clamp", "kl_k1", 2.0
    base.task.long_prompts = "left"
    ignored = overrides.overlay_file(base, str(EXAMPLE))
    cfg = config.from_configdict(base)
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.model.dtype == "bfloat16"
    assert cfg.model.remat and cfg.seed == 1
    assert (cfg.gconfig.n_samples, cfg.gconfig.max_new_tokens, cfg.gconfig.temperature) == (
        4,
        1024,
        1.0,
    )
    assert (cfg.rollout.batch_size, cfg.rollout.max_head_offpolicyness) == (256, 2)
    a = cfg.actor
    assert (a.m2_threshold, a.eps_clip, a.reward_scaling, a.reward_bias) == (0.04, 0.0, 10.0, -0.5)
    assert (
        a.optimizer.eps == 1e-8 and a.optimizer.lr == 1.7e-5 and a.optimizer.weight_decay == 0.017
    )
    assert a.adv_norm and (a.reward_norm.mean_level, a.reward_norm.std_level) == ("group", "group")
    # behav_imp_weight_cap is AReaL's token-level ratio rejection: every derived field.
    rs = a.rejection_sampling
    assert rs.enabled and (rs.level, rs.action, rs.metric, rs.upper) == (
        "token",
        "mask",
        "ratio",
        5.0,
    )
    assert rs.lower is None
    assert a.mb_spec.max_tokens_per_mb == 10240 and a.temperature == 1.0
    assert (cfg.task.max_prompt_len, cfg.task.long_prompts, cfg.eval.batch_size) == (
        1024,
        "filter",
        256,
    )
    for launcher_only in ("experiment_name", "cluster", "allocation_mode", "sglang", "vllm",
                          "launcher", "actor.weight_update_mode", "ref.scheduling_strategy"):  # fmt: skip
        assert launcher_only in ignored
    assert any(
        x.startswith("train_dataset.path ('openai/gsm8k' is not a local file") for x in ignored
    )


def test_interpolations_resolve_with_their_types_and_fail_in_one_line():
    doc = {"a": {"n": 4, "s": "x"}, "b": "${a.n}", "c": "run-${a.s}-${a.n}", "d": ["${b}"]}
    assert areal.resolve(doc) == {"a": {"n": 4, "s": "x"}, "b": 4, "c": "run-x-4", "d": [4]}
    with pytest.raises(ConfigError, match=r"f.yaml: c: \$\{a.zz\} names no key"):
        areal.resolve({"a": {}, "c": "${a.zz}"}, "f.yaml")
    with pytest.raises(ConfigError, match=r"circular interpolation x -> y -> x"):
        areal.resolve({"x": "${y}", "y": "${x}"})
    with pytest.raises(ConfigError, match=r"resolver \$\{oc.env:HOME\} is not supported"):
        areal.resolve({"x": "${oc.env:HOME}"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (("gconfig", "min_new_tokens", 8), "gconfig.min_new_tokens=8: a minimum completion length"),
        (("actor", "group_size", 8), "actor.group_size=8 must equal gconfig.n_samples=4"),
        (("actor", "dynamic_sampling", True), "actor.dynamic_sampling=True: dynamic sampling"),
        (("actor", "use_magic", True), "actor.use_magic: no counterpart in this trainer"),
        (("actor", "adv_norm", {"mean_level": "group", "std_level": "batch"}), "actor.adv_norm="),
    ],
)
def test_keys_that_would_change_training_are_refused_with_the_reason(edit, message):
    data = yaml.safe_load(EXAMPLE.read_text())
    section, key, value = edit
    data = copy.deepcopy(data)
    data[section][key] = value
    with pytest.raises(ConfigError, match=r"^x.yaml: AReaL keys this trainer cannot honour: "):
        try:
            _translate(data)
        except ConfigError as e:
            assert message in str(e) and "\n" not in str(e), str(e)
            raise


def test_yaml_exponents_without_a_dot_are_floats_in_our_files_too(tmp_path):
    base = gsm8k.get_config()
    path = tmp_path / "o.yaml"
    path.write_text(
        "actor:\n  optimizer:\n    eps: 1e-6\n    lr: 3E-5\n  eps_clip: ${actor.c}\n  c: 1\n"
    )
    with pytest.raises(ConfigError, match=r"unknown config key 'actor.c'"):
        overrides.overlay_file(base, str(path))
    path.write_text("actor:\n  optimizer:\n    eps: 1e-6\n    lr: 3E-5\n")
    assert overrides.overlay_file(base, str(path)) == []
    assert (base.actor.optimizer.eps, base.actor.optimizer.lr) == (1e-6, 3e-5)


def test_arealss_launcher_keys_are_ignored_by_what_they_do_and_training_keys_still_refused():
    # AReaL's current gsm8k_m2po.yaml: the allocation moved into per-section `backend` keys.
    data = yaml.safe_load(EXAMPLE.read_text())
    data["rollout"].update(backend="sglang:d4p1t1", fileroot="/tmp/areal", dump_to_file=True,
                           tokenizer_path="${tokenizer_path}", request_timeout=3600)  # fmt: skip
    data["actor"]["backend"] = "fsdp:d4p1t1"
    data["ref"]["backend"] = "${actor.backend}"
    data["name_resolve"] = {"type": "nfs"}  # a section AReaL might add next
    out, ignored = _translate(data)
    for key in ("rollout.backend", "actor.backend", "ref.backend", "rollout.fileroot",
                "rollout.dump_to_file", "rollout.request_timeout", "name_resolve"):  # fmt: skip
        assert key in ignored, key
    assert out["actor.m2_threshold"] == 0.04 and out["model.path"] == data["actor"]["path"]
    assert not any(k.endswith(("backend", "fileroot", "dump_to_file")) for k in out)

    data["rollout"]["tokenizer_path"] = "/other/tokenizer"  # the tokenizer is the model's
    with pytest.raises(ConfigError, match=r"rollout.tokenizer_path='/other/tokenizer' must equal"):
        _translate(data)
    data["rollout"]["tokenizer_path"] = "${actor.path}"
    for where, key in (("rollout", "use_lora"), ("actor", "backend_loss_scale"), (None, "async")):
        edited = copy.deepcopy(data)
        (edited[where] if where else edited)[key] = True
        with pytest.raises(ConfigError, match=f"{key}: no counterpart in this trainer"):
            _translate(edited)
