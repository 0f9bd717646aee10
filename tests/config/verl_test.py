"""verl's algorithm.rollout_correction keys: each mapped to its fields, checked against a numpy
transcription of verl's rollout_corr_helper, read from files and the command line, refused
where they do not map."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from m2po_jax import config as config_lib
from m2po_jax.algorithm import losses
from m2po_jax.algorithm.rejection import behaviour_correction
from m2po_jax.common.errors import ConfigError
from m2po_jax.config import overrides, verl
from m2po_jax.configs import default
from m2po_jax.learner.actor_settings import ActorSettings

REPO = Path(__file__).resolve().parents[2]
RC, RS = "actor.rollout_correction", "actor.rejection_sampling"
NO_RS = {f"{RS}.enabled": False}


def _rs(level, metric, upper, lower, agg="mean"):
    fields = dict(enabled=True, action="mask", agg=agg, level=level, metric=metric)
    return {f"{RS}.{k}": v for k, v in {**fields, "upper": upper, "lower": lower}.items()}


def _is(level, threshold):
    return {f"{RC}.is_level": level, f"{RC}.is_threshold": threshold}


MAPPINGS = [
    ({}, {**_is("none", None), **NO_RS}),
    ({"rollout_is": "token"}, {**_is("token", 2.0), **NO_RS}),  # verl's default threshold
    ({"rollout_is": "sequence", "rollout_is_threshold": 3}, {**_is("sequence", 3.0), **NO_RS}),
    ({"rollout_is": None, "rollout_is_threshold": 3.0}, {**_is("none", None), **NO_RS}),
    (
        {"rollout_rs": "token", "rollout_rs_threshold": 2.0},
        {**_is("none", None), **_rs("token", "ratio", 2.0, 0.5)},  # lower 1 / upper
    ),
    (
        {"rollout_rs": "token", "rollout_rs_threshold": "4", "rollout_rs_threshold_lower": 0.8},
        {**_is("none", None), **_rs("token", "ratio", 4.0, 0.8)},
    ),
    (
        {"rollout_rs": "sequence", "rollout_rs_threshold": 4.0},
        {**_is("none", None), **_rs("sequence", "kl_k1", math.log(4.0), math.log(0.25), "sum")},
    ),
    (
        {"rollout_rs": "geometric", "rollout_rs_threshold": 1.1, "rollout_is": "token"},
        {**_is("token", 2.0), **_rs("sequence", "kl_k1", math.log(1.1), math.log(1 / 1.1))},
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_4.0"},
        {**_is("none", None), **_rs("token", "kl_k1", -math.log(0.5), -math.log(4.0))},
    ),
    (
        {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0},
        {**_is("none", None), **_rs("token", "kl_k1", -math.log(0.5), -math.log(2.0))},
    ),
    (
        {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.1},
        {**_is("none", None), **_rs("token", "kl_k2", 0.1, None)},
    ),
    (  # the keys that change nothing, at their neutral values
        {
            "bypass_mode": False,
            "loss_type": "ppo_clip",
            "rollout_is_batch_normalize": False,
            "rollout_token_veto_threshold": None,
        },
        {**_is("none", None), **NO_RS},
    ),
]


@pytest.mark.parametrize("section, want", MAPPINGS)
def test_each_key_maps_to_its_fields(section, want):
    assert verl.translate(section, "x.yaml") == want
    c = default.get_config()
    overrides.apply_dotted(c, want)
    config_lib.from_configdict(c)  # and the config takes them


# ------------------------------------------------------------ against verl's own rule


def verl_reference(old, rollout, mask, section):
    """(IS weights, kept tokens) as verl's rollout_corr_helper computes them (Nov 2025 names
    and token_k1 / token_k2 of Jan 2026), transcribed to numpy float32."""
    lr = (old - rollout).astype(np.float32)
    m = mask.astype(np.float32)
    safe = np.clip(lr, -20, 20)
    weights = np.ones_like(lr)
    level = section.get("rollout_is")
    if level == "token":
        weights = np.exp(safe)
    elif level == "sequence":
        weights = np.exp(np.clip((lr * m).sum(-1, keepdims=True), -20, 20)) * np.ones_like(lr)
    if level is not None:
        weights = np.minimum(weights * m, section.get("rollout_is_threshold", 2.0))
    keep = mask.copy()
    name, spec = section.get("rollout_rs"), section.get("rollout_rs_threshold")
    if name in ("token", "sequence", "geometric"):
        upper = float(spec)
        lower = section.get("rollout_rs_threshold_lower") or 1.0 / upper
        if name == "token":
            w = np.exp(safe)
        elif name == "sequence":
            w = np.exp(np.clip((lr * m).sum(-1, keepdims=True), -20, 20))
        else:
            mean = (lr * m).sum(-1, keepdims=True) / (m.sum(-1, keepdims=True) + 1e-8)
            w = np.exp(np.clip(mean, -20, 20))
        keep = keep & (w >= np.float32(lower)) & (w <= np.float32(upper))
    elif name == "token_k1":
        low_text, up_text = str(spec).split("_") if "_" in str(spec) else (None, str(spec))
        upper = float(up_text)
        lower = float(low_text) if low_text else 1.0 / upper
        k1 = -safe
        keep = keep & (k1 >= np.float32(math.log(lower))) & (k1 <= np.float32(math.log(upper)))
    elif name == "token_k2":
        keep = keep & (0.5 * safe**2 <= np.float32(spec))
    return weights, keep


VERL_CONFIGS = [
    {"rollout_is": "token", "rollout_is_threshold": 1.5},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {"rollout_rs": "token", "rollout_rs_threshold": 1.6},
    {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_threshold": 3.0},
    {"rollout_is": "sequence", "rollout_rs": "geometric", "rollout_rs_threshold": 1.2},
    {"rollout_rs": "geometric", "rollout_rs_threshold": 1.3, "rollout_rs_threshold_lower": 0.9},
    {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.8"},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.05},
]


@pytest.mark.parametrize("section", VERL_CONFIGS)
def test_translated_settings_weigh_and_keep_as_verl(section):
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.5, (8, 12)).astype(np.float32)
    rollout = (old + rng.normal(0.0, 0.4, old.shape)).astype(np.float32)
    mask = rng.random(old.shape) < 0.8
    mask[:, 0] = True
    c = default.get_config()
    overrides.apply_dotted(c, verl.translate(section, "x.yaml"))
    loss = ActorSettings.build(config_lib.from_configdict(c).actor).loss
    got = behaviour_correction(old, rollout, mask, loss.rejection_sampling, loss.rollout_correction)
    weights, keep = verl_reference(old, rollout, mask, section)
    np.testing.assert_array_equal(got.keep_BxT, keep)
    assert 0 < keep.sum() <= mask.sum()
    assert ("rollout_rs" in section) == (keep.sum() < mask.sum())  # each rejection rejects
    # exp of float32 row sums in another order: a few ulp.
    np.testing.assert_allclose(got.weight_BxT, np.where(keep, weights, 0.0), rtol=2e-6)


# ------------------------------------------------------------------ files, command line


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_verl_file_gives_the_native_fields_and_the_same_loss(tmp_path):
    verl_config = default.get_config()
    path = _write(
        tmp_path,
        {
            "actor": {"eps_clip": 0.3},
            "algorithm": {
                "rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2}
            },
        },
    )
    overrides.overlay_file(verl_config, path)
    native = default.get_config()
    overrides.apply_dotted(
        native,
        {
            "actor.eps_clip": 0.3,
            f"{RC}.is_level": "sequence",
            f"{RC}.is_threshold": 2.0,
            f"{RS}.enabled": False,
        },
    )
    a, b = (config_lib.from_configdict(c).actor for c in (verl_config, native))
    assert a == b and a.rollout_correction.is_level == "sequence"
    rng = np.random.default_rng(1)
    prox = rng.normal(-1.0, 0.5, (4, 6)).astype(np.float32)
    logp, behav = prox + 0.1, prox + rng.normal(0, 0.3, prox.shape).astype(np.float32)
    adv, mask = rng.normal(0, 1, prox.shape).astype(np.float32), rng.random(prox.shape) < 0.7
    settings = [ActorSettings.build(x).loss for x in (a, b)]
    la, lb = (losses.policy_loss_with(s, logp, prox, behav, adv, mask)[0] for s in settings)
    assert float(la) == float(lb)
    # And the weight is the sequence one: not the loss of the default settings.
    default_loss = losses.policy_loss_with(
        losses.LossSettings(eps_clip=0.3), logp, prox, behav, adv, mask
    )[0]
    assert abs(float(la) - float(default_loss)) > 1e-3


def test_verl_keys_in_an_areal_file_and_conflicts_with_native_keys(tmp_path):
    areal_file = {
        "experiment_name": "x",
        "actor": {"eps_clip": 0.25},
        "algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 3.0}},
    }
    c = default.get_config()
    overrides.overlay_file(c, _write(tmp_path, areal_file))
    assert (c.actor.eps_clip, c.actor.rollout_correction.is_threshold) == (0.25, 3.0)
    # AReaL's behav_imp_weight_cap sets the rejection sampling a verl section decides.
    clash = {**areal_file, "actor": {"behav_imp_weight_cap": 5.0}}
    with pytest.raises(ConfigError, match=r"run\.yaml: algorithm\.rollout_correction decides actor\.rollout_correction and actor\.rejection_sampling whole, and actor\.rejection_sampling\.action is set too"):  # fmt: skip
        overrides.overlay_file(default.get_config(), _write(tmp_path, clash))
    # A native key of those sections in the same file, or on the command line.
    plain = {
        "actor": {"rollout_correction": {"is_level": "geometric"}},
        **{"algorithm": areal_file["algorithm"]},
    }
    with pytest.raises(ConfigError, match=r"and actor\.rollout_correction\.is_level is set too"):
        overrides.overlay_file(default.get_config(), _write(tmp_path, plain))
    only_verl = _write(tmp_path, {"algorithm": areal_file["algorithm"]})
    with pytest.raises(ConfigError, match=r"and actor\.rejection_sampling\.upper is set too"):
        overrides.overlay_file(default.get_config(), only_verl, native_keys={f"{RS}.upper"})
    # The command line's verl keys win over the file's, key by key.
    c = default.get_config()
    overrides.overlay_file(c, only_verl, verl_args={"rollout_is": "sequence"})
    assert (c.actor.rollout_correction.is_level, c.actor.rollout_correction.is_threshold) == (
        "sequence",
        3.0,
    )


def test_command_line_keys_in_verls_spelling():
    code = (
        "import sys; from m2po_jax import main; main.define_flags(); "
        "main.parse_flags(sys.argv); t = main.config_from_flags().actor; "
        "print(t.rollout_correction.is_level, t.rollout_correction.is_threshold, "
        "t.rejection_sampling.enabled, t.rejection_sampling.upper, t.eps_clip)"
    )
    args = [
        "algorithm.rollout_correction.rollout_is=sequence",  # Hydra's spelling
        "--algorithm.rollout_correction.rollout_is_threshold=1e1",  # YAML's string: a number
        "--algorithm.rollout_correction.rollout_rs=token",
        "--algorithm.rollout_correction.rollout_rs_threshold=3",
        "--config.actor.eps_clip=0.3",
    ]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["sequence", "10.0", "True", "3.0", "0.3"]


# ----------------------------------------------------------------------------- refusals

REFUSED = [
    ({"rollout_iss": "token"}, r"algorithm\.rollout_correction\.rollout_iss: no counterpart here; did you mean 'rollout_is'\?"),
    ({"rollout_is": "geometric"}, r"rollout_is='geometric' is not one of verl's token, sequence, null \(actor\.rollout_correction\.is_level also takes geometric\)"),
    ({"rollout_is": "token", "rollout_is_threshold": None}, r"rollout_is_threshold=None turns verl's weight off, not its truncation"),
    ({"rollout_is": "token", "rollout_is_threshold": -1}, r"rollout_is_threshold=-1: expected a number > 0"),
    ({"rollout_is_batch_normalize": True}, r"rollout_is_batch_normalize=True: normalises the weights to mean 1 over the batch"),
    ({"rollout_token_veto_threshold": 1e-4}, r"rollout_token_veto_threshold=0\.0001: drops a whole sequence .* actor\.rejection_sampling\.lower drops only those tokens"),
    ({"bypass_mode": True}, r"bypass_mode=True: verl's bypass mode .* actor\.use_decoupled_loss=false"),
    ({"loss_type": "reinforce"}, r"loss_type='reinforce': it is read only in verl's bypass mode"),
    ({"rollout_rs": "token"}, r"rollout_rs_threshold: verl needs it with rollout_rs='token'"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 0.8}, r"lower bound 1\.25 > upper bound 0\.8"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 1.0}, r"AReaL's token ratio bound \(what rollout_rs=token becomes\) must be > 1"),
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 1e9}, r"rollout_rs_threshold=1000000000\.0: beyond verl's clip of log rho to \+-20"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": 200}, r"beyond verl's clip of log rho to \+-20"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": 0.5}, r"verl's token_k1 takes its bounds in rollout_rs_threshold"),
    ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 2}, r"verl clips each token's log rho to \+-20 before the row's mean; the nearest is actor\.rejection_sampling level=sequence, agg=mean, metric=kl_k1 \(lower = -log u, upper = -log l\)"),
    ({"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 2}, r"before the row's max; the nearest is .* agg=max, metric=kl_k2 \(upper\)"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": 2}, r"verl's k3 is exp\(log rho\) - 1 - log rho, AReaL's kl_k3 is exp\(-log rho\) - 1 \+ log rho"),
    ({"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": 2}, r"one rejection criterion here"),
    ({"rollout_rs": "median", "rollout_rs_threshold": 2}, r"rollout_rs='median' is not one of verl's token, sequence, geometric, token_k1, token_k2 or null"),
]  # fmt: skip


@pytest.mark.parametrize("section, message", REFUSED)
def test_keys_that_do_not_map_are_refused_in_one_line(section, message):
    with pytest.raises(
        ConfigError, match=r"^x\.yaml: verl keys this trainer cannot honour: .*" + message
    ) as e:
        verl.translate(section, "x.yaml")
    assert "\n" not in str(e.value)


def test_other_algorithm_keys_are_refused():
    with pytest.raises(
        ConfigError, match=r"^f: algorithm\.adv_estimator: verl keys with no counterpart here"
    ):
        verl.split({"algorithm": {"adv_estimator": "grpo", "rollout_correction": {}}}, "f")
    assert verl.split({"actor": {}}, "f") == ({"actor": {}}, {})
