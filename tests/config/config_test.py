"""Config: typed sections, clear errors naming the field, overrides, the CLI's messages."""

import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import ml_collections
import pytest

from m2po_jax import config as config_lib
from m2po_jax.algorithm import rejection as rejection_lib
from m2po_jax.configs import arith, default, gsm8k
from m2po_jax.configs import math as math_config

REPO = Path(__file__).resolve().parents[2]


def build(**changes):
    c = default.get_config().to_dict()  # a plain dict: any value type can be tried
    for dotted, value in changes.items():
        node = c
        *parents, leaf = dotted.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config_lib.from_configdict(c)


def _flat(section, prefix=""):
    """A config's fields as {"actor.eps_clip": value, ...}."""
    out = {}
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = value
    return out


# What each arith preset changes from configs/default.py (the docstring of configs/arith.py):
# exactly these fields, to these values.
TINY = {
    "total_steps": 4,
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.num_layers": 1,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "sft.max_steps": 4,
    "sft.batch_size": 16,
    "sft.eval_every": 2,
    "gconfig.n_samples": 4,
    "actor.reward_norm.group_size": 4,  # derived from gconfig.n_samples
    "rollout.batch_size": 4,
    "rollout.max_head_offpolicyness": 2,  # min(k, 2)
    "actor.ppo_n_minibatches": 2,
    "eval.every": 2,
    "eval.num_examples": 16,
    "eval.batch_size": 16,
    "checkpoint.every": 2,
    "logging.progress": False,
    "logging.plots": False,
}
MOE = {
    "model.model_type": "qwen3_moe",
    "model.num_experts": 8,
    "model.num_experts_per_tok": 2,
    "model.moe_intermediate_size": 48,  # an eighth of the default intermediate_size
}
PRESET_CHANGES = {
    "m2po": {},  # the default: stale-4 rollouts, M2PO at tau = 0.04
    "grpo": {"actor.m2_threshold": None, "rollout.max_head_offpolicyness": 0},
    "stale_grpo": {"actor.m2_threshold": None},
    "paper": {
        "actor.m2po_second_moment": "current_behav",
        "actor.m2po_stop_rule": "le",
        "actor.eps_clip": None,
        "actor.loss_denominator": "valid",
    },
    "paper_final": {
        "actor.m2po_second_moment": "current_behav",
        "actor.m2po_stop_rule": "le",
        "actor.m2po_candidates": "harmful",
        "actor.eps_clip": None,
        "actor.use_decoupled_loss": False,
        "actor.loss_denominator": "valid",
        "actor.rejection_sampling.enabled": False,
    },
    "authors": {"actor.m2po_candidates": "harmful", "actor.m2po_stop_rule": "capped_clip"},
    "tiny": TINY,
    "stale_grpo,tiny": {**TINY, "actor.m2_threshold": None},
    "moe": MOE,
    "tiny,moe": {**TINY, **MOE, "model.moe_intermediate_size": 8},  # an eighth of tiny's
    "calculator": {
        "task.name": "calculator",
        "task.ops": "*",
        "task.min_digits": 2,
        "task.max_digits": 3,
        "task.max_prompt_len": 10,
        "gconfig.max_new_tokens": 24,
        "agent.env": "tools",
        "agent.tools": "m2po_jax.tasks.calculator:calculator",
        "agent.max_turns": 2,
        "agent.max_append_tokens": 8,
        "agent.on_tool_error": "end",
    },
}


def test_default_and_presets_build():
    cfg = build()
    assert cfg.actor.m2_threshold == 0.04
    assert cfg.rollout.max_head_offpolicyness == 4
    assert cfg.actor.rejection_sampling.upper == 5.0
    assert (cfg.actor.eps_clip, cfg.actor.m2po_stop_rule, cfg.actor.loss_denominator) == (
        0.2,
        "lt",
        "kept",
    )
    base = _flat(cfg)
    assert sorted(PRESET_CHANGES) == sorted([*arith.PRESETS, "stale_grpo,tiny", "tiny,moe"])
    for preset, changes in PRESET_CHANGES.items():
        got = _flat(config_lib.from_configdict(arith.get_config(preset)))
        changed = {k: v for k, v in got.items() if v != base[k]}
        assert changed == changes, preset
    assert arith.get_config(None).to_dict() == arith.get_config("m2po").to_dict()
    g = config_lib.from_configdict(gsm8k.get_config())
    assert g.task.name == "gsm8k" and g.actor.eps_clip == 0.0
    assert (g.task.long_prompts, cfg.task.long_prompts) == ("filter", "left")
    assert (cfg.task.chat_template, cfg.task.enable_thinking) == ("auto", None)
    assert (cfg.task.question_key, cfg.task.answer_key) == ("", "answer")  # "": the task's
    m = config_lib.from_configdict(math_config.get_config("qwen3-4b-base"))
    assert (m.task.name, m.task.chat_template, m.rollout.max_head_offpolicyness) == (
        "math",
        "off",
        256,
    )
    assert (m.actor.m2_threshold, m.eval.n_samples, m.eval.temperature) == (0.04, 4, 0.6)
    # The built-in default and the presets decide by the budget: the real-size presets'
    # long completions through the paged engine, the CPU preset's 48 tokens through the
    # static sampler; the multi-turn ones need an engine's episodes.
    assert cfg.rollout.engine == "auto" and config_lib.rollout_engine(cfg) == "static"
    for module in (gsm8k, math_config):
        for name in module.PRESETS:
            preset = config_lib.from_configdict(module.get_config(name))
            engine = "paged" if preset.gconfig.max_new_tokens >= 128 else "static"
            engine = "continuous" if preset.agent.env else engine
            assert config_lib.rollout_engine(preset) == engine, name
    assert config_lib.rollout_engine(m) == "paged"
    small = config_lib.from_configdict(math_config.get_config("qwen3-1.7b-base"))
    assert config_lib.rollout_engine(small) == "paged"
    tools = config_lib.from_configdict(gsm8k.get_config("qwen2.5-0.5b,tools"))
    assert (tools.agent.env, tools.agent.tools) == (
        "tools",
        "m2po_jax.tasks.calculator:python_calculator",
    )


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown preset 'tny'.*'tiny'"):
        arith.get_config("tny")


