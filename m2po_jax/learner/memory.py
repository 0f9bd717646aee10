"""Per-device memory plan of a run: what the train step holds, analytically.

plan = memory_plan(model_config, mesh, batch=rows, seq_len=T, micro_batch=rows_per_mb,
                   kv_cache_batch=rows)
print(plan.format())             # params, optimizer, gradients, activations, head, ...

The check that refuses a run that cannot fit is `m2po_jax.trainer.memory_check`.

The plan follows what `train_step` does (micro-batches, rematerialised layers, chunked
output head) and is checked against XLA's own `memory_analysis()` of the compiled step
(`compiled_step_memory`, tests/learner/memory_test.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from m2po_jax.learner import logprobs
from m2po_jax.models import attention, lora, paged, quant
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding

_OPT_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 0}
# Attention implementations that keep [B, H, T, S] scores for the backward pass; the
# others (flash-style kernels) keep O(T) statistics per head.
_DENSE_ATTENTION = ("xla", "dot_product")
# Per token, what a remat policy saves of each layer beyond its input (elements).
_SAVED_PER_TOKEN = {
    "nothing_saveable": lambda e, h, k, d, f: 0,
    "dots_saveable": lambda e, h, k, d, f: (h + 2 * k) * d + 2 * e + 2 * f,
    "dots_with_no_batch_dims_saveable": lambda e, h, k, d, f: (h + 2 * k) * d + 2 * e + 2 * f,
    "save_qkv_proj": lambda e, h, k, d, f: (h + 2 * k) * d,
    "save_attention_out": lambda e, h, k, d, f: h * d,
}
_FIELDS = (
    "params", "optimizer", "gradients", "stacked_layers", "activations", "logits", "kv_cache",
    "sampling_weights",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes per device; see `memory_plan` for what each entry counts."""

    params: int
    optimizer: int
    gradients: int
    activations: int
    logits: int  # the output head's chunk buffers
    kv_cache: int
    sampling_weights: int = 0  # the sampler's copy of the params (sampling layout)
    stacked_layers: int = 0  # scanned layers: their params and gradients stacked [L, ...]
    mesh_shape: tuple[tuple[str, int], ...] = ()
    micro_batch: int = 0  # rows per micro-batch (global)

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in _FIELDS)

    @property
    def train_step(self) -> int:
        """What the compiled train step holds (everything but the sampler's KV cache and
        weights)."""
        return self.total - self.kv_cache - self.sampling_weights

    @property
    def sampling(self) -> int:
        """What a rollout holds: the train state (params and optimizer, resident between
        steps), the sampler's weights and its KV cache or engine."""
        return self.params + self.optimizer + self.sampling_weights + self.kv_cache

    @property
    def peak(self) -> int:
        """The larger of the two phases (`train_step`, `sampling`): a run that samples and
        trains on the same devices holds one of them at a time."""
        return max(self.train_step, self.sampling)

    def format(self) -> str:
        """A small table in MiB."""
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape)
        rows = [f"memory per device (mesh {mesh or '?'}, {self.micro_batch} rows per micro-batch)"]
        for name in _FIELDS:
            rows.append(f"  {name:<17}{getattr(self, name) / 2**20:>12.2f} MiB")
        rows.append(f"  {'total':<17}{self.total / 2**20:>12.2f} MiB")
        rows.append(f"  {'peak (phases)':<17}{self.peak / 2**20:>12.2f} MiB")
        return "\n".join(rows)


