"""The M2PO mask on inputs sharded over 8 (fake CPU) devices equals the unsharded mask.

Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts. When the
test process already has 8 devices (tests/conftest.py sets the flag) the check runs
in-process; otherwise it reruns this file in a subprocess with the flag set.
"""

import os
import subprocess
import sys

import numpy as np

NUM_DEVICES = 8


def _grid_batch(seed=0, shape=(16, 24)):
    """Log-ratios on a 1/8 grid, so every sum is exact whatever the reduction order."""
    rng = np.random.default_rng(seed)
    behav = rng.integers(-40, 0, shape).astype(np.float32) / 8
    prox = behav + rng.integers(-5, 6, shape).astype(np.float32) / 8
    prox[3, :5] = behav[3, :5] + 0.75  # ties above tau: the tie-splitting path
    loss_mask = rng.random(shape) < 0.8
    return behav, prox, loss_mask


def check_sharded():
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from m2po_jax.algorithm import scopes
    from m2po_jax.algorithm.masking import m2po_mask, m2po_mask_with_stats
    from m2po_jax.algorithm.masking_stats import finalize_stats

    assert jax.device_count() >= NUM_DEVICES, jax.devices()
    behav, prox, loss_mask = _grid_batch()
    tau = jnp.float32(0.1)
    for method in ("sort", "bisect"):
        for scope in ("global", "row"):
            fn = jax.jit(
                lambda b, p, m, t, method=method, scope=scope: m2po_mask_with_stats(
                    b, p, m, t, method=method, scope=scope
                )
            )
            expected, expected_stats = fn(behav, prox, loss_mask, tau)  # one device
            assert 0 < int(expected_stats["m2po/masked_tokens"]) < loss_mask.sum()
            layouts = [
                ((4, 2), P("x", "y"), AxisType.Auto),
                ((2, 4), P(None, ("x", "y")), AxisType.Explicit),  # tokens split across devices
            ]
            if scope == "global":
                layouts += [((8,), P("x"), AxisType.Auto), ((8,), P("x"), AxisType.Explicit)]
            for mesh_shape, spec, axis_type in layouts:
                names = ("x", "y")[: len(mesh_shape)]
                mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
                sharding = NamedSharding(mesh, spec)
                args = [jax.device_put(a, sharding) for a in (behav, prox, loss_mask)]
                assert len(args[0].sharding.device_set) == NUM_DEVICES
                with jax.set_mesh(mesh):
                    under_mesh = fn(*args, tau)
                # Plain JAX: no mesh context, jitted and eager (the library in other code;
                # eager dispatches every op on its own, so once per mesh and axis type).
                ways = [("set_mesh", under_mesh), ("jit", fn(*args, tau))]
                if method == "sort" and scope == "global":
                    eager = m2po_mask_with_stats(*args, tau, method=method, scope=scope)
                    ways.append(("eager", eager))
                for how, (mask, stats) in ways:
                    msg = f"{method} {scope} {spec} {axis_type} {how}"
                    np.testing.assert_array_equal(mask, expected, err_msg=msg)
                    if axis_type == AxisType.Explicit:  # comes back sharded like the input
                        assert mask.sharding.is_equivalent_to(sharding, mask.ndim), msg
                    for key, value in expected_stats.items():
                        np.testing.assert_allclose(stats[key], value, rtol=1e-6, err_msg=key)

        # Per-shard scope: inside shard_map each device masks its own block of rows.
        rows = behav.shape[0] // NUM_DEVICES
        expected = np.concatenate(
            [
                m2po_mask(behav[i : i + rows], prox[i : i + rows], loss_mask[i : i + rows], tau)
                for i in range(0, behav.shape[0], rows)
            ]
        )
        for axis_type in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(axis_type,))
            per_shard = jax.jit(
                jax.shard_map(
                    lambda b, p, m, t, method=method: m2po_mask(b, p, m, t, method=method),
                    mesh=mesh,
                    in_specs=(P("x"), P("x"), P("x"), P()),
                    out_specs=P("x"),
                )
            )
            args = [
                jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (behav, prox, loss_mask)
            ]
            with jax.set_mesh(mesh):
                mask = per_shard(*args, jax.device_put(tau, NamedSharding(mesh, P())))
            np.testing.assert_array_equal(mask, expected, err_msg=f"shard_map {method} {axis_type}")
            # The library's shard scope: the same blocks, statistics summed across shards.
            with jax.set_mesh(mesh):
                mask, parts = scopes.m2po_mask_scoped(
                    *args, tau, scope="shard", method=method, mesh=mesh, axes=("x",)
                )
            np.testing.assert_array_equal(mask, expected, err_msg=f"scope {method} {axis_type}")
            stats = finalize_stats(parts)
            assert int(stats["m2po/masked_tokens"]) == int((loss_mask & ~expected).sum())
            m2 = np.square(behav - prox)
            np.testing.assert_allclose(stats["m2po/m2_after"], m2[expected].mean(), rtol=1e-6)
            np.testing.assert_allclose(stats["m2po/boundary"], m2[expected].max(), rtol=1e-6)


def test_sharded_mask_equals_unsharded():
    import jax

    if jax.device_count() >= NUM_DEVICES:
        check_sharded()
        return
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


if __name__ == "__main__":
    check_sharded()
    print("sharded masks match")
