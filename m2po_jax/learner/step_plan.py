"""What one train step runs, decided from static settings before anything is traced.

The step needs the proximal log-probs (the policy at the start of the step) for the
decoupled loss and the M2PO mask. Where they come from decides whether the step runs a
forward pass the loss does not need:

    prox_source   where the proximal log-probs come from
      "pass"        a forward pass without gradient over the batch before the updates
      "loss"        the loss's own forward pass, gradient stopped: with one PPO minibatch
                    the current params are the proximal ones, so this is exact
      "loglinear"   AReaL's approximation inside the loss pass (`proximal.loglinear_prox`)
      "behav"       the behaviour log-probs (`actor.recompute_logprob=False`)
    mask_at       where the M2PO mask is taken
      "none"        M2PO off, or the capped-clip rule (it clips instead of masking)
      "prepare"     on the whole batch, before the updates
      "minibatch"   on each minibatch, before its micro-batches are split
      "loss"        inside each loss pass (one micro-batch or the whole minibatch)

The mask needs the proximal log-probs of the whole block it is taken on before any of
that block's loss. So prox comes from the loss pass only where the mask is taken there:
with M2PO off, with `m2po_scope="microbatch"`, or when the block is one micro-batch (a
minibatch of one micro-batch under scopes "minibatch" and "row"; the batch when it is one).
The capped-clip rule needs its bound before the loss: always "pass".

`block` is the number of consecutive rows the minibatch permutation and the micro-batch
split keep together: `group_size` when rows come in groups sharing a prompt and the
counts divide, so that the loss pass can run each prompt once
(`logprobs.shared_prompt_logp`).
"""

from __future__ import annotations

import dataclasses

from m2po_jax.common.config_schema import ActorSection
from m2po_jax.common.types import PromptGroups
from m2po_jax.learner import batching, logprobs


@dataclasses.dataclass(frozen=True)
class StepPlan:
    n_minibatches: int
    n_micro: int  # micro-batches per minibatch
    prox_source: str  # "pass" | "loss" | "loglinear" | "behav"
    mask_at: str  # "none" | "prepare" | "minibatch" | "loss"
    perm_block: int  # rows the minibatch permutation keeps together
    micro_block: int  # rows the micro-batch split keeps together
    loss_prompt: logprobs.SharedPrompt | None  # how the loss pass shares prompts, or None
    approx_metrics: bool  # report the loglinear approximation's error (method "metrics")
    batch_prompt: logprobs.SharedPrompt | None = None  # passes over the batch's own order

    @property
    def length_blocks(self) -> int:
        """Blocks of rows by completion length in the loss pass (1: whole rows)."""
        return self.loss_prompt.length_blocks if self.loss_prompt is not None else 1

    @property
    def prox_pass(self) -> bool:
        """Whether the step runs a forward pass only for the proximal log-probs."""
        return self.prox_source == "pass"

    @property
    def prox_recomputed(self) -> bool:
        """Whether the proximal log-probs are the trainer's own at the step's start (a pass
        or the loss pass), not the behaviour ones or an approximation."""
        return self.prox_source in ("pass", "loss")

    @property
    def prox_in_loss(self) -> bool:
        """Whether the loss pass takes the proximal log-probs (none are known before it)."""
        return self.prox_source in ("loss", "loglinear")


def m2po_masks(actor: ActorSection) -> bool:
    """M2PO on and masking (the capped-clip rule clips the ratio instead)."""
    return actor.m2_threshold is not None and actor.m2po_stop_rule != "capped_clip"


def m2po_level(actor: ActorSection) -> str:
    """Which blocks the mask is taken on: "batch", "minibatch" or "microbatch".

    Per minibatch when the scope says so or when the second moment needs the current
    policy, which changes after each minibatch's update (then scopes "global" and
    "shard" mean the minibatch and its shards). Without a mask: once, on the batch.
    """
    if not m2po_masks(actor):
        return "batch"
    if actor.m2po_scope == "microbatch":
        return "microbatch"
    if actor.m2po_scope == "minibatch" or actor.m2po_second_moment != "behav_prox":
        return "minibatch"
    return "batch"