def _per_device(n_items: int, splits: int) -> int:
    return -(-n_items // splits)


def memory_plan(
    model_config: model_config_lib.ModelConfig,
    mesh: Mesh,
    *,
    rules: sharding.Rules | Mapping = sharding.TRAIN_RULES,
    batch: int,
    seq_len: int,
    micro_batch: int | None = None,
    kv_cache_batch: int = 0,
    kv_cache_len: int | None = None,
    optimizer: str = "adamw",
    remat: bool | None = None,
    logp_chunk: int = logprobs.DEFAULT_CHUNK,
    param_dtype_bytes: int | None = None,
    compute_dtype_bytes: int | None = None,
    shared_prompt: logprobs.SharedPrompt | None = None,
    kv_cache_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
    rollout_config: model_config_lib.ModelConfig | None = None,
    router_replay: bool = False,
    proximal_pass: bool = False,
) -> MemoryPlan:
    """Estimate peak bytes per device for one train step (plus a sampling KV cache).

    - params / gradients: each param's shard under `rules` (exact; a quantised LoRA base,
      `lora_base` int8 / nf4, at its codes' and float32 scales' own bytes); with several
      micro-batches a float32 gradient accumulator besides; under LoRA (`lora_rank`)
      gradients of the float32 adapters only;
    - optimizer: moments (2 for AdamW) sharded like the params, in param dtype (the
      adapters' only under LoRA);
    - stacked_layers (`scan_layers`): the scan over the layers runs on their params
      stacked [L, ...] (`model._scan_layers`' `jnp.stack`), a copy of every layer's
      params, and its backward pass writes the layers' gradients into a stacked buffer
      (dynamic-update-slice) that XLA holds twice (the loop's carry in and out) before
      the accumulator adds them: 1 + 2 layer-sized copies, plus the stack of the
      proximal pass (`proximal_pass`: the step plan's `prox_source == "pass"`), which
      the compiler does not share with the loss pass's. What the TPU compiler's buffers
      show for Qwen3-30B-A3B at 4 layers: 4 copies of each expert kernel [L, X, E, F]
      (`CausalLM/stack`, `jvp(CausalLM)/stack`, 2 x `transpose(jvp(CausalLM))`'s
      dynamic-update-slice), 7.1 x a layer's params of temporaries per layer in all;
    - activations of one micro-batch (rows split over data x fsdp, heads and MLP over
      tensor when divisible) kept for the backward pass per layer: 4 residual-width
      tensors [b,T,E], q/k/v before and after RoPE and the attention output
      [b,T,(3H+3K)D], MLP gate/up/hidden [b,T,F]x3 (a mixture of experts: F = K x its
      experts' width, plus [b,T,K,E]x2 of the routed rows and [b,T,X]x2 of the router's
      logits and probabilities; with the experts split over an axis of s devices,
      `expert_axis`, s x those routed rows and the s x [b,T,E] gathered tokens and their
      float32 sum; without it, on fsdp, one layer's experts gathered and their gradient
      before the reduce-scatter, 2 x [X, E, F] in param dtype), and for the attention
      implementations that materialise them ("xla", "dot_product") the probabilities
      [b,H,T,T]; with remat each layer's input and what `remat_policy` saves, plus one
      layer recomputed and its gradients;
    - logits: the output head's float32 chunk (`logp_chunk` tokens x V, V split over
      tensor), its softmax and its gradient;
    - kv_cache: k and v [b,S,K,D] per layer at `kv_dtype_bytes` each (default: the
      config's `cache_dtype`; the rollouts' `kv_dtype`, `setup.rollout_model_config`), b
      split over data x fsdp and K over tensor (0 when `kv_cache_batch` is 0) for the
      static sampler, or `kv_cache_bytes` when given: a continuous-batching engine's peak
      (`engine_bytes`);
    - sampling_weights: the params resharded for sampling (`sharding.SAMPLE_RULES`:
      split over tensor only), which the sampler holds beside the train state; 0 when
      the two layouts are the same (one device, or data-parallel only) or without a
      sampler (`kv_cache_batch` 0). With fsdp and no tensor axis every device then holds
      all the weights: the TPU compiler refuses Qwen3-8B's on a 16 GiB v5e chip. With a
      `rollout_config` whose weights are stored otherwise (`setup.rollout_model_config`:
      `weight_quant` codes at 1 byte a weight and float32 scales, or another
      param_dtype) the rollouts' copy is always made, at its own bytes in the sampling
      layout; the line is the larger of it and the evaluation's (the trained params,
      resharded as above: evaluation runs the trained weights).
    `router_replay` (a mixture of experts' routing replay): the recorded experts, L x K
    int16 a token, of the train batch (counted in activations: the step holds the whole
    batch's) and of the sampler's rows (in kv_cache, beside the cache).
    `total` adds everything; `train_step` leaves the sampler's KV cache and weights out,
    `sampling` is what a rollout holds (the train state, the sampler's weights and KV);
    `peak`, the larger of the two, is what the start-up check holds a device to (a trainer
    that samples and trains on the same devices holds one phase at a time).

    `shared_prompt` (the step plan's `loss_prompt`): the trunk runs each group's prompt
    once (G = micro_batch / group_size prompts, split over the batch shards when they
    divide, else on every device) and then each row's completion columns against it, in
    `length_blocks` blocks of rows one after the other; activations count both passes,
    the prompts' keys and values (and their gradients) and the blocks' head buffers.
    """
    c = model_config
    micro_batch = _checked_sizes(batch, seq_len, micro_batch, optimizer)
    remat = c.remat if remat is None else remat
    pbytes = param_dtype_bytes or model_config_lib.as_dtype(c.param_dtype).itemsize
    cbytes = compute_dtype_bytes or model_config_lib.as_dtype(c.dtype).itemsize
    kv_cache_len = seq_len if kv_cache_len is None else kv_cache_len

    shardings = sharding.param_shardings(c, mesh, rules)
    shapes = sharding.param_shapes(c)
    items, layer_items, quantised = _param_items(shardings, shapes)
    params = items["base"] * pbytes + items["adapters"] * 4 + quantised
    trained, tbytes = (items["adapters"], 4) if c.lora_rank else (items["base"], pbytes)
    gradients = trained * tbytes + (trained * 4 if micro_batch < batch else 0)
    stacked_layers = 0
    if c.scan_layers:
        layer_bytes = layer_items["base"] * pbytes + layer_items["adapters"] * 4
        layer_trained = layer_items["adapters"] if c.lora_rank else layer_items["base"]
        copies = 2 if proximal_pass else 1
        stacked_layers = copies * layer_bytes + 2 * layer_trained * tbytes
    sampling_weights = 0
    if kv_cache_batch:
        sampling_weights = _sampling_weights(c, mesh, shardings, shapes, pbytes, rollout_config)

    trunk = _Trunk.of(c, mesh, cbytes, c.remat_policy if remat else "everything_saveable")
    b = _per_device(micro_batch, sharding.batch_shards(mesh))
    activations = _activation_bytes(trunk, mesh, micro_batch, seq_len, shared_prompt, logp_chunk)
    if c.is_moe and not c.expert_axis and mesh.shape.get("fsdp", 1) > 1:
        # One layer's experts gathered whole (F split over tensor) and their gradient
        # before its reduce-scatter: 1.1 GiB each for Qwen3-30B-A3B.
        experts = 3 * c.num_experts * c.hidden_size * trunk.split(c.moe_intermediate_size)
        activations += 2 * experts * pbytes
    # One chunk of about `logp_chunk` tokens of the micro-batch, on this device's rows (the
    # shared-prompt pass runs the head on completion columns only).
    scored = seq_len - 1 if shared_prompt is None else seq_len - shared_prompt.prompt_len
    columns = max(1, min(logp_chunk // micro_batch, scored))
    logits = 3 * b * columns * trunk.split(c.vocab_size) * 4

    kv_b = _per_device(kv_cache_batch, sharding.batch_shards(mesh))
    kvbytes = kv_dtype_bytes or c.cache_dtype.itemsize
    kv_cache = 2 * c.num_layers * kv_b * kv_cache_len * trunk.k * trunk.d * kvbytes
    if kv_cache_bytes is not None and kv_cache_batch:
        kv_cache = kv_cache_bytes
    if router_replay:
        token = c.num_layers * c.num_experts_per_tok * 2  # int16 experts a token
        activations += _per_device(batch, sharding.batch_shards(mesh)) * seq_len * token
        kv_cache += kv_b * kv_cache_len * token
    return MemoryPlan(
        params=params,
        optimizer=_OPT_MOMENTS[optimizer] * trained * tbytes,
        gradients=gradients,
        stacked_layers=stacked_layers,
        activations=activations,
        logits=logits,
        kv_cache=kv_cache,
        sampling_weights=sampling_weights,
        mesh_shape=tuple(mesh.shape.items()),
        micro_batch=micro_batch,
    )


def _checked_sizes(batch: int, seq_len: int, micro_batch: int | None, optimizer: str) -> int:
    """`memory_plan`'s sizes checked in one line each; returns the micro-batch."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch ({batch}) and seq_len ({seq_len}) must be positive")
    micro_batch = batch if micro_batch is None else micro_batch
    if micro_batch < 1 or batch % micro_batch:
        raise ValueError(f"micro_batch: {micro_batch} must be positive and divide batch {batch}")
    if optimizer not in _OPT_MOMENTS:
        raise ValueError(
            f"optimizer: {optimizer!r} unknown; expected one of {sorted(_OPT_MOMENTS)}"
        )
    return micro_batch


def _param_items(shardings, shapes) -> tuple[dict, dict, int]:
    """Params on one device: (items of the base and of the adapters, the decoder layers'
    share of them (not the embeddings), bytes of quantised leaves). Under LoRA (adapters
    in float32) only the adapters have gradients and moments; a quantised base
    (`lora_base`, `quant.py`) holds its codes and float32 scales at their own itemsize: 1
    byte a weight (int8), 1 byte per 2 weights (nf4)."""
    items = {"base": 0, "adapters": 0}
    layer_items = {"base": 0, "adapters": 0}
    quantised = 0
    for (path, shape), sh in zip(
        jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(shardings), strict=True
    ):
        keys = tuple(getattr(k, "key", k) for k in path)
        n = math.prod(sh.shard_shape(shape.shape))
        if quant.is_quantized_leaf(keys, shape.dtype):
            quantised += n * shape.dtype.itemsize
        else:
            kind = "adapters" if lora.is_adapter(keys) else "base"
            items[kind] += n
            if str(keys[0]).startswith("layers_"):
                layer_items[kind] += n
    return items, layer_items, quantised


def _sampling_weights(c, mesh, shardings, shapes, pbytes: int, rollout_config) -> int:
    """The sampler's copy of the weights (`memory_plan`'s sampling_weights): the trained
    params resharded when the sampling layout differs, or the rollouts' own copy when
    `rollout_config` stores them otherwise, the larger of the two."""
    out = 0
    sample = sharding.param_shardings(c, mesh, sharding.SAMPLE_RULES)
    leaves = (jax.tree.leaves(sample), jax.tree.leaves(shardings), jax.tree.leaves(shapes))
    pairs = zip(*leaves, strict=True)
    if not all(a.is_equivalent_to(b, len(x.shape)) for a, b, x in pairs):
        out = _sampling_bytes(c, mesh, pbytes)
    rc = c if rollout_config is None else rollout_config
    if (rc.weight_quant, rc.param_dtype) != (c.weight_quant, c.param_dtype):
        rbytes = model_config_lib.as_dtype(rc.param_dtype).itemsize
        if rc.param_dtype == c.param_dtype:
            rbytes = pbytes
        out = max(out, _sampling_bytes(rc, mesh, rbytes))
    return out


def _sampling_bytes(c: model_config_lib.ModelConfig, mesh: Mesh, pbytes: int) -> int:
    """Bytes per device of `c`'s params in the sampling layout: float leaves at `pbytes`,
    quantised codes and scales at their own itemsize."""
    shapes = sharding.param_shapes(c)
    sample = sharding.param_shardings(c, mesh, sharding.SAMPLE_RULES)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    total = 0
    for (path, s), sh in zip(flat, jax.tree.leaves(sample), strict=True):
        keys = tuple(getattr(k, "key", k) for k in path)
        itemsize = s.dtype.itemsize if quant.is_quantized_leaf(keys, s.dtype) else pbytes
        total += math.prod(sh.shard_shape(s.shape)) * itemsize
    return total


@dataclasses.dataclass(frozen=True)
class _Trunk:
    """Per-device sizes of the model's trunk (heads and MLP split over tensor when they
    divide) and what one pass keeps for the backward pass under a remat policy."""

    config: model_config_lib.ModelConfig
    tensor: int
    h: int
    k: int
    d: int
    f: int
    cbytes: int
    dense_attention: bool
    policy: str
    gathered: int = 1  # tokens per local token a mixture of experts' block routes (`of`)

    @classmethod
    def of(cls, c, mesh: Mesh, cbytes: int, policy: str) -> _Trunk:
        tensor = mesh.shape.get("tensor", 1)
        split = lambda n: n // tensor if n % tensor == 0 else n  # noqa: E731
        # Experts split over a batch axis of s devices (`moe.moe_experts`): each device routes
        # the s x its tokens of its expert group, all N x K assignments of them as static
        # rows (most for other devices' experts, zero here).
        gathered = mesh.shape.get(c.expert_axis, 1) if c.is_moe and c.expert_axis else 1
        return cls(
            config=c,
            tensor=tensor,
            h=split(c.num_heads),
            k=split(c.num_kv_heads),
            d=c.dim_per_head,
            # the hidden units a token runs through: of a mixture of experts, its K experts'
            # (of the s tokens gathered per local token)
            f=gathered * c.num_experts_per_tok * split(c.moe_intermediate_size)
            if c.is_moe
            else split(c.intermediate_size),
            cbytes=cbytes,
            dense_attention=attention_kind(c, mesh_platform(mesh)) in _DENSE_ATTENTION,
            policy=policy,
            gathered=gathered,
        )

    def split(self, n: int) -> int:
        """The per-device share of a tensor-parallel dim."""
        return n // self.tensor if n % self.tensor == 0 else n

    def __call__(self, rows: int, queries: int, keys: int) -> int:
        """Bytes one trunk pass over `rows` rows keeps for the backward pass."""
        c, e, h, k, d, f = self.config, self.config.hidden_size, self.h, self.k, self.d, self.f
        per_token = 4 * e + (3 * h + 3 * k) * d + 3 * f
        if c.is_moe:  # each of its K assignments' input and output rows; router logits, probs
            per_token += 2 * self.gathered * c.num_experts_per_tok * e + 2 * c.num_experts
            if self.gathered > 1:  # the gathered tokens, their float32 sum before the scatter
                per_token += self.gathered * e * (1 + 4 // self.cbytes)
        scores = rows * h * queries * keys if self.dense_attention else 0
        layer = (rows * queries * per_token + scores) * self.cbytes
        if self.policy == "everything_saveable":
            return c.num_layers * layer
        # Each layer's input and what the policy saves, plus one layer recomputed and its
        # gradients in the backward pass.
        saved = rows * queries * _SAVED_PER_TOKEN[self.policy](e, h, k, d, f) * self.cbytes
        if self.policy == "dots_saveable":
            saved += scores * self.cbytes  # the attention matmuls are dots too
        return c.num_layers * (rows * queries * e * self.cbytes + saved) + 2 * layer


def _activation_bytes(
    trunk: _Trunk, mesh: Mesh, micro_batch: int, t: int, shared_prompt, logp_chunk: int
) -> int:
    """What the loss pass over one micro-batch of `t` columns keeps, per device: whole rows,
    or each group's prompt once and then the completion columns (`memory_plan`)."""
    shards = sharding.batch_shards(mesh)
    b = _per_device(micro_batch, shards)
    if shared_prompt is None:
        return trunk(b, t, t)
    c, p = trunk.config, shared_prompt.prompt_len
    groups = micro_batch // shared_prompt.group_size
    g = groups // shards if groups % shards == 0 else groups
    prompt_kv = 2 * 2 * c.num_layers * g * trunk.k * p * trunk.d * trunk.cbytes  # k, v, grads
    activations = trunk(g, p, p) + prompt_kv
    blocks = shared_prompt.length_blocks
    if blocks == 1:
        return activations + trunk(b, t - p, t)
    # The blocks run one after another, yet XLA keeps about half of what whole rows would
    # (tests/learner/memory_test.py); and the branches' head buffers.
    head = _branch_head_bytes(c, mesh, micro_batch, t - p, blocks, logp_chunk)
    return activations + trunk(max(b // 2, 1), t - p, t) + head


# Vocabulary-wide buffers one length-block branch of `logprobs.shared_prompt_logp` keeps
# (its head chunk's logits, softmax, gradients and copies), measured against XLA at
# Qwen2.5-0.5B's vocabulary: the four branches cost ~12 GiB there whatever the rows.
_BRANCH_HEAD_BUFFERS = 5


def _branch_head_bytes(c, mesh: Mesh, rows: int, width: int, blocks: int, logp_chunk: int) -> int:
    """Vocabulary-wide buffers the four length-block branches of a micro-batch of `rows`
    rows and `width` completion columns keep, per device."""
    tensor = mesh.shape.get("tensor", 1)
    vocab = c.vocab_size // tensor if c.vocab_size % tensor == 0 else c.vocab_size
    block_tokens = min(logp_chunk, rows // blocks * (width + 1))
    tokens = _per_device(block_tokens, sharding.batch_shards(mesh))
    return 4 * _BRANCH_HEAD_BUFFERS * tokens * vocab * 4


def length_blocks_pay(
    model_config: model_config_lib.ModelConfig,
    mesh: Mesh,
    *,
    rows: int,
    seq_len: int,
    prompt_len: int,
    blocks: int,
    logp_chunk: int = logprobs.DEFAULT_CHUNK,
) -> bool:
    """Whether running a micro-batch of `rows` rows in `blocks` blocks by completion length
    holds less than running whole rows: the blocks skip about half the completion pass's
    activations, and each of their four compiled widths keeps its own vocabulary-wide head
    buffers (XLA does not share them between the branches). Small vocabularies: they pay;
    Qwen-sized ones (152k) with a few rows per device: they do not."""
    whole = memory_plan(model_config, mesh, batch=rows, seq_len=seq_len, micro_batch=rows)
    width = seq_len - prompt_len
    head = _branch_head_bytes(model_config, mesh, rows, width, blocks, logp_chunk)
    return whole.activations // 2 > head


def blocks_pay_fn(model_config: model_config_lib.ModelConfig, mesh: Mesh, logp_chunk: int):
    """`length_blocks_pay` bound to a model and mesh, as `step_plan.plan_step` takes it."""

    def pays(rows: int, seq_len: int, prompt_len: int, blocks: int) -> bool:
        return length_blocks_pay(
            model_config,
            mesh,
            rows=rows,
            seq_len=seq_len,
            prompt_len=prompt_len,
            blocks=blocks,
            logp_chunk=logp_chunk,
        )

    return pays


def attention_kind(config: model_config_lib.ModelConfig, platform: str | None = None) -> str:
    """The attention implementation a config trains with on `platform` (default: the
    default backend)."""
    return attention.resolve(
        config.attention,
        model_config_lib.as_dtype(config.dtype),
        config.dim_per_head,
        platform=platform or jax.default_backend(),
    )


def mesh_platform(mesh: Mesh) -> str:
    """The platform of a mesh's devices ("tpu", "gpu", "cpu")."""
    return mesh.devices.flat[0].platform


def engine_bytes(
    model_config: model_config_lib.ModelConfig,
    engine: str,
    *,
    prompts: int,
    n_samples: int,
    prompt_len: int,
    max_new: int,
    slots: int = 0,
    pages: int = 0,
    page_size: int = 16,
    insert_lanes: int = 0,
    shards: int = 1,
    tensor: int = 1,
) -> int:
    """Peak bytes a continuous-batching rollout engine holds on one device beside its
    weights: the largest of its programs (tests/learner/memory_test.py checks it against
    XLA's analysis of `RolloutEngine.programs`).

    Q prompts of P columns, J = Q x n sequences of N new tokens, S slots, a cache column
    c = 2 x layers x K x D x bytes of the config's `cache_dtype` (keys and values; c' the
    same in the compute dtype, what attention reads them as):
    - continuous: the prefixes Q x P x c and the prompts' logits [Q, V] float32; the slots'
      rows S x (P + N) x c and the output rows (J x N x 14 bytes: tokens, log-probs,
      versions, masks); its prefill builds Q full-width rows, (Q x (P + N) x c), and its
      decode step reads one layer's cache at a time (S x (P + N) x c' / layers);
    - paged: the pool (`pages` x page size x c; 0 = every prompt's pages and every slot's
      whole completion, the engine's default), page tables, logits and output rows; its
      prefill runs Q x P tokens, its resume (lanes sequences recomputed up to the
      completion's width W rounded to a power of two) chunks of lanes x min(W, 256) tokens
      (`paged.RESUME_CHUNK`) over W + P columns; a decode step gathers each live row's
      pages of one layer (x c' / layers).
    A multi-token pass holds per token ~(2E + (H + 2K) D + 2F) activations in the compute
    dtype and, per query head, float32 scores and probabilities over the columns it reads.
    `shards`, `tensor`: the paged engine on a mesh (`PagedEngine.shards` batch shards, a
    "tensor" axis of `tensor` devices): each device holds its shard's share of the
    prompts, sequences, slots and `pages`, and of the pool's KV heads when they divide
    over `tensor` (the heads' and the MLP's activations split with them).
    """
    c = model_config
    cbytes = model_config_lib.as_dtype(c.dtype).itemsize
    split = tensor if engine == "paged" and c.num_kv_heads % tensor == 0 else 1
    column = 2 * c.num_layers * c.num_kv_heads * c.dim_per_head * c.cache_dtype.itemsize // split
    read = column * cbytes // c.cache_dtype.itemsize  # a column as attention reads it
    jobs = prompts * n_samples
    slots = min(slots or jobs, jobs)
    logits = prompts * c.vocab_size * 4
    rows = jobs * max_new * 14
    per_token = (2 * c.hidden_size + ((c.num_heads + 2 * c.num_kv_heads) * c.dim_per_head
                 + 2 * c.intermediate_size) // split) * cbytes  # fmt: skip

    def tokens(batch: int, width: int, columns: int) -> int:
        return batch * width * per_token + 2 * batch * c.num_heads * width * columns * 4 // split

    if engine == "continuous":
        held = prompts * prompt_len * column + logits
        prefill = held + prompts * (prompt_len + max_new) * column
        prefill += tokens(prompts, prompt_len, prompt_len)
        run = held + rows + slots * (prompt_len + max_new) * (column + read / c.num_layers)
        return int(max(prefill, run))
    if engine != "paged":
        raise ValueError(f"engine: 'continuous' or 'paged', got {engine!r}")
    if shards > 1:  # one shard's engine
        return engine_bytes(
            model_config, engine, prompts=prompts // shards, n_samples=n_samples,
            prompt_len=prompt_len, max_new=max_new, slots=slots // shards,
            pages=pages // shards, page_size=page_size, insert_lanes=insert_lanes,
            tensor=tensor,
        )  # fmt: skip
    # own pages: the prompt's partly filled last page (copied) and the completion after it
    own, per_prompt = -(-(max_new + page_size - 1) // page_size), -(-prompt_len // page_size)
    pages = pages or prompts * per_prompt + slots * own
    tables = (prompts * per_prompt + slots * own) * 4 + 2 * pages * 4
    held = pages * page_size * column + tables + logits + rows
    prompt_cols = per_prompt * page_size
    prefill = held + tokens(prompts, prompt_len, 2 * prompt_cols)
    lanes = min(insert_lanes or max(slots // 4, 1), slots)
    width = max(8, 1 << max(max_new - 1, 0).bit_length())
    chunk = min(width, paged.RESUME_CHUNK)
    resume = held + tokens(lanes, chunk, min(width, own * page_size) + prompt_cols)
    step = slots * own * page_size + min(prompts, slots) * prompt_cols
    run = held + step * read // c.num_layers
    return int(max(prefill, resume, run))
