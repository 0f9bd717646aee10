"""The built-in default: M2PO on a synthetic arithmetic task, rollouts 4 updates stale.

A small causal LM learns 1-2 digit addition from scratch on a CPU: a short supervised
warm-up makes it sometimes right, then GRPO-style RL with M2PO trains on rollouts that
were generated `rollout.max_head_offpolicyness` updates earlier.

Run:
  m2po-train                                  # this config, workdir ./runs/default
  m2po-train --config=configs/default.py --workdir=/tmp/run \
      --config.actor.m2_threshold=0.04 --config.rollout.max_head_offpolicyness=8
"""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg:  # a preset here would be ignored silently
        raise ValueError(
            f"configs/default.py: no presets (got {arg!r}); the arithmetic presets are in "
            f"configs/arith.py, e.g. --config=configs/arith.py:{arg}"
        )
    c = ml_collections.ConfigDict()
    c.seed = 0  # base PRNG seed; every step derives its keys with fold_in(seed, step)
    c.total_steps = 200  # RL updates (policy versions) to run
    c.max_nonfinite_steps = 3  # stop after this many consecutive non-finite steps

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local Hugging Face checkpoint dir; "" = a new model from the fields below
    c.model.vocab_size = 0  # 0 = the task tokenizer's vocabulary size
    c.model.hidden_size = 128  # width of the residual stream
    c.model.intermediate_size = 384  # SwiGLU hidden width
    c.model.num_layers = 2  # decoder layers
    c.model.num_heads = 4  # query heads
    c.model.num_kv_heads = 2  # key/value heads (grouped-query attention)
    c.model.head_dim = 0  # 0 = hidden_size // num_heads
    c.model.model_type = "llama"  # llama | qwen2 | qwen3 (for a new model)
    c.model.rope_theta = 10000.0  # RoPE base
    c.model.tie_word_embeddings = True  # share input embedding and output head
    c.model.dtype = "float32"  # compute dtype: float32 on CPU, bfloat16 on GPU/TPU
    c.model.param_dtype = "float32"  # storage dtype of params and optimizer state
    c.model.remat = False  # recompute each layer in the backward pass to save memory
    # With remat: what each layer keeps (m2po_jax.models.model.REMAT_POLICIES): nothing_saveable
    # (full remat) | dots_saveable | dots_with_no_batch_dims_saveable | everything_saveable
    # | save_qkv_proj | save_attention_out
    c.model.remat_policy = "nothing_saveable"
    # auto (GPU bf16/fp16: cudnn, TPU: splash, else xla) | xla | dot_product | cudnn | splash
    # | chunked (flash-style pure JAX, any backend: long sequences); m2po_jax/models/attention.py
    c.model.attention = "auto"
    # run the layers of a training pass as one lax.scan: fast compiles and bounded memory for
    # deep models (each layer's weights gathered and gradients reduced in turn)
    c.model.scan_layers = False
    # a mixture of experts (Qwen3-MoE): weight of the load-balancing loss added to the
    # training loss (HF's name; Qwen3-MoE pretraining used 0.001, RL recipes turn it off)
    c.model.router_aux_loss_coef = 0.0
    # LoRA: train low-rank adapters on the frozen model (rank 0 = off, full fine-tuning).
    # Each target projection (q, k, v, o, gate, up, down) gets A [in, rank] and B [rank, out]
    # in float32, its output scaled by alpha / rank; only the adapters get gradients and
    # optimizer state; the KL reference is the model with the adapters off.
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0
    c.model.lora.alpha = 16.0
    c.model.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated projection names
    # Dropout on the adapters' input: 0 only (the importance ratios need the sampler's network)
    c.model.lora.dropout = 0.0
    # QLoRA: how the adapted projections' frozen base kernels are held: float (param_dtype)
    # | int8 (per output channel scales, 1 byte a weight) | nf4 (QLoRA's 4-bit NormalFloat,
    # 64-weight blocks, half a byte a weight); dequantised per projection; needs rank > 0
    c.model.lora.base = "float"

    c.task = ml_collections.ConfigDict()
    # arith (built-in synthetic) | calculator (arith with a calculator tool to call) | gsm8k
    # (GSM8K-format files, numeric answers) | math (competition math: LaTeX answers,
    # math-verify) | "package.module:TaskClass" (yours)
    c.task.name = "arith"
    c.task.seed = 1234  # problem generator seed (train and held-out split)
    c.task.min_digits = 1  # arith: fewest digits per operand
    c.task.max_digits = 2  # arith: most digits per operand
    c.task.ops = "+"  # arith: operators to draw from, subset of "+-*"
    # gsm8k / math: training JSONL, .parquet or datasets.save_to_disk directory
    c.task.train_path = ""
    c.task.eval_path = ""  # gsm8k / math: held-out file; "" = the last eval_size records
    c.task.eval_size = 200  # gsm8k / math: records held out when eval_path is ""
    c.task.question_key = ""  # key / column of the problem; "" = question (gsm8k), problem (math)
    # key / column of the reference answer, kept as written: the last \boxed{}, else the
    # text after '####', else the whole value (a number is taken as its string)
    c.task.answer_key = "answer"
    # key / column of a full solution (the warm-up's target; the reference when a record
    # has no answer_key); "" = none (gsm8k), solution (math)
    c.task.solution_key = ""
    # a string with {problem} (or {question}), or a file holding one; "" = the task's own
    c.task.prompt_template = ""
    c.task.verifier = ""  # math (math-verify) | numeric (last number); "" = the task's own
    c.task.max_prompt_len = 8  # prompt width in tokens (left-padded to it; see long_prompts)
    c.task.long_prompts = "left"  # longer prompts: left (keep last tokens) | filter | error
    c.task.chat_template = "auto"  # auto (the checkpoint's, if any) | on (required) | off (raw)
    c.task.enable_thinking = placeholder(bool)  # Qwen3 thinking switch; None = template default
    c.task.format_reward = 0.0  # arith: reward for a well-formed but wrong answer (shaping)
    # calculator (arith with a calculator tool; configs/arith.py:calculator): the share of
    # warm-up examples that are episodes calling the tool (the rest answer directly)
    c.task.tool_demos = 0.1
    c.task.reward_fn = ""  # "pkg.module:function" (completion, answer) -> float; "" = task's

    c.sft = ml_collections.ConfigDict()
    c.sft.max_steps = 400  # supervised warm-up steps before RL (0 = none)
    c.sft.batch_size = 64  # warm-up sequences per step
    c.sft.lr = 1e-3  # warm-up learning rate (AdamW, constant)
    c.sft.stop_at_accuracy = 0.3  # end the warm-up once held-out greedy accuracy reaches this
    c.sft.eval_every = 25  # warm-up steps between accuracy checks

    c.gconfig = ml_collections.ConfigDict()
    c.gconfig.n_samples = 8  # completions per prompt (the GRPO group)
    c.gconfig.max_new_tokens = 4  # completion budget in tokens
    c.gconfig.temperature = 1.0  # sampling temperature (behaviour log-probs use it too)
    c.gconfig.greedy = False  # argmax decoding instead of sampling
    c.gconfig.top_p = 1.0  # nucleus sampling mass (1.0 = off)
    c.gconfig.top_k = 0  # top-k sampling (0 = off)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.batch_size = 64  # prompts per step (rows = batch_size * n_samples)
    c.rollout.max_head_offpolicyness = 4  # staleness k: train on the batch made k updates ago
    # sync: each step generates a batch, then trains on the one made k steps ago (the same
    # devices, deterministic) | async: a rollout worker on its own devices (mesh.rollout_devices)
    # generates with the newest published weights while the learner trains; a batch starts
    # only while no sample would be trained more than k updates stale (m2po_jax/rollout/staleness.py)
    c.rollout.mode = "sync"
    # completions scored at once on host threads (rewards that wait on I/O: sandboxes,
    # remote verifiers; a pure-Python reward gains nothing), in both modes; 1 = one by one
    c.rollout.reward_workers = 1
    # a completion's scoring stops after this and scores 0 (reward/timeouts counts them); the
    # math verifier runs in reward_workers processes for it; 0 = no limit
    c.rollout.reward_timeout_s = 10.0
    c.rollout.worker_timeout_s = 600.0  # async: fail (naming what it was doing) after this wait
    c.rollout.publish_dtype = ""  # the older name of rollout.weight_dtype: "" | bfloat16
    # the rollout engine's copy of the weights (sync: made once per step; async: at each
    # publish): "" (as trained) | bfloat16 | int8 | float8_e4m3fn (every projection kernel
    # as codes with a float32 scale per output channel, the codes the matmul's operand and
    # the scale applied to its output; the compute dtype stays model.dtype). Evaluation
    # runs the trained weights (docs/rollouts.md, "Cheaper rollout weights")
    c.rollout.weight_dtype = ""
    # static: each batch decodes until its longest completion ends (`sampling.generate`) |
    # continuous: a fixed number of decode slots, a slot refilled with the next queued
    # sequence as soon as its own stops (m2po_jax/rollout/engines/); same greedy answers |
    # paged: continuous batching over a paged KV cache: a group's prompt stored once, pages
    # taken as sequences grow, the youngest preempted when the pool runs short |
    # auto: paged from gconfig.max_new_tokens >= 128 on (long completions end at spread-out
    # lengths), static below, continuous for multi-turn episodes (agent.env)
    c.rollout.engine = "auto"
    c.rollout.engine_slots = 0  # continuous, paged: slots (0 = one per row it makes)
    c.rollout.insert_lanes = 0  # continuous, paged: sequences started per step (0 = slots / 4)
    # paged: pages in the pool; 0 = every prompt and every slot's whole completion, at most
    # what the memory plan leaves of 90% of the device's memory (where it reports it, or
    # mesh.device_memory_gib)
    c.rollout.kv_pages = 0
    c.rollout.page_size = 16  # paged: tokens per page
    # the rollout engines' KV cache (static, continuous, paged): "" (model.dtype) | bfloat16 |
    # float8_e4m3fn (no scales, saturated at +-448); evaluation keeps model.dtype
    c.rollout.kv_dtype = ""
    # async + continuous: between decode calls of `chunk_steps` steps, take newer weights;
    # sequences in flight go on under them and each token records its version
    c.rollout.inflight_updates = False
    c.rollout.chunk_steps = 32
    # async + continuous: batches the worker admits at once (each by the admission rule) and
    # generates through the same slots, each handed to training as soon as it ends
    c.rollout.stream_batches = 1

    # Multi-turn tool use (m2po_jax/rollout/episodes.py): each rollout row is an episode whose
    # assistant turns end at a stop token; the environment answers (tools run on the host) and
    # its answer's tokens are appended to the live sequence (never re-rendered); only the
    # assistant's tokens are trained. Needs the continuous engine (auto picks it).
    c.agent = ml_collections.ConfigDict()
    # "" = single-turn completions | tools (the built-in environment: agent.tools called from
    # the assistant's tool calls, no call = the final answer) | "package.module:Env" (an
    # Environment subclass of yours: reset(example) -> messages, step(text) -> StepResult)
    c.agent.env = ""
    c.agent.tools = ""  # comma-separated "package.module:function" (type hints + docstring)
    # tool-call format: auto (from the chat template: hermes for Qwen, llama3_json for Llama 3)
    # | hermes | llama3_json | calc (the built-in calculator task's) | a registered parser
    c.agent.parser = "auto"
    c.agent.max_turns = 4  # assistant turns per episode (status max_turns past it)
    c.agent.max_append_tokens = 256  # tokens one environment answer may add (max_tokens past it)
    # per turn: the tool calls of one turn share this deadline (a call queued behind busy
    # threads gets it from its own start); a call past it answers an error, and its thread
    # is left to finish and replaced (episode/tool_abandoned)
    c.agent.tool_timeout_s = 10.0
    # a tool that raises or times out: reply (its error is the tool's answer, the episode goes
    # on) | end (the episode ends with status tool_error / tool_timeout)
    c.agent.on_tool_error = "reply"
    c.agent.bad_tool_call_reward = 0.0  # reward of an episode ended by a malformed tool call
    c.agent.workers = 4  # environment steps (tool calls) run at once, on host threads
    # seconds one environment reset or step may take (tools included; above tool_timeout_s):
    # a step past it ends its episode as env_timeout, a reset past it fails the rollout
    c.agent.step_timeout_s = 300.0
    # take failed episodes (env_error, env_timeout: the environment broke, not the model) out
    # of the loss (their loss-mask rows zeroed; episode/masked_failed counts them)
    c.agent.mask_failed_episodes = True
    # take budget-cut episodes (max_turns, max_tokens) out of the loss, as TRL's
    # mask_truncated_completions / DAPO's overlong filtering (episode/masked_truncated)
    c.agent.mask_truncated_episodes = False

    c.actor = ml_collections.ConfigDict()
    c.actor.m2_threshold = placeholder(float)
    c.actor.m2_threshold = 0.04  # M2PO second-moment bound tau (> 0); None disables M2PO
    c.actor.m2po_method = "sort"  # sort | bisect (sort-free, exact up to ties)
    c.actor.m2po_second_moment = (
        "behav_prox"  # behav_prox (AReaL) | current_behav (paper) | prox_current (authors' code)
    )
    c.actor.m2po_stop_rule = (
        "lt"  # lt (AReaL, mean < tau) | le (paper) | capped_clip (authors' code: clip range)
    )
    c.actor.m2po_candidates = (
        "all"  # all | harmful (authors' code: only tokens pushing the wrong way)
    )
    # Which tokens form one M2PO set (m2po_jax/algorithm/scopes.py): global (the whole batch; the whole
    # minibatch when m2po_second_moment needs the current policy) | shard (each data-parallel
    # shard of it, mesh data x fsdp: AReaL's per-rank rule) | minibatch | row (per sequence) |
    # microbatch (inside each micro-batch's loss). capped_clip needs global.
    c.actor.m2po_scope = "global"
    c.actor.eps_clip = placeholder(float)
    # PPO clip: ratio clipped to [1 - eps_clip, 1 + eps_clip_higher]; None = no ratio clip
    # (the paper's M2PO loss -A * r on the kept tokens; eps_clip_higher must then be None)
    c.actor.eps_clip = 0.2
    c.actor.eps_clip_higher = placeholder(float)  # upper clip (clip-higher); None = eps_clip
    c.actor.c_clip = placeholder(float)  # dual-clip bound (> 1) for negative advantages; None = off
    c.actor.use_decoupled_loss = True  # decoupled PPO: ratio against the recomputed proximal policy
    c.actor.recompute_logprob = True  # recompute proximal log-probs with the current params
    # Where the proximal log-probs come from (AReaL's names): recompute (exact; from the
    # loss's own forward pass when there is one minibatch, else one extra pass) | loglinear
    # (AReaL's version-interpolated approximation, no extra pass) | metrics (recompute and
    # report the approximation's error). m2po_jax/algorithm/proximal.py, m2po_jax/learner/step_plan.py.
    c.actor.prox_logp_method = "recompute"
    c.actor.loss_denominator = "kept"  # kept (AReaL: tokens after M2PO) | valid (paper)
    c.actor.rejection_sampling = ml_collections.ConfigDict()
    c.actor.rejection_sampling.enabled = True  # behaviour correction of the decoupled loss
    c.actor.rejection_sampling.level = "token"  # token | sequence
    c.actor.rejection_sampling.action = "mask"  # mask (drop) | clamp (clamp the weight)
    c.actor.rejection_sampling.metric = "ratio"  # ratio | kl_k1 | kl_k2 | kl_k3
    c.actor.rejection_sampling.agg = "mean"  # sequence aggregation: sum | mean | max
    c.actor.rejection_sampling.upper = 5.0  # upper bound on the metric (inclusive)
    c.actor.rejection_sampling.lower = placeholder(float)  # lower bound (inclusive); None = none
    # The weight of the tokens rejection sampling keeps (verl's algorithm.rollout_correction,
    # whose keys are read too: docs/algorithm.md)
    c.actor.rollout_correction = ml_collections.ConfigDict()
    # token (rho, AReaL) | sequence (the row's product of rho) | geometric (the row's
    # geometric mean of rho) | none (1)
    c.actor.rollout_correction.is_level = "token"
    # truncated importance sampling: weight = min(weight, is_threshold); None = untruncated
    c.actor.rollout_correction.is_threshold = placeholder(float)
    c.actor.importance_sampling_level = "token"  # token (PPO) | sequence (GSPO)
    c.actor.use_sapo_loss = False  # SAPO soft gate (needs use_decoupled_loss=False)
    c.actor.sapo_tau_pos = 1.0  # SAPO temperature for positive advantages
    c.actor.sapo_tau_neg = 1.05  # SAPO temperature for negative advantages
    c.actor.ppo_n_minibatches = 1  # optimizer updates per step (lax.scan over minibatches)
    c.actor.mb_spec = ml_collections.ConfigDict()  # micro-batches (gradient accumulation)
    c.actor.mb_spec.n_mbs = 1  # at least this many micro-batches per minibatch
    c.actor.mb_spec.max_tokens_per_mb = 0  # at most this many padded tokens each (0 = no cap)
    c.actor.logp_chunk_size = 1024  # tokens per output-head chunk when taking log-probs
    c.actor.reward_scaling = 1.0  # R' = clip((R + reward_bias) * reward_scaling, +-reward_clip)
    c.actor.reward_bias = 0.0  # added to the raw reward before scaling
    c.actor.reward_clip = 20.0  # absolute bound on the transformed reward
    c.actor.reward_norm = ml_collections.ConfigDict()
    c.actor.reward_norm.mean_level = "group"  # group | batch | None: what the reward is centred on
    c.actor.reward_norm.std_level = "group"  # group | batch | None: what it is scaled by
    # completions per prompt; unset = gconfig.n_samples (AReaL's key; no other value is valid)
    c.actor.reward_norm.group_size = placeholder(int)
    c.actor.reward_norm.mean_leave1out = False  # leave-one-out mean
    c.actor.reward_norm.std_unbiased = True  # unbiased (n-1) standard deviation
    c.actor.reward_norm.eps = 1e-5  # added to the std
    c.actor.adv_norm = False  # normalise advantages over all tokens of the batch
    c.actor.kl_ctl = 0.0  # KL penalty coefficient against the initial (reference) policy
    c.actor.kl_estimator = "k1"  # k1 | k2 | k3
    # a mixture of experts: off | rollout (routing replay, R3: the engine records each
    # token's experts per layer and the trainer's passes route through them)
    c.actor.router_replay = "off"
    # logits / temperature when recomputing log-probs; unset = gconfig.temperature (AReaL's
    # key; the behaviour log-probs are recorded at the sampling temperature, so no other value)
    c.actor.temperature = placeholder(float)
    c.actor.optimizer = ml_collections.ConfigDict()
    c.actor.optimizer.lr = 1e-4  # peak learning rate (AdamW)
    c.actor.optimizer.weight_decay = 0.0  # decoupled weight decay
    c.actor.optimizer.beta1 = 0.9  # Adam beta1
    c.actor.optimizer.beta2 = 0.999  # Adam beta2
    c.actor.optimizer.eps = 1e-8  # Adam epsilon
    c.actor.optimizer.gradient_clipping = 1.0  # global-norm clip (0 = off)
    c.actor.optimizer.lr_scheduler_type = "constant"  # constant | linear | cosine (after warm-up)
    c.actor.optimizer.warmup_steps_proportion = 0.0  # fraction of updates spent warming up
    c.actor.optimizer.min_lr_ratio = 0.0  # final lr / peak lr for linear and cosine decay

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 25  # RL steps between held-out greedy evaluations (0 = only first/last)
    c.eval.num_examples = 256  # held-out problems per evaluation
    c.eval.batch_size = 256  # prompts per greedy decoding call
    # held-out sets, "name=path,name=path" (gsm8k / math: files like task.train_path), each
    # reported as eval/<name>/avg@k and pass@k; "" = the task's held-out split
    c.eval.sets = ""
    c.eval.n_samples = 1  # k: completions per problem (avg@k, pass@k)
    c.eval.temperature = 0.0  # 0 = greedy (then n_samples must be 1)
    c.eval.reward = "train"  # train: score as training does (task.reward_fn) | verifier

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50  # steps between orbax checkpoints (0 = only at the end)
    c.checkpoint.keep = 2  # checkpoints kept
    # Hugging Face exports of the policy (only when model.path is a HF directory):
    # <workdir>/hf/step_<N>/ at the end of the run and every hf_every steps (0 = only the end)
    c.checkpoint.hf_every = 0
    c.checkpoint.hf_keep = 1  # exports kept
    c.checkpoint.hf_dtype = "bfloat16"  # dtype of the exported tensors: bfloat16 | float32

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True  # TensorBoard event files in the workdir
    c.logging.wandb_project = ""  # Weights & Biases project ("" = off)
    c.logging.progress = True  # progress bar on stderr
    c.logging.plots = True  # PNG plots in the workdir at the end
    # also the gradient of the tokens M2PO masked: m2po/masked_grad_norm and
    # m2po/masked_grad_share (one more backward pullback per micro-batch)
    c.logging.masked_grad_norm = False

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel axis size (-1 = all remaining devices)
    c.mesh.fsdp = 1  # fully sharded data-parallel axis (params and optimizer state)
    c.mesh.tensor = 1  # tensor-parallel axis (heads and MLP)
    # rollout.mode=async: devices of each process given to rollouts (0 = half of them); the
    # mesh above spans the rest of every process's devices
    c.mesh.rollout_devices = 0
    c.mesh.device_memory_gib = 0.0  # memory per device for the start-up check (0 = ask the device)
    # Deprecated alias, removed in the next release: True means actor.m2po_scope = "shard".
    c.mesh.m2po_per_shard = False
    return c