def test_unknown_key_names_itself_and_the_closest_valid_key():
    c = default.get_config()
    with c.actor.unlocked():
        c.actor.m2_threshlod = 0.1
    with pytest.raises(config_lib.ConfigError, match="'actor.m2_threshlod'.*'actor.m2_threshold'"):
        config_lib.from_configdict(c)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "actor.m2_threshold",
            -0.01,
            r"actor.m2_threshold=-0.01 is out of range; allowed \(0.0, inf\)",
        ),
        # tau = 0 keeps one token per set: nothing learns. None turns M2PO off.
        (
            "actor.m2_threshold",
            0.0,
            r"actor.m2_threshold=0.0 is out of range; allowed \(0.0, inf\)",
        ),
        ("actor.eps_clip", 1.0, r"actor.eps_clip=1.0 is out of range; allowed \[0.0, 1.0\)"),
        ("actor.c_clip", 1.0, r"actor.c_clip=1.0 is out of range; allowed \(1.0, inf\)"),
        ("actor.optimizer.lr", 0.0, r"actor.optimizer.lr=0.0 is out of range"),
        ("gconfig.top_p", 1.5, r"gconfig.top_p=1.5 is out of range"),
        (
            "actor.m2po_method",
            "scan",
            r"actor.m2po_method='scan' is not one of \['sort', 'bisect'\]",
        ),
        ("actor.kl_estimator", "k4", r"actor.kl_estimator='k4' is not one of"),
        ("actor.ppo_n_minibatches", 3, r"ppo_n_minibatches=3 must divide the rows per step"),
        (
            "actor.reward_norm.group_size",
            4,
            r"actor.reward_norm.group_size=4 differs from gconfig.n_samples=8; .* is derived "
            r"from gconfig.n_samples \(a group is the completions of one prompt\)",
        ),
        (
            "actor.temperature",
            0.7,
            r"actor.temperature=0.7 differs from gconfig.temperature=1.0; .* is derived from "
            r"gconfig.temperature \(the behaviour log-probs are recorded at the sampling",
        ),
        ("actor.sapo_tau_neg", 0.0, r"actor.sapo_tau_neg=0.0 is out of range; allowed \(0.0"),
        ("eval.sets", "math500", r"eval.sets: expected name=path\[,name=path...\], got 'math500'"),
        ("eval.n_samples", 4, r"eval.n_samples=4 with eval.temperature=0 \(greedy\) gives 4 equal"),
        ("eval.reward", "mean", r"eval.reward='mean' is not one of \['train', 'verifier'\]"),
        ("task.verifier", "sympy", r"task.verifier='sympy' is not one of \['math', 'numeric'\]"),
        ("task.prompt_template", "Solve it.", r"task.prompt_template: expected a '\{problem\}'"),
        ("task.name", "nope_pkg:Task", r"task.name 'nope_pkg:Task': module 'nope_pkg' not found"),
        ("rollout.reward_timeout_s", -1.0, r"rollout.reward_timeout_s=-1.0 is out of range"),
        ("rollout.page_size", 0, r"rollout.page_size=0 is out of range; allowed \[1"),
        ("model.model_type", "gpt2", r"model.model_type='gpt2' is not one of \['llama'"),
        (
            "model.model_type",
            "qwen3_moe",  # a new mixture of experts needs its experts
            r"model.num_experts=0: model.model_type='qwen3_moe' needs it >= 1",
        ),
        (
            "rollout.kv_dtype",
            "fp8",
            r"rollout.kv_dtype='fp8' is not one of \['', 'bfloat16', 'float8_e4m3fn'\]",
        ),
        (
            "actor.optimizer.lr_scheduler_type",
            "step",
            r"lr_scheduler_type='step' is not one of \['constant', 'linear', 'cosine'\]",
        ),
        ("actor.m2_threshold", float("inf"), r"m2_threshold=inf is not a finite number"),
        ("actor.optimizer.lr", float("nan"), r"lr=nan is not a finite number"),
        (
            "gconfig.temperature",
            1e-30,
            r"gconfig.temperature=1e-30 is out of range; allowed \[0.001",
        ),
        ("total_steps", 2.5, r"total_steps: expected an integer, got 2.5"),
        ("mesh.fsdp", 0, r"mesh.fsdp=0 must be a positive size or -1"),
        (
            "task.long_prompts",
            "truncate",
            r"task.long_prompts='truncate' is not one of \['filter', 'left', 'error'\]",
        ),
        ("task.chat_template", "none", r"task.chat_template='none' is not one of \['auto', 'on'"),
        ("task.enable_thinking", "yes", r"task.enable_thinking: expected true or false"),
        ("task.answer_key", "", r"task.answer_key: expected a column name"),
        ("model.attention", "flash", r"model.attention='flash' is not one of \['auto', 'xla'"),
        (
            "model.remat_policy",
            "dots",
            r"model.remat_policy='dots' is not one of \['nothing_saveable'",
        ),
    ],
)
def test_out_of_range_values_name_field_value_and_range(field, value, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        build(**{field: value})


def test_sapo_with_decoupled_loss_is_refused():
    with pytest.raises(config_lib.ConfigError, match="use_sapo_loss=True cannot be combined"):
        build(**{"actor.use_sapo_loss": True})
    cfg = build(**{"actor.use_sapo_loss": True, "actor.use_decoupled_loss": False})
    assert cfg.actor.use_sapo_loss


def test_yaml_and_json_overrides(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("actor:\n  m2_threshold: 0.08\n  optimizer:\n    lr: 1.0e-5\n")
    c = default.get_config()
    config_lib.apply_overrides(c, config_lib.load_overrides(str(yaml_file)))
    cfg = config_lib.from_configdict(c)
    assert cfg.actor.m2_threshold == 0.08 and cfg.actor.optimizer.lr == 1e-5

    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"actor": {"m2_threshold": None}}))
    config_lib.apply_overrides(c, config_lib.load_overrides(str(json_file)))
    assert config_lib.from_configdict(c).actor.m2_threshold is None

    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  eps_clp: 0.1\n")
    with pytest.raises(config_lib.ConfigError, match="'actor.eps_clp'.*'actor.eps_clip'"):
        config_lib.apply_overrides(c, config_lib.load_overrides(str(bad)))
    with pytest.raises(config_lib.ConfigError, match="does not exist"):
        config_lib.load_overrides(str(tmp_path / "missing.yaml"))


