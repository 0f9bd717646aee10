"""GSM8K with a local Hugging Face checkpoint (Qwen2.5 / Llama / Qwen3) and local JSONL.

Nothing is downloaded: point the config at a checkpoint directory (config.json,
*.safetensors, tokenizer.json) and at GSM8K-format JSONL or Parquet files (question, answer
ending in '#### <number>'). Instruct checkpoints get their chat template (task.chat_template).

  m2po-train --config=configs/gsm8k.py --workdir=/tmp/gsm8k \
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \
      --config.task.train_path=/data/gsm8k/train.jsonl \
      --config.task.eval_path=/data/gsm8k/test.jsonl

Settings follow AReaL's GSM8K M2PO example (tau 0.04, eps_clip 0.0, one minibatch) at a
scale one accelerator host handles; raise rollout.batch_size and use a mesh for more.
"""

import ml_collections

from m2po_jax.configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = default.get_config()
    c.total_steps = 200
    c.model.path = ""  # required: local HF checkpoint directory
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = True
    c.task.name = "gsm8k"
    c.task.train_path = ""  # required: GSM8K-format JSONL or .parquet
    c.task.eval_path = ""  # held-out JSONL / .parquet ("" = the last task.eval_size records)
    c.task.eval_size = 200
    c.task.max_prompt_len = 256
    c.task.long_prompts = "filter"  # drop the few over-long problems at start-up (counted)
    c.sft.max_steps = 0  # start RL from the checkpoint
    c.gconfig.n_samples = 8
    c.gconfig.max_new_tokens = 512
    c.rollout.batch_size = 16
    c.rollout.max_head_offpolicyness = 8
    c.actor.m2_threshold = 0.04
    c.actor.eps_clip = 0.0  # AReaL's GSM8K M2PO example; 0.2 for plain PPO clipping
    c.actor.ppo_n_minibatches = 1
    c.actor.reward_norm.group_size = 8
    c.actor.kl_ctl = 0.0
    c.actor.optimizer.lr = 1e-6
    c.actor.optimizer.weight_decay = 0.01
    c.actor.optimizer.lr_scheduler_type = "constant"
    c.actor.optimizer.warmup_steps_proportion = 0.001
    c.eval.every = 20
    c.eval.num_examples = 200
    c.eval.batch_size = 50
    c.checkpoint.every = 20
    return c
