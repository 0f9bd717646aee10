"""verl's `algorithm.rollout_correction` keys as `actor.rollout_correction` and
`actor.rejection_sampling`.

verl (`verl/trainer/config/algorithm.py` `RolloutCorrectionConfig`,
`verl/trainer/ppo/rollout_corr_helper.py`) corrects the decoupled loss with an importance
weight (`rollout_is`, truncated at `rollout_is_threshold`) and a rejection (`rollout_rs`),
both of log rho = old (proximal) - rollout (behaviour) log-probs: the two halves of
`rejection.RolloutCorrection` and `rejection.RejectionSampling`. Its keys come from an
overrides file (`algorithm: {rollout_correction: {...}}`, beside this config's own keys or
in an AReaL file) or the command line (`algorithm.rollout_correction.rollout_is=token`,
with or without `--`), the command line winning key by key.

A verl section is translated whole, with verl's defaults for the keys it leaves out
(`rollout_is: null`: no weight, `rollout_is_threshold: 2.0`, `rollout_rs: null`: no
rejection, `rollout_rs_threshold_lower`: 1 / upper), so it decides both config sections;
it cannot be combined with keys of those sections (`CORRECTION_SECTIONS`).

| verl | here |
|---|---|
| `rollout_is: token / sequence / null` | `is_level: token / sequence / none` |
| `rollout_is_threshold: t` | `is_threshold: t` |
| `rollout_rs: token`, thresholds u, l | level token, metric ratio, [l, u] |
| `rollout_rs: sequence` | level sequence, agg sum, metric kl_k1, [log l, log u] |
| `rollout_rs: geometric` | level sequence, agg mean, metric kl_k1, [log l, log u] |
| `rollout_rs: token_k1`, "l_u" or u (l = 1 / u) | level token, metric kl_k1, [-log u, -log l] |
| `rollout_rs: token_k2`, u | level token, metric kl_k2, upper u |

action is mask throughout. Sequence and geometric rejection bound the row's sum / mean of
log rho (kl_k1), not AReaL's sequence ratio, because AReaL's ratio also replaces the weight
by the row's geometric mean, which verl's rejection leaves alone; the bounds are verl's
taken to log space (verl compares exp(clip(s, -20, 20)) with them: the same decision but
at rounding ties). token_k1 is verl's `-log rho` between log l and log u. Every name maps
exactly where its bounds lie inside verl's clip of log rho to +-20 (ratio bounds: |log
bound| < 20; token_k2: upper < 200), and is refused beyond. The `seq_*_k*` names are refused (verl clips
each token's log rho before the row's sum, mean or max), and so is every `*_k3` (verl's k3
is exp(log rho) - 1 - log rho, AReaL's kl_k3 is exp(-log rho) - 1 + log rho): each error
names the nearest native fields.

Refused, with what to use: `rollout_is_threshold: null` (verl: no weight at all),
`rollout_is_batch_normalize: true`, `rollout_token_veto_threshold`, `bypass_mode: true`,
`loss_type` other than `ppo_clip`, and any other `algorithm.*` key. Deliberate difference
that no key can express: verl takes rejected tokens out of its token-mean's denominator,
here they stay in it (AReaL).
"""

from __future__ import annotations

import math
from typing import Any

from m2po_jax.common.checks import did_you_mean, is_number
from m2po_jax.common.errors import ConfigError

PREFIX = "algorithm.rollout_correction"
# The sections a verl section decides whole: their own keys cannot be set beside it.
CORRECTION_SECTIONS = ("actor.rollout_correction", "actor.rejection_sampling")
IS_THRESHOLD = 2.0  # verl's default rollout_is_threshold
LOG_BOUND = 20.0  # verl's SAFETY_BOUND on log rho
_IS_LEVELS = {"token": "token", "sequence": "sequence", None: "none"}
_RS_LEVELS = ("token", "sequence", "geometric")  # verl Nov 2025 - Jan 2026
_RS_KL = ("token_k1", "token_k2")  # verl since Jan 2026, the ones that map exactly
# verl's keys that are accepted at the value that changes nothing here.
_NEUTRAL = {
    "rollout_is_batch_normalize": (
        False,
        "normalises the weights to mean 1 over the batch, which is not implemented",
    ),
    "rollout_token_veto_threshold": (
        None,
        "drops a whole sequence holding a token with rho below it, which is not "
        "implemented; actor.rejection_sampling.lower drops only those tokens",
    ),
    "bypass_mode": (
        False,
        "verl's bypass mode (rollout log-probs as the old policy, its own loss) is not "
        "implemented; actor.use_decoupled_loss=false is PPO against the behaviour policy",
    ),
    "loss_type": ("ppo_clip", "it is read only in verl's bypass mode, which is not implemented"),
}
_KEYS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "rollout_rs_threshold_lower",
    *_NEUTRAL,
)


