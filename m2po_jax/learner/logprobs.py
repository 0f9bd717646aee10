"""Token log-probs and entropies without materialising [B, T, V] logits.

At the vocabularies real checkpoints use (128k-152k), float32 logits of a batch are the
largest tensor of a train step (a 0.5B model's logits outweigh the rest of its
activations). Here the output head is applied to the final hidden states one chunk of
columns at a time inside a `lax.scan` whose body is rematerialised (`jax.checkpoint`):
the forward pass keeps only [B, T] results, and the backward pass recomputes each
chunk's logits. Peak head memory is about `chunk x V` floats instead of `rows x T x V`,
`chunk` counting tokens (rows x columns) of the batch the function sees.

    logp_BxT, entropy_BxT = sequence_logp(params, config, tokens_BxT, valid_BxT,
                                          temperature=1.0, chunk=1024)

Alignment follows `model.token_logp`: column t holds log p(tokens[:, t] | tokens[:, :t]);
column 0 is 0. Temperature divides the logits first, as the sampler does.

A mixture of experts: `routed_experts_BxTxLxK` (routing replay, the rollout's recorded
experts; -1 routes freshly) is replayed by every forward here; with `router=True` the
functions also return the forward's `moe.RoutingSums` over the valid tokens (the
load-balancing loss, expert load and replay agreement), summed over the parts a batch
runs in (a shared prompt counts once per row that shares it, as a whole-row forward does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from m2po_jax.learner.batching import merge_rows, split_rows
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config, moe

DEFAULT_CHUNK = 1024  # tokens per output-head chunk


def _chunk_logp_entropy(hidden_BxCxE, head_ExV, targets_BxC, temperature, with_entropy):
    """log p(target) and entropy (or None) of softmax(hidden @ head / temperature), f32 [B, C]."""
    logits = model_lib.dense(hidden_BxCxE, head_ExV).astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_BxC[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return picked - lse, None
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return picked - lse, entropy


def head_logp_entropy(
    hidden_BxTxE: jax.Array,
    head_ExV: jax.Array,
    tokens_BxT: jax.Array,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs and entropies of the next tokens from final hidden states, chunk by chunk.

    `logits[:, t] = hidden[:, t] @ head / temperature` predicts `tokens[:, t + 1]`. The
    T - 1 predicting columns are cut into chunks of max(1, chunk // B) columns (the last
    padded), so a chunk holds about `chunk` tokens;
    each chunk's logits exist only inside one rematerialised scan iteration, in the forward
    and in the backward pass. Values and gradients equal `model.token_logp` /
    `model.token_entropy` of the full logits up to float reordering.

    Args:
      hidden_BxTxE: final-normed hidden states (`model.apply(..., hidden_only=True)`).
      head_ExV: output head (`model.head_weight`), same dtype as the hidden states.
      tokens_BxT: int token ids.
      temperature: divides the logits (> 0).
      chunk: tokens per chunk (>= 1); chunk >= B x (T - 1) is one pass over all columns.
      with_entropy: False skips the entropy (returned as None).

    Returns:
      (logp_BxT, entropy_BxT), float32, column 0 zero.
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be >= 1, got {chunk}")
    b, t, e = hidden_BxTxE.shape
    if t < 2:
        zeros = jnp.zeros((b, t), jnp.float32)
        return zeros, zeros if with_entropy else None
    cols = t - 1
    width = min(max(chunk // b, 1), cols)
    n = math.ceil(cols / width)
    pad = n * width - cols
    hidden = jnp.pad(hidden_BxTxE[:, :-1], ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, pad)))
    # [n, B, chunk, ...]: the scan walks over column chunks; rows keep their sharding.
    hidden_NxBxCxE = hidden.reshape(b, n, width, e).swapaxes(0, 1)
    targets_NxBxC = targets.reshape(b, n, width).swapaxes(0, 1)

    @jax.checkpoint
    def body(head, xs):
        h, tgt = xs
        return _chunk_logp_entropy(h, head, tgt, temperature, with_entropy)

    def step(carry, xs):
        return carry, body(head_ExV, xs)

    _, (logp_NxBxC, ent_NxBxC) = jax.lax.scan(step, None, (hidden_NxBxCxE, targets_NxBxC))

    def unchunk(x_NxBxC):
        if x_NxBxC is None:
            return None
        x = x_NxBxC.swapaxes(0, 1).reshape(b, n * width)[:, :cols]
        return jnp.pad(x, ((0, 0), (1, 0)))

    return unchunk(logp_NxBxC), unchunk(ent_NxBxC)


def _routing_sums(config, routing, valid_BxT, routed_experts_BxTxLxK) -> moe.RoutingSums:
    """The `moe.RoutingSums` of a forward's routing (`model.apply(return_routing=True)`)."""
    logits_LxBxTxX, _ = routing
    return moe.routing_sums(
        logits_LxBxTxX,
        config.num_experts_per_tok,
        valid_BxT,
        recorded_BxTxLxK=routed_experts_BxTxLxK,
    )


