"""The README's masking example and its two commands stay true."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax import m2po_mask, m2po_mask_with_stats

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
CI = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()


def test_readme_masking_example():
    behav_logp = jnp.array([[-1.0, -2.0, -0.5, -3.0]])
    prox_logp = jnp.array([[-1.1, -0.2, -0.5, -2.9]])
    loss_mask = jnp.array([[True, True, True, False]])
    mask = jax.jit(m2po_mask)(behav_logp, prox_logp, loss_mask, 0.04)
    np.testing.assert_array_equal(mask, [[True, False, True, False]])
    mask, stats = m2po_mask_with_stats(
        behav_logp, prox_logp, loss_mask, jnp.float32(0.04), method="bisect"
    )
    np.testing.assert_array_equal(mask, [[True, False, True, False]])
    np.testing.assert_allclose(stats["m2po/masked_fraction"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["m2po/m2_before"], (0.01 + 3.24 + 0.0) / 3, rtol=1e-4)
    np.testing.assert_allclose(stats["m2po/m2_after"], 0.005, rtol=1e-3)
    assert "mask == [[True, False, True, False]]" in README


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^    (python3 -m venv .*)$", README, flags=re.M)
    assert len(commands) == 2 and commands[0].endswith("m2po-train")
    assert commands[1] in CI
