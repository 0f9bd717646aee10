"""The run configuration, declared once: one frozen dataclass per section of `configs/*.py`.

Each field is declared with `knob(default, doc, ...)` (`m2po_jax.common.knobs`): its type
(the annotation), its default, what it means (the doc the manual shows) and what it allows
(`low` / `high`, closed unless `low_open` / `high_open`, or `choices`); a nested section is
a `section(cls, doc)`. From these declarations and nothing else come `configs/default.py`
(`knobs.default_configdict(Config)`), the check of every field's range or choices in
`m2po_jax.config.from_configdict` (`knobs.check_declared`; a number must also be finite)
and the manual's "Every field" tables (docs/hooks.py). `m2po_jax.config.validate` holds
only what no single declaration can say: checks that relate fields to each other or need
a library registry. Adding a field is one `knob(...)` line here and the code that reads it.

A choice list a library owns (`masking.METHODS`, `engines.ENGINES`, ...) is spelled here
too, so that this module imports no library; tests/common/knobs_test.py checks that each
agrees with its library. Field names follow AReaL's where it has the option. Fields derived
from another field (`actor.temperature`, `actor.reward_norm.group_size`:
`config.validate.DERIVED`) default to None and hold the derived value in a built `Config`.
"""

from __future__ import annotations

import dataclasses

from m2po_jax.common.knobs import knob, section

# Storage dtypes of params and optimizer state: float16 would need loss scaling, which the
# optimizer does not do (float16 is a compute dtype only: model.dtype).
PARAM_DTYPES = ("float32", "bfloat16")

# logits / temperature: below this the float32 log-probs and their gradients (scaled by
# 1 / temperature) overflow or lose all precision; greedy=True is the argmax limit.
MIN_TEMPERATURE = 1e-3


@dataclasses.dataclass(frozen=True)
class LoraSection:
    rank: int = knob(0, "adapter rank; 0 = off (full fine-tuning)", low=0)
    alpha: float = knob(
        16.0,
        "the adapters' output is scaled by alpha / rank",
        low=0.0,
        low_open=True,
    )
    targets: str = knob("q,k,v,o,gate,up,down", "comma-separated projection names")
    dropout: float = knob(
        0.0,
        "Dropout on the adapters' input: 0 only (the importance ratios need the sampler's network)",
    )
    base: str = knob(
        "float",
        "QLoRA: how the adapted projections' frozen base kernels are held: float "
        "(param_dtype) | int8 (per output channel scales, 1 byte a weight) | nf4 (QLoRA's "
        "4-bit NormalFloat, 64-weight blocks, half a byte a weight); dequantised per "
        "projection; needs rank > 0",
        choices=("float", "int8", "nf4"),
    )


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = knob(
        "",
        'local Hugging Face checkpoint dir; "" = a new model from the fields below',
    )
    vocab_size: int = knob(0, "0 = the task tokenizer's vocabulary size")
    hidden_size: int = knob(128, "width of the residual stream")
    intermediate_size: int = knob(384, "SwiGLU hidden width")
    num_layers: int = knob(2, "decoder layers")
    num_heads: int = knob(4, "query heads")
    num_kv_heads: int = knob(2, "key/value heads (grouped-query attention)")
    head_dim: int = knob(0, "0 = hidden_size // num_heads")
    model_type: str = knob(
        "llama",
        "llama | qwen2 | qwen3 | qwen3_moe (for a new model)",
        choices=("llama", "qwen2", "qwen3", "qwen3_moe"),
    )
    rope_theta: float = knob(10000.0, "RoPE base")
    tie_word_embeddings: bool = knob(True, "share input embedding and output head")
    dtype: str = knob(
        "float32",
        "compute dtype: float32 on CPU, bfloat16 on GPU/TPU",
        choices=("float32", "bfloat16", "float16"),
    )
    param_dtype: str = knob(
        "float32",
        "storage dtype of params and optimizer state",
        choices=PARAM_DTYPES,
    )
    remat: bool = knob(False, "recompute each layer in the backward pass to save memory")
    remat_policy: str = knob(
        "nothing_saveable",
        "With remat: what each layer keeps (m2po_jax.models.model_config.REMAT_POLICIES): "
        "nothing_saveable (full remat) | dots_saveable | dots_with_no_batch_dims_saveable "
        "| everything_saveable | save_qkv_proj | save_attention_out",
        choices=(
            "nothing_saveable",
            "dots_saveable",
            "dots_with_no_batch_dims_saveable",
            "everything_saveable",
            "save_qkv_proj",
            "save_attention_out",
        ),
    )
    attention: str = knob(
        "auto",
        "auto (GPU bf16/fp16: cudnn, TPU: splash, else xla) | xla | dot_product | cudnn | "
        "splash | chunked (flash-style pure JAX, any backend: long sequences); "
        "m2po_jax/models/attention.py",
        choices=("auto", "xla", "dot_product", "cudnn", "splash", "chunked"),
    )
    scan_layers: bool = knob(
        False,
        "run the layers of a training pass as one lax.scan: fast compiles and bounded "
        "memory for deep models (each layer's weights gathered and gradients reduced in "
        "turn)",
    )
    num_experts: int = knob(
        0,
        "A new qwen3_moe model's mixture of experts (every layer's feed-forward block; 0 "
        "for the dense model_types; a checkpoint's come from its config.json): experts per "
        "layer",
        low=0,
    )
    num_experts_per_tok: int = knob(0, "experts each token runs (the router's top k)", low=0)
    moe_intermediate_size: int = knob(0, "one expert's SwiGLU hidden width", low=0)
    norm_topk_prob: bool = knob(True, "the top-k routing weights renormalised to sum to 1")
    router_aux_loss_coef: float = knob(
        0.0,
        "a mixture of experts: weight of the load-balancing loss added to the training "
        "loss (HF's name; Qwen3-MoE pretraining used 0.001, RL recipes turn it off); "
        "refused on a dense model",
        low=0.0,
    )
    lora: LoraSection = section(
        LoraSection,
        "LoRA: train low-rank adapters on the frozen model (rank 0 = off, full "
        "fine-tuning). Each target projection (q, k, v, o, gate, up, down) gets A [in, "
        "rank] and B [rank, out] in float32, its output scaled by alpha / rank (qwen3_moe: "
        "gate, up and down adapt every expert, the router stays frozen); only the adapters "
        "get gradients and optimizer state; the KL reference is the model with the "
        "adapters off.",
    )


