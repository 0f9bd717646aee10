"""Mutation testing of the suite: does a realistic bug in the code fail its tests?

  python benchmarks/mutants.py --list                          # the mutants, nothing run
  python benchmarks/mutants.py --modules m2po_jax/learner/optim.py,m2po_jax/models/prompts.py
  python benchmarks/mutants.py --ids masking-harmful-noncandidates-masked --timeout 300
  python benchmarks/mutants.py                                 # every mutant (long)

Each mutant (`MUTANTS`) is one realistic bug: an exact source snippet of a module, the
snippet that replaces it, and the tests that should catch it. A snippet must occur exactly
once in its module; the script refuses to run (naming the mutant) when one occurs 0 or 2+
times, so the list stays honest as the code changes (tests/e2e/mutants_test.py checks it).

A run first copies the repository to a temporary directory (no .venv, .git, runs/ or
caches) and runs the union of the selected mutants' tests there unmutated: a mutant
"caught" by tests that fail anyway means nothing, so the run stops if they fail. Then, for
each mutant, a fresh copy gets the mutant applied and runs

  python -m pytest -x -q -p no:cacheprovider <its tests>

with PYTHONPATH=<copy> (the copy's m2po_jax is imported, not the editable install).
Results: caught (a test failed), survived (every test passed), or error (timeout,
collection or usage error, no such test file, tests that select nothing: reported
separately, never counted as caught). A mutant whose tests are partly missing is still
caught if the existing ones fail; if they pass it is an error, not a survivor. The table
gives id, module, result, seconds and the first failing test, then the score
caught / total. Exit status: 1 if any mutant survived, 2 if the run could not be made
(a broken mutant, failing clean tests), else 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Not copied: the virtualenv, git, run outputs and caches (ignored by .gitignore too).
# Run outputs only at the top: m2po_jax/run/workdir.py is code.
TOP_IGNORE = ("runs", "workdir*", "build")
COPY_IGNORE = (
    ".git",
    ".venv*",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".mypy_cache",
    "*.egg-info",
    "*.pyc",
)
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


@dataclasses.dataclass(frozen=True)
class Tests:
    """Tests of a mutant: a test file or node id (`path::name`), optionally with `-k`."""

    path: str
    k: str | None = None

    @property
    def file(self) -> str:
        return self.path.split("::", 1)[0]

    def __str__(self) -> str:
        return self.path if self.k is None else f"{self.path} -k {self.k!r}"


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    module: str  # path relative to the repository root
    original: str  # exact source snippet: occurs exactly once in `module`
    mutated: str
    tests: tuple[Tests, ...]
    description: str


def T(path: str, k: str | None = None) -> Tests:
    return Tests(path, k)


MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ the train step
    Mutant(
        "train_step-finite-guard-loss-only",
        "m2po_jax/learner/train_step.py",
        "finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)",
        "finite = jnp.isfinite(loss)",
        (T("tests/learner/train_step_test.py", "non_finite"),),
        "the non-finite guard checks the loss only: a NaN/inf gradient is applied",
    ),
    Mutant(
        "advantages-kl-ctl-zero",
        "m2po_jax/algorithm/advantages.py",
        "kl_ctl=s.kl_ctl if with_kl else 0.0,",
        "kl_ctl=0.0,",
        (T("tests/learner/train_step_test.py", "kl"), T("tests/trainer/trainer_test.py", "kl")),
        "kl_ctl forced to 0 inside the step: the reference log-probs are computed, unused",
    ),
    Mutant(
        "train_step-micro-weight-uniform",
        "m2po_jax/learner/train_step.py",
        "weight = part_valid / jnp.maximum(n_valid, 1) if mask_in_loss else 1.0",
        "weight = 1.0 / plan.n_micro if mask_in_loss else 1.0",
        (T("tests/learner/train_step_test.py", "microbatch"),),
        "micro-batch loss weight 1 / n_micro instead of its share of valid tokens",
    ),
    Mutant(
        "train_step-kept-count-is-valid",
        "m2po_jax/learner/train_step.py",
        'count = jnp.sum(mb.mask_BxT if s.loss.denominator == "kept" else mb.loss_mask_BxT)',
        "count = jnp.sum(mb.loss_mask_BxT)",
        (T("tests/learner/train_step_test.py", "kept_denominator"),),
        "the step's 'kept' loss denominator counts valid tokens (before M2PO) instead",
    ),
    Mutant(
        "step_metrics-plain-mean",
        "m2po_jax/learner/step_metrics.py",
        "out[name] = jnp.sum(values * share)",
        "out[name] = jnp.mean(values)",
        (
            T("tests/learner/step_metrics_test.py"),
            T("tests/learner/train_step_test.py", "statistics"),
        ),
        "minibatch / micro-batch metrics combined by a plain mean, not token-weighted",
    ),
    Mutant(
        "mismatch-fresh-includes-older-versions",
        "m2po_jax/algorithm/mismatch.py",
        "return jnp.asarray(version_BxT) == jnp.asarray(version, jnp.int32)",
        "return jnp.asarray(version_BxT) <= jnp.asarray(version, jnp.int32)",
        (
            T("tests/algorithm/mismatch_test.py"),
            T("tests/learner/step_paths_test.py", "mismatch"),
        ),
        "fresh tokens defined as version <= the step's: stale tokens count as engine mismatch",
    ),
    Mutant(
        "mismatch-drop-alone-masks-every-token",
        "m2po_jax/learner/step_math.py",
        "s.mask, behav, prox, loss_mask & fresh, adv, logp, mesh",
        "s.mask, behav, prox, loss_mask, adv, logp, mesh",
        (T("tests/learner/step_paths_test.py", "mismatch"),),
        "the drop-alone mask runs over every token, not the fresh ones only",
    ),
    Mutant(
        "batching-trim-drops-last-column",
        "m2po_jax/learner/batching.py",
        "return int(used.nonzero()[0].max()) + 1 if used.any() else 0",
        "return int(used.nonzero()[0].max()) if used.any() else 0",
        (T("tests/learner/batching_test.py"),),
        "off-by-one in the longest completion: a completion ending at a bucket edge loses "
        "its last column",
    ),
    # ------------------------------------------------------------------ async rollouts
    Mutant(
        "staleness-one-batch-too-many",
        "m2po_jax/rollout/staleness.py",
        "return (version + max_staleness + 1) * batch_size - (accepted + running)",
        "return (version + max_staleness + 2) * batch_size - (accepted + running)",
        (T("tests/rollout/staleness_test.py"), T("tests/rollout/worker_test.py")),
        "admission lets the worker one batch further ahead: samples trained k + 1 stale",
    ),
    Mutant(
        "staleness-resume-counts-from-zero",
        "m2po_jax/rollout/staleness.py",
        "return cls(max_staleness, batch_size, accepted=version * batch_size + buffered)",
        "return cls(max_staleness, batch_size, accepted=buffered)",
        (T("tests/rollout/staleness_test.py", "resume"),),
        "AReaL's issue 1388: a resumed run's counters forget the consumed prompts",
    ),
    Mutant(
        "async-resume-counts-batches-not-prompts",
        "m2po_jax/trainer/async_rollouts.py",
        "            self.k, self.batch_size, version, len(buffered) * self.batch_size",
        "            self.k, self.batch_size, version, len(buffered)",
        (T("tests/trainer/async_test.py", "learns_within_k"),),
        "a resumed async run counts its buffered batches as prompts: one batch too many is "
        "admitted, trained k + 1 stale",
    ),
    Mutant(
        "worker-error-before-earlier-batches",
        "m2po_jax/rollout/worker.py",
        'self._to_score.put(("failed", self._next, e, traceback.format_exc()))',
        "self._fail(e, self._next, traceback.format_exc())",
        (T("tests/rollout/worker_test.py", "exception"),),
        "a generator error overtakes the batches made before it (they are lost)",
    ),
    # ------------------------------------------------------------------ multi-turn episodes
    Mutant(
        "episodes-appended-tokens-trained",
        "m2po_jax/rollout/engines/turns.py",
        'valid_JxN=state.valid_JxN.at[drop, at[1]].set(True, mode="drop"),',
        'valid_JxN=state.valid_JxN.at[drop, at[1]].set(True, mode="drop"),\n'
        '        sampled_JxN=state.sampled_JxN.at[drop, at[1]].set(True, mode="drop"),',
        (T("tests/rollout/episodes_test.py", "rows"),),
        "a tool's appended answer is marked sampled: its tokens enter the loss mask",
    ),
    Mutant(
        "episodes-appended-version-is-the-policy",
        "m2po_jax/rollout/engines/turns.py",
        'version_JxN=state.version_JxN.at[drop, at[1]].set(-1, mode="drop"),',
        'version_JxN=state.version_JxN.at[drop, at[1]].set(version, mode="drop"),',
        (T("tests/rollout/engine_test.py", "turns"),),
        "appended tokens get the policy's version, as if sampled (staleness counts them)",
    ),
    Mutant(
        "episodes-append-positions-shifted",
        "m2po_jax/rollout/engines/turns.py",
        "positions_LxT = (state.prompt_len_S[s_L] + step_L - 1)[:, None] + t_T[None]",
        "positions_LxT = (state.prompt_len_S[s_L] + step_L)[:, None] + t_T[None]",
        (T("tests/rollout/engine_test.py", "turns"),),
        "the appended tokens are run one RoPE position too far: the cache disagrees with a "
        "forward over the row",
    ),
    Mutant(
        "episodes-env-reward-ignored",
        "m2po_jax/rollout/batches.py",
        "batch = episodes_lib.with_env_rewards(batch, sampled.episodes)",
        "batch = batch",
        (T("tests/rollout/episodes_test.py", "rows or malformed"),),
        "the environment's own rewards (and the malformed-call reward) are dropped",
    ),
    Mutant(
        "episodes-max-turns-ignored",
        "m2po_jax/rollout/episodes.py",
        "if episode.turns >= agent.max_turns:",
        "if False:",
        (T("tests/rollout/episodes_test.py", "budgets"),),
        "agent.max_turns is not enforced",
    ),
    Mutant(
        "sft-appended-segments-trained",
        "m2po_jax/trainer/sft.py",
        "t += [trained] * len(ids)",
        "t += [True] * len(ids)",
        (T("tests/rollout/episodes_test.py", "warm_up"),),
        "the warm-up trains on the tokens an environment appended, not only the assistant's",
    ),
    # ------------------------------------------------------------------ LoRA
    Mutant(
        "lora-base-trains",
        "m2po_jax/learner/train_step.py",
        "trainable, frozen = lora.split(state.params)",
        "trainable, frozen = state.params, None",
        (T("tests/models/lora_test.py", "base_bit_identical"),),
        "under LoRA the step differentiates and updates the whole model, not the adapters",
    ),
    Mutant(
        "lora-scale-inverted",
        "m2po_jax/models/model_config.py",
        "return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0",
        "return self.lora_rank / self.lora_alpha if self.lora_rank else 0.0",
        (T("tests/models/lora_test.py", "merged_model"),),
        "the adapters' product scaled by rank / alpha instead of alpha / rank",
    ),
    Mutant(
        "lora-kl-reference-is-the-policy",
        "m2po_jax/learner/train_step.py",
        "ref_params = lora.adapters_off(state.params)",
        "ref_params = state.params",
        (T("tests/models/lora_test.py", "kl_is_against_the_base"),),
        "under LoRA the KL penalty compares the policy with itself, not with the base",
    ),
    Mutant(
        "peft-export-b-untransposed",
        "m2po_jax/run/export.py",
        'yield f"{prefix}.lora_B.weight", np.ascontiguousarray(b.reshape(r, -1).T)',
        'yield f"{prefix}.lora_B.weight", np.ascontiguousarray(b.reshape(-1, r))',
        (T("tests/e2e/lora_export_test.py"),),
        "the PEFT export writes B's values in the wrong order (the shape still [out, r])",
    ),
    Mutant(
        "lora-resume-accepts-another-base",
        "m2po_jax/run/checkpoint.py",
        'if saved["hash"] != base["hash"]:',
        'if saved["path"] != base["path"]:',
        (T("tests/e2e/lora_checkpoint_test.py"),),
        "a resume checks the base's path only: another checkpoint at the same path passes",
    ),
    # ------------------------------------------------------------------ mixture of experts
    Mutant(
        "moe-expert-parallel-no-offset",
        "m2po_jax/models/moe.py",
        "first = jax.lax.axis_index(split) * gate.shape[0]",
        "first = jax.lax.axis_index(split)",
        (T("tests/models/moe_test.py", "expert_parallel"),),
        "each device's local experts taken to start at its axis index, not index x X / s",
    ),
    Mutant(
        "memory-stacked-gradients-once",
        "m2po_jax/learner/memory.py",
        "stacked_layers = copies * layer_bytes + 2 * layer_trained * tbytes",
        "stacked_layers = copies * layer_bytes + layer_trained * tbytes",
        (T("tests/learner/memory_test.py", "moe_plan_grows"),),
        "the plan counts the backward scan's stacked gradient once, not as its two carries",
    ),
    Mutant(
        "memory-gathered-experts-on-split",
        "m2po_jax/learner/memory.py",
        'if c.is_moe and not c.expert_axis and mesh.shape.get("fsdp", 1) > 1:',
        'if c.is_moe and mesh.shape.get("fsdp", 1) > 1:',
        (T("tests/learner/memory_test.py", "moe_plan"),),
        "the plan adds gathered expert weights also where the experts are split (not gathered)",
    ),
    Mutant(
        "memory-expert-split-rows-not-counted",
        "m2po_jax/learner/memory.py",
        "gathered = mesh.shape.get(c.expert_axis, 1) if c.is_moe and c.expert_axis else 1",
        "gathered = 1",
        (T("tests/models/moe_test.py", "memory_plan_counts"),),
        "the plan leaves out the routed rows of the tokens gathered over the expert axis",
    ),
    Mutant(
        "moe-unsorted-by-the-sort-order",
        "m2po_jax/models/moe.py",
        "y_NxKxE = jnp.take(y_MxE, inverse_M, axis=0).reshape(n, k, -1)",
        "y_NxKxE = jnp.take(y_MxE, order_M, axis=0).reshape(n, k, -1)",
        (T("tests/models/moe_test.py", "dense_reference or logits_match"),),
        "the experts' rows go back to their tokens through the sort's permutation instead "
        "of its inverse: tokens get other tokens' expert outputs",
    ),
    Mutant(
        "moe-balance-loss-one-layer-denominator",
        "m2po_jax/models/moe.py",
        "tokens = layers * sums.tokens",
        "tokens = sums.tokens",
        (T("tests/models/moe_test.py", "load_balancing or renormalises"),),
        "the load-balancing loss divides by one layer's tokens, not every layer's: L^2 too big",
    ),
    Mutant(
        "moe-checkpoint-experts-reversed",
        "m2po_jax/models/hf_format.py",
        'HFTensor(path, f"{hf}mlp.experts.{j}.{proj}_proj.weight", hf_shape, shape, True, j)',
        'HFTensor(path, f"{hf}mlp.experts.{j}.{proj}_proj.weight", hf_shape, shape, True, n - 1 - j)',
        (T("tests/models/moe_test.py", "logits_match or each_expert or round_trip"),),
        "checkpoint expert j loads into (and exports from) slot X-1-j: a round trip is "
        "exact, the router's choices reach the wrong experts",
    ),
    Mutant(
        "moe-lora-one-expert-s-a-for-all",
        "m2po_jax/models/moe.py",
        "low_MxR = _ragged_dot(rows_MxI, a_LxIxR, sizes_X, interpret)",
        "low_MxR = rows_MxI @ a_LxIxR[0]",
        (T("tests/models/moe_test.py", "numpy_reference or merges_to_the_same_model"),),
        "every expert's rows go through expert 0's A (a plain matmul for the grouped one): "
        "the adapters are not each expert's",
    ),
    Mutant(
        "moe-lora-merge-sums-the-experts",
        "m2po_jax/models/lora.py",
        "delta = jnp.matmul(a, b)",
        'delta = jnp.einsum("xir,yro->xio", a, b)',
        (T("tests/models/moe_test.py", "merges_to_the_same_model or lora_export"),),
        "the merge adds every expert's A_e B_e to each expert kernel (an einsum that sums "
        "over the expert axis instead of pairing it)",
    ),
    Mutant(
        "moe-replay-gates-not-renormalised",
        "m2po_jax/models/moe.py",
        "    if norm_topk_prob:\n        weights_NxK = weights_NxK / jnp.sum(",
        "    if norm_topk_prob and recorded_NxK is None:\n"
        "        weights_NxK = weights_NxK / jnp.sum(",
        (T("tests/learner/router_replay_test.py", "gates or one_expert"),),
        "replayed rows keep the raw softmax at their recorded experts (not renormalised "
        "under norm_topk_prob): a replayed forward is another function than the rollout's",
    ),
    Mutant(
        "moe-replay-sentinel-as-expert-0",
        "m2po_jax/models/moe.py",
        "experts_NxK = jnp.where(replayed_Nx1, recorded_NxK, experts_NxK)",
        "experts_NxK = jnp.maximum(recorded_NxK, 0)",
        (T("tests/learner/router_replay_test.py", "gates or recorded_experts"),),
        "the -1 sentinel is read as expert 0: prompt and padding tokens all run expert 0",
    ),
    Mutant(
        "engine-records-experts-at-the-drawn-column",
        "m2po_jax/rollout/engines/slots.py",
        "at = (job_S, state.step_S - 1)",
        "at = (job_S, state.step_S)",
        (T("tests/rollout/replay_test.py", "continuous"),),
        "a decode step records the fed token's experts at the column of the token it draws",
    ),
    # ------------------------------------------------------------------ rollout engine
    Mutant(
        "decode-bucket-one-too-small",
        "m2po_jax/models/model.py",
        "mask = mask._replace(width_index=jnp.minimum(index, len(widths) - 1))",
        "mask = mask._replace(width_index=jnp.maximum(jnp.minimum(index, len(widths) - 1) - 1, 0))",
        (T("tests/rollout/engine_test.py", "read_the_written"),),
        "a decode step reads one attention bucket less than its queries need",
    ),
    Mutant(
        "kv-dtype-rounded-only-with-a-cache",
        "m2po_jax/models/model.py",
        "        if c.kv_dtype:  # as a cache holds them, with a cache or without (attended in dt)",
        "        if c.kv_dtype and cache_kv is not None:",
        (T("tests/rollout/kv_dtype_test.py", "teacher_forced"),),
        "a teacher-forced forward of the rollout config attends to unrounded keys and "
        "values: it no longer gives the engines' behaviour log-probs",
    ),
    Mutant(
        "kv-float8-cast-unsaturated",
        "m2po_jax/models/model.py",
        "    if dtype == jnp.float8_e4m3fn:\n        big = float(jnp.finfo(dtype).max)",
        "    if dtype == jnp.float8_e5m2:\n        big = float(jnp.finfo(dtype).max)",
        (T("tests/rollout/kv_dtype_test.py", "teacher_forced and float8"),),
        "a float8 cache casts keys past 448 without clipping them: NaN scores",
    ),
    Mutant(
        "engine-bucket-by-nearest-slot",
        "m2po_jax/rollout/engines/slots.py",
        "needed = jnp.max(jnp.where(live_S, column_S + 1, 1))",
        "needed = jnp.min(jnp.where(live_S, column_S + 1, total))",
        (T("tests/rollout/engine_test.py", "read_the_written"),),
        "the engine sizes attention by its shortest live slot, cutting the others' keys",
    ),
    Mutant(
        "engine-refill-keeps-old-columns",
        "m2po_jax/rollout/engines/slots.py",
        'valid_BxS=state.cache.valid_BxS.at[slot_L].set(row_valid_LxW, mode="drop"),',
        'valid_BxS=state.cache.valid_BxS.at[slot_L, :width].set(row_valid_LxW[:, :width], mode="drop"),',
        (T("tests/rollout/engine_test.py", "greedy"),),
        "a refilled slot still attends to the completion of the sequence it ran before",
    ),
    Mutant(
        "engine-position-off-by-one",
        "m2po_jax/rollout/engines/slots.py",
        "(state.prompt_len_S + state.step_S - 1)[:, None],",
        "(state.prompt_len_S + state.step_S)[:, None],",
        (T("tests/rollout/engine_test.py", "greedy"),),
        "decode tokens get the RoPE position after their own",
    ),
    Mutant(
        "engine-keys-by-slot",
        "m2po_jax/rollout/engines/slots.py",
        "_sequence_keys(keys_U, state, job_S, state.step_S)",
        "_sequence_keys(keys_U, state, jnp.arange(job_S.shape[0]), state.step_S)",
        (T("tests/rollout/engine_test.py", "keys"),),
        "sampling keys follow the slot, so the tokens depend on the slot count",
    ),
    Mutant(
        "engine-inflight-keeps-old-version",
        "m2po_jax/rollout/engines/continuous.py",
        "# in flight keep their cache and go on under the new weights.\n"
        '                    prefixes = programs["prefill"](\n'
        "                        params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version)",
        "# in flight keep their cache and go on under the new weights.\n"
        '                    prefixes = programs["prefill"](\n'
        "                        params, prompt_tokens_BxP, prompt_valid_BxP, version_",
        (T("tests/rollout/engine_test.py", "flight"),),
        "tokens drawn after an in-flight update are recorded under the old version",
    ),
    Mutant(
        "engine-stream-yields-a-batch-early",
        "m2po_jax/rollout/engines/continuous.py",
        "while ready < count and done[:, ready].all():",
        "while ready < count and done[:, ready].any():",
        (T("tests/rollout/engine_test.py", "stream"),),
        "a streamed batch is handed on when its first sequence ends, not its last",
    ),
    Mutant(
        "worker-pause-before-scored",
        "m2po_jax/rollout/worker.py",
        "                if self._drained():\n                    self._idle.set()\n",
        "                self._idle.set()\n",
        (T("tests/rollout/worker_test.py", "pause"),),
        "pause returns while the scorer still scores the last batch made: the checkpoint's "
        "buffer lacks it, its next index counts it (a resumed run never trains those prompts)",
    ),
    Mutant(
        "worker-stream-failure-discards-one-batch",
        "m2po_jax/rollout/worker.py",
        'self.admission.discard((count - done) * self.batch_size, "worker error")',
        'self.admission.discard(self.batch_size, "worker error")',
        (T("tests/rollout/worker_test.py", "streamed"),),
        "a failure in a multi-batch call leaves the rest of its batches counted as running",
    ),
    Mutant(
        "trainer-sync-ignores-the-engine",
        "m2po_jax/trainer/loop.py",
        "engine=self.setup.engine,",
        "engine=None,",
        (T("tests/trainer/trainer_test.py", "continuous"),),
        "rollout.engine=continuous is accepted but a sync run samples with the static sampler",
    ),
    Mutant(
        "trainer-async-ignores-the-engine",
        "m2po_jax/trainer/async_rollouts.py",
        "engine=run.engine,",
        "engine=None,",
        (T("tests/trainer/async_test.py", "exception"),),
        "rollout.engine=paged is accepted but the async worker samples with the static sampler",
    ),
    # ------------------------------------------------------------------ optimizer
    Mutant(
        "optim-clip-sign",
        "m2po_jax/learner/optim.py",
        "if opt.gradient_clipping > 0:",
        "if opt.gradient_clipping < 0:",
        (T("tests/learner/optim_test.py"),),
        "global-norm gradient clipping never applied (> 0 became < 0)",
    ),
    Mutant(
        "optim-linear-ends-at-zero",
        "m2po_jax/learner/optim.py",
        "main = optax.linear_schedule(opt.lr, end, decay)",
        "main = optax.linear_schedule(opt.lr, 0.0, decay)",
        (T("tests/learner/optim_test.py"),),
        "the linear schedule decays to 0 instead of lr * min_lr_ratio",
    ),
    # ------------------------------------------------------------------ prompts, rollouts
    Mutant(
        "rollout-long-prompt-keeps-head",
        "m2po_jax/rollout/batches.py",
        "ids.append(tokens[-width:])",
        "ids.append(tokens[:width])",
        (
            T("tests/rollout/rollout_test.py", "long or left"),
            T("tests/models/prompts_test.py", "long or left"),
        ),
        "an over-long prompt keeps its first tokens, not its last (long_prompts='left')",
    ),
    Mutant(
        "prompts-filter-drops-at-limit",
        "m2po_jax/models/prompts.py",
        'if n <= max_len or mode == "left":',
        'if n < max_len or mode == "left":',
        (
            T("tests/tasks/gsm8k_data_test.py", "long_prompts"),
            T("tests/models/prompts_test.py", "long or filter"),
        ),
        "a prompt of exactly max_prompt_len tokens is filtered out (<= became <)",
    ),
    Mutant(
        "checkpoint-queue-reversed",
        "m2po_jax/run/checkpoint.py",
        'for i in range(meta["queue_len"])',
        'for i in reversed(range(meta["queue_len"]))',
        (
            T("tests/rollout/rollout_test.py"),
            T("tests/trainer/checkpoint_test.py"),
            T("tests/trainer/trainer_test.py", "resume"),
        ),
        "the stale-rollout queue is restored newest first",
    ),
    Mutant(
        "checkpoint-crc-not-checked",
        "m2po_jax/run/checkpoint.py",
        "            if _crc32(path) != crc:\n"
        '                return f"{name}: checksum mismatch (damaged)"\n',
        "",
        (T("tests/trainer/checkpoint_test.py", "damaged or verif"),),
        "the manifest check compares file sizes only: a corrupted byte verifies",
    ),
    # ------------------------------------------------------------------ M2PO mask
    Mutant(
        "masking_kernels-stop-rule-lt-is-le",
        "m2po_jax/algorithm/masking_kernels.py",
        'return mean < tau if stop_rule == "lt" else mean <= tau',
        'return mean <= tau if stop_rule == "lt" else mean <= tau',
        (T("tests/algorithm/masking_test.py", "strict_less or examples"),),
        "AReaL's strict stop rule (kept mean < tau) becomes <=",
    ),
    Mutant(
        "masking_kernels-sort-descending",
        "m2po_jax/algorithm/masking_kernels.py",
        "sorted_key = lax.sort(key_N)",
        "sorted_key = -lax.sort(-key_N)",
        (T("tests/algorithm/masking_test.py", "examples"),),
        "the sort method orders m2 descending: it keeps the largest-m2 tokens",
    ),
    Mutant(
        "masking_kernels-invalid-tokens-counted",
        "m2po_jax/algorithm/masking_kernels.py",
        "return jnp.where(active, lax.bitcast_convert_type(m2, jnp.int32), _INACTIVE)",
        "return lax.bitcast_convert_type(m2, jnp.int32)",
        (T("tests/algorithm/masking_test.py", "examples or matches_reference"),),
        "invalid (padding) tokens take part in the running mean",
    ),
    Mutant(
        "masking_kernels-bisect-too-few-steps",
        "m2po_jax/algorithm/masking_kernels.py",
        "_BISECT_STEPS = 31",
        "_BISECT_STEPS = 24",
        (T("tests/algorithm/masking_test.py", "examples or sort_equals_bisect"),),
        "the bisect method stops before the boundary bit pattern is found",
    ),
    Mutant(
        "masking_kernels-m2-abs",
        "m2po_jax/algorithm/masking_kernels.py",
        "    return r * r\n",
        "    return jnp.abs(r)\n",
        (T("tests/algorithm/masking_test.py", "second_moment or examples"),),
        "the second moment is |log r| instead of (log r)^2",
    ),
    Mutant(
        "masking-harmful-noncandidates-masked",
        "m2po_jax/algorithm/masking.py",
        "mask = valid & (~active | kept)",
        "mask = valid & kept",
        (T("tests/algorithm/masking_test.py", "harmful"),),
        "candidates='harmful': tokens outside the candidate set are masked too",
    ),
    Mutant(
        "masking-nonfinite-not-candidate",
        "m2po_jax/algorithm/masking.py",
        "active = valid & (harmful | ~jnp.isfinite(m2))",
        "active = valid & harmful",
        (T("tests/algorithm/masking_test.py", "harmful"),),
        "candidates='harmful': a non-finite m2 token escapes the mask when not harmful",
    ),
    Mutant(
        "masking_stats-masked-counts-invalid",
        "m2po_jax/algorithm/masking_stats.py",
        "count(valid & ~mask),",
        "count(~mask),",
        (T("tests/algorithm/masking_test.py", "stats"),),
        "m2po/masked_tokens counts padding tokens as masked",
    ),
    Mutant(
        "scopes-row-scope-is-global",
        "m2po_jax/algorithm/scopes.py",
        'block_scope = "row" if scope == "row" else "global"',
        'block_scope = "global"',
        (T("tests/algorithm/m2po_scopes_test.py", "every_combination"),),
        "m2po_scope='row' silently takes one global mask",
    ),
    # ------------------------------------------------------------------ the loss
    Mutant(
        "losses-kept-denominator-is-valid",
        "m2po_jax/algorithm/losses.py",
        'count = mask.sum() if o.denominator == "kept" else valid_mask.astype(bool).sum()',
        "count = valid_mask.astype(bool).sum() if valid_mask is not None else mask.sum()",
        (T("tests/algorithm/losses_test.py", "denominator"), T("tests/algorithm/variants_test.py")),
        "the 'kept' loss denominator counts the valid tokens (before M2PO)",
    ),
    Mutant(
        "losses-clip-low-uses-high",
        "m2po_jax/algorithm/losses.py",
        "clipped = -adv * _clamp(r, 1.0 - eps_clip, 1.0 + eps_high)",
        "clipped = -adv * _clamp(r, 1.0 - eps_high, 1.0 + eps_high)",
        (T("tests/algorithm/losses_test.py", "clip"),),
        "the lower clip bound uses eps_clip_higher (clip-higher widens both sides)",
    ),
    Mutant(
        "losses-dual-clip-wrong-sign",
        "m2po_jax/algorithm/losses.py",
        "per_token = jnp.where(adv < 0, jnp.minimum(per_token, bound), per_token)",
        "per_token = jnp.where(adv > 0, jnp.minimum(per_token, bound), per_token)",
        (T("tests/algorithm/losses_test.py", "dual"),),
        "dual clip bounds the loss of A > 0 tokens instead of A < 0",
    ),
    Mutant(
        "losses-clamp-halves-gradient",
        "m2po_jax/algorithm/losses.py",
        "return jnp.where((x >= low) & (x <= high), x, jnp.clip(x, low, high))",
        "return jnp.clip(x, low, high)",
        (T("tests/algorithm/losses_test.py", "r_equal_one or check_grads"),),
        "jnp.clip instead of torch.clamp semantics: the gradient is halved on a bound",
    ),
    Mutant(
        "rejection-behav-weight-inverted",
        "m2po_jax/algorithm/rejection.py",
        "log_rho = jax.lax.stop_gradient(prox - behav)",
        "log_rho = jax.lax.stop_gradient(behav - prox)",
        (T("tests/algorithm/losses_test.py", "behaviour_weight or numpy_reference"),),
        "the behaviour weight is exp(behav - prox), the inverse of rho",
    ),
    Mutant(
        "rejection-row-weight-over-kept",
        "m2po_jax/algorithm/rejection.py",
        "log_w = jnp.clip(row_sum(log_rho, mask), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)",
        "log_w = jnp.clip(row_sum(log_rho, keep), -LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)",
        (T("tests/algorithm/rejection_test.py", "compose_with_token_rejection"),),
        "the row's product of rho (is_level=sequence) only over the tokens rejection kept",
    ),
    Mutant(
        "verl-token-k1-bounds-unnegated",
        "m2po_jax/config/verl.py",
        'level="token", metric="kl_k1", upper=-math.log(lower), lower=-math.log(upper)',
        'level="token", metric="kl_k1", upper=math.log(upper), lower=math.log(lower)',
        (T("tests/config/verl_test.py", "weigh_and_keep_as_verl"),),
        "verl's token_k1 bounds taken as bounds on log rho (verl's k1 is -log rho)",
    ),
    # ------------------------------------------------------------------ advantages
    Mutant(
        "advantages-leave1out-divides-by-n",
        "m2po_jax/algorithm/advantages.py",
        "loo = (total - xg * mg) / jnp.maximum(count - mg, 1.0)",
        "loo = (total - xg * mg) / jnp.maximum(count, 1.0)",
        (T("tests/algorithm/advantages_test.py", "by_hand or matches_reference"),),
        "the leave-one-out mean divides by n instead of n - 1",
    ),
    Mutant(
        "advantages-std-without-eps",
        "m2po_jax/algorithm/advantages.py",
        "scale = jnp.broadcast_to(std, cg.shape).reshape(shape) + eps",
        "scale = jnp.broadcast_to(std, cg.shape).reshape(shape)",
        (T("tests/algorithm/advantages_test.py", "by_hand"),),
        "the group std loses its epsilon",
    ),
    Mutant(
        "advantages-kl-forward-cumsum",
        "m2po_jax/algorithm/advantages.py",
        "kl_return = jnp.flip(jnp.cumsum(jnp.flip(kl_reward, -1), -1), -1)",
        "kl_return = jnp.cumsum(kl_reward, -1)",
        (T("tests/algorithm/advantages_test.py", "kl"),),
        "the KL return sums the past tokens' KL rewards instead of the future ones",
    ),
    # ------------------------------------------------------------------ sampling
    Mutant(
        "sampling-top-p-drops-crossing-token",
        "m2po_jax/rollout/sampling.py",
        "keep_BxK = mass_before_BxK < sampling.top_p",
        "keep_BxK = jnp.cumsum(probs_BxK, axis=-1) < sampling.top_p",
        (T("tests/rollout/sampling_test.py", "truncate or top_k_one"),),
        "top-p drops the token whose mass crosses top_p (and all tokens if the first does)",
    ),
    Mutant(
        "sampling-logp-without-temperature",
        "m2po_jax/rollout/sampling.py",
        "logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)",
        "logp_BxV = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)",
        (T("tests/rollout/sampling_test.py", "behav_logp"),),
        "the recorded behaviour log-prob ignores the temperature",
    ),
    # ------------------------------------------------------------------ the export
    Mutant(
        "export-fetch-without-gather",
        "m2po_jax/parallel/placement.py",
        "    return multihost_utils.process_allgather(tree, tiled=True)",
        "    return jax.device_get(tree)",
        (T("tests/e2e/export_test.py", "two_processes"),),
        "a multi-host export fetches each process's shards instead of gathering the tensor",
    ),
    Mutant(
        "export-tokenizer-files-not-copied",
        "m2po_jax/models/hf.py",
        "    if source_dir is not None and os.path.abspath(source_dir) != os.path.abspath(path):",
        "    if False:",
        (T("tests/e2e/export_test.py", "transformers"),),
        "the export leaves out the source's tokenizer, chat template and generation config",
    ),
    Mutant(
        "overrides-bool-as-number",
        "m2po_jax/config/overrides.py",
        "            if isinstance(value, bool) and kind in (int, float):",
        "            if False:",
        (T("tests/config/config_test.py", "bool"),),
        "a YAML `true` for a number field is stored as 1.0 (kl_ctl: true trains with kl_ctl 1)",
    ),
    Mutant(
        "run-record-resume-may-change-the-seed",
        "m2po_jax/run/run_record.py",
        '    "total_steps", "logging.", "eval.", "checkpoint.", "mesh.", "model.path",',
        '    "total_steps", "seed", "logging.", "eval.", "checkpoint.", "mesh.", "model.path",',
        (T("tests/trainer/run_record_test.py", "every_field"),),
        "a resume may change the seed without being asked (the data order and samples change)",
    ),
    Mutant(
        "run-record-reward-workers-refused",
        "m2po_jax/run/run_record.py",
        '    "rollout.worker_timeout_s", "rollout.reward_workers", "rollout.reward_timeout_s",',
        '    "rollout.worker_timeout_s", "rollout.reward_timeout_s",',
        (T("tests/trainer/run_record_test.py", "every_field"),),
        "a resume on a host with more cores, scoring with more reward workers, is refused",
    ),
    Mutant(
        "study-tie-counts-as-hurting",
        "m2po_jax/cli/study.py",
        '            hurts = _spread([s["final"] for s in stale])[0] < lo',
        '            hurts = _spread([s["final"] for s in stale])[0] <= lo',
        (T("tests/trainer/study_test.py", "equality"),),
        "the study calls staleness harmful when the stale mean ties the on-policy minimum",
    ),
    Mutant(
        "study-tie-does-not-rescue",
        "m2po_jax/cli/study.py",
        '                    ok = _spread([s["final"] for s in found[(k, rule, lr)]])[0] >= lo',
        '                    ok = _spread([s["final"] for s in found[(k, rule, lr)]])[0] > lo',
        (T("tests/trainer/study_test.py", "equality"),),
        "a rule whose mean reaches the on-policy minimum is said not to rescue",
    ),
    Mutant(
        "micro-batches-floor-of-the-cap",
        "m2po_jax/learner/batching.py",
        "        need = max(need, math.ceil(rows * seq_len / max_tokens_per_mb))",
        "        need = max(need, rows * seq_len // max_tokens_per_mb)",
        (T("tests/learner/batching_test.py", "token_cap"),),
        "micro-batches counted by the floor: one token over the cap still gives one micro-batch",
    ),
    Mutant(
        "sampling-top-p-never-reaches-the-sampler",
        "m2po_jax/rollout/sampling.py",
        "        top_p=gconfig.top_p,",
        "        top_p=1.0,",
        (T("tests/trainer/settings_reach_test.py"),),
        "gconfig.top_p is validated, then the sampler samples from the whole distribution",
    ),
    Mutant(
        "sampling-top-k-never-reaches-the-sampler",
        "m2po_jax/rollout/sampling.py",
        "        top_k=gconfig.top_k,",
        "        top_k=0,",
        (T("tests/trainer/settings_reach_test.py"),),
        "gconfig.top_k is validated, then ignored",
    ),
    Mutant(
        "areal-cap-keeps-the-base-level",
        "m2po_jax/config/areal.py",
        '                    ("level", "token"),\n',
        "",
        (T("tests/config/areal_test.py", "example"),),
        "AReaL's behav_imp_weight_cap maps to the bound but keeps the base config's rejection "
        "level (a sequence-level rule where AReaL masks tokens)",
    ),
    Mutant(
        "areal-max-length-truncates",
        "m2po_jax/config/areal.py",
        '            out["task.long_prompts"] = "filter"',
        "            pass",
        (T("tests/config/areal_test.py", "example"),),
        "AReaL's train_dataset.max_length drops longer prompts; mapped, it truncates them",
    ),
    Mutant(
        "actor-reward-bias-never-reaches-the-step",
        "m2po_jax/learner/actor_settings.py",
        "                reward_bias=actor.reward_bias,",
        "                reward_bias=0.0,",
        (T("tests/learner/actor_fields_test.py", "reward_bias"),),
        "actor.reward_bias is validated, then the step's advantages ignore it",
    ),
    Mutant(
        "engine-insert-lanes-never-reach-the-engine",
        "m2po_jax/rollout/engines/continuous.py",
        "            insert_lanes=rollout.insert_lanes,",
        "            insert_lanes=0,",
        (T("tests/trainer/settings_reach_test.py", "engine"),),
        "rollout.insert_lanes is validated, then the engine starts its default number per step",
    ),
    Mutant(
        "async-publish-dtype-never-reaches-the-worker",
        "m2po_jax/trainer/async_rollouts.py",
        "        dtype = config_lib.rollout_weight_dtype(cfg)",
        '        dtype = ""',
        (T("tests/trainer/async_test.py", "reaches_the_worker"),),
        "rollout.publish_dtype=bfloat16 is validated, then float32 weights are sent",
    ),
    Mutant(
        "async-stream-batches-never-reach-the-worker",
        "m2po_jax/trainer/async_rollouts.py",
        "            batches_per_call=self.cfg.rollout.stream_batches,",
        "            batches_per_call=1,",
        (T("tests/trainer/async_test.py", "reaches_the_worker"),),
        "rollout.stream_batches is validated, then the worker asks for one batch per call",
    ),
    Mutant(
        "reward-workers-never-reach-the-scorer",
        "m2po_jax/trainer/setup.py",
        "            task, workers=cfg.rollout.reward_workers, timeout_s=cfg.rollout.reward_timeout_s",
        "            task, workers=1, timeout_s=cfg.rollout.reward_timeout_s",
        (T("tests/trainer/async_test.py", "reaches_the_worker"),),
        "rollout.reward_workers is validated, then completions are scored one at a time",
    ),
    Mutant(
        "reward-timeout-never-reaches-the-scorer",
        "m2po_jax/trainer/setup.py",
        "            task, workers=cfg.rollout.reward_workers, timeout_s=cfg.rollout.reward_timeout_s",
        "            task, workers=cfg.rollout.reward_workers, timeout_s=0.0",
        (T("tests/trainer/async_test.py", "reaches_the_worker"),),
        "rollout.reward_timeout_s is validated, then a slow reward is waited for",
    ),
    Mutant(
        "async-worker-timeout-never-reaches-the-learner",
        "m2po_jax/trainer/async_rollouts.py",
        "        self.timeout = cfg.rollout.worker_timeout_s",
        "        self.timeout = 600.0",
        (T("tests/trainer/async_test.py", "stalled"),),
        "rollout.worker_timeout_s is validated, then a stalled worker is waited for 10 minutes",
    ),
    Mutant(
        "auto-engine-threshold-exclusive",
        "m2po_jax/config/validate.py",
        "    long = cfg.gconfig.max_new_tokens >= AUTO_PAGED_MIN_NEW_TOKENS",
        "    long = cfg.gconfig.max_new_tokens > AUTO_PAGED_MIN_NEW_TOKENS",
        (T("tests/trainer/trainer_test.py", "auto_engine"),),
        "rollout.engine=auto takes the static sampler at exactly the documented budget",
    ),
    Mutant(
        "auto-engine-never-paged",
        "m2po_jax/config/validate.py",
        '    return "paged" if long else "static"',
        '    return "static"',
        (T("tests/trainer/trainer_test.py", "auto_engine"),),
        "rollout.engine=auto always samples with the static sampler",
    ),
    Mutant(
        "config-open-bound-taken-as-closed",
        "m2po_jax/common/checks.py",
        "(value <= low if low_open else value < low)",
        "value < low",
        (
            T("tests/common/knobs_test.py", "allows_its_range"),
            T("tests/config/config_test.py", "out_of_range_values"),
        ),
        "a declared open lower bound admits the bound itself: actor.m2_threshold=0.0 passes",
    ),
    Mutant(
        "knob-unbounded-float-not-checked-finite",
        "m2po_jax/common/knobs.py",
        "elif self.low is not None or self.high is not None or isinstance(value, float):",
        "elif self.low is not None or self.high is not None:",
        (
            T("tests/common/knobs_test.py", "allows_its_range"),
            T("tests/config/config_test.py", "rejection_sampling_ranges"),
        ),
        "a float field declared without bounds takes nan (rejection_sampling.upper=nan)",
    ),
    Mutant(
        "knob-none-default-not-a-placeholder",
        "m2po_jax/common/knobs.py",
        "            c[f.name] = placeholder(_optional_type(hints[f.name]))",
        "            c[f.name] = None",
        (T("tests/common/knobs_test.py", "default_of_its_type"),),
        "an optional field's default is a bare None: --config.actor.eps_clip_higher=0.28 no "
        "longer parses as a float",
    ),
    Mutant(
        "setup-reads-the-engine-unresolved",
        "m2po_jax/trainer/setup.py",
        "    engine = engines.engine_class(config_lib.rollout_engine(cfg))",
        '    engine = engines.engine_class("continuous" if cfg.rollout.engine == "continuous" else "static")',
        (T("tests/trainer/trainer_test.py", "auto_engine"),),
        "the run builds no engine for rollout.engine=auto with a long budget",
    ),
    Mutant(
        "continuous-engine-metric-constant",
        "m2po_jax/trainer/loop.py",
        '            record["rollout/continuous_engine"] = float(self.setup.engine.name == "continuous")',
        '            record["rollout/continuous_engine"] = 0.0',
        (T("tests/trainer/trainer_test.py", "paged_engines_train"),),
        "the metrics say the static sampler made rollouts the continuous engine made",
    ),
    # ------------------------------------------------------------------ your own problems
    Mutant(
        "problems-filter-keeps-solutions",
        "m2po_jax/tasks/problems.py",
        "                self._solutions = [self._solutions[i] for i in keep]",
        "                pass",
        (T("tests/tasks/gsm8k_data_test.py", "warm_up_pairs"),),
        "a filtered long prompt keeps its solution: the warm-up pairs later prompts with the "
        "next problem's solution",
    ),
    Mutant(
        "problems-reference-not-checked",
        "m2po_jax/tasks/problems.py",
        "            verifier.check_reference(reference)",
        "            pass",
        (T("tests/tasks/problems_test.py", "mangle"),),
        "references are not checked at start: a gsm8k '1/3' trains, scored as another number",
    ),
    Mutant(
        "evaluate-ignores-eval-reward",
        "m2po_jax/trainer/evaluate.py",
        '    if cfg.eval.reward == "train" and run.rewards is not None:',
        "    if False:",
        (T("tests/e2e/gsm8k_run_test.py", "math_run"),),
        "evaluation scores with the verifier whatever eval.reward says (the user's reward_fn "
        "is used in training only)",
    ),
    Mutant(
        "evaluate-sets-ignored",
        "m2po_jax/tasks/problems.py",
        '        return {k: list(v) for k, v in self._sets.items()} or {"held_out": self.eval_examples()}',
        '        return {"held_out": self.eval_examples()}',
        (T("tests/e2e/gsm8k_run_test.py", "math_run"),),
        "eval.sets are read and screened, then never evaluated",
    ),
    Mutant(
        "rewards-thread-timeout-ignored",
        "m2po_jax/rollout/rewards.py",
        "self._one, pairs, workers=self.workers, timeout_s=self.timeout_s, name=",
        "self._one, pairs, workers=self.workers, timeout_s=0, name=",
        (T("tests/tasks/problems_test.py", "times_out"),),
        "rollout.reward_timeout_s is validated but a slow reward on threads is waited for",
    ),
    Mutant(
        "rewards-nan-accepted",
        "m2po_jax/tasks/base.py",
        "    if not math.isfinite(value):",
        "    if False:",
        (T("tests/tasks/problems_test.py", "raw_reference"),),
        "a reward function's NaN becomes the reward (training continues on a NaN advantage)",
    ),
    # ---- data, rewards, chips and stops (issue 48)
    Mutant(
        "problems-held-out-not-filtered",
        "m2po_jax/tasks/problems.py",
        '            elif split == "eval":\n                self._eval = kept',
        '            elif split == "eval":\n                self._eval = examples',
        (T("tests/tasks/gsm8k_data_test.py", "long_prompts"),),
        "task.long_prompts='filter' counts the held-out prompts it drops but evaluates them",
    ),
    Mutant(
        "rewards-alarm-not-set",
        "m2po_jax/rollout/rewards.py",
        "    signal.setitimer(signal.ITIMER_REAL, _TIMEOUT_S)\n    try:",
        "    try:",
        (T("tests/tasks/problems_test.py", "times_out"),),
        "the reward worker's alarm is never armed: a slow verifier is stopped only by the "
        "grace period and a new pool (seconds per timeout)",
    ),
    Mutant(
        "chips-h200-marketing-gigabytes",
        "m2po_jax/parallel/chips.py",
        "            139.8,",
        "            141,",
        (T("tests/parallel/chips_test.py"),),
        "the H200's HBM is the marketing 141 (GiB) instead of what the device reports",
    ),
    Mutant(
        "chips-v5e-hbm",
        "m2po_jax/parallel/chips.py",
        'Chip("v5e", "TPU v5 lite", 16, 197, 819,',
        'Chip("v5e", "TPU v5 lite", 32, 197, 819,',
        (T("tests/parallel/chips_test.py"),),
        "a v5e chip judged with 32 GiB of HBM (the v6e's): the dry run passes what cannot fit",
    ),
    Mutant(
        "stopping-signal-not-shared",
        "m2po_jax/trainer/stopping.py",
        "                    state.client.key_value_set(_SIGNAL_KEY, str(int(signum)))",
        "                    pass",
        (T("tests/parallel/parallel_test.py", "a_signal_to_one_of_two"),),
        "a signal to one process of a run: the others exit with SIGTERM's code, not its own",
    ),
    Mutant(
        "stopping-no-notifier-stops-alone",
        "m2po_jax/trainer/stopping.py",
        "        wanted = multihost_utils.process_allgather(np.int32(self.requested is not None))\n"
        "        return bool(np.any(wanted))\n",
        "        return self.requested is not None\n",
        (T("tests/parallel/distributed_test.py", "without_the_preemption_notifier"),),
        "without the runtime's preemption notifier each process checks only its own request: "
        "the signalled one stops alone, the others need a signal each (issue 65, item 3)",
    ),
    Mutant(
        "stopping-handlers-not-restored",
        "m2po_jax/trainer/stopping.py",
        "signal.signal(sig, python_handler if python_handler is not None else signal.SIG_DFL)",
        "signal.signal(sig, signal.SIG_DFL)",
        (T("tests/trainer/stopping_test.py", "restores"),),
        "a run leaves SIGTERM / SIGINT at the default: after Trainer.run in a notebook or a "
        "host program, Ctrl-C kills it (no KeyboardInterrupt) and its own handlers are gone",
    ),
    Mutant(
        "peer-watch-leaving-ignored",
        "m2po_jax/parallel/distributed.py",
        "            missing = [i for i in ids if i not in live and not _left(state.client, i)]",
        "            missing = [i for i in ids if i not in live]",
        (T("tests/parallel/distributed_test.py", "peer_watch"),),
        "a process that finished (or stopped) and disconnected is reported lost by the others",
    ),
    Mutant(
        "sft-unbounded-dispatch",
        "m2po_jax/trainer/sft.py",
        "        if len(in_flight) == 2:",
        "        if len(in_flight) == s.eval_every:",
        (T("tests/trainer/trainer_test.py", "in_flight"),),
        "the warm-up queues steps until the next evaluation (XLA:CPU's collectives time out "
        "and abort the process on a busy host)",
    ),
    # ---- episodes and tools (issue 48)
    Mutant(
        "tools-timeout-not-from-config",
        "m2po_jax/trainer/setup.py",
        "                timeout_s=ag.tool_timeout_s,\n",
        "",
        (T("tests/config/config_test.py", "agent_is_built"),),
        "agent.tool_timeout_s is validated but never reaches ToolEnv (its 10 s default runs)",
    ),
    Mutant(
        "tools-timeout-per-call",
        "m2po_jax/common/workers.py",
        "            end = job.started_at + timeout_s",
        "            end = time.perf_counter() + timeout_s",
        (T("tests/tasks/environments_test.py", "share_one_deadline"),),
        "the timeout restarts for each call of a turn: two hung calls take 2 x tool_timeout_s",
    ),
    Mutant(
        "tools-abandoned-thread-not-replaced",
        "m2po_jax/common/workers.py",
        "            if job.queue is self._queue:  # not after a shutdown of the job's threads\n"
        "                self._spawn(self._queue)\n        return True",
        "        return True",
        (
            T("tests/tasks/environments_test.py", "poison"),
            T("tests/common/workers_test.py"),
            T("tests/tasks/problems_test.py", "times_out"),
        ),
        "a timed-out call keeps its pool thread: a hung tool starves every later call",
    ),
    Mutant(
        "pool-shutdown-leaves-its-threads",
        "m2po_jax/common/workers.py",
        "                for _ in range(self.workers):\n                    self._queue.put(None)\n",
        "",
        (T("tests/common/workers_test.py", "holds_threads"),),
        "shutdown forgets its threads without ending them: each run leaves its pool's idle",
    ),
    Mutant(
        "pool-abandoned-thread-rejoins",
        "m2po_jax/common/workers.py",
        "            with self._lock:\n"
        "                if job.abandoned:  # replaced already: this thread leaves the pool\n"
        "                    return\n",
        "",
        (T("tests/common/workers_test.py", "leaves_the_pool"),),
        "a timed-out call's thread, replaced already, comes back to serve when its call "
        "returns: the pool grows by a thread per timeout, and a shutdown leaves them running",
    ),
    Mutant(
        "agent-close-leaves-the-tool-pool",
        "m2po_jax/rollout/episodes.py",
        "        for pool in self.pools:\n            pool.shutdown()\n",
        "",
        (T("tests/config/config_test.py", "agent_is_built"),),
        "closing the agent leaves the shared tool pool's threads running",
    ),
    Mutant(
        "agent-loop-check-unlocked",
        "m2po_jax/rollout/episodes.py",
        "        with self._loop_lock:\n            if self._loop is None:\n"
        "                self._loop = env_lib.EnvLoop()\n            return self._loop\n",
        "        if self._loop is None:\n            self._loop = env_lib.EnvLoop()\n"
        "        return self._loop\n",
        (T("tests/rollout/episodes_test.py", "one_event_loop"),),
        "two threads that reach the agent's loop first both start one: one is left running",
    ),
    Mutant(
        "trainer-never-closes-the-agent",
        "m2po_jax/trainer/loop.py",
        "                    stack.callback(self.setup.agent.close)\n",
        "                    pass\n",
        (T("tests/trainer/agent_run_test.py", "on_policy"),),
        "a run leaves its agent's environment threads and event loop behind",
    ),
    Mutant(
        "episodes-exception-text-is-the-text",
        "m2po_jax/rollout/episodes.py",
        'episode.status, episode.error = env_lib.ENV_ERROR, f"{type(e).__name__}: {e}"',
        'episode.status, episode.text = env_lib.ENV_ERROR, f"{type(e).__name__}: {e}"',
        (T("tests/rollout/episodes_test.py", "crashed"),),
        "a crashed environment's exception becomes the episode's text: scored and trained on",
    ),
    Mutant(
        "episodes-failed-not-masked",
        "m2po_jax/rollout/episodes.py",
        "        return (self.mask_failed and status in FAILED) or (self.mask_truncated and status in _CUT)",
        "        return self.mask_truncated and status in _CUT",
        (T("tests/rollout/episodes_test.py", "crashed"),),
        "agent.mask_failed_episodes is ignored: env_error episodes stay in the loss",
    ),
    Mutant(
        "episodes-step-rewards-not-summed",
        "m2po_jax/rollout/episodes.py",
        "        episode.reward = (episode.reward or 0.0) + float(result.reward)",
        "        episode.reward = float(result.reward)",
        (T("tests/rollout/episodes_test.py", "sum_of_its_steps"),),
        "only the last step's reward counts: rewards of earlier steps are dropped",
    ),
    Mutant(
        "episodes-long-prompt-uncounted",
        "m2po_jax/rollout/episodes.py",
        "    return len(long), 0\n",
        "    return 0, 0\n",
        (T("tests/rollout/episodes_test.py", "long_agent_prompts"),),
        "an agent prompt cut from the left is not counted in rollout/prompts_truncated",
    ),
    Mutant(
        "episodes-async-on-threads",
        "m2po_jax/rollout/episodes.py",
        "    if inspect.iscoroutinefunction(fn):",
        "    if False:",
        (T("tests/rollout/episodes_test.py", "share_one_loop"),),
        "async environment steps each hold a worker thread: episodes do not overlap",
    ),
    # ---- LoRA and QLoRA (issue 48)
    Mutant(
        "qlora-warmup-trains-the-codes",
        "m2po_jax/trainer/sft.py",
        '    if model_config.lora_base != "float":\n        return adapters, base',
        "    if False:\n        return adapters, base",
        (T("tests/e2e/lora_checkpoint_test.py", "qlora_warmup"),),
        "under a quantised base the warm-up differentiates the base's integer codes (crash)",
    ),
    Mutant(
        "nf4-blocks-along-the-kernel",
        "m2po_jax/models/quant.py",
        "    t = jnp.transpose(jnp.asarray(w, jnp.float32), _nf4_perm(len(shape), n_in))",
        "    t = jnp.reshape(w.astype(jnp.float32), [shape[i] for i in _nf4_perm(len(shape), n_in)])",
        (T("tests/models/quant_test.py", "bitsandbytes or torch_weight"),),
        "NF4 blocks run along the [in, out] kernel, not bitsandbytes' torch weight [out, in]",
    ),
    Mutant(
        "publish-casts-the-quant-scales",
        "m2po_jax/models/quant.py",
        "        if is_quantized_leaf(keys, x.dtype) or not jnp.issubdtype(x.dtype, jnp.floating):",
        "        if not jnp.issubdtype(x.dtype, jnp.floating):",
        (T("tests/models/quant_test.py", "publishing"),),
        "rollout.publish_dtype=bfloat16 rounds a quantised base's float32 scales",
    ),
    Mutant(
        "fp8-rollout-weights-scaled-as-int8",
        "m2po_jax/models/quant.py",
        "    scale = absmax / FP8_MAX",
        "    scale = absmax / INT8_MAX",
        (T("tests/models/quant_test.py", "fp8"),),
        "float8 rollout weights take int8's scale (absmax / 127): codes never pass 127 and "
        "more of them fall below e4m3's normal range",
    ),
    Mutant(
        "sync-rollout-copy-of-an-older-version",
        "m2po_jax/parallel/placement.py",
        "        if self._copy is None or version != self._version:",
        "        if self._copy is None:",
        (T("tests/models/quant_test.py", "sampling_copy"),),
        "sync rollouts keep generating with the weights converted for an older policy version",
    ),
    Mutant(
        "export-peft-base-compared-with-itself",
        "m2po_jax/cli/export.py",
        "        base_params, base = _model_path_base(cfg, model_config, where)",
        "        base_params, base = _model_path_base(cfg, model_config, where)\n"
        '        base = saved_base if fmt == "peft" else base',
        (T("tests/e2e/lora_checkpoint_test.py", "changed_base"),),
        "m2po-export --format peft checks the checkpoint's base hash against itself",
    ),
    Mutant(
        "dry-run-passes-the-params-as-kl-reference-under-lora",
        "m2po_jax/trainer/setup.py",
        "    return params if needs_reference(cfg, model_config) else None",
        "    return params if cfg.actor.kl_ctl > 0 else None",
        (T("tests/parallel/tpu_compile_test.py", "trainers_with_a_kl"),),
        "under LoRA with kl_ctl > 0 the step gets the params as KL reference (a second copy)",
    ),
    Mutant(
        "add-adapters-b-not-zero",
        "m2po_jax/models/model.py",
        "            flat[path] = jnp.zeros(shape.shape, shape.dtype)",
        "            flat[path] = lora_a_init(rng, shape.shape, shape.dtype)",
        (T("tests/models/lora_test.py", "zero_adapters"),),
        "adapters added to a loaded checkpoint start with B != 0: the first step is not the base's",
    ),
    Mutant(
        "qlora-memory-plan-scales-uncounted",
        "m2po_jax/learner/memory.py",
        "            quantised += n * shape.dtype.itemsize",
        '            quantised += n * shape.dtype.itemsize if shape.dtype.kind in "iu" else 0',
        (T("tests/models/quant_test.py", "memory_plan"),),
        "the QLoRA memory plan leaves out the quantised base's float32 scales",
    ),
    Mutant(
        "dry-run-evaluates-with-the-static-sampler",
        "m2po_jax/trainer/compile_only.py",
        "    evaluator = setup_lib.build_engine(\n"
        "        cfg, model_config, settings, placement, limit, trained_weights=True\n"
        "    )",
        "    evaluator = engines.StaticEngine(model_config, settings, mesh=placement.mesh)",
        (T("tests/parallel/tpu_compile_test.py", "every_program"),),
        "--compile_only compiles the evaluation with the static sampler where the run "
        "evaluates through its own engine",
    ),
    # ---- paged engine (issue 49)
    Mutant(
        "paged-prompt-tail-not-copied",
        "m2po_jax/rollout/engines/paged.py",
        "    copy_X = copy_X & (_tails(state, inst) > 0)",
        "    copy_X = copy_X & (_tails(state, inst) < 0)",
        (T("tests/rollout/paged_engine_test.py", "static_sampler"),),
        "a sequence's first own page starts empty: its prompt's partly filled last page is "
        "never copied, so its last prompt tokens are not attended",
    ),
    Mutant(
        "paged-prompt-part-reads-the-tail",
        "m2po_jax/rollout/engines/paged.py",
        "    len_I = state.prompt_len_I - state.prompt_len_I % state.pool.page_size",
        "    len_I = state.prompt_len_I",
        (T("tests/rollout/paged_engine_test.py", "static_sampler"),),
        "the prompt part reads the partly filled last page that the own part holds a copy "
        "of: those tokens are attended twice",
    ),
    Mutant(
        "paged-resume-chunk-forgets-earlier-chunks",
        "m2po_jax/rollout/engines/paged.py",
        "        view = _view(state.replace(pool=pool), table_LxM, tail_L + start, inst_L,",
        "        view = _view(state.replace(pool=pool), table_LxM, tail_L, inst_L,",
        (T("tests/rollout/paged_engine_test.py", "sampled_rows"),),
        "a resume's chunk writes its tokens over the first chunk's and attends as if no "
        "chunk came before it",
    ),
    Mutant(
        "plan-leaves-out-the-evaluation-engine",
        "m2po_jax/trainer/setup.py",
        "            held(trained, prompts=cfg.eval.batch_size, n_samples=cfg.eval.n_samples,",
        "            0 * held(trained, prompts=cfg.eval.batch_size, n_samples=cfg.eval.n_samples,",
        (T("tests/trainer/engine_pool_test.py", "evaluation_engine"),),
        "the memory plan counts the rollouts' engine only: an evaluation of more sequences "
        "gets a pool sized without its own buffers and overfills the device",
    ),
    Mutant(
        "paged-page-copy-changes-the-pools-layout",
        "m2po_jax/models/paged.py",
        '        kv = tuple(kv.at[to_XxP, pos_XxP].set(kv[src_XxP, pos_XxP], mode="drop")',
        '        kv = tuple(kv.at[to_X].set(kv[src_XxP[:, 0]], mode="drop")',
        (T("tests/parallel/tpu_compile_test.py", "ragged_paged_attention_kernel"),),
        "the prompt's tail page is copied by whole-page indexing: the TPU compiler changes "
        "every layer's pool to another layout and back around it, each decode step",
    ),
    Mutant(
        "gpu-paged-kernel-unscaled",
        "m2po_jax/models/paged_kernels.py",
        "        (q_BxHxD * sm_scale).astype(dtype), k_KxNPxPGxD, v_KxNPxPGxD, pages_BxM, lengths_B,",
        "        q_BxHxD.astype(dtype), k_KxNPxPGxD, v_KxNPxPGxD, pages_BxM, lengths_B,",
        (T("tests/models/paged_kernels_test.py", "gpu"),),
        "the Triton kernel has no scale: q passed unscaled gives softmax(q k) instead of "
        "softmax(q k / sqrt(D))",
    ),
    Mutant(
        "hlo-traffic-in-place-update-counts-the-buffer",
        "m2po_jax/trainer/hlo_traffic.py",
        '        moved = _in_hbm(shapes.get(root.operands[_IN_PLACE[root.op]], ""))',
        "        moved = _in_hbm(i.shape)",
        (T("tests/trainer/hlo_traffic_test.py", "by_hand"),),
        "an in-place cache write counted as a write of the whole pool, not of its update",
    ),
    Mutant(
        "paged-kernel-never-chosen",
        "m2po_jax/models/paged.py",
        '    if t != 1 or platform not in ("tpu", "gpu"):',
        '    if t != 1 or platform not in ("tpu", "gpu") or True:',
        (T("tests/parallel/tpu_compile_test.py", "ragged_paged_attention_kernel"),),
        "a decode step traced for a TPU runs the XLA path, never the ragged paged kernel",
    ),
    Mutant(
        "paged-row-pages-one-prompt-page-too-many",
        "m2po_jax/models/paged.py",
        "    pages_BxM = jnp.where(j < full_B[:, None], from_prompt, from_own)",
        "    pages_BxM = jnp.where(j <= full_B[:, None], from_prompt, from_own)",
        (T("tests/models/paged_test.py", "kernel_reads"),),
        "a row's page list for the kernel takes its prompt's partly filled last page, not "
        "its own copy of it",
    ),
    Mutant(
        "paged-prefill-reads-through-the-pages",
        "m2po_jax/rollout/engines/paged.py",
        "                 fresh=True)  # fmt: skip",
        "                 fresh=False)  # fmt: skip",
        (T("tests/parallel/tpu_compile_test.py", "ragged_paged_attention_kernel"),),
        "the prompts' prefill attends through the pages (XLA) instead of splash on a TPU",
    ),
    Mutant(
        "plan-peak-sums-the-phases",
        "m2po_jax/learner/memory.py",
        "        return max(self.train_step, self.sampling)",
        "        return self.total",
        (T("tests/learner/memory_test.py", "which_setting_fits"),),
        "the start-up check holds a device to the train step and a rollout summed, as if "
        "both were held at once",
    ),
    Mutant(
        "pool-budget-counts-the-train-step",
        "m2po_jax/trainer/setup.py",
        "    return max(int(POOL_MEMORY_FRACTION * limit) - (plan.sampling - one_page), 1)",
        "    return max(int(POOL_MEMORY_FRACTION * limit) - (plan.total - one_page), 1)",
        (T("tests/trainer/engine_pool_test.py", "plan_leaves"),),
        "the paged engine's pool leaves room for the train step's activations, which are not "
        "held while it samples",
    ),
    Mutant(
        "paged-budget-pages-half-size",
        "m2po_jax/rollout/engines/paged.py",
        "        cap = self.kv_budget // self.page_bytes if self.kv_budget else None",
        "        cap = self.kv_budget // (2 * self.page_bytes) if self.kv_budget else None",
        (T("tests/trainer/engine_pool_test.py", "plan_leaves"),),
        "the paged engine turns its memory budget into half the pages the plan counts",
    ),
    Mutant(
        "plan-pool-one-shard",
        "m2po_jax/trainer/setup.py",
        "    return shards * engines.pool_pages(prompt, slots, own, cap)",
        "    return engines.pool_pages(prompt, slots, own, cap)",
        (T("tests/trainer/engine_pool_test.py", "plan_leaves"),),
        "the memory plan counts one batch shard's pool where the mesh has several",
    ),
    Mutant(
        "paged-page-taken-one-token-late",
        "m2po_jax/rollout/engines/paged.py",
        "    need_S = state.live_S & ((own_len_S % pg == 0) | first_S)",
        "    need_S = state.live_S & ((own_len_S % pg == 1) | first_S)",
        (T("tests/rollout/paged_engine_test.py", "continuous_engines"),),
        "a sequence takes its next page one token after it needs it: that token's keys are "
        "written nowhere",
    ),
    Mutant(
        "paged-preempts-the-oldest",
        "m2po_jax/rollout/engines/paged.py",
        "    order = jnp.argsort(jnp.where(live, -state.age_S, jnp.iinfo(jnp.int32).max), stable=True)",
        "    order = jnp.argsort(jnp.where(live, state.age_S, jnp.iinfo(jnp.int32).max), stable=True)",
        (T("tests/rollout/paged_engine_test.py", "youngest"),),
        "a short pool preempts the oldest sequences (their work is the most to redo), not the "
        "youngest",
    ),
    Mutant(
        "paged-resume-pending-token-off-by-one",
        "m2po_jax/rollout/engines/paged.py",
        "    last_L = state.tokens_JxN[j_L, jnp.maximum(step_L - 1, 0)]",
        "    last_L = state.tokens_JxN[j_L, jnp.maximum(step_L - 2, 0)]",
        (T("tests/rollout/paged_engine_test.py", "continuous_engines"),),
        "a resumed sequence goes on from its second-to-last token",
    ),
    Mutant(
        "paged-ended-pages-not-returned",
        "m2po_jax/rollout/engines/paged.py",
        "        state = _push(state, jnp.where(ends_S[:, None], own_table, n_pages))",
        "        state = state",
        (T("tests/rollout/paged_engine_test.py", "greedy_equals"),),
        "an ended sequence's pages never return to the pool (memory leaks until preemption "
        "thrashes)",
    ),
    Mutant(
        "paged-prompt-left-padding-kept",
        "m2po_jax/rollout/engines/paged.py",
        "    col_QxP = jnp.minimum(jnp.arange(width)[None] + (width - len_Q)[:, None], width - 1)",
        "    col_QxP = jnp.minimum(jnp.arange(width)[None], width - 1)",
        (T("tests/rollout/paged_engine_test.py", "greedy_equals"),),
        "the prompt's pages hold its left padding instead of its last tokens",
    ),
    Mutant(
        "paged-merge-drops-the-prompt-rescale",
        "m2po_jax/models/paged.py",
        "    total = l1 * a1 + l2 * a2",
        "    total = l1 + l2 * a2",
        (T("tests/models/paged_test.py", "shared_prompt"),),
        "the two softmax parts are merged without rescaling the prompt's sum to the common max",
    ),
    Mutant(
        "paged-member-rank-off-by-one",
        "m2po_jax/models/paged.py",
        "    rank_IxB = jnp.cumsum(onehot_IxB, axis=1, dtype=jnp.int32) - 1",
        "    rank_IxB = jnp.cumsum(onehot_IxB, axis=1, dtype=jnp.int32)",
        (T("tests/models/paged_test.py", "shared_prompt"),),
        "a decode step hands each row its neighbour's prompt attention",
    ),
    # ---- paged engine: turns (issue 49)
    Mutant(
        "paged-turns-appended-tokens-marked-sampled",
        "m2po_jax/rollout/engines/paged.py",
        '        version_JxN=state.version_JxN.at[row_LxM, col_LxM].set(-1, mode="drop"),\n',
        '        version_JxN=state.version_JxN.at[row_LxM, col_LxM].set(-1, mode="drop"),\n'
        '        sampled_JxN=state.sampled_JxN.at[row_LxM, col_LxM].set(True, mode="drop"),\n',
        (T("tests/rollout/paged_engine_test.py", "continuous_engines_parked"),),
        "the paged engine's appended (environment) tokens are in the loss mask",
    ),
    Mutant(
        "paged-turns-held-sequence-pages-freed",
        "m2po_jax/rollout/engines/paged.py",
        "        state = state.replace(held_S=state.held_S | ends_S)\n",
        "        state = state.replace(held_S=state.held_S | ends_S)\n"
        "        state = _push(state, jnp.where(ends_S[:, None], own_table, n_pages))\n",
        (T("tests/rollout/paged_engine_test.py", "continuous_engines_parked"),),
        "a parked sequence's pages go back to the pool while it waits for its answer",
    ),
    Mutant(
        "paged-turns-answers-wait-for-every-held-turn",
        "m2po_jax/rollout/engines/paged.py",
        "            ready = answers.poll(0.0 if busy else None)\n",
        "            ready = answers.poll(None) if pending else []\n"
        "            while len(ready) < len(pending):\n"
        "                ready += answers.poll(None)\n",
        (T("tests/rollout/paged_engine_test.py", "slow_answer"),),
        "the paged engine applies answers only once every held turn is answered (blocking)",
    ),
    # ---- config knobs: the paged engine's sizes (issue 65, items 6, 10, 11)
    Mutant(
        "knob-page-size-low-off-by-one",
        "m2po_jax/common/config_schema.py",
        '    page_size: int = knob(16, "paged: tokens per page (refused on another engine)", low=1)',
        '    page_size: int = knob(16, "paged: tokens per page (refused on another engine)", low=0)',
        (T("tests/config/config_test.py", "out_of_range_values"),),
        "rollout.page_size=0 passes validation (a pool of empty pages)",
    ),
    Mutant(
        "knob-page-size-default-changed",
        "m2po_jax/common/config_schema.py",
        '    page_size: int = knob(16, "paged: tokens per page (refused on another engine)", low=1)',
        '    page_size: int = knob(32, "paged: tokens per page (refused on another engine)", low=1)',
        (T("tests/trainer/engine_pool_test.py", "its_batch_fits"),),
        "the default page size doubles: every default pool's pages and least pool change",
    ),
    Mutant(
        "paged-from-config-drops-kv-pages",
        "m2po_jax/rollout/engines/paged.py",
        "            pages=rollout.kv_pages,\n",
        "",
        (T("tests/trainer/engine_pool_test.py", "its_batch_fits"),),
        "rollout.kv_pages stops reaching the paged engine: it always takes its default pool",
    ),
    Mutant(
        "setup-paged-sizes-unchecked",
        "m2po_jax/trainer/setup.py",
        "    check_engine_sizes(\n"
        "        cfg, model_config, placement, rollout_placement, cfg.rollout.batch_size // processes\n"
        "    )\n",
        "",
        (T("tests/trainer/engine_pool_test.py", "refused_at_setup"),),
        "the run's setup no longer checks the paged sizes: a pool too small for a batch, or "
        "slots / pages not dividing over the shards, fail in the warm-up's first evaluation",
    ),
    Mutant(
        "compile-only-budget-from-the-rollouts-config",
        "m2po_jax/trainer/compile_only.py",
        "    engine = setup_lib.build_engine(cfg, model_config, decoding, sampler_placement, limit)",
        "    engine = setup_lib.build_engine(cfg, rollout_config, decoding, sampler_placement, limit)",
        (T("tests/trainer/engine_pool_test.py", "cheaper_rollout_weights"),),
        "--compile_only sizes the rollouts' pool from the rollouts' weights (int8: the train "
        "state counted at a quarter, a pool too large)",
    ),
)


# ----------------------------------------------------------------------------- the list


class MutantError(ValueError):
    """A mutant that cannot be applied (its snippet does not occur exactly once)."""


class RunError(RuntimeError):
    """The run cannot give meaningful results (the unmutated tests fail, wrong imports)."""


def occurrences(mutant: Mutant, root: Path = REPO) -> int:
    path = root / mutant.module
    if not path.is_file():
        raise MutantError(f"mutant {mutant.id}: module {mutant.module} does not exist")
    return path.read_text(encoding="utf-8").count(mutant.original)


def check(mutant: Mutant, root: Path = REPO) -> None:
    """Raises MutantError naming the mutant unless its snippet occurs exactly once."""
    n = occurrences(mutant, root)
    if n != 1:
        where = "does not occur" if n == 0 else f"occurs {n} times"
        raise MutantError(
            f"mutant {mutant.id}: its original snippet {where} in {mutant.module} (it must "
            f"occur exactly once; update the mutant in benchmarks/mutants.py): "
            f"{mutant.original!r}"
        )


def apply(mutant: Mutant, root: Path) -> None:
    """Replaces the mutant's snippet in `root`'s copy of its module (refuses as `check`)."""
    check(mutant, root)
    path = root / mutant.module
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace(mutant.original, mutant.mutated, 1), encoding="utf-8")


def select(
    mutants: tuple[Mutant, ...], modules: list[str] | None, ids: list[str] | None
) -> list[Mutant]:
    """The mutants of `modules` (paths, as in the list) and/or with `ids`; unknown names raise."""
    chosen = list(mutants)
    if modules:
        known = {m.module for m in mutants}
        wanted = {str(Path(p)) for p in modules}
        unknown = sorted(wanted - known)
        if unknown:
            raise MutantError(
                f"--modules: no mutants for {unknown}; modules with mutants: {sorted(known)}"
            )
        chosen = [m for m in chosen if m.module in wanted]
    if ids:
        known_ids = {m.id for m in mutants}
        unknown = sorted(set(ids) - known_ids)
        if unknown:
            raise MutantError(f"--ids: unknown mutants {unknown} (see --list)")
        chosen = [m for m in chosen if m.id in ids]
    return chosen


def print_list(mutants: list[Mutant], root: Path = REPO) -> int:
    """Prints the mutants; returns the number whose snippet is not exactly once in its module."""
    broken = 0
    for m in mutants:
        try:
            check(m, root)
            state = ""
        except MutantError as e:
            broken += 1
            state = f"  !! BROKEN: {e}"
        print(f"{m.id}  [{m.module}]{state}")
        print(f"    {m.description}")
        print(f"    - {m.original.strip()}")
        print(f"    + {m.mutated.strip() or '(removed)'}")
        for t in m.tests:
            print(f"    tests: {t}")
    print(f"{len(mutants)} mutants" + (f", {broken} broken" if broken else ""))
    return broken


# ----------------------------------------------------------------------------- running


def copy_repo(src: Path, dst: Path) -> Path:
    everywhere, top = shutil.ignore_patterns(*COPY_IGNORE), shutil.ignore_patterns(*TOP_IGNORE)

    def ignore(directory, names):
        skipped = everywhere(directory, names)
        return skipped | top(directory, names) if Path(directory) == src else skipped

    shutil.copytree(src, dst, ignore=ignore, symlinks=True)
    return dst


def needs_device_flag(root: Path) -> bool:
    """True unless the repository's tests/conftest.py sets the fake device count itself."""
    conftest = root / "tests" / "conftest.py"
    try:
        return "xla_force_host_platform_device_count" not in conftest.read_text("utf-8")
    except FileNotFoundError:
        return True


