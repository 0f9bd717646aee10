"""LoRA through the trainer: the built-in default with rank-8 adapters learns as the full
run's test asks (tests/trainer/async_test.py: +0.05 held-out accuracy in 50 steps), with
the base left as the warm-up made it.

On one device: what is checked (the adapters learn, the base stays as the warm-up left it,
moments for the adapters only) does not depend on the device count (LoRA steps on a
4-device train mesh: tests/trainer/lora_async_test.py), and the run takes a third less CPU
time. Held-out gain in 50 steps by seed (c.seed 0-4): one device +0.098, +0.039, +0.109,
+0.106, +0.125; the 8 devices of tests/conftest.py +0.113, +0.121 (seeds 2 and 3 then
aborted the process in the warm-up: up to 50 steps in flight on two cores outwaited
XLA:CPU's all-reduce rendezvous; the warm-up now keeps two in flight,
tests/trainer/trainer_test.py::test_the_warm_up_keeps_at_most_two_steps_in_flight)."""

import jax
import numpy as np
from flax import traverse_util

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import default
from m2po_jax.models import lora
from m2po_jax.run import metrics as metrics_lib


def _base(params):
    flat = traverse_util.flatten_dict(jax.device_get(params))
    return {path: np.asarray(x) for path, x in flat.items() if not lora.is_adapter(path)}


def test_a_lora_run_learns_and_trains_the_adapters_alone(tmp_path):
    c = default.get_config()
    changes = {
        "total_steps": 50,
        "model.lora.rank": 8,
        "actor.optimizer.lr": 1e-3,  # LoRA wants about 10x full fine-tuning's rate
        "rollout.batch_size": 32,  # half the full run's prompts per step
        "eval.every": 0,  # steps 0 and 49
        "sft.eval_every": 50,
        "checkpoint.every": 0,
        "mesh.data": 1,  # one device (see above)
        "logging.tensorboard": False,
        "logging.progress": False,
        "logging.plots": False,  # nothing here reads them (2 s)
    }
    config_lib.apply_dotted(c, changes)
    trainer = trainer_lib.Trainer(config_lib.from_configdict(c), tmp_path)
    assert trainer.model_config.lora_rank == 8
    first = {}
    step = trainer.train_step

    def watched(state, *args):
        if not first:  # the base as the warm-up left it, before the first RL update
            first.update(_base(state.params))
        return step(state, *args)

    trainer.train_step = watched
    trainer.run()
    records = metrics_lib.read_metrics(tmp_path / "metrics.jsonl")
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(accuracy) == 2
    assert accuracy[-1] >= accuracy[0] + 0.05, accuracy
    after = _base(trainer.state.params)
    assert first.keys() == after.keys() and len(after) > 0
    for path, x in first.items():
        np.testing.assert_array_equal(after[path], x, err_msg=str(path))
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if np.ndim(x)]
    assert sum(x.size for x in moments) == 2 * trainer.model_config.lora_params()
