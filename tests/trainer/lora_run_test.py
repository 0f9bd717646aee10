"""LoRA through the trainer: the built-in default with rank-8 adapters learns as the full
run's test asks (tests/trainer/async_test.py: +0.05 held-out accuracy in 50 steps), with
the base left as the warm-up made it."""

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
        "rollout.batch_size": 32,  # half the full run's prompts per step (measured: +0.11)
        "eval.every": 0,  # steps 0 and 49
        "sft.eval_every": 50,
        "checkpoint.every": 0,
        "logging.tensorboard": False,
        "logging.progress": False,
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