def child_env(copy: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if needs_device_flag(copy):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DEVICE_FLAG}".strip()
    return env


def check_imports_copy(copy: Path) -> None:
    """Stops the run unless `m2po_jax` resolves to the copy under its test environment."""
    code = "import importlib.util as u; print(u.find_spec('m2po_jax').origin)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=copy,
        env=child_env(copy),
        capture_output=True,
        text=True,
        timeout=120,
    )
    origin = out.stdout.strip()
    if out.returncode or not Path(origin).resolve().is_relative_to(copy.resolve()):
        raise RunError(
            f"m2po_jax resolves to {origin or out.stderr.strip()!r}, not the copy "
            f"{copy}: mutants would not be tested"
        )


@dataclasses.dataclass
class Outcome:
    status: str  # "caught", "survived" or "error"
    seconds: float = 0.0
    detail: str = ""  # the first failing test, or what went wrong
    output: str = ""


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
_PASSED = re.compile(r"^PASSED (\S+)", re.M)
_USAGE = re.compile(r"^ERROR: (.*)$", re.M)


def run_pytest(
    copy: Path, tests: list[Tests], k: str | None, timeout: float, report: str = "-rfE"
) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output, seconds) of one pytest run in `copy`;
    `report`: pytest's summary option (failures and errors name their node ids there)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", report]
    cmd += [t.path for t in tests]
    if k is not None:
        cmd += ["-k", k]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=copy,
        env=child_env(copy),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends all of it
    )
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    except BaseException:  # Ctrl-C: the child's own session does not get it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return code, output, time.monotonic() - start


