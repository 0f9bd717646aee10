"""An async run with LoRA adapters publishes the base once and then only the adapters:
`rollout/published_bytes` per step is the adapters' size in the publish dtype (a full run:
the whole model's), the worker samples version v with the learner's base and the adapters
the learner had after v updates, and the staleness bound holds as in tests/trainer/
async_test.py."""

import jax
import numpy as np
import pytest
from flax import traverse_util

from m2po_jax import trainer as trainer_lib
from m2po_jax.models import lora
from m2po_jax.rollout import worker as worker_lib
from m2po_jax.trainer import async_rollouts
from tests.trainer.async_test import async_config, read

K = 1  # the staleness bound
STEPS = 4


def _flat(params, dtype) -> dict:
    """Host copies of a params tree's leaves by path, cast to `dtype` ("" keeps them)."""
    flat = traverse_util.flatten_dict(jax.device_get(params))
    return {p: np.asarray(x).astype(dtype or np.asarray(x).dtype) for p, x in flat.items()}


@pytest.mark.parametrize("rank, dtype", [(4, "bfloat16"), (0, "")])
def test_a_lora_run_publishes_its_adapters_alone(tmp_path, monkeypatch, rank, dtype):
    changes = {
        "total_steps": STEPS,
        "model.lora.rank": rank,
        "rollout.publish_dtype": dtype,
        "rollout.max_head_offpolicyness": K,
        "actor.optimizer.lr": 1e-2,  # adapters that move visibly in a few steps
        "eval.every": 0,
        "eval.batch_size": 8,
        "eval.num_examples": 8,
        "checkpoint.every": 0,
        "sft.max_steps": 0,
        "rollout.worker_timeout_s": 120.0,  # a worker starved of new versions fails fast
    }
    trainer = trainer_lib.Trainer(async_config(**changes), tmp_path)
    mc = trainer.model_config
    assert mc.lora_rank == rank

    # What the worker sampled each version with, as it received it.
    used: dict[int, dict] = {}
    generate = async_rollouts.AsyncRollouts.generate

    def recording(self, index, version, params):
        used.setdefault(version, _flat(params, ""))
        return generate(self, index, version, params)

    monkeypatch.setattr(async_rollouts.AsyncRollouts, "generate", recording)
    # The learner's params at each version (before the next step donates them).
    learned: dict[int, dict] = {}
    step = trainer.train_step

    def watched(state, *args):
        learned.setdefault(int(state.step), _flat(state.params, dtype))
        new, metrics = step(state, *args)
        learned[int(new.step)] = _flat(new.params, dtype)
        return new, metrics

    trainer.train_step = watched
    assert trainer.run().final_step == STEPS
    records = read(tmp_path)
    assert [r["step"] for r in records] == list(range(STEPS))

    # (a) bytes per step, from the model config alone.
    size = np.dtype(dtype or mc.param_dtype).itemsize
    adapters, whole = mc.lora_params() * size, (mc.num_params() + mc.lora_params()) * size
    per_step = adapters if rank else whole
    sent = [r["rollout/published_bytes"] for r in records]
    assert sent == [whole + per_step] + [per_step] * (STEPS - 1), (sent, adapters, whole)
    assert lora.adapter_bytes(trainer.state.params) == mc.lora_params() * 4  # float32
    for r in records:
        assert np.isfinite(r["time/publish_s"]) and r["time/publish_s"] >= 0
        # (b) the staleness bound, measured from the rows' versions
        assert 0 <= r["staleness/min"] <= r["staleness/max"] <= K, r

    # (c) the worker sampled version v with exactly the learner's weights at version v
    # (the base bit-identical, the adapters those after v updates), in the publish dtype.
    assert len(used) >= 3, sorted(used)  # the worker saw new versions
    base = {p: x for p, x in learned[0].items() if not lora.is_adapter(p)}
    for version, got in used.items():
        want = learned[version]
        assert got.keys() == want.keys()
        for path, x in got.items():
            assert x.dtype == want[path].dtype, path
            np.testing.assert_array_equal(x, want[path], err_msg=f"v{version} {path}")
            if rank and not lora.is_adapter(path):
                np.testing.assert_array_equal(x, base[path], err_msg=f"base {path}")
    if rank:  # the adapters did change, so a stale copy would have failed above
        last = max(used)
        b = [p for p in used[last] if str(p[-1]).endswith("_lora_b")]
        assert b and all(np.any(used[last][p] != used[0][p]) for p in b)
        version, published, held = trainer.async_rollouts.weights.parts()
        assert version == STEPS and set(traverse_util.flatten_dict(published)) == {
            p for p in learned[0] if lora.is_adapter(p)
        }
        assert held is not None


def test_a_slot_with_a_base_gives_the_merged_tree_of_the_newest_adapters():
    def adapters(tag):
        return {"layer": {"q_lora_a": f"a{tag}", "q_lora_b": f"b{tag}"}}

    base = {"layer": {"q_kernel": 1.0, "norm": 2.0}}
    slot = worker_lib.WeightSlot(0, adapters(0), base=base)
    assert slot.has_base
    assert slot.latest() == (0, lora.merge(adapters(0), base))
    slot.publish(1, adapters(1))
    assert slot.latest() == (1, lora.merge(adapters(1), base))
    assert slot.latest()[1]["layer"]["norm"] == 2.0
    new_base = {"layer": {"q_kernel": 3.0}}
    slot.publish(2, adapters(2), base=new_base)
    assert slot.latest() == (2, {"layer": {"q_kernel": 3.0, "q_lora_a": "a2", "q_lora_b": "b2"}})
    assert slot.parts() == (2, adapters(2), new_base)
    with pytest.raises(ValueError, match="older"):
        slot.publish(1, adapters(1))
    whole = worker_lib.WeightSlot(0, "w0")
    assert not whole.has_base and whole.parts() == (0, "w0", None)
    with pytest.raises(ValueError, match="a base for a slot"):
        whole.publish(1, "w1", base="b")