def split(data: dict, source: str) -> tuple[dict, dict]:
    """(`data` without its `algorithm` section, that section's `rollout_correction` keys);
    any other `algorithm.*` key is refused (verl's, with no counterpart here)."""
    if "algorithm" not in data:
        return data, {}
    rest = {k: v for k, v in data.items() if k != "algorithm"}
    algorithm = data["algorithm"]
    if not isinstance(algorithm, dict):
        raise ConfigError(
            f"{source}: algorithm: expected verl's section (a mapping), got {algorithm!r}"
        )
    other = sorted(f"algorithm.{k}" for k in algorithm if k != "rollout_correction")
    if other:
        raise ConfigError(
            f"{source}: {', '.join(other)}: verl keys with no counterpart here (only "
            f"{PREFIX}.* is read; the rest of verl's algorithm section has native fields)"
        )
    section = algorithm.get("rollout_correction") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {PREFIX}: expected a mapping, got {section!r}")
    return rest, section


def translate(section: dict, source: str) -> dict[str, Any]:
    """This config's dotted keys for a verl `algorithm.rollout_correction` section (its
    keys without the prefix); refuses, in one line, every key it cannot honour."""
    refused: list[str] = []
    for key in section:
        if key not in _KEYS:
            refused.append(f"{PREFIX}.{key}: no counterpart here{did_you_mean(key, _KEYS)}")
    for key, (neutral, why) in _NEUTRAL.items():
        if section.get(key, neutral) != neutral:
            refused.append(f"{PREFIX}.{key}={section[key]!r}: {why}")
    out = _weight(section, refused)
    out.update(_rejection(section, refused))
    if refused:
        raise ConfigError(f"{source}: verl keys this trainer cannot honour: {'; '.join(refused)}")
    return out