def _groups(tests: list[Tests]) -> list[tuple[str | None, list[Tests]]]:
    """Tests sharing a -k expression run in one pytest call (order kept)."""
    groups: dict[str | None, list[Tests]] = {}
    for t in tests:
        groups.setdefault(t.k, []).append(t)
    return list(groups.items())


def _explain(code: int | None, output: str, timeout: float) -> str:
    if code is None:
        return f"timeout after {timeout:.0f} s"
    if code == 5:
        return "no tests selected"
    usage = _USAGE.findall(output)
    if usage:
        return usage[0].strip()
    if code == 2:
        return "interrupted (collection error)"
    return f"pytest exit {code}"


def missing_files(tests, root: Path) -> list[str]:
    return sorted({t.file for t in tests if not (root / t.file).is_file()})


def run_mutant(mutant: Mutant, timeout: float, workdir: Path) -> Outcome:
    """Copies the repository, applies the mutant and runs its tests there."""
    missing = missing_files(mutant.tests, REPO)
    present = [t for t in mutant.tests if t.file not in missing]
    note = f"no such test file: {', '.join(missing)}" if missing else ""
    if not present:
        return Outcome("error", 0.0, note)
    copy = copy_repo(REPO, Path(tempfile.mkdtemp(prefix=f"{mutant.id}-", dir=workdir)) / "repo")
    try:
        apply(mutant, copy)
        start = time.monotonic()
        errors = [note] if note else []
        for k, group in _groups(present):
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                errors.append(f"timeout after {timeout:.0f} s")
                break
            code, output, _ = run_pytest(copy, group, k, left)
            if code == 1:
                first = _FAILED.findall(output)
                detail = first[0] if first else "a test failed"
                return Outcome("caught", time.monotonic() - start, detail, output)
            if code != 0:
                errors.append(f"{' '.join(map(str, group))}: {_explain(code, output, left)}")
        seconds = time.monotonic() - start
        if errors:
            return Outcome("error", seconds, "; ".join(errors))
        return Outcome("survived", seconds)
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)


