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

Presets for real runs (combine left to right, e.g. `configs/gsm8k.py:qwen2.5-7b`); the
Scale page of the manual (docs/scale.md) shows the memory plan of each
(`python benchmarks/scale_bench.py --plans`):
  qwen2.5-0.5b   Qwen2.5-0.5B(-Instruct) on one 80 GB GPU
  qwen2.5-7b     Qwen2.5-7B(-Instruct) on 8 GPUs (fsdp=8), 512 rows in 4 minibatches
  qwen3-8b       Qwen3-8B on a TPU v5e-16 slice (16 chips x 16 GB, fsdp=4 x tensor=4)
  smollm2-135m-cpu  SmolLM2-135M-Instruct on a CPU (benchmarks/real_model.py)
  tools          multi-turn: a Python calculator tool the policy may call (with any of the
                 above, e.g. `configs/gsm8k.py:qwen2.5-0.5b,tools`)
"""

import ml_collections

from m2po_jax.configs import default


def _qwen25_05b(c):
    """One 80 GB GPU: 128 rows of 256 + 1,024 tokens, micro-batches of <= 16k tokens."""
    c.mesh.data, c.mesh.fsdp = 1, 1
    c.task.max_prompt_len = 256
    c.gconfig.max_new_tokens = 1024
    c.rollout.batch_size = 16
    c.actor.mb_spec.max_tokens_per_mb = 16384


def _qwen25_7b(c):
    """8 GPUs, params and optimizer state sharded 8 ways: 512 rows of 512 + 1,024 tokens in
    4 minibatches, one row per device per micro-batch."""
    c.mesh.data, c.mesh.fsdp = 1, 8
    c.task.max_prompt_len = 512
    c.gconfig.max_new_tokens = 1024
    c.rollout.batch_size = 64
    c.actor.ppo_n_minibatches = 4
    c.actor.mb_spec.max_tokens_per_mb = 8 * 1536


def _qwen3_8b(c):
    """TPU v5e-16 (16 chips x 16 GB): fsdp=4 x tensor=4 (the sampling layout splits the
    weights over tensor only: with fsdp=16 every chip would hold all 16 GB of them, which
    the TPU compiler refuses), bfloat16 params (MaxText's v5e choice), 256 rows of 512 +
    1,024 tokens in 4 minibatches."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 4
    c.model.param_dtype = "bfloat16"
    c.task.max_prompt_len = 512
    c.gconfig.max_new_tokens = 1024
    c.rollout.batch_size = 32
    c.actor.ppo_n_minibatches = 4
    c.actor.mb_spec.max_tokens_per_mb = 16 * 1536


def _smollm2_135m_cpu(c):
    """SmolLM2-135M-Instruct on a laptop CPU (`benchmarks/real_model.py`): short word
    problems, 4 prompts x 4 samples of <= 48 tokens per step, a float32 policy, a
    learning rate that moves a 135M model in a dozen steps."""
    c.total_steps = 12
    c.mesh.data, c.mesh.fsdp = 1, 1
    c.model.dtype = "float32"
    c.model.remat = False
    c.task.max_prompt_len = 128
    c.task.eval_size = 32
    c.gconfig.n_samples = 4
    c.gconfig.max_new_tokens = 48
    c.rollout.batch_size = 4
    c.rollout.max_head_offpolicyness = 2
    c.actor.optimizer.lr = 5e-6
    c.eval.every = 6
    c.eval.num_examples = 32
    c.eval.batch_size = 32
    c.checkpoint.every = 6


def _tools(c):
    """Multi-turn tool use: the policy may call a Python calculator (Hermes tool calls for
    Qwen, JSON ones for Llama 3, from the chat template) for up to 4 turns; the tool's answer
    is appended to the episode and only the model's own tokens are trained."""
    c.agent.env = "tools"
    c.agent.tools = "m2po_jax.tasks.calculator:python_calculator"
    c.agent.max_turns = 4
    c.agent.max_append_tokens = 128
    c.rollout.engine = "continuous"


PRESETS = {
    "qwen2.5-0.5b": _qwen25_05b,
    "qwen2.5-7b": _qwen25_7b,
    "qwen3-8b": _qwen3_8b,
    "smollm2-135m-cpu": _smollm2_135m_cpu,
    "tools": _tools,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = _base()
    for name in filter(None, (arg or "").split(",")):
        if name not in PRESETS:
            raise ValueError(
                f"configs/gsm8k.py: unknown preset {name!r}; choose from {sorted(PRESETS)}"
            )
        PRESETS[name](c)
    return c


def _base() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.total_steps = 200
    c.model.path = ""  # required: local HF checkpoint directory
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = True
    c.model.scan_layers = True  # real checkpoints are deep: one scanned layer compiles fast
    # rollout.engine=auto: the paged engine at these budgets, its pool sized by what the chip
    # has left (rollout.kv_pages=0); the continuous engine's full rows need 26.9 GiB per v5e
    # chip for math:qwen3-1.7b-base (`--compile_only`), more than it has.
    c.rollout.engine = "auto"
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
    c.actor.kl_ctl = 0.0
    c.actor.optimizer.lr = 1e-6
    c.actor.optimizer.weight_decay = 0.01
    c.actor.optimizer.lr_scheduler_type = "constant"
    c.actor.optimizer.warmup_steps_proportion = 0.001
    c.eval.every = 20
    c.eval.num_examples = 200
    c.eval.batch_size = 40  # divides over 1, 2, 4 or 8 batch shards
    c.checkpoint.every = 20
    return c