def plan_step(
    actor: ActorSection,
    rows: int,
    seq_len: int,
    *,
    groups: PromptGroups | None = None,
    fuse_prox: bool = True,
    batch_shards: int = 1,
    blocks_pay=None,
) -> StepPlan:
    """The plan for a batch of `rows` x `seq_len` (see the module doc).

    `groups`: the batch's rows come in groups sharing their prompt columns (the sampler's
    layout); None: no such promise.
    `fuse_prox=False` keeps the separate proximal pass wherever the method recomputes
    (the reference the fused paths are tested against). `batch_shards`: the devices the
    rows are split over (data x fsdp); length blocks run only where every block splits
    evenly over them (see `length_blocks`). `blocks_pay(rows, seq_len, prompt_len,
    blocks) -> bool` (`memory.length_blocks_pay` bound to the model and mesh): whether
    blocks of a micro-batch hold less than whole rows; None: they are taken to.
    """
    n_mb = actor.ppo_n_minibatches
    mb = actor.mb_spec
    n_micro = batching.micro_batch_count(rows // n_mb, seq_len, mb.n_mbs, mb.max_tokens_per_mb)
    source, mask_at = prox_and_mask(actor, n_micro, fuse_prox)
    group_size = 1 if groups is None else groups.group_size
    perm_block = group_size if group_size > 1 and rows % (n_mb * group_size) == 0 else 1
    micro_rows = rows // n_mb
    micro_block = perm_block if micro_rows % (n_micro * perm_block) == 0 else 1
    rows_micro = micro_rows // n_micro
    prompt = shared_prompt(groups, rows_micro, seq_len, batch_shards, blocks_pay)
    shared = (
        perm_block > 1
        and (n_micro == 1 or micro_block > 1)
        and logprobs.shares_prompts(rows_micro, prompt)
    )
    return StepPlan(
        n_minibatches=n_mb,
        n_micro=n_micro,
        prox_source=source,
        mask_at=mask_at,
        perm_block=perm_block,
        micro_block=micro_block,
        loss_prompt=prompt if shared else None,
        approx_metrics=actor.prox_logp_method == "metrics" and source != "behav",
        batch_prompt=prompt,
    )


def prox_and_mask(actor: ActorSection, n_micro: int, fuse_prox: bool) -> tuple[str, str]:
    """(`prox_source`, `mask_at`) for minibatches of `n_micro` micro-batches."""
    n_mb = actor.ppo_n_minibatches
    level = m2po_level(actor)
    masks = m2po_masks(actor)
    capped = actor.m2_threshold is not None and actor.m2po_stop_rule == "capped_clip"
    # Can the mask wait for the loss pass, i.e. is its block one loss pass?
    mask_in_loss_ok = (
        not masks
        or level == "microbatch"
        or (n_micro == 1 and (level == "minibatch" or n_mb == 1 or actor.m2po_scope == "row"))
    )
    if not actor.recompute_logprob:
        source = "behav"
    elif capped or not mask_in_loss_ok:
        source = "pass"
    elif actor.prox_logp_method == "loglinear":
        source = "loglinear"
    elif fuse_prox and n_mb == 1:
        source = "loss"
    else:
        source = "pass"
    if not masks:
        mask_at = "none"
    elif source in ("loss", "loglinear") or level == "microbatch":
        mask_at = "loss"
    elif level == "minibatch":
        mask_at = "loss" if n_micro == 1 else "minibatch"
    else:
        mask_at = "prepare"
    return source, mask_at


def shared_prompt(
    groups: PromptGroups | None, rows: int, seq_len: int, batch_shards: int, blocks_pay
) -> logprobs.SharedPrompt | None:
    """How a pass over `rows` rows of a micro-batch shares prompts (None: rows carry no
    group promise), with the length blocks that split evenly and pay (`plan_step`)."""
    if groups is None or not (groups.prompt_len and groups.group_size):
        return None
    prompt_len = groups.prompt_len
    blocks = length_blocks(rows, seq_len - prompt_len, batch_shards)
    if blocks > 1 and blocks_pay is not None:
        blocks = blocks if blocks_pay(rows, seq_len, prompt_len, blocks) else 1
    return logprobs.SharedPrompt(prompt_len, groups.group_size, blocks)


LENGTH_BLOCKS = 8


def length_blocks(rows: int, width: int, batch_shards: int = 1) -> int:
    """Blocks of rows by completion length for a pass over `rows` rows of `width`
    completion columns: `LENGTH_BLOCKS`, or 1 (whole rows).

    Blocks from `logprobs.MIN_BLOCKED_WIDTH` columns on (below that a block skips few
    columns, and its four branches make the trunk's program four times as long to
    compile), and only where each block's rows split evenly over the `batch_shards`
    devices. A block of fewer rows than devices cannot be split over them: every device
    would run the whole block (the Qwen2.5-7B preset, one row per device per
    micro-batch, needed 54 GiB of temporaries per device with blocks against 18 without).
    `plan_step` also asks whether they pay in memory (`memory.length_blocks_pay`).
    """
    if width < logprobs.MIN_BLOCKED_WIDTH or rows % (LENGTH_BLOCKS * batch_shards):
        return 1
    return LENGTH_BLOCKS