@dataclasses.dataclass(frozen=True)
class TaskSection:
    name: str = knob(
        "arith",
        "arith (built-in synthetic) | calculator (arith with a calculator tool to call) | "
        "gsm8k (GSM8K-format files, numeric answers) | math (competition math: LaTeX "
        'answers, math-verify) | "package.module:TaskClass" (yours)',
    )
    seed: int = knob(1234, "problem generator seed (train and held-out split)")
    min_digits: int = knob(1, "arith: fewest digits per operand", low=1)
    max_digits: int = knob(2, "arith: most digits per operand", low=1)
    ops: str = knob("+", 'arith: operators to draw from, subset of "+-*"')
    train_path: str = knob(
        "",
        "gsm8k / math: training JSONL, .parquet or datasets.save_to_disk directory",
    )
    eval_path: str = knob("", 'gsm8k / math: held-out file; "" = the last eval_size records')
    eval_size: int = knob(200, 'gsm8k / math: records held out when eval_path is ""')
    question_key: str = knob(
        "",
        'key / column of the problem; "" = question (gsm8k), problem (math)',
    )
    answer_key: str = knob(
        "answer",
        "key / column of the reference answer, kept as written: the last \\boxed{}, else "
        "the text after '####', else the whole value (a number is taken as its string)",
    )
    solution_key: str = knob(
        "",
        "key / column of a full solution (the warm-up's target; the reference when a "
        'record has no answer_key); "" = none (gsm8k), solution (math)',
    )
    prompt_template: str = knob(
        "",
        'a string with {problem} (or {question}), or a file holding one; "" = the task\'s own',
    )
    verifier: str = knob("", 'math (math-verify) | numeric (last number); "" = the task\'s own')
    max_prompt_len: int = knob(
        8,
        "prompt width in tokens (left-padded to it; see long_prompts)",
        low=1,
    )
    long_prompts: str = knob(
        "left",
        "longer prompts: left (keep last tokens) | filter | error",
        choices=("filter", "left", "error"),
    )
    chat_template: str = knob(
        "auto",
        "auto (the checkpoint's, if any) | on (required) | off (raw)",
        choices=("auto", "on", "off"),
    )
    enable_thinking: bool | None = knob(None, "Qwen3 thinking switch; None = template default")
    format_reward: float = knob(
        0.0,
        "arith: reward for a well-formed but wrong answer (shaping)",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    tool_demos: float = knob(
        0.1,
        "calculator (arith with a calculator tool; configs/arith.py:calculator): the "
        "share of warm-up examples that are episodes calling the tool (the rest answer "
        "directly)",
    )
    reward_fn: str = knob(
        "",
        '"pkg.module:function" (completion, answer) -> float; "" = task\'s',
    )


@dataclasses.dataclass(frozen=True)
class SftSection:
    max_steps: int = knob(400, "supervised warm-up steps before RL (0 = none)", low=0)
    batch_size: int = knob(64, "warm-up sequences per step")
    lr: float = knob(1e-3, "warm-up learning rate (AdamW, constant)")
    stop_at_accuracy: float = knob(
        0.3,
        "end the warm-up once held-out greedy accuracy reaches this",
        low=0.0,
        high=1.0,
    )
    eval_every: int = knob(25, "warm-up steps between accuracy checks")


@dataclasses.dataclass(frozen=True)
class GenerationSection:
    n_samples: int = knob(8, "completions per prompt (the GRPO group)", low=1)
    max_new_tokens: int = knob(4, "completion budget in tokens", low=1)
    temperature: float = knob(
        1.0,
        "sampling temperature (behaviour log-probs use it too)",
        low=MIN_TEMPERATURE,
    )
    greedy: bool = knob(False, "argmax decoding instead of sampling")
    top_p: float = knob(1.0, "nucleus sampling mass (1.0 = off)", low=0.0, high=1.0, low_open=True)
    top_k: int = knob(0, "top-k sampling (0 = off)", low=0)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    batch_size: int = knob(64, "prompts per step (rows = batch_size * n_samples)", low=1)
    max_head_offpolicyness: int = knob(
        4,
        "staleness k: train on the batch made k updates ago",
        low=0,
    )
    mode: str = knob(
        "sync",
        "sync: each step generates a batch, then trains on the one made k steps ago (the "
        "same devices, deterministic) | async: a rollout worker on its own devices "
        "(mesh.rollout_devices) generates with the newest published weights while the "
        "learner trains; a batch starts only while no sample would be trained more than k "
        "updates stale (m2po_jax/rollout/staleness.py)",
        choices=("sync", "async"),
    )
    reward_workers: int = knob(
        1,
        "completions scored at once on host threads (rewards that wait on I/O: sandboxes, "
        "remote verifiers; a pure-Python reward gains nothing), in both modes; 1 = one by "
        "one",
        low=1,
    )
    reward_timeout_s: float = knob(
        10.0,
        "a completion's scoring stops after this and scores 0 (reward/timeouts counts "
        "them); the math verifier runs in reward_workers processes for it; 0 = no limit",
        low=0.0,
    )
    worker_timeout_s: float = knob(
        600.0,
        "async: fail (naming what it was doing) after this wait",
        low=0.0,
        low_open=True,
    )
    publish_dtype: str = knob(
        "",
        'the older name of rollout.weight_dtype: "" | bfloat16',
        choices=("", *PARAM_DTYPES),
    )
    weight_dtype: str = knob(
        "",
        "the rollout engine's copy of the weights (sync: made once per step; async: at "
        'each publish): "" (as trained) | bfloat16 | int8 | float8_e4m3fn (every '
        "projection kernel as codes with a float32 scale per output channel, the codes "
        "the matmul's operand and the scale applied to its output; the compute dtype "
        "stays model.dtype). Evaluation runs the trained weights (docs/rollouts.md, "
        '"Cheaper rollout weights")',
        choices=("", "bfloat16", "int8", "float8_e4m3fn"),
    )
    engine: str = knob(
        "auto",
        "static: each batch decodes until its longest completion ends "
        "(`sampling.generate`) | continuous: a fixed number of decode slots, a slot "
        "refilled with the next queued sequence as soon as its own stops "
        "(m2po_jax/rollout/engines/); same greedy answers | paged: continuous batching "
        "over a paged KV cache: a group's prompt stored once, pages taken as sequences "
        "grow, the youngest preempted when the pool runs short | auto: paged from "
        "gconfig.max_new_tokens >= 128 on (long completions end at spread-out lengths), "
        "static below, continuous for multi-turn episodes (agent.env)",
        choices=("auto", "continuous", "paged", "static"),
    )
    engine_slots: int = knob(
        0,
        "continuous, paged: slots (0 = one per row it makes; paged: the total, dividing "
        "over the batch shards); refused on the static engine",
        low=0,
    )
    insert_lanes: int = knob(
        0,
        "continuous, paged: sequences started per step (0 = slots / 4); refused on the "
        "static engine",
        low=0,
    )
    kv_pages: int = knob(
        0,
        "paged: pages in the rollouts' pool (the evaluation's takes at least its batch's "
        "prompts and one whole completion); 0 = every prompt and every slot's whole "
        "completion, at most what the memory plan leaves of 90% of the device's memory "
        "(where it reports it, or mesh.device_memory_gib). Refused at start-up below a "
        "batch's prompts and one completion, not dividing over the batch shards, or on "
        "another engine",
        low=0,
    )
    page_size: int = knob(16, "paged: tokens per page (refused on another engine)", low=1)
    kv_dtype: str = knob(
        "",
        'the rollout engines\' KV cache (static, continuous, paged): "" (model.dtype) | '
        "bfloat16 | float8_e4m3fn (no scales, saturated at +-448); evaluation keeps "
        "model.dtype",
        choices=("", "bfloat16", "float8_e4m3fn"),
    )
    inflight_updates: bool = knob(
        False,
        "async + continuous or paged: between decode calls of `chunk_steps` steps, take "
        "newer weights; sequences in flight go on under them and each token records its "
        "version",
    )
    chunk_steps: int = knob(
        32,
        "continuous, paged: decode steps per call where the engine works between calls: "
        "newer weights (async with inflight_updates), streamed batches (stream_batches > "
        "1) and, on the paged engine, multi-turn episodes (the environment's answers)",
        low=1,
    )
    stream_batches: int = knob(
        1,
        "async + continuous or paged: batches the worker admits at once (each by the "
        "admission rule) and generates through the same slots, each handed to training as "
        "soon as it ends",
        low=1,
    )


@dataclasses.dataclass(frozen=True)
class AgentSection:
    env: str = knob(
        "",
        '"" = single-turn completions | tools (the built-in environment: agent.tools '
        "called from the assistant's tool calls, no call = the final answer) | "
        '"package.module:Env" (an Environment subclass of yours: reset(example) -> '
        "messages, step(text) -> StepResult)",
    )
    tools: str = knob("", 'comma-separated "package.module:function" (type hints + docstring)')
    parser: str = knob(
        "auto",
        "tool-call format: auto (from the chat template: hermes for Qwen, llama3_json for "
        "Llama 3) | hermes | llama3_json | calc (the built-in calculator task's) | a "
        "registered parser",
    )
    max_turns: int = knob(4, "assistant turns per episode (status max_turns past it)", low=1)
    max_append_tokens: int = knob(
        256,
        "tokens one environment answer may add (max_tokens past it)",
        low=1,
    )
    tool_timeout_s: float = knob(
        10.0,
        "per turn: the tool calls of one turn share this deadline (a call queued behind "
        "busy threads gets it from its own start); a call past it answers an error, and "
        "its thread is left to finish and replaced (episode/tool_abandoned)",
        low=0.0,
        low_open=True,
    )
    on_tool_error: str = knob(
        "reply",
        "a tool that raises or times out: reply (its error is the tool's answer, the "
        "episode goes on) | end (the episode ends with status tool_error / tool_timeout)",
        choices=("reply", "end"),
    )
    bad_tool_call_reward: float = knob(0.0, "reward of an episode ended by a malformed tool call")
    workers: int = knob(4, "environment steps (tool calls) run at once, on host threads", low=1)
    step_timeout_s: float = knob(
        300.0,
        "seconds one environment reset or step may take (tools included; above "
        "tool_timeout_s): a step past it ends its episode as env_timeout, a reset past it "
        "fails the rollout",
        low=0.0,
        low_open=True,
    )
    mask_failed_episodes: bool = knob(
        True,
        "take failed episodes (env_error, env_timeout: the environment broke, not the "
        "model) out of the loss (their loss-mask rows zeroed; episode/masked_failed "
        "counts them)",
    )
    mask_truncated_episodes: bool = knob(
        False,
        "take budget-cut episodes (max_turns, max_tokens) out of the loss, as TRL's "
        "mask_truncated_completions / DAPO's overlong filtering "
        "(episode/masked_truncated)",
    )


@dataclasses.dataclass(frozen=True)
class RejectionSamplingSection:
    enabled: bool = knob(True, "behaviour correction of the decoupled loss")
    level: str = knob("token", "token | sequence")
    action: str = knob("mask", "mask (drop) | clamp (clamp the weight)")
    metric: str = knob("ratio", "ratio | kl_k1 | kl_k2 | kl_k3")
    agg: str = knob("mean", "sequence aggregation: sum | mean | max")
    upper: float = knob(5.0, "upper bound on the metric (inclusive)")
    lower: float | None = knob(None, "lower bound (inclusive); None = none")


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSection:
    is_level: str = knob(
        "token",
        "token (rho, AReaL) | sequence (the row's product of rho) | geometric (the row's "
        "geometric mean of rho) | none (1)",
        choices=("token", "sequence", "geometric", "none"),
    )
    is_threshold: float | None = knob(
        None,
        "truncated importance sampling: weight = min(weight, is_threshold); None = untruncated",
        low=0.0,
        low_open=True,
    )


@dataclasses.dataclass(frozen=True)
class RewardNormSection:
    mean_level: str | None = knob(
        "group",
        "group | batch | None: what the reward is centred on",
        choices=("group", "batch", None),
    )
    std_level: str | None = knob(
        "group",
        "group | batch | None: what it is scaled by",
        choices=("group", "batch", None),
    )
    group_size: int = knob(
        None,
        "completions per prompt; unset = gconfig.n_samples (AReaL's key; no other value is valid)",
    )
    mean_leave1out: bool = knob(False, "leave-one-out mean")
    std_unbiased: bool = knob(True, "unbiased (n-1) standard deviation")
    eps: float = knob(1e-5, "added to the std", low=0.0, low_open=True)


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float = knob(1e-4, "peak learning rate (AdamW)", low=0.0, low_open=True)
    weight_decay: float = knob(0.0, "decoupled weight decay", low=0.0)
    beta1: float = knob(0.9, "Adam beta1", low=0.0, high=1.0, high_open=True)
    beta2: float = knob(0.999, "Adam beta2", low=0.0, high=1.0, high_open=True)
    eps: float = knob(1e-8, "Adam epsilon", low=0.0, low_open=True)
    gradient_clipping: float = knob(1.0, "global-norm clip (0 = off)", low=0.0)
    lr_scheduler_type: str = knob(
        "constant",
        "constant | linear | cosine (after warm-up)",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps_proportion: float = knob(
        0.0,
        "fraction of updates spent warming up",
        low=0.0,
        high=1.0,
    )
    min_lr_ratio: float = knob(
        0.0,
        "final lr / peak lr for linear and cosine decay",
        low=0.0,
        high=1.0,
    )


@dataclasses.dataclass(frozen=True)
class MicroBatchSection:
    n_mbs: int = knob(1, "at least this many micro-batches per minibatch", low=1)
    max_tokens_per_mb: int = knob(0, "at most this many padded tokens each (0 = no cap)", low=0)


@dataclasses.dataclass(frozen=True)
class ActorSection:
    m2_threshold: float | None = knob(
        0.04,
        "M2PO second-moment bound tau (> 0); None disables M2PO",
        low=0.0,
        low_open=True,
    )
    m2po_method: str = knob(
        "sort",
        "sort | bisect (sort-free, exact up to ties)",
        choices=("sort", "bisect"),
    )
    m2po_second_moment: str = knob(
        "behav_prox",
        "behav_prox (AReaL) | current_behav (paper) | prox_current (authors' code)",
        choices=("behav_prox", "current_behav", "prox_current"),
    )
    m2po_stop_rule: str = knob(
        "lt",
        "lt (AReaL, mean < tau) | le (paper) | capped_clip (authors' code: clip range)",
        choices=("lt", "le", "capped_clip"),
    )
    m2po_candidates: str = knob(
        "all",
        "all | harmful (authors' code: only tokens pushing the wrong way)",
        choices=("all", "harmful"),
    )
    m2po_scope: str = knob(
        "global",
        "Which tokens form one M2PO set (m2po_jax/algorithm/scopes.py): global (the whole "
        "batch; the whole minibatch when m2po_second_moment needs the current policy) | "
        "shard (each data-parallel shard of it, mesh data x fsdp: AReaL's per-rank rule) "
        "| minibatch | row (per sequence) | microbatch (inside each micro-batch's loss). "
        "capped_clip needs global.",
        choices=("global", "shard", "minibatch", "row", "microbatch"),
    )
    eps_clip: float | None = knob(
        0.2,
        "PPO clip: ratio clipped to [1 - eps_clip, 1 + eps_clip_higher]; None = no ratio "
        "clip (the paper's M2PO loss -A * r on the kept tokens; eps_clip_higher must then "
        "be None)",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    eps_clip_higher: float | None = knob(None, "upper clip (clip-higher); None = eps_clip", low=0.0)
    c_clip: float | None = knob(
        None,
        "dual-clip bound (> 1) for negative advantages; None = off",
        low=1.0,
        low_open=True,
    )
    use_decoupled_loss: bool = knob(
        True,
        "decoupled PPO: ratio against the recomputed proximal policy",
    )
    recompute_logprob: bool = knob(True, "recompute proximal log-probs with the current params")
    prox_logp_method: str = knob(
        "recompute",
        "Where the proximal log-probs come from (AReaL's names): recompute (exact; from "
        "the loss's own forward pass when there is one minibatch, else one extra pass) | "
        "loglinear (AReaL's version-interpolated approximation, no extra pass) | metrics "
        "(recompute and report the approximation's error). "
        "m2po_jax/algorithm/proximal.py, m2po_jax/learner/step_plan.py.",
        choices=("recompute", "loglinear", "metrics"),
    )
    loss_denominator: str = knob(
        "kept",
        "kept (AReaL: tokens after M2PO) | valid (paper)",
        choices=("kept", "valid"),
    )
    rejection_sampling: RejectionSamplingSection = section(RejectionSamplingSection)
    rollout_correction: RolloutCorrectionSection = section(
        RolloutCorrectionSection,
        "The weight of the tokens rejection sampling keeps (verl's "
        "algorithm.rollout_correction, whose keys are read too: docs/algorithm.md)",
    )
    importance_sampling_level: str = knob(
        "token",
        "token (PPO) | sequence (GSPO)",
        choices=("token", "sequence"),
    )
    use_sapo_loss: bool = knob(False, "SAPO soft gate (needs use_decoupled_loss=False)")
    sapo_tau_pos: float = knob(
        1.0,
        "SAPO temperature for positive advantages",
        low=0.0,
        low_open=True,
    )
    sapo_tau_neg: float = knob(
        1.05,
        "SAPO temperature for negative advantages",
        low=0.0,
        low_open=True,
    )
    ppo_n_minibatches: int = knob(
        1,
        "optimizer updates per step (lax.scan over minibatches)",
        low=1,
    )
    mb_spec: MicroBatchSection = section(MicroBatchSection, "micro-batches (gradient accumulation)")
    logp_chunk_size: int = knob(1024, "tokens per output-head chunk when taking log-probs", low=1)
    reward_scaling: float = knob(
        1.0,
        "R' = clip((R + reward_bias) * reward_scaling, +-reward_clip)",
        low=0.0,
        low_open=True,
    )
    reward_bias: float = knob(0.0, "added to the raw reward before scaling")
    reward_clip: float = knob(
        20.0,
        "absolute bound on the transformed reward",
        low=0.0,
        low_open=True,
    )
    reward_norm: RewardNormSection = section(RewardNormSection)
    adv_norm: bool = knob(False, "normalise advantages over all tokens of the batch")
    kl_ctl: float = knob(
        0.0,
        "KL penalty coefficient against the initial (reference) policy",
        low=0.0,
    )
    kl_estimator: str = knob("k1", "k1 | k2 | k3", choices=("k1", "k2", "k3"))
    router_replay: str = knob(
        "off",
        "a mixture of experts: off | rollout (routing replay, R3: the engine records each "
        "token's experts per layer and the trainer's passes route through them)",
        choices=("off", "rollout"),
    )
    temperature: float = knob(
        None,
        "logits / temperature when recomputing log-probs; unset = gconfig.temperature "
        "(AReaL's key; the behaviour log-probs are recorded at the sampling temperature, "
        "so no other value)",
    )
    optimizer: OptimizerSection = section(OptimizerSection)


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int = knob(
        25,
        "RL steps between held-out greedy evaluations (0 = only first/last)",
        low=0,
    )
    num_examples: int = knob(256, "held-out problems per evaluation", low=1)
    batch_size: int = knob(256, "prompts per greedy decoding call", low=1)
    sets: str = knob(
        "",
        'held-out sets, "name=path,name=path" (gsm8k / math: files like task.train_path), '
        'each reported as eval/<name>/avg@k and pass@k; "" = the task\'s held-out split',
    )
    n_samples: int = knob(1, "k: completions per problem (avg@k, pass@k)", low=1)
    temperature: float = knob(0.0, "0 = greedy (then n_samples must be 1)", low=0.0)
    reward: str = knob(
        "train",
        "train: score as training does (task.reward_fn) | verifier",
        choices=("train", "verifier"),
    )


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = knob(50, "steps between orbax checkpoints (0 = only at the end)", low=0)
    keep: int = knob(2, "checkpoints kept", low=1)
    hf_every: int = knob(
        0,
        "Hugging Face exports of the policy (only when model.path is a HF directory): "
        "<workdir>/hf/step_<N>/ at the end of the run and every hf_every steps (0 = only "
        "the end)",
        low=0,
    )
    hf_keep: int = knob(1, "exports kept", low=1)
    hf_dtype: str = knob(
        "bfloat16",
        "dtype of the exported tensors: bfloat16 | float32",
        choices=PARAM_DTYPES,
    )


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    tensorboard: bool = knob(True, "TensorBoard event files in the workdir")
    wandb_project: str = knob("", 'Weights & Biases project ("" = off)')
    progress: bool = knob(True, "progress bar on stderr")
    plots: bool = knob(True, "PNG plots in the workdir at the end")
    masked_grad_norm: bool = knob(
        False,
        "also the gradient of the tokens M2PO masked: m2po/masked_grad_norm and "
        "m2po/masked_grad_share (one more backward pullback per micro-batch)",
    )


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = knob(-1, "data-parallel axis size (-1 = all remaining devices)")
    fsdp: int = knob(1, "fully sharded data-parallel axis (params and optimizer state)")
    tensor: int = knob(1, "tensor-parallel axis (heads and MLP)")
    expert_axis: str = knob(
        "",
        'a mixture of experts\' experts split over this axis ("" = every device holds every '
        'expert; "fsdp" / "data": tokens exchanged over it instead of weights gathered); '
        "refused on a dense model",
        choices=("", "data", "fsdp"),
    )
    rollout_devices: int = knob(
        0,
        "rollout.mode=async: devices of each process given to rollouts (0 = half of "
        "them); the mesh above spans the rest of every process's devices",
        low=0,
    )
    device_memory_gib: float = knob(
        0.0,
        "memory per device for the start-up check (0 = ask the device)",
        low=0.0,
    )
    m2po_per_shard: bool = knob(
        False,
        'Deprecated alias, removed in the next release: True means actor.m2po_scope = "shard".',
    )


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = knob(0, "base PRNG seed; every step derives its keys with fold_in(seed, step)")
    total_steps: int = knob(200, "RL updates (policy versions) to run", low=0)
    max_nonfinite_steps: int = knob(3, "stop after this many consecutive non-finite steps", low=1)
    model: ModelSection = section(ModelSection)
    task: TaskSection = section(TaskSection)
    sft: SftSection = section(SftSection)
    gconfig: GenerationSection = section(GenerationSection)
    rollout: RolloutSection = section(RolloutSection)
    agent: AgentSection = section(
        AgentSection,
        "Multi-turn tool use (m2po_jax/rollout/episodes.py): each rollout row is an "
        "episode whose assistant turns end at a stop token; the environment answers "
        "(tools run on the host) and its answer's tokens are appended to the live "
        "sequence (never re-rendered); only the assistant's tokens are trained. Runs on "
        "the continuous engine (auto picks it) or the paged one.",
    )
    actor: ActorSection = section(ActorSection)
    eval: EvalSection = section(EvalSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    logging: LoggingSection = section(LoggingSection)
    mesh: MeshSection = section(MeshSection)