def clean_check(mutants: list[Mutant], timeout: float, workdir: Path) -> dict[str, str]:
    """Runs the union of the mutants' tests on an unmutated copy.

    Returns {mutant id: problem} for mutants with a selection that picks no passing test
    there (a -k that matches nothing, tests all skipped); exits if a test fails unmutated.
    """
    union: list[Tests] = []
    for m in mutants:
        for t in m.tests:
            if t not in union and (REPO / t.file).is_file():
                union.append(t)
    copy = copy_repo(REPO, workdir / "clean" / "repo")
    check_imports_copy(copy)
    passed: dict[str | None, list[str]] = {}  # -k expression -> node ids that passed
    try:
        for k, group in _groups(union):
            names = " ".join(map(str, group))
            print(f"clean: {names} ...", flush=True)
            code, output, seconds = run_pytest(copy, group, k, timeout, report="-rA")
            result = "passed" if code == 0 else _explain(code, output, timeout)
            print(f"clean: {result} ({seconds:.1f} s)", flush=True)
            if code not in (0, 5):
                tail = "\n".join(output.strip().splitlines()[-30:])
                raise RunError(
                    f"the unmutated tests do not pass ({names}: {result}); fix them "
                    f"before mutation testing:\n{tail}"
                )
            passed[k] = _PASSED.findall(output)
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
    problems = {}
    for m in mutants:
        empty = [str(t) for t in m.tests if t in union and not selects_any(t, passed[t.k])]
        if empty:
            problems[m.id] = f"selects no passing test: {', '.join(empty)}"
    return problems


