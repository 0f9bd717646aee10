"""Jit-compiled autoregressive sampling with a KV cache into fixed-shape buffers.

One call of `generate` = one prefill per prompt (its cache shared by the prompt's samples)
plus a `jax.lax.while_loop` that decodes a token per iteration and exits once every row has
emitted a stop token (or at `max_new_tokens`). Shapes are fixed: no recompiles.

Output layout (`SampleOutput`), T = P + max_new_tokens:

    tokens_BxT  = [left pad | prompt | completion (stop token included) | right pad]

Completions always start at column P. Behaviour log-probs follow the SGLang default that
AReaL trains against: `log_softmax(logits / temperature)` at the sampled token, taken
*before* top-k / top-p truncation (the truncated distribution is used only to draw the
token). With top-k and top-p off, this is exactly the distribution the token was drawn
from, and `model.token_logp(apply(params, config, tokens_BxT, valid_BxT=valid_BxT),
tokens_BxT, temperature)` reproduces it. Greedy decoding records the same
`logits / temperature` log-prob (use `temperature=1.0` for the plain model distribution).

Routing replay (`SamplingConfig.record_experts`, a mixture of experts): each generated
token's experts in every layer, from the decode step that fed it into the model, as
`experts_BxTxLxK` (int16, -1 at prompt columns, padding and the last token, which no step
feeds); the trainer's passes replay them (`model.apply(routed_experts_BxTxLxK=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding


@flax.struct.dataclass
class SampleOutput:
    """Rollouts of one `generate` call; B = prompts * n_samples, T = P + max_new_tokens."""

    tokens_BxT: jax.Array  # int32: [left pad | prompt | completion | right pad]
    valid_BxT: jax.Array  # bool: real tokens (prompt and generated, stop token included)
    behav_logp_BxT: (
        jax.Array
    )  # float32: log_softmax(logits / temperature) at generated tokens, 0 elsewhere
    completion_mask_BxT: jax.Array  # bool: generated tokens (stop token included)
    prompt_len_B: jax.Array  # int32: real prompt tokens
    completion_len_B: jax.Array  # int32: generated tokens, stop token included
    stopped_B: jax.Array  # bool: the row ended with a stop token
    num_steps: jax.Array  # int32 scalar: token positions decoded (< max_new_tokens on early exit)
    # int16 [B, T, L, K]: each generated token's experts per layer from the pass that fed
    # it (-1 elsewhere); None unless `SamplingConfig.record_experts`
    experts_BxTxLxK: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static decoding settings (hashable: a jit static argument).

    Attributes:
      max_new_tokens: completion buffer width; rows stop after this many tokens.
      temperature: logits are divided by it before sampling and before recording log-probs.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus sampling, keep the smallest prefix of the sorted distribution whose mass
        reaches top_p (1.0 = off). Applied after top-k, on the renormalised distribution.
      greedy: take the argmax (top-k and top-p are ignored).
      stop_token_ids: a row ends after emitting any of these (the stop token is kept).
      pad_id: token written after a row has ended.
      record_experts: a mixture of experts: record each generated token's experts per
        layer (`SampleOutput.experts_BxTxLxK`, for routing replay).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    pad_id: int = 0
    record_experts: bool = False

    def __post_init__(self):
        # Lists would make the config unhashable (and so unusable as a static jit argument).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_settings(self, "")


def _check_settings(settings, where: str) -> None:
    """Ranges of the decoding settings; errors name `<where>.<field>` (or the bare field)."""
    at = f"{where}." if where else ""
    if int(settings.max_new_tokens) < 1:
        raise ValueError(f"{at}max_new_tokens: must be >= 1, got {settings.max_new_tokens}")
    if not settings.temperature > 0:
        raise ValueError(
            f"{at}temperature: must be > 0, got {settings.temperature} (use greedy=True for argmax)"
        )
    if int(settings.top_k) < 0:
        raise ValueError(f"{at}top_k: must be >= 0 (0 = off), got {settings.top_k}")
    if not 0.0 < settings.top_p <= 1.0:
        raise ValueError(f"{at}top_p: must be in (0, 1], got {settings.top_p}")


def from_gconfig(
    gconfig, stop_token_ids: Sequence[int] = (), pad_id: int = 0, where: str = "gconfig"
) -> SamplingConfig:
    """The decoding settings of a `gconfig` config section (the one builder of both
    `config.validate`, which has no tokenizer yet, and the trainer).

    Args:
      gconfig: has max_new_tokens, temperature, top_k, top_p and greedy.
      stop_token_ids: the tokenizer's end-of-sequence ids.
      pad_id: the tokenizer's padding id.
      where: the section's name in errors.
    """
    _check_settings(gconfig, where)
    return SamplingConfig(
        max_new_tokens=gconfig.max_new_tokens,
        temperature=gconfig.temperature,
        top_k=gconfig.top_k,
        top_p=gconfig.top_p,
        greedy=gconfig.greedy,
        stop_token_ids=tuple(stop_token_ids),
        pad_id=pad_id,
    )


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists to a common width.

    Args:
      prompts: one non-empty list of token ids per prompt.
      pad_id: id written into the padding.
      width: output width P; defaults to the longest prompt.

    Returns:
      (tokens_BxP int32, valid_BxP bool) numpy arrays, real tokens right-aligned.
    """
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt, got an empty list")
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompts: prompt {lengths.index(0)} is empty; every prompt needs a token")
    width = max(lengths) if width is None else width
    if max(lengths) > width:
        raise ValueError(f"width: {width} is shorter than the longest prompt ({max(lengths)})")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    valid = np.zeros((len(prompts), width), bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = prompt
        valid[row, width - len(prompt) :] = True
    return tokens, valid


def sample_token(
    logits_BxV: jax.Array, rng: jax.Array, sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row and its behaviour log-prob.

    behav_logp = log_softmax(logits / temperature)[token], before top-k / top-p truncation.

    Args:
      logits_BxV: next-token logits.
      rng: PRNG key (unused when greedy), or one typed key per row (shape [B]).
      sampling: static settings.

    Returns:
      (token_B int32, behav_logp_B float32).
    """
    scaled_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
    logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
    if sampling.greedy:
        token_B = jnp.argmax(scaled_BxV, axis=-1)
    else:
        token_B = _inverse_cdf_draw(_truncate(scaled_BxV, sampling), rng)
    token_B = token_B.astype(jnp.int32)
    behav_logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
    return token_B, behav_logp_B


def _inverse_cdf_draw(scaled_BxV: jax.Array, rng: jax.Array) -> jax.Array:
    """One categorical draw per row from softmax(scaled_BxV) by inverting its CDF.

    token = first v with cdf[v] > u * cdf[V - 1], u ~ U[0, 1). One uniform per row instead of
    the V Gumbel draws of `jax.random.categorical`, whose random bits dominated a decode step's
    sampling cost. A token of probability 0 (-inf logit) never has the first cdf value above
    the threshold, so truncated tokens cannot be drawn.
    """
    probs_BxV = jnp.exp(scaled_BxV - jnp.max(scaled_BxV, axis=-1, keepdims=True))
    cdf_BxV = jnp.cumsum(probs_BxV, axis=-1)
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == scaled_BxV.shape[:1]:
        u_B = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(rng)
    else:
        u_B = jax.random.uniform(rng, scaled_BxV.shape[:1], jnp.float32)
    return jnp.argmax(cdf_BxV > (u_B * cdf_BxV[:, -1])[:, None], axis=-1)


def _truncate(scaled_BxV: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Sets logits outside the top-k / top-p set to -inf (ties at the threshold are kept)."""
    vocab = scaled_BxV.shape[-1]
    use_top_k = 0 < sampling.top_k < vocab
    if not use_top_k and sampling.top_p >= 1.0:
        return scaled_BxV
    # lax.top_k returns values sorted descending, which top-p needs anyway.
    k = sampling.top_k if use_top_k else vocab
    sorted_BxK, _ = jax.lax.top_k(scaled_BxV, k)
    threshold_B = sorted_BxK[:, -1]
    if sampling.top_p < 1.0:
        probs_BxK = jax.nn.softmax(sorted_BxK, axis=-1)
        mass_before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
        # The most likely token is always kept (mass before it is 0 < top_p).
        keep_BxK = mass_before_BxK < sampling.top_p
        threshold_B = jnp.min(jnp.where(keep_BxK, sorted_BxK, jnp.inf), axis=-1)
    return jnp.where(scaled_BxV >= threshold_B[:, None], scaled_BxV, -jnp.inf)


SMALLEST_BUCKET = 128  # attention widths of decode steps: 128, 256, ... then the whole cache


def decode_buckets(prompt_width: int, total: int) -> tuple[int, ...]:
    """The attention widths a decode step over a `total`-column cache may use
    (`model.Columns`): the powers of two from `SMALLEST_BUCKET` that exceed the prompt's
    `prompt_width` columns and are below `total`, then `total`. One width for short
    completions (then no branch at all). A 544-column cache whose rows hold ~200 columns
    reads 256 instead of 544."""
    widths, width = [], SMALLEST_BUCKET
    while width < total:
        if width > prompt_width:
            widths.append(width)
        width *= 2
    return (*widths, total)


EXPERTS_DTYPE = jnp.int16  # recorded experts (routing replay); -1 = not recorded


def no_experts(model_config: model_config_lib.ModelConfig, *dims: int) -> jax.Array:
    """An experts record [*dims, L, K] with nothing recorded (-1 everywhere)."""
    shape = (*dims, model_config.num_layers, model_config.num_experts_per_tok)
    return jnp.full(shape, -1, EXPERTS_DTYPE)


def fed_experts(routing, live_B: jax.Array) -> jax.Array:
    """The experts [B, L, K] (`EXPERTS_DTYPE`) a one-column step's fed tokens ran, from
    `model.apply(..., return_routing=True)`'s routing; -1 on rows not `live_B`."""
    experts_BxLxK = routing[1][:, 0].astype(EXPERTS_DTYPE)
    return jnp.where(live_B[:, None, None], experts_BxLxK, -1)


@flax.struct.dataclass
class _DecodeState:
    step: jax.Array  # int32 scalar: index of the completion column decoded next
    tokens_BxN: jax.Array
    logp_BxN: jax.Array
    valid_BxN: jax.Array
    last_token_B: jax.Array  # token at column step - 1, fed to the next forward
    last_valid_B: jax.Array
    stopped_B: jax.Array
    cache: model_lib.KVCache
    experts_BxNxLxK: jax.Array | None = None  # with `record_experts`


def _write_column(buffer_BxN: jax.Array, column: jax.Array, values_B: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer_BxN, values_B[:, None], column, axis=1)


def is_stop(token_B: jax.Array, stop_token_ids: tuple[int, ...]) -> jax.Array:
    """Whether each token is one of the stop tokens."""
    if not stop_token_ids:
        return jnp.zeros(token_B.shape, bool)
    return jnp.any(token_B[:, None] == jnp.asarray(stop_token_ids, jnp.int32)[None, :], axis=-1)


# Long on purpose: the prefill, the first draw, the decode loop and the output layout of one
# jitted program; the loop's body closes over the prefill's widths, buckets and key, and
# reads top to bottom as the sampler runs.
@functools.partial(jax.jit, static_argnames=("model_config", "sampling", "n_samples"))
def _generate(
    params,
    prompt_tokens_BxP: jax.Array,
    prompt_valid_BxP: jax.Array,
    rng: jax.Array,
    *,
    model_config: model_config_lib.ModelConfig,
    sampling: SamplingConfig,
    n_samples: int,
) -> SampleOutput:
    """The jitted body of `generate` (inputs already validated)."""
    prompt_tokens_GxP = prompt_tokens_BxP.astype(jnp.int32)
    prompt_valid_GxP = prompt_valid_BxP.astype(bool)
    tokens_BxP = jnp.repeat(prompt_tokens_GxP, n_samples, axis=0)
    valid_BxP = jnp.repeat(prompt_valid_GxP, n_samples, axis=0)
    batch, width = tokens_BxP.shape
    max_new = sampling.max_new_tokens
    prompt_len_B = jnp.sum(valid_BxP, axis=-1, dtype=jnp.int32)

    # One prefill per prompt, not per sample: its cache is then repeated for the samples.
    cache = model_lib.init_cache(model_config, prompt_tokens_GxP.shape[0], width + max_new)
    # Left padding puts each row's last prompt token in the last column: the head runs there.
    logits_Gx1xV, cache = model_lib.apply(
        params,
        model_config,
        prompt_tokens_GxP,
        model_lib.make_positions(prompt_valid_GxP),
        prompt_valid_GxP,
        cache,
        0,
        last_only=True,
    )
    repeat = functools.partial(jnp.repeat, repeats=n_samples, axis=0)
    logits_Bx1xV, cache = jax.tree.map(repeat, (logits_Gx1xV, cache))
    token_B, logp_B = sample_token(logits_Bx1xV[:, 0], jax.random.fold_in(rng, 0), sampling)
    zeros_BxN = jnp.zeros((batch, max_new), jnp.int32)
    state = _DecodeState(
        step=jnp.int32(1),
        tokens_BxN=_write_column(zeros_BxN + sampling.pad_id, 0, token_B),
        logp_BxN=_write_column(jnp.zeros((batch, max_new), jnp.float32), 0, logp_B),
        valid_BxN=_write_column(jnp.zeros((batch, max_new), bool), 0, jnp.ones(batch, bool)),
        last_token_B=token_B,
        last_valid_B=jnp.ones(batch, bool),
        stopped_B=is_stop(token_B, sampling.stop_token_ids),
        cache=cache,
        experts_BxNxLxK=no_experts(model_config, batch, max_new)
        if sampling.record_experts
        else None,
    )

    def cond(state: _DecodeState) -> jax.Array:
        return (state.step < max_new) & ~jnp.all(state.stopped_B)

    widths = decode_buckets(width, width + max_new)

    def body(state: _DecodeState) -> _DecodeState:
        i = state.step
        # Feed the previous token; finished rows feed pad, marked invalid in the cache.
        # Its query, at column width + i - 1, reads columns 0 .. width + i - 1.
        out = model_lib.apply(
            params,
            model_config,
            state.last_token_B[:, None],
            (prompt_len_B + i - 1)[:, None],
            state.last_valid_B[:, None],
            state.cache,
            width + i - 1,
            last_only=True,
            columns=model_lib.Columns(needed=width + i, widths=widths),
            return_routing=sampling.record_experts,
        )
        experts = state.experts_BxNxLxK
        if sampling.record_experts:  # the routing of the token this step fed (column i - 1)
            out, routing = out
            fed_BxLxK = fed_experts(routing, state.last_valid_B)
            experts = jax.lax.dynamic_update_slice_in_dim(experts, fed_BxLxK[:, None], i - 1, 1)
        logits_Bx1xV, cache = out
        token_B, logp_B = sample_token(logits_Bx1xV[:, 0], jax.random.fold_in(rng, i), sampling)
        active_B = ~state.stopped_B
        token_B = jnp.where(active_B, token_B, sampling.pad_id)
        logp_B = jnp.where(active_B, logp_B, 0.0)
        return _DecodeState(
            step=i + 1,
            tokens_BxN=_write_column(state.tokens_BxN, i, token_B),
            logp_BxN=_write_column(state.logp_BxN, i, logp_B),
            valid_BxN=_write_column(state.valid_BxN, i, active_B),
            last_token_B=token_B,
            last_valid_B=active_B,
            stopped_B=state.stopped_B | (active_B & is_stop(token_B, sampling.stop_token_ids)),
            cache=cache,
            experts_BxNxLxK=experts,
        )

    state = jax.lax.while_loop(cond, body, state)
    no_completion_BxP = jnp.zeros((batch, width), bool)
    return SampleOutput(
        tokens_BxT=jnp.concatenate([tokens_BxP, state.tokens_BxN], axis=1),
        valid_BxT=jnp.concatenate([valid_BxP, state.valid_BxN], axis=1),
        behav_logp_BxT=jnp.concatenate(
            [jnp.zeros((batch, width), jnp.float32), state.logp_BxN], axis=1
        ),
        completion_mask_BxT=jnp.concatenate([no_completion_BxP, state.valid_BxN], axis=1),
        prompt_len_B=prompt_len_B,
        completion_len_B=jnp.sum(state.valid_BxN, axis=-1, dtype=jnp.int32),
        stopped_B=state.stopped_B,
        num_steps=state.step,
        experts_BxTxLxK=None
        if state.experts_BxNxLxK is None
        else jnp.concatenate([no_experts(model_config, batch, width), state.experts_BxNxLxK], 1),
    )


def generate(
    params,
    model_config: model_config_lib.ModelConfig,
    prompt_tokens_BxP: jax.typing.ArrayLike,
    prompt_valid_BxP: jax.typing.ArrayLike,
    rng: jax.Array,
    sampling: SamplingConfig,
    n_samples: int = 1,
) -> SampleOutput:
    """Samples `n_samples` completions per left-padded prompt.

    Rows b * n_samples .. b * n_samples + n_samples - 1 of the output answer prompt b.
    Compiled once per (shapes, model_config, sampling, n_samples).

    Args:
      params: model params (`model.init_params` or `hf.load_pretrained(...).params`).
      model_config: static architecture.
      prompt_tokens_BxP: int prompt ids, left-padded (see `pad_prompts`).
      prompt_valid_BxP: bool, True on real prompt tokens; each row needs at least one,
        and its real tokens must end in the last column.
      rng: PRNG key; the same key gives the same tokens.
      sampling: static decoding settings.
      n_samples: completions per prompt.

    Returns:
      A `SampleOutput` with B = prompts * n_samples rows and T = P + max_new_tokens columns.
    """
    check_inputs(model_config, sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples)
    return _generate(
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        model_config=model_config,
        sampling=sampling,
        n_samples=int(n_samples),
    )


def generate_program(
    model_config: model_config_lib.ModelConfig,
    sampling: SamplingConfig,
    n_samples: int,
    mesh: jax.sharding.Mesh | None = None,
):
    """`generate`'s jitted program, traced with `mesh` in context (`sharding.on_mesh`), for
    compiling ahead of a run: called as (params, prompt_tokens_BxP, prompt_valid_BxP, rng)."""
    fn = functools.partial(
        _generate.__wrapped__, model_config=model_config, sampling=sampling, n_samples=n_samples
    )
    return jax.jit(sharding.on_mesh(fn, mesh))


def check_inputs(model_config, sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples) -> None:
    """Raises a one-line error on what `generate` (or a rollout engine) cannot take."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling: expected a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(model_config, model_config_lib.ModelConfig):
        raise TypeError(f"model_config: expected a ModelConfig, got {type(model_config).__name__}")
    if not isinstance(n_samples, int | np.integer) or n_samples < 1:
        raise ValueError(f"n_samples: expected a positive int, got {n_samples!r}")
    tokens_shape, valid_shape = np.shape(prompt_tokens_BxP), np.shape(prompt_valid_BxP)
    if len(tokens_shape) != 2 or tokens_shape[0] == 0 or tokens_shape[1] == 0:
        raise ValueError(
            f"prompt_tokens_BxP: expected a non-empty [batch, width] array, got shape {tokens_shape}"
        )
    if valid_shape != tokens_shape:
        raise ValueError(
            f"prompt_valid_BxP: shape {valid_shape} must equal prompt_tokens_BxP's {tokens_shape}"
        )
    if not jnp.issubdtype(jnp.result_type(prompt_tokens_BxP), jnp.integer):
        raise TypeError(
            f"prompt_tokens_BxP: expected integer token ids, got {jnp.result_type(prompt_tokens_BxP)}"
        )
    if jnp.result_type(prompt_valid_BxP) != jnp.bool_:
        raise TypeError(f"prompt_valid_BxP: expected bool, got {jnp.result_type(prompt_valid_BxP)}")
    if sampling.record_experts and not model_config.is_moe:
        raise ValueError(
            f"sampling: record_experts needs a mixture of experts; {model_config.model_type} "
            "is dense"
        )
    for token_id in (*sampling.stop_token_ids, sampling.pad_id):
        if not 0 <= token_id < model_config.vocab_size:
            raise ValueError(
                f"sampling: token id {token_id} is outside the vocabulary [0, {model_config.vocab_size})"
            )
    _check_left_padded(prompt_valid_BxP)
    model_lib.check_token_ids(prompt_tokens_BxP, model_config.vocab_size, "prompt_tokens_BxP")


def _check_left_padded(prompt_valid_BxP: jax.typing.ArrayLike) -> None:
    """Raises unless every row's real tokens are a non-empty run ending in the last column."""
    valid_BxP = model_lib.host_value(prompt_valid_BxP)
    if valid_BxP is None:
        return
    # Left padded <=> valid never goes from True back to False, and the last column is real.
    bad_B = ~valid_BxP[:, -1] | np.any(valid_BxP[:, :-1] & ~valid_BxP[:, 1:], axis=-1)
    if bad_B.any():
        raise ValueError(
            f"prompt_valid_BxP: rows {np.flatnonzero(bad_B).tolist()} are not left-padded "
            "non-empty prompts (real tokens must be contiguous and end in the last column)"
        )
