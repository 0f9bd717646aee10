"""Competition math as the M2PO paper trains it: a Qwen3 base model, `\\boxed{}` answers
scored by math-verify, rollouts 256 updates stale, tau 0.04, avg@k over held-out sets.

Nothing is downloaded: point it at a checkpoint directory and at local problem files
(JSONL, .parquet or a `datasets.save_to_disk` directory with `problem` and `answer`, or a
`solution` whose last `\\boxed{}` is the answer, as MATH has them).

  m2po-train --config=math:qwen3-4b-base --workdir=/tmp/math4b \\
      --config.model.path=/models/Qwen3-4B-Base \\
      --config.task.train_path=/data/math/train.jsonl \\
      --config.eval.sets=math500=/data/math/math500.jsonl,aime24=/data/math/aime24.jsonl

or, with every file in one directory named as `EVAL_SETS` lists (`train.jsonl`,
`math500.jsonl`, `aime24.jsonl`, ...; the sets present are used):

  m2po-train --config=math:qwen3-4b-base,data=/data/math --workdir=/tmp/math4b \\
      --config.model.path=/models/Qwen3-4B-Base

A base model has no chat template: the prompt is the problem and the instruction to box
the answer, as written (`task.prompt_template` changes it). From the paper: staleness 256
(`rollout.max_head_offpolicyness`), tau 0.04, the second moment of behaviour against
proximal log-probs (AReaL's rule), Qwen3-Base models. The rest (learning rate, lengths,
batch) are AReaL's GSM8K M2PO example's, at sizes the named hardware holds.

Presets (combine left to right):
  qwen3-1.7b-base  Qwen3-1.7B-Base on a TPU v5e-8 (8 chips x 16 GB, fsdp=4 x tensor=2)
  qwen3-4b-base    Qwen3-4B-Base on a TPU v5e-16 (16 chips x 16 GB, fsdp=4 x tensor=4)
  data=DIR         train.jsonl and the held-out sets of EVAL_SETS found in DIR
Each passes `m2po-train --compile_only` for its slice (docs/scale.md, "Compile before you rent").
"""

import os

import ml_collections

from m2po_jax.configs import default

# The held-out sets a `data=DIR` preset looks for, as DIR/<name>.jsonl (or .parquet).
EVAL_SETS = ("math500", "aime24", "aime25", "amc23", "minerva", "olympiadbench")


def _qwen3_17b_base(c):
    """TPU v5e-8: fsdp=4 x tensor=2 (at fsdp=8 the sampler, whose layout splits the weights
    over tensor only, needs 16.6 of the 16 GiB per chip), 128 rows of 512 + 2,048 tokens in 4
    minibatches."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
    c.rollout.batch_size = 16
    c.actor.ppo_n_minibatches = 4
    c.actor.mb_spec.max_tokens_per_mb = 8 * 2560


def _qwen3_4b_base(c):
    """TPU v5e-16: fsdp=4 x tensor=4 (the sampling layout splits the weights over tensor),
    bfloat16 params, 256 rows of 512 + 2,048 tokens in 8 minibatches."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 4
    c.model.param_dtype = "bfloat16"
    c.rollout.batch_size = 32
    c.actor.ppo_n_minibatches = 8
    c.actor.mb_spec.max_tokens_per_mb = 8 * 2560
    # rollout.engine=auto: the paged engine, its pool derived (compiled for v5e:4x4: 8.54
    # GiB per chip at the peak, the evaluation's resume; the static sampler: 9.81).