def selects_any(t: Tests, passed_nodes: list[str]) -> bool:
    """Whether a node id that passed in the run of `t`'s -k group belongs to `t`."""
    return any(n == t.path or n.startswith(t.path + "::") for n in passed_nodes)


# ----------------------------------------------------------------------------- report


def table(rows: list[tuple[Mutant, Outcome]]) -> str:
    width_id = max(len(m.id) for m, _ in rows)
    width_mod = max(len(m.module) for m, _ in rows)
    lines = [f"{'id':<{width_id}}  {'module':<{width_mod}}  {'result':<8}  {'s':>6}  detail"]
    for m, o in rows:
        lines.append(
            f"{m.id:<{width_id}}  {m.module:<{width_mod}}  {o.status:<8}  "
            f"{o.seconds:>6.1f}  {o.detail}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modules", help="comma-separated module paths, e.g. m2po_jax/learner/optim.py"
    )
    parser.add_argument("--ids", help="comma-separated mutant ids")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds per mutant (its pytest runs together), and per pytest run of the clean check",
    )
    args = parser.parse_args(argv)

    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
    try:
        mutants = select(MUTANTS, split(args.modules), split(args.ids))
    except MutantError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    if args.list:
        return 2 if print_list(mutants) else 0
    if not mutants:
        print("mutants: nothing selected", file=sys.stderr)
        return 2
    try:
        for m in mutants:
            check(m)
    except MutantError as e:
        print(f"mutants: refusing to run: {e}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="m2po_mutants_") as tmp:
        workdir = Path(tmp)
        print(f"mutants: {len(mutants)} selected; clean run of their tests first", flush=True)
        try:
            problems = clean_check(mutants, args.timeout, workdir)
        except RunError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
        runnable = [m for m in mutants if m.id not in problems]
        outcomes = {
            m.id: Outcome("error", 0.0, problems[m.id]) for m in mutants if m.id in problems
        }
        with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
            futures = {pool.submit(run_mutant, m, args.timeout, workdir): m for m in runnable}
            for future in concurrent.futures.as_completed(futures):
                m = futures[future]
                outcomes[m.id] = o = future.result()
                print(f"{m.id}: {o.status} ({o.seconds:.1f} s) {o.detail}", flush=True)

    rows = [(m, outcomes[m.id]) for m in mutants]
    print()
    print(table(rows))
    caught = sum(o.status == "caught" for _, o in rows)
    survived = [m.id for m, o in rows if o.status == "survived"]
    errors = [m.id for m, o in rows if o.status == "error"]
    print(f"\nscore: {caught} / {len(rows)} caught", end="")
    print(f"; {len(survived)} survived" + (f"; {len(errors)} error" if errors else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