def sequence_logp(
    params,
    config: model_config.ModelConfig,
    tokens_BxT: jax.Array,
    valid_BxT: jax.Array | None = None,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
    *,
    routed_experts_BxTxLxK: jax.Array | None = None,
    router: bool = False,
):
    """(logp_BxT, entropy_BxT or None) of `tokens_BxT` under `params`, like `token_logp`;
    with `router`, (logp, entropy, `moe.RoutingSums`) (module doc)."""
    hidden = model_lib.apply(
        params,
        config,
        tokens_BxT,
        valid_BxT=valid_BxT,
        hidden_only=True,
        routed_experts_BxTxLxK=routed_experts_BxTxLxK,
        return_routing=router,
    )
    sums = None
    if router:
        hidden, routing = hidden
        valid = jnp.ones(tokens_BxT.shape, bool) if valid_BxT is None else valid_BxT
        sums = _routing_sums(config, routing, valid, routed_experts_BxTxLxK)
    head = model_lib.head_weight(params, config)
    out = head_logp_entropy(hidden, head, tokens_BxT, temperature, chunk, with_entropy)
    return (*out, sums) if router else out


# Long on purpose: most of it is the docstring (the layout the sampler must write and the
# length blocks' measured gain); the body is the prompt pass, then the blocked completion
# pass whose `lax.switch` branches close over the prompt's keys and values.
def shared_prompt_logp(
    params,
    config: model_config.ModelConfig,
    tokens_BxT: jax.Array,
    valid_BxT: jax.Array,
    prompt_len: int,
    group_size: int,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
    length_blocks: int = 8,
    *,
    routed_experts_BxTxLxK: jax.Array | None = None,
    router: bool = False,
):
    """`sequence_logp` of completions whose `group_size` consecutive rows share a prompt.

    The first `prompt_len` columns of rows g * group_size ... (g + 1) * group_size - 1 must
    hold the same (left-padded) prompt, as the sampler writes them. The trunk then runs
    over each prompt once (returning its keys and values, `model.apply(return_kv=True)`)
    and over each row's completion columns against them (`model.Prefix`: each layer
    expands its group's prompt keys and values to the rows inside the layer, so with
    `model.scan_layers` the step keeps one layer's copies, and gradients flow back into
    the shared prompt), instead of over every row's whole sequence; the head runs on the
    completion columns only. Prompt columns of the result
    are 0 (log-probs there are never used). Values and gradients equal `sequence_logp`'s
    on the completion columns up to float reordering.

    Completions end at different lengths. The rows are sorted by completion length and cut
    into `length_blocks` blocks of equal size; each block runs over the first N/8, N/4,
    N/2 or all N completion columns, the fewest that hold its longest completion (a
    `lax.switch` in a `lax.scan` over the blocks: four compiled widths, one run per block;
    each branch is rematerialised, so the backward pass keeps no activations of the
    branches a block did not take). With lengths spread as a sampler's are, most blocks
    skip most padding columns (fwd + bwd of 16 x 8 rows of 128 + 192 columns with
    geometric lengths of mean 40 on this CPU: 2.0 s against 6.4 s for whole rows).

    Args:
      tokens_BxT, valid_BxT: [B, P + N] rows, B a multiple of `group_size`; completions
        right-padded (a row's real completion tokens are its first ones).
      prompt_len: P, the prompt width (>= 1).
      group_size: rows per prompt.
      temperature, chunk, with_entropy: as in `sequence_logp`.
      length_blocks: blocks of rows by length (1: every row over all N columns); used
        when it divides B.
      routed_experts_BxTxLxK, router: as in `sequence_logp` (the prompt columns are never
        recorded: the prompt pass routes freshly).
    """
    b, t = tokens_BxT.shape
    if not 1 <= prompt_len < t or group_size < 1 or b % group_size:
        raise ValueError(
            f"shared_prompt_logp: prompt_len={prompt_len} must be in [1, {t}) and "
            f"group_size={group_size} must divide the {b} rows"
        )
    n = t - prompt_len
    prompt_GxP = tokens_BxT[::group_size, :prompt_len]
    prompt_valid_GxP = valid_BxT[::group_size, :prompt_len]
    prompt_out = model_lib.apply(
        params,
        config,
        prompt_GxP,
        None,
        prompt_valid_GxP,
        hidden_only=True,
        return_kv=True,
        return_routing=router,
    )
    sums = None
    if router:  # each prompt stands for its group's rows
        prompt_out, routing = prompt_out
        sums = _routing_sums(config, routing, prompt_valid_GxP, None).scaled(group_size)
    hidden_GxPxE, (k_LxGxKxPxD, v_LxGxKxPxD) = prompt_out
    groups = prompt_GxP.shape[0]
    group_B = jnp.arange(b) // group_size
    completion_valid = valid_BxT[:, prompt_len:]
    prompt_count_B = jnp.sum(prompt_valid_GxP, axis=-1, dtype=jnp.int32)[group_B]
    positions = prompt_count_B[:, None] + jnp.cumsum(completion_valid, axis=-1) - 1
    # Column 0: the prompt's last column predicts the first completion token.
    targets = tokens_BxT[:, prompt_len - 1 :]
    head = model_lib.head_weight(params, config)
    blocks = length_blocks if length_blocks > 1 and b % length_blocks == 0 else 1
    widths = sorted({n} if blocks == 1 else {max(1, -(-n // k)) for k in (8, 4, 2, 1)})

    def run(width, rows_R, group_R):
        """[R, N + 1] log-probs (and entropies) of rows `rows_R` over `width` columns."""
        # Rows in the batch's own order continue their group's prompt by a repeat; rows
        # sorted by length pick it (`Prefix`).
        pick = None if group_R is None else jax.nn.one_hot(group_R, groups, dtype=jnp.float32)
        prefix = model_lib.Prefix(k_LxGxKxPxD, v_LxGxKxPxD, prompt_valid_GxP, pick)
        rows = b if rows_R is None else rows_R.shape[0]
        take = (lambda x: x) if rows_R is None else (lambda x: x[rows_R])  # noqa: E731
        routed_RxWxLxK = None
        if routed_experts_BxTxLxK is not None:
            routed_RxWxLxK = take(routed_experts_BxTxLxK)[:, prompt_len : prompt_len + width]
        valid_RxW = take(completion_valid)[:, :width]
        hidden_RxWxE = model_lib.apply(
            params,
            config,
            take(tokens_BxT)[:, prompt_len : prompt_len + width],
            jnp.maximum(take(positions)[:, :width], 0),
            valid_RxW,
            hidden_only=True,
            prefix=prefix,
            routed_experts_BxTxLxK=routed_RxWxLxK,
            return_routing=router,
        )
        part_sums = None
        if router:
            hidden_RxWxE, routing = hidden_RxWxE
            part_sums = _routing_sums(config, routing, valid_RxW, routed_RxWxLxK)
        last_RxE = prefix.expand(hidden_GxPxE[:, -1], rows)
        hidden = jnp.concatenate([last_RxE[:, None], hidden_RxWxE], axis=1)
        out = head_logp_entropy(
            hidden,
            head,
            take(targets)[:, : width + 1],
            temperature,
            chunk,
            with_entropy,
        )
        pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, n - width)))  # noqa: E731
        return pad(out[0]), pad(out[1]), part_sums

    if blocks == 1:
        logp, entropy, part_sums = run(n, None, None)
    else:
        length_B = jnp.sum(completion_valid, axis=-1)
        order = jnp.argsort(-length_B, stable=True)
        rows_KxR = order.reshape(blocks, b // blocks)
        need_K = jnp.max(length_B[rows_KxR], axis=-1)
        branch_K = jnp.searchsorted(jnp.asarray(widths), need_K)
        branches = [jax.checkpoint(functools.partial(run, w)) for w in widths]

        def one(_, xs):
            branch, rows_R = xs
            return None, jax.lax.switch(branch, branches, rows_R, group_B[rows_R])

        _, (logp_KxR, entropy_KxR, sums_K) = jax.lax.scan(one, None, (branch_K, rows_KxR))
        inverse = jnp.argsort(order)
        unsort = lambda x: None if x is None else x.reshape(b, n + 1)[inverse]  # noqa: E731
        logp, entropy = unsort(logp_KxR), unsort(entropy_KxR)
        part_sums = None if sums_K is None else jax.tree.map(lambda x: x.sum(0), sums_K)
    pad = lambda x: None if x is None else jnp.pad(x[:, 1:], ((0, 0), (prompt_len, 0)))  # noqa: E731
    if router:
        return pad(logp), pad(entropy), jax.tree.map(jnp.add, sums, part_sums)
    return pad(logp), pad(entropy)


MIN_BLOCKED_WIDTH = 64  # completion columns from which a step may use length blocks


@dataclasses.dataclass(frozen=True)
class SharedPrompt:
    """Rows come in groups of `group_size` sharing their first `prompt_len` columns (the
    sampler's layout), and `shared_prompt_logp` runs them in `length_blocks` blocks."""

    prompt_len: int
    group_size: int
    length_blocks: int = 1


def shares_prompts(rows: int, shared: SharedPrompt | None) -> bool:
    """Whether `policy_logp` can run a block of `rows` rows through `shared_prompt_logp`."""
    return shared is not None and shared.group_size > 1 and rows % shared.group_size == 0


def policy_logp(
    params,
    config: model_config.ModelConfig,
    tokens_BxT: jax.Array,
    valid_BxT: jax.Array,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
    shared: SharedPrompt | None = None,
    *,
    routed_experts_BxTxLxK: jax.Array | None = None,
    router: bool = False,
):
    """`shared_prompt_logp` when the rows come in whole groups sharing a prompt (prompt
    columns of the result are 0), `sequence_logp` otherwise (`shared` None). Equal on the
    completion columns either way. `routed_experts_BxTxLxK`, `router`: module doc.
    """
    moe_args = dict(routed_experts_BxTxLxK=routed_experts_BxTxLxK, router=router)
    if shares_prompts(tokens_BxT.shape[0], shared):
        return shared_prompt_logp(
            params,
            config,
            tokens_BxT,
            valid_BxT,
            shared.prompt_len,
            shared.group_size,
            temperature,
            chunk,
            with_entropy,
            shared.length_blocks,
            **moe_args,
        )
    return sequence_logp(
        params, config, tokens_BxT, valid_BxT, temperature, chunk, with_entropy, **moe_args
    )


def micro_batched_logp(
    params,
    config: model_config.ModelConfig,
    tokens_BxT: jax.Array,
    valid_BxT: jax.Array,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    n_micro: int = 1,
    layout=None,
    shared: SharedPrompt | None = None,
    *,
    routed_experts_BxTxLxK: jax.Array | None = None,
    router: bool = False,
):
    """`policy_logp` without gradient, `n_micro` groups of rows at a time (`lax.map`).

    With `shared` (rows in groups sharing a prompt, as the sampler writes them) each part
    holds whole groups and runs every prompt once. `layout` (`placement.Layout`) keeps
    each part's rows sharded like the batch's. `routed_experts_BxTxLxK`, `router`: module
    doc (the parts' `moe.RoutingSums` summed).
    """
    rows = tokens_BxT.shape[0]
    block = shared.group_size if shares_prompts(rows // n_micro, shared) else 1
    shared = shared if block > 1 else None

    def one(xs):
        tokens, valid, routed = xs
        return policy_logp(
            params,
            config,
            tokens,
            valid,
            temperature,
            chunk,
            True,
            shared,
            routed_experts_BxTxLxK=routed,
            router=router,
        )

    xs = (tokens_BxT, valid_BxT, routed_experts_BxTxLxK)
    if n_micro == 1:
        return jax.lax.stop_gradient(one(xs))
    constrain = layout.rows if layout is not None else (lambda x, row_axis=0: x)
    split = lambda x: constrain(split_rows(x, n_micro, block), 1)  # noqa: E731
    parts = jax.lax.map(one, jax.tree.map(split, xs))
    merged = jax.tree.map(lambda x: merge_rows(x, block), parts[:2])
    if router:  # the parts' sums added up
        merged = (*merged, jax.tree.map(lambda x: x.sum(0), parts[2]))
    return jax.lax.stop_gradient(merged)