def _qwen3_30b_a3b_base(c):
    """TPU v5p-8 (8 chips x 95 GB): fsdp=2 x tensor=4, the 128 experts on every chip
    (their weights gathered a layer at a time, as a dense MLP's; megablox still runs them),
    bfloat16 params, 128 rows of 512 + 2,048 tokens in 4 minibatches. Not fsdp=8: the
    sampling layout splits the weights over tensor only, so at tensor=1 every chip holds
    all 61 GB of them and the TPU compiler refuses the reshard (120.9 GB of temporaries).
    Not `mesh.expert_axis=fsdp`: at 2,560 tokens a chip the split routes s x the tokens'
    N x K rows on every chip and cost more (4 layers compiled for v5p:2x2x2: 10.45 against
    9.26 GiB, 204 against 94 GB accessed; docs/scale.md) than gathering the experts."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
    c.mesh.expert_axis = ""
    c.model.param_dtype = "bfloat16"
    c.rollout.batch_size = 16
    c.actor.ppo_n_minibatches = 4
    c.actor.mb_spec.max_tokens_per_mb = 8 * 2560


PRESETS = {
    "qwen3-1.7b-base": _qwen3_17b_base,
    "qwen3-4b-base": _qwen3_4b_base,
    "qwen3-30b-a3b-base": _qwen3_30b_a3b_base,
}


def _data(c, directory: str) -> None:
    """task.train_path = DIR/train.jsonl (or .parquet) and eval.sets = the EVAL_SETS there."""

    def found(name):
        for ext in (".jsonl", ".parquet", ""):
            path = os.path.join(directory, name + ext)
            if os.path.isfile(path) or (ext == "" and os.path.isdir(path)):
                return path
        return None

    train = found("train")
    if train is None:
        raise ValueError(f"configs/math.py: data={directory}: no train.jsonl or train.parquet")
    c.task.train_path = train
    sets = [f"{name}={path}" for name in EVAL_SETS if (path := found(name))]
    if not sets:
        raise ValueError(
            f"configs/math.py: data={directory}: none of {', '.join(EVAL_SETS)} (.jsonl or "
            ".parquet) there"
        )
    c.eval.sets = ",".join(sets)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = _base()
    for name in filter(None, (arg or "").split(",")):
        if name.startswith("data="):
            _data(c, name.removeprefix("data="))
        elif name in PRESETS:
            PRESETS[name](c)
        else:
            raise ValueError(
                f"configs/math.py: unknown preset {name!r}; choose from {sorted(PRESETS)} or "
                "data=DIR"
            )
    return c


def _base() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.total_steps = 500
    c.model.path = ""  # required: a local Qwen3-Base (or any) checkpoint directory
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = True
    c.model.scan_layers = True
    c.task.name = "math"
    c.task.train_path = ""  # required: MATH-format problems (problem, answer / solution)
    c.task.eval_size = 500  # held out of train_path when eval.sets is empty
    c.task.max_prompt_len = 512
    c.task.long_prompts = "filter"
    c.task.chat_template = "off"  # base models: the prompt as written
    c.sft.max_steps = 0
    c.gconfig.n_samples = 8
    c.gconfig.max_new_tokens = 2048
    c.gconfig.temperature = 1.0
    c.rollout.batch_size = 32
    c.rollout.max_head_offpolicyness = 256  # the paper's staleness
    c.rollout.reward_workers = 8  # math-verify in 8 processes, 10 s per completion at most
    # rollout.engine=auto: the paged engine at these budgets, its pool sized by what the chip
    # has left (rollout.kv_pages=0); the continuous engine's full rows need 26.9 GiB per v5e
    # chip for math:qwen3-1.7b-base (`--compile_only`), more than it has.
    c.rollout.engine = "auto"
    c.actor.m2_threshold = 0.04
    c.actor.eps_clip = 0.2
    c.actor.ppo_n_minibatches = 4
    c.actor.kl_ctl = 0.0
    c.actor.optimizer.lr = 1e-6
    c.actor.optimizer.weight_decay = 0.01
    c.actor.optimizer.lr_scheduler_type = "constant"
    c.eval.every = 50
    c.eval.num_examples = 500
    c.eval.batch_size = 64
    c.eval.n_samples = 4  # avg@4 and pass@4
    c.eval.temperature = 0.6
    c.checkpoint.every = 50
    return c