def test_bad_overrides_files_name_the_file_line_and_key(tmp_path):
    c = default.get_config()
    broken = tmp_path / "broken.yaml"
    broken.write_text("actor:\n  eps_clip: 0.1\n   lr: [1\n")
    with pytest.raises(config_lib.ConfigError, match=r"broken.yaml:3:\d+: not valid YAML"):
        config_lib.load_overrides(str(broken))
    broken_json = tmp_path / "broken.json"
    broken_json.write_text('{"actor":\n {"eps_clip": }}')
    with pytest.raises(config_lib.ConfigError, match=r"broken.json:2:\d+: not valid JSON"):
        config_lib.load_overrides(str(broken_json))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"actor:\n  m2po_method: \xe9\n")
    with pytest.raises(config_lib.ConfigError, match=r"latin.yaml: not UTF-8 text"):
        config_lib.load_overrides(str(latin))
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("actor:\n  eps_clip: abc\n")
    with pytest.raises(
        config_lib.ConfigError, match=r"actor.eps_clip: expected a float, got 'abc'"
    ):
        config_lib.apply_overrides(c, config_lib.load_overrides(str(wrong_type)))


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "m2po_jax.cli.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_apply_dotted_sets_nested_fields_and_rejects_unknown_keys():
    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, {"actor.c_clip": None, "actor.optimizer.lr": 3e-4, "seed": 7})
    assert c.actor.c_clip is None and c.actor.optimizer.lr == 3e-4 and c.seed == 7
    with pytest.raises(config_lib.ConfigError, match=r"'actor\.optimizer\.lrr'.*lr"):
        config_lib.apply_dotted(c, {"actor.optimizer.lrr": 1.0})
    with pytest.raises(config_lib.ConfigError, match="actor: expected a section"):
        config_lib.apply_dotted(c, {"actor": 1.0})


def test_cli_reports_config_errors_in_one_line(tmp_path):
    typo = _cli("--config.actor.m2_threshlod=0.1", f"--workdir={tmp_path}")
    assert typo.returncode == 2
    assert "config error" in typo.stderr and "m2_threshold" in typo.stderr
    assert "Traceback" not in typo.stderr

    negative = _cli("--config.actor.m2_threshold=-1", f"--workdir={tmp_path}")
    assert negative.returncode == 2
    assert "actor.m2_threshold=-1.0 is out of range" in negative.stderr

    sapo = _cli("--config.actor.use_sapo_loss=True", f"--workdir={tmp_path}")
    assert sapo.returncode == 2 and "use_sapo_loss" in sapo.stderr

    # A typo in a `=None` override (set apart from the others) is a one-line error too.
    none_typo = _cli("--config.actor.c_clipp=None", f"--workdir={tmp_path}")
    assert none_typo.returncode == 2 and '"c_clip"' in none_typo.stderr
    assert "Traceback" not in none_typo.stderr

    overrides = tmp_path / "o.yaml"
    overrides.write_text("rollout:\n  max_head_offpolicynes: 2\n")
    bad = _cli(f"--overrides={overrides}", f"--workdir={tmp_path}")
    assert bad.returncode == 2 and "max_head_offpolicyness" in bad.stderr


