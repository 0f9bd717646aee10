"""The typed run configuration: one frozen dataclass per section of `configs/*.py`.

`m2po_jax.config.from_configdict` builds a `Config` from a ConfigDict and validates it; the
field names follow AReaL's where it has the option. Fields a config derives from another
field (`actor.temperature`, `actor.reward_norm.group_size`) hold the derived value here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoraSection:
    rank: int
    alpha: float
    targets: str
    dropout: float
    base: str


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str
    param_dtype: str
    remat: bool
    remat_policy: str
    scan_layers: bool
    attention: str
    router_aux_loss_coef: float
    lora: LoraSection


@dataclasses.dataclass(frozen=True)
class TaskSection:
    name: str
    seed: int
    min_digits: int
    max_digits: int
    ops: str
    train_path: str
    eval_path: str
    eval_size: int
    question_key: str
    answer_key: str
    solution_key: str
    prompt_template: str
    verifier: str
    max_prompt_len: int
    long_prompts: str
    chat_template: str
    enable_thinking: bool | None
    reward_fn: str
    format_reward: float
    tool_demos: float


@dataclasses.dataclass(frozen=True)
class SftSection:
    max_steps: int
    batch_size: int
    lr: float
    stop_at_accuracy: float
    eval_every: int


@dataclasses.dataclass(frozen=True)
class GenerationSection:
    n_samples: int
    max_new_tokens: int
    temperature: float
    greedy: bool
    top_p: float
    top_k: int


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    batch_size: int
    max_head_offpolicyness: int
    mode: str  # sync | async
    reward_workers: int
    reward_timeout_s: float
    worker_timeout_s: float
    publish_dtype: str  # the older name of weight_dtype ("" | bfloat16 | float32)
    weight_dtype: str  # "" (as trained) | bfloat16 | int8 | float8_e4m3fn
    engine: str  # static | continuous
    engine_slots: int
    insert_lanes: int
    kv_pages: int
    page_size: int
    kv_dtype: str  # "" (model.dtype) | bfloat16 | float8_e4m3fn
    inflight_updates: bool
    chunk_steps: int
    stream_batches: int


@dataclasses.dataclass(frozen=True)
class AgentSection:
    env: str
    tools: str
    parser: str
    max_turns: int
    max_append_tokens: int
    tool_timeout_s: float
    on_tool_error: str
    bad_tool_call_reward: float
    workers: int
    step_timeout_s: float
    mask_failed_episodes: bool
    mask_truncated_episodes: bool


@dataclasses.dataclass(frozen=True)
class RejectionSamplingSection:
    enabled: bool
    level: str
    action: str
    metric: str
    agg: str
    upper: float
    lower: float | None


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSection:
    is_level: str  # token | sequence | geometric | none
    is_threshold: float | None  # None: no truncation


@dataclasses.dataclass(frozen=True)
class RewardNormSection:
    mean_level: str | None
    std_level: str | None
    group_size: int  # derived: gconfig.n_samples
    mean_leave1out: bool
    std_unbiased: bool
    eps: float


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    gradient_clipping: float
    lr_scheduler_type: str
    warmup_steps_proportion: float
    min_lr_ratio: float


@dataclasses.dataclass(frozen=True)
class MicroBatchSection:
    n_mbs: int
    max_tokens_per_mb: int


@dataclasses.dataclass(frozen=True)
class ActorSection:
    m2_threshold: float | None
    m2po_method: str
    m2po_second_moment: str
    m2po_stop_rule: str
    m2po_candidates: str
    m2po_scope: str
    eps_clip: float | None  # None: no ratio clip
    eps_clip_higher: float | None
    c_clip: float | None
    use_decoupled_loss: bool
    recompute_logprob: bool
    prox_logp_method: str
    loss_denominator: str
    rejection_sampling: RejectionSamplingSection
    rollout_correction: RolloutCorrectionSection
    importance_sampling_level: str
    use_sapo_loss: bool
    sapo_tau_pos: float
    sapo_tau_neg: float
    ppo_n_minibatches: int
    mb_spec: MicroBatchSection
    logp_chunk_size: int
    reward_scaling: float
    reward_bias: float
    reward_clip: float
    reward_norm: RewardNormSection
    adv_norm: bool
    kl_ctl: float
    kl_estimator: str
    router_replay: str
    temperature: float  # derived: gconfig.temperature
    optimizer: OptimizerSection


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int
    num_examples: int
    batch_size: int
    sets: str
    n_samples: int
    temperature: float
    reward: str


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int
    keep: int
    hf_every: int
    hf_keep: int
    hf_dtype: str


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool
    wandb_project: str
    progress: bool
    plots: bool
    masked_grad_norm: bool


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int
    fsdp: int
    tensor: int
    rollout_devices: int  # async: each process's devices for rollouts (0 = half)
    m2po_per_shard: bool
    device_memory_gib: float


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int
    total_steps: int
    max_nonfinite_steps: int
    model: ModelSection
    task: TaskSection
    sft: SftSection
    gconfig: GenerationSection
    rollout: RolloutSection
    agent: AgentSection
    actor: ActorSection
    eval: EvalSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    mesh: MeshSection