def _number(key: str, value: Any, refused: list[str]) -> float | None:
    """`value` as a float > 0 (PyYAML reads `1e-3` as text), else None with a refusal."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if not is_number(value) or not 0 < value < math.inf:
        refused.append(f"{PREFIX}.{key}={value!r}: expected a number > 0")
        return None
    return float(value)


def _weight(section: dict, refused: list[str]) -> dict[str, Any]:
    level = section.get("rollout_is")
    if level not in _IS_LEVELS:
        refused.append(
            f"{PREFIX}.rollout_is={level!r} is not one of verl's token, sequence, null "
            "(actor.rollout_correction.is_level also takes geometric)"
        )
        return {}
    threshold = None
    if level is not None:
        threshold = section.get("rollout_is_threshold", IS_THRESHOLD)
        if threshold is None:
            refused.append(
                f"{PREFIX}.rollout_is_threshold=None turns verl's weight off, not its "
                "truncation: write rollout_is: null for no weight, or set "
                "actor.rollout_correction.is_threshold=None for an untruncated one"
            )
            return {}
        threshold = _number("rollout_is_threshold", threshold, refused)
    return {
        "actor.rollout_correction.is_level": _IS_LEVELS[level],
        "actor.rollout_correction.is_threshold": threshold,
    }


def _rejection(section: dict, refused: list[str]) -> dict[str, Any]:
    name = section.get("rollout_rs")
    rs = "actor.rejection_sampling"
    if name is None:
        return {f"{rs}.enabled": False}
    if not isinstance(name, str) or name.strip() not in (*_RS_LEVELS, *_RS_KL):
        refused.append(_rs_refusal(name))
        return {}
    name = name.strip()
    spec = section.get("rollout_rs_threshold")
    if spec is None:
        refused.append(f"{PREFIX}.rollout_rs_threshold: verl needs it with rollout_rs={name!r}")
        return {}
    lower_key = "rollout_rs_threshold_lower"
    if name in _RS_KL and lower_key in section:
        refused.append(
            f"{PREFIX}.{lower_key}: verl's {name} takes its bounds in rollout_rs_threshold "
            "('lower_upper' for k1)"
        )
        return {}
    fields = {"enabled": True, "action": "mask", "agg": "mean", "lower": None}
    if name == "token_k2":
        upper = _number("rollout_rs_threshold", spec, refused)
        if upper is not None and upper >= LOG_BOUND**2 / 2:
            refused.append(_beyond_clip("rollout_rs_threshold", spec))
        fields.update(level="token", metric="kl_k2", upper=upper)
    else:
        text = str(spec) if name == "token_k1" else None
        if text is not None and "_" in text:
            low_text, up_text = text.split("_", 1)
            lower = _number("rollout_rs_threshold", low_text, refused)
            upper = _number("rollout_rs_threshold", up_text, refused)
        else:
            upper = _number("rollout_rs_threshold", spec, refused)
            lower = section.get(lower_key)
            if lower is None:
                lower = None if upper is None else 1.0 / upper  # verl's default
            else:
                lower = _number(lower_key, lower, refused)
        if upper is None or lower is None:
            return {}
        if lower > upper:
            refused.append(f"{PREFIX}: lower bound {lower} > upper bound {upper}")
            return {}
        if max(abs(math.log(lower)), abs(math.log(upper))) >= LOG_BOUND:
            refused.append(_beyond_clip("rollout_rs_threshold", spec))
        if name == "token":
            if upper <= 1.0:
                refused.append(
                    f"{PREFIX}.rollout_rs_threshold={spec!r}: AReaL's token ratio bound "
                    "(what rollout_rs=token becomes) must be > 1"
                )
            fields.update(level="token", metric="ratio", upper=upper, lower=lower)
        elif name == "token_k1":
            # verl keeps -log rho in [log l, log u]: log rho in [-log u, -log l].
            fields.update(
                level="token", metric="kl_k1", upper=-math.log(lower), lower=-math.log(upper)
            )
        else:
            agg = "sum" if name == "sequence" else "mean"
            fields.update(
                level="sequence",
                agg=agg,
                metric="kl_k1",
                upper=math.log(upper),
                lower=math.log(lower),
            )
    return {f"{rs}.{field}": value for field, value in fields.items()}


def _beyond_clip(key: str, value: Any) -> str:
    return (
        f"{PREFIX}.{key}={value!r}: beyond verl's clip of log rho to +-{LOG_BOUND:g}, where "
        "its rejection and AReaL's differ; set actor.rejection_sampling instead"
    )


def _rs_refusal(name: Any) -> str:
    """Why verl's `rollout_rs` value `name` does not map, and the nearest native fields."""
    where = f"{PREFIX}.rollout_rs={name!r}"
    if isinstance(name, str) and "," in name:
        return f"{where}: one rejection criterion here; set actor.rejection_sampling for one"
    if isinstance(name, str) and name.endswith("k3"):
        return (
            f"{where}: verl's k3 is exp(log rho) - 1 - log rho, AReaL's kl_k3 is "
            "exp(-log rho) - 1 + log rho; no counterpart (kl_k2 is the same in both)"
        )
    if isinstance(name, str) and name.startswith("seq_") and name[4:8] in ("sum_", "mean", "max_"):
        agg = name.split("_")[1]
        metric = "kl_" + name.rsplit("_", 1)[-1]
        bounds = "lower = -log u, upper = -log l" if metric == "kl_k1" else "upper"
        return (
            f"{where}: verl clips each token's log rho to +-{LOG_BOUND:g} before the row's "
            f"{agg}; the nearest is actor.rejection_sampling level=sequence, agg={agg}, "
            f"metric={metric} ({bounds})"
        )
    return (
        f"{where} is not one of verl's {', '.join((*_RS_LEVELS, *_RS_KL))} or null "
        "(the ones that map here)"
    )