def test_build_model_passes_attention_and_remat_policy():
    from m2po_jax import trainer

    cfg = build(
        **{"model.attention": "chunked", "model.remat": True, "model.remat_policy": "dots_saveable"}
    )
    model_config, _ = trainer.build_model(cfg, vocab_size=20)
    assert model_config.attention == "chunked"
    assert model_config.remat and model_config.remat_policy == "dots_saveable"
    default_config, _ = trainer.build_model(build(), vocab_size=20)
    assert default_config.attention == "auto" and not default_config.remat


MOE_FIELDS = {"model.model_type": "qwen3_moe", "model.num_experts": 4,
              "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 24}  # fmt: skip


def test_build_model_makes_a_new_mixture_of_experts_from_the_config_fields():
    from m2po_jax import trainer

    cfg = build(**MOE_FIELDS, **{"model.norm_topk_prob": False})
    model_config, _ = trainer.build_model(cfg, vocab_size=20)
    got = (model_config.model_type, model_config.num_experts, model_config.num_experts_per_tok)
    assert got == ("qwen3_moe", 4, 2)
    assert (model_config.moe_intermediate_size, model_config.norm_topk_prob) == (24, False)
    assert model_config.qk_norm and not model_config.attention_bias  # Qwen3's attention
    default_config, _ = trainer.build_model(build(), vocab_size=20)
    assert (default_config.num_experts, default_config.model_type) == (0, "llama")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model.num_experts": 4}, r"^model.num_experts=4: model.model_type='llama' is dense; "),
        (
            {"model.model_type": "qwen3", "model.moe_intermediate_size": 8},
            r"^model.moe_intermediate_size=8: model.model_type='qwen3' is dense; experts need",
        ),
        (
            {**MOE_FIELDS, "model.num_experts_per_tok": 5},
            r"^model.num_experts_per_tok=5: expected 1..model.num_experts \(4\)$",
        ),
        (
            {**MOE_FIELDS, "model.num_experts_per_tok": 0},
            r"^model.num_experts_per_tok=0: expected 1..model.num_experts \(4\)$",
        ),
        (
            {**MOE_FIELDS, "model.moe_intermediate_size": 0},
            r"^model.moe_intermediate_size=0: model.model_type='qwen3_moe' needs it >= 1$",
        ),
        ({**MOE_FIELDS, "model.num_experts": -1}, r"^model.num_experts=-1 is out of range"),
        (
            {**MOE_FIELDS, "model.path": "/ckpt"},
            r"^model.num_experts=4: model.path's config.json gives a checkpoint's \(leave it 0\)",
        ),
    ],
)
def test_expert_fields_that_do_not_compose_are_named(changes, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        build(**changes)


# What the library's RejectionSampling refuses is refused by the config, before any work.
REJECTION_ERRORS = [
    (
        {"actor.rejection_sampling.upper": 0.5},
        r"actor\.rejection_sampling\.upper must be > 1 for metric 'ratio', got 0\.5",
    ),
    (
        {"actor.rejection_sampling.lower": 3.0, "actor.rejection_sampling.upper": 2.0},
        r"actor\.rejection_sampling\.lower \(3\.0\) must be <= upper \(2\.0\)",
    ),
    (
        {"actor.rejection_sampling.action": "clamp", "actor.rejection_sampling.metric": "kl_k1"},
        r"actor\.rejection_sampling\.action 'clamp' needs metric 'ratio', got 'kl_k1'",
    ),
]


@pytest.mark.parametrize("changes, message", REJECTION_ERRORS)
def test_rejection_sampling_errors_are_config_errors(changes, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        build(**changes)


def test_rejection_sampling_ranges_are_the_librarys():
    # kl_k1 = log rho can be negative: the library allows a negative lower bound, so does
    # the config; a disabled section is still checked (it is one switch from being used).
    cfg = build(
        **{
            "actor.rejection_sampling.metric": "kl_k1",
            "actor.rejection_sampling.lower": -0.5,
            "actor.rejection_sampling.upper": 0.5,
        }
    )
    assert cfg.actor.rejection_sampling.lower == -0.5
    with pytest.raises(config_lib.ConfigError, match=r"rejection_sampling\.upper must be > 1"):
        build(**{"actor.rejection_sampling.enabled": False, "actor.rejection_sampling.upper": 0.5})
    with pytest.raises(config_lib.ConfigError, match=r"rejection_sampling.upper=nan is not a fin"):
        build(**{"actor.rejection_sampling.upper": float("nan")})


# actor.rollout_correction: its own ranges and the combinations that do not compose,
# refused at start-up naming the config's fields.
ROLLOUT_CORRECTION_ERRORS = [
    (
        {"actor.rollout_correction.is_level": "row"},
        r"actor\.rollout_correction\.is_level='row' is not one of \['token', 'sequence', "
        r"'geometric', 'none'\]",
    ),
    (
        {"actor.rollout_correction.is_threshold": 0.0},
        r"actor\.rollout_correction\.is_threshold=0\.0 is out of range; allowed \(0\.0, inf\)",
    ),
    (
        {"actor.rollout_correction.is_level": "none", "actor.rollout_correction.is_threshold": 2.0},
        r"actor\.rollout_correction\.is_threshold=2\.0 truncates a weight that is_level='none'",
    ),
    (
        {"actor.rollout_correction.is_level": "sequence", "actor.use_decoupled_loss": False},
        r"^actor\.rollout_correction \(is_level='sequence', is_threshold=None\) weighs the "
        r"decoupled loss's behaviour ratio, which actor\.use_decoupled_loss=False does not have",
    ),
    (
        {
            "actor.rollout_correction.is_threshold": 2.0,
            "actor.use_decoupled_loss": False,
            "actor.use_sapo_loss": True,
        },
        r"which actor\.use_sapo_loss=True does not have",
    ),
    (
        {"actor.rollout_correction.is_threshold": 2.0, "actor.rejection_sampling.action": "clamp"},
        r"actor\.rollout_correction\.is_threshold=2\.0 and actor\.rejection_sampling\.action="
        r"'clamp' are two truncations of one weight: pick one",
    ),
    (
        {"actor.rollout_correction.is_level": "none", "actor.rejection_sampling.action": "clamp"},
        r"actor\.rejection_sampling\.action='clamp' clamps the token weight rho, which "
        r"actor\.rollout_correction\.is_level='none' replaces",
    ),
    (
        {
            "actor.rollout_correction.is_level": "geometric",
            "actor.rejection_sampling.level": "sequence",
        },
        r"actor\.rollout_correction\.is_level='geometric' with actor\.rejection_sampling "
        r"level='sequence', metric='ratio': AReaL's sequence ratio already replaces rho",
    ),
]


@pytest.mark.parametrize("changes, message", ROLLOUT_CORRECTION_ERRORS)
def test_rollout_correction_errors_are_config_errors(changes, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        build(**changes)


def test_rollout_correction_reaches_the_loss_settings():
    from m2po_jax.learner.actor_settings import ActorSettings

    fields = {"actor.rollout_correction.is_level": "geometric"}
    cfg = build(**fields, **{"actor.rollout_correction.is_threshold": 2.0})
    want = rejection_lib.RolloutCorrection("geometric", 2.0)
    assert config_lib.build_library_objects(cfg)["rollout_correction"] == want
    assert ActorSettings.build(cfg.actor).loss.rollout_correction == want
    # The disabled rejection composes with anything; GSPO composes with a row weight.
    build(
        **fields,
        **{"actor.rejection_sampling.enabled": False, "actor.rejection_sampling.level": "sequence"},
    )
    build(**fields, **{"actor.importance_sampling_level": "sequence"})
    assert build().actor.rollout_correction == config_lib.RolloutCorrectionSection("token", None)


def test_library_objects_are_built_by_the_runs_builders():
    from m2po_jax.learner.actor_settings import ActorSettings
    from m2po_jax.rollout import sampling

    cfg = build(**{"actor.rejection_sampling.lower": 0.5, "gconfig.top_k": 5})
    built = config_lib.build_library_objects(cfg)
    assert built["rejection_sampling"] == rejection_lib.RejectionSampling(upper=5.0, lower=0.5)
    assert ActorSettings.build(cfg.actor).loss.rejection_sampling == built["rejection_sampling"]
    assert built["sampling"] == sampling.SamplingConfig(max_new_tokens=4, temperature=1.0, top_k=5)
    off = build(**{"actor.rejection_sampling.enabled": False})
    assert config_lib.build_library_objects(off)["rejection_sampling"] is None
    # A Config made without validate's range checks still meets the builders' checks.
    cold = dataclasses.replace(cfg, gconfig=dataclasses.replace(cfg.gconfig, temperature=0.0))
    with pytest.raises(config_lib.ConfigError, match=r"gconfig\.temperature: must be > 0"):
        config_lib.build_library_objects(cold)


def test_derived_fields_follow_their_source():
    cfg = build(**{"gconfig.temperature": 0.7, "gconfig.n_samples": 4})
    assert cfg.actor.temperature == 0.7 and cfg.actor.reward_norm.group_size == 4
    # An explicit value equal to the source is accepted (AReaL configs set both).
    same = build(**{"actor.temperature": 1.0, "actor.reward_norm.group_size": 8})
    assert same.actor.temperature == 1.0 and same.actor.reward_norm.group_size == 8
    # A config written before the fields were derived may leave them out.
    c = default.get_config().to_dict()
    del c["actor"]["temperature"], c["actor"]["reward_norm"]["group_size"]
    cfg = config_lib.from_configdict(c)
    assert cfg.actor.temperature == 1.0 and cfg.actor.reward_norm.group_size == 8
    assert "temperature" not in c["actor"]
    tiny = config_lib.from_configdict(arith.get_config("tiny"))
    assert tiny.gconfig.n_samples == tiny.actor.reward_norm.group_size == 4


def test_eps_clip_none_turns_the_ratio_clip_off():
    assert build(**{"actor.eps_clip": None}).actor.eps_clip is None
    with pytest.raises(
        config_lib.ConfigError,
        match=r"actor.eps_clip_higher=0.28 needs a ratio clip, but actor.eps_clip=None",
    ):
        build(**{"actor.eps_clip": None, "actor.eps_clip_higher": 0.28})


def test_placeholder_override_of_the_wrong_type_names_the_declared_type(tmp_path):
    c = default.get_config()
    with pytest.raises(config_lib.ConfigError, match=r"actor.temperature: expected a float, got"):
        config_lib.apply_overrides(c, {"actor": {"temperature": "hot"}})
    config_lib.apply_overrides(c, {"actor": {"temperature": 1, "eps_clip": None}})
    cfg = config_lib.from_configdict(c)
    assert cfg.actor.temperature == 1.0 and cfg.actor.eps_clip is None


def test_cli_parses_derived_fields_and_none_clip():
    # m2po_jax.cli.train's own flag parsing, then the config it hands to the trainer.
    code = (
        "import sys; from m2po_jax import main, config as c; main.define_flags(); "
        "main.parse_flags(sys.argv); cfg = main.FLAGS.config; "
        "c.apply_dotted(cfg, dict.fromkeys(main._none_keys)); t = c.from_configdict(cfg); "
        "print(t.actor.temperature, t.actor.reward_norm.group_size, t.actor.eps_clip)"
    )
    args = [
        "--config.actor.temperature=0.7",
        "--config.gconfig.temperature=0.7",
        "--config.actor.reward_norm.group_size=8",
        "--config.actor.eps_clip=None",
    ]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.7", "8", "None"]
    # And the CLI refuses a derived field that differs, in one line, before any work.
    bad = _cli("--config.actor.temperature=0.7", "--workdir=/nonexistent/never-made")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "actor.temperature=0.7 differs from gconfig.temperature=1.0" in bad.stderr


def test_setup_errors_name_the_config_fields(tokenizer_dir, tmp_path):
    from m2po_jax.models.tokenizer import load_tokenizer
    from m2po_jax.trainer import setup

    cfg = arith.get_config("m2po,tiny")
    cfg.model.num_heads = 3
    with pytest.raises(ValueError, match=r"^model.hidden_size \(32\) must be a multiple of model"
                                         r".num_heads \(3\) unless model.head_dim is given$"):  # fmt: skip
        setup.build_model(config_lib.from_configdict(cfg), 16)
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "the cat ?", "answer": "#### 12"}\n' * 3)
    cfg = gsm8k.get_config()
    cfg.task.train_path, cfg.task.eval_size = str(data), 5
    with pytest.raises(ValueError, match=r"^task.eval_size=5: .* has only 3 records"):
        setup.build_task(config_lib.from_configdict(cfg), load_tokenizer(tokenizer_dir))


def test_the_math_config_finds_its_data_and_eval_sets_in_a_directory(tmp_path):
    for name in ("train", "math500", "aime24"):
        (tmp_path / f"{name}.jsonl").write_text('{"problem": "p", "answer": "1"}\n')
    c = config_lib.from_configdict(math_config.get_config(f"qwen3-1.7b-base,data={tmp_path}"))
    assert c.task.train_path == str(tmp_path / "train.jsonl")
    assert c.eval.sets == f"math500={tmp_path}/math500.jsonl,aime24={tmp_path}/aime24.jsonl"
    assert (c.mesh.fsdp, c.mesh.tensor, c.rollout.batch_size * c.gconfig.n_samples) == (4, 2, 128)
    with pytest.raises(ValueError, match=r"data=/nonexistent: no train.jsonl or train.parquet"):
        math_config.get_config("data=/nonexistent")


@pytest.mark.parametrize(
    "text, message",
    [
        ("actor:\n  kl_ctl: true\n", "actor.kl_ctl: expected a number, got True"),
        ("rollout:\n  batch_size: false\n", "rollout.batch_size: expected an integer, got False"),
        ("model:\n  remat: 1\n", "model.remat: expected true or false, got 1"),
    ],
)
def test_a_bool_for_a_number_and_a_number_for_a_bool_are_refused_from_a_file(
    tmp_path, text, message
):
    """ConfigDict would store True as 1.0 in a number field (kl_ctl = 1.0 trained)."""
    from m2po_jax.config import overrides

    path = tmp_path / "o.yaml"
    path.write_text(text)
    with pytest.raises(config_lib.ConfigError) as e:
        overrides.overlay_file(default.get_config(), str(path))
    assert str(e.value) == message


def test_a_bool_for_a_number_is_refused_in_a_plain_dict_config():
    """`m2po-study` builds its cells from plain dicts: the same types are checked there."""
    c = default.get_config().to_dict()
    c["actor"]["kl_ctl"] = True
    with pytest.raises(config_lib.ConfigError, match=r"^actor.kl_ctl: expected a number, got True"):
        config_lib.from_configdict(ml_collections.ConfigDict(c))
    c["actor"]["kl_ctl"] = 0
    assert config_lib.from_configdict(ml_collections.ConfigDict(c)).actor.kl_ctl == 0.0


CALC = {"agent.env": "tools", "agent.tools": "m2po_jax.tasks.calculator:calculator"}
AGENT_ERRORS = [
    ({"agent.env": "nope"}, r"agent\.env='nope': expected '' \(single-turn\), 'tools' or"),
    ({"agent.env": "tools"}, r"agent\.env='tools' needs agent\.tools"),
    (
        {**CALC, "rollout.engine": "static"},
        r"multi-turn episodes run on the continuous or paged engine; set "
        r"rollout.engine=continuous, paged or auto \(got 'static'\)",
    ),
    (
        {**CALC, "gconfig.max_new_tokens": 8, "agent.max_append_tokens": 8},
        r"agent\.max_append_tokens=8 must be below gconfig\.max_new_tokens=8",
    ),
    ({**CALC, "agent.parser": "xml"}, r"agent\.parser='xml': expected auto or one of \["),
    ({**CALC, "agent.on_tool_error": "ignore"}, r"agent\.on_tool_error"),
    ({**CALC, "agent.max_turns": 0}, r"agent\.max_turns=0 is out of range"),
    ({**CALC, "agent.step_timeout_s": 0.0}, r"agent\.step_timeout_s=0\.0 is out of range"),
    (
        {**CALC, "agent.tool_timeout_s": 10.0, "agent.step_timeout_s": 5.0},
        r"agent\.step_timeout_s=5\.0 must be above agent\.tool_timeout_s=10\.0",
    ),
    (
        {"agent.env": "tools", "agent.tools": "m2po_jax.tasks.calculator:nope"},
        r"agent\.tools 'm2po_jax\.tasks\.calculator:nope'.*has no attribute 'nope'",
    ),
    ({"agent.env": "no_such_envs:Env"}, r"agent\.env 'no_such_envs:Env': module"),
    (
        {
            **CALC,
            "rollout.mode": "async",
            "rollout.engine": "continuous",
            "rollout.stream_batches": 2,
        },
        r"episodes are not streamed; set rollout\.stream_batches=1",
    ),  # fmt: skip
]


@pytest.mark.parametrize("changes, message", AGENT_ERRORS)
def test_agent_errors_are_one_line_config_errors(changes, message):
    with pytest.raises(config_lib.ConfigError, match=message) as err:
        build(**{"gconfig.max_new_tokens": 24, "agent.max_append_tokens": 8, **changes})
    assert "\n" not in str(err.value)
    # auto resolves to the continuous engine for episodes; the paged engine runs them too
    ok = build(**{"gconfig.max_new_tokens": 24, "agent.max_append_tokens": 8, **CALC})
    assert config_lib.rollout_engine(ok) == "continuous"
    paged = build(**{"gconfig.max_new_tokens": 24, "agent.max_append_tokens": 8, **CALC,
                     "rollout.engine": "paged"})  # fmt: skip
    assert config_lib.rollout_engine(paged) == "paged"


def test_the_agent_is_built_with_its_settings_from_the_config():
    from m2po_jax.tasks import calculator, environments
    from m2po_jax.trainer import setup

    cfg = build(
        **{"gconfig.max_new_tokens": 24, "agent.max_append_tokens": 8, **CALC},
        **{"agent.tool_timeout_s": 1.5, "agent.step_timeout_s": 7.0},
        **{"agent.mask_failed_episodes": False, "agent.mask_truncated_episodes": True},
        **{"task.long_prompts": "filter"},
    )
    agent = setup.build_agent(cfg, calculator.CalculatorTask(seed=0, eval_size=8), None)
    try:
        env = agent.env_factory()
        assert env.timeout_s == 1.5 and isinstance(env.pool, environments.WorkerPool)
        assert env.pool is agent.env_factory().pool  # one pool shared by the episodes
        assert (agent.step_timeout_s, agent.long_prompts) == (7.0, "filter")
        assert (agent.mask_failed, agent.mask_truncated) == (False, True)
        # The shared tool pool's threads end with the agent (a run closes it at its end).
        assert env.pool.wait(env.pool.submit(lambda: "ran"), 5.0) == "ran"
        threads = [t for t in threading.enumerate() if t.name.startswith(env.pool.name + "_")]
        assert len(threads) == env.pool.workers
    finally:
        agent.close()
    for thread in threads:
        thread.join(5.0)
        assert not thread.is_alive(), thread.name
    defaults = build()
    assert defaults.agent.mask_failed_episodes and not defaults.agent.mask_truncated_episodes
    assert defaults.agent.step_timeout_s > defaults.agent.tool_timeout_s


# A config field as an error message names it: `rollout.kv_pages`, `model.lora.rank`.
_FIELD_IN_TEXT = r"\b({sections})\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"


def _raised_texts(tree):
    """(line, text) of every string literal (an f-string's literal parts joined, each
    placeholder as "{}") in what a `raise` raises or a `check_*` call is given."""
    import ast

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(text(v) if isinstance(v, ast.Constant) else "{}" for v in node.values)
        return None

    for node in ast.walk(tree):
        where = None
        if isinstance(node, ast.Raise) and node.exc is not None:
            where = node.exc
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")
                                                    ).startswith("check_"):  # fmt: skip
            where = node
        if where is None:
            continue
        for sub in ast.walk(where):
            found = text(sub)
            if found:
                yield sub.lineno, found


def test_every_config_field_an_error_message_names_exists():
    """Each `section.field` in a raised message (or a `check_*` call's name) of the
    package is a field of `config_schema`: a message that names `rollout.paged.pages`
    sends the user to a knob that does not exist."""
    import ast
    import re

    from m2po_jax.common import knobs
    from m2po_jax.common.config_schema import Config

    paths = {path for path, _ in knobs.fields(Config)}
    sections = sorted({path.split(".")[0] for path in paths if "." in path})
    pattern = re.compile(_FIELD_IN_TEXT.format(sections="|".join(sections)))
    wrong = set()
    for source in sorted((REPO / "m2po_jax").rglob("*.py")):
        tree = ast.parse(source.read_text())
        for line, found in _raised_texts(tree):
            for match in pattern.finditer(found):
                dotted = match.group(0).rstrip(".")
                # "model.path's", "task.eval_sets()": the longest prefix that is a field
                parts = dotted.split(".")
                if not any(".".join(parts[:n]) in paths for n in range(2, len(parts) + 1)):
                    wrong.add(f"{source.relative_to(REPO)}:{line}: {dotted}")
    assert not wrong, "messages name fields config_schema does not declare:\n" + "\n".join(
        sorted(wrong)
    )


# A setting that reaches nothing in the run it configures: refused in one line, naming it.
UNREACHED = [
    ({"rollout.engine": "static", "rollout.kv_pages": 64}, r"^rollout\.kv_pages=64 sizes the paged engine; this run's engine is static"),
    ({"rollout.engine": "continuous", "rollout.page_size": 8}, r"^rollout\.page_size=8 sizes the paged engine; this run's engine is continuous"),
    ({"rollout.kv_pages": 64}, r"^rollout\.kv_pages=64 .* is static \(rollout\.engine=auto -> static"),
    ({"rollout.engine": "static", "rollout.engine_slots": 4}, r"^rollout\.engine_slots=4 sizes the continuous or paged engine"),
    ({"rollout.engine": "static", "rollout.insert_lanes": 2}, r"^rollout\.insert_lanes=2 sizes"),
    ({"mesh.expert_axis": "fsdp"}, r"^mesh\.expert_axis='fsdp': llama is a dense model \(no experts to split\)"),
    ({"model.router_aux_loss_coef": 0.01}, r"^model\.router_aux_loss_coef=0\.01: llama is a dense model \(no router"),
]  # fmt: skip


@pytest.mark.parametrize("changes, message", UNREACHED)
def test_a_setting_that_reaches_nothing_is_refused(changes, message):
    with pytest.raises(config_lib.ConfigError, match=message) as err:
        build(**changes)
    assert "\n" not in str(err.value)


def test_the_same_settings_are_accepted_where_they_reach():
    moe = {"model.model_type": "qwen3_moe", "model.num_experts": 4,
           "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16}  # fmt: skip
    build(**moe, **{"mesh.expert_axis": "fsdp", "model.router_aux_loss_coef": 0.01})
    build(**{"rollout.engine": "paged", "rollout.kv_pages": 64, "rollout.page_size": 8})
    build(**{"gconfig.max_new_tokens": 128, "rollout.kv_pages": 64})  # auto -> paged
    build(**{"rollout.engine": "continuous", "rollout.engine_slots": 4, "rollout.insert_lanes": 2})
    # a checkpoint's model is known once loaded: setup checks it there, by the same rule
    cfg = build(**{"model.router_aux_loss_coef": 0.01, "model.model_type": "qwen3_moe",
                   **{k: v for k, v in moe.items() if k != "model.model_type"}})  # fmt: skip
    with pytest.raises(config_lib.ConfigError, match=r"^model\.router_aux_loss_coef=0\.01: llama"):
        config_lib.check_moe_settings(cfg, "llama", False)
    config_lib.check_moe_settings(cfg, "qwen3_moe", True)


def test_the_manual_says_which_engines_the_in_flight_fields_need():
    """Validation accepts the paged engine for multi-turn episodes, weights in flight and
    streamed batches (and the paged engine uses them): the field docs the manual is made
    from say so, not "continuous" alone."""
    from m2po_jax.common import knobs
    from m2po_jax.common.config_schema import Config

    docs = {
        path: f.metadata.get("knob", f.metadata.get("section")) for path, f in knobs.fields(Config)
    }
    docs = {path: getattr(doc, "doc", doc) for path, doc in docs.items()}
    paged = {"rollout.mode": "async", "rollout.engine": "paged"}
    build(**paged, **{"rollout.inflight_updates": True, "rollout.chunk_steps": 4})
    build(**paged, **{"rollout.stream_batches": 2})
    build(**{"gconfig.max_new_tokens": 24, "agent.max_append_tokens": 8, **CALC,
             "rollout.engine": "paged"})  # fmt: skip
    for path in (
        "agent",
        "rollout.inflight_updates",
        "rollout.chunk_steps",
        "rollout.stream_batches",
    ):
        assert "paged" in docs[path], (path, docs[path])
    assert "Needs the continuous engine" not in docs["agent"]
