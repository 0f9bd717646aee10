"""The rollout side of an async run (`rollout.mode = "async"`), as the trainer drives it.

Each process gives some of its devices to rollouts (`setup.build`: `mesh.rollout_devices`)
and runs a `rollout.worker.RolloutWorker` thread on them. The worker generates this
process's share of each batch's prompts (the rows the process feeds to the train step)
with the newest weights published, under `rollout.staleness.Admission`; the learner
takes the oldest finished batch, trains, and publishes its new weights
(`placement.WeightPublisher`: a copy inside each process, converted to
`rollout.weight_dtype` on the way). Under LoRA it publishes only the adapters each step:
the frozen base goes to the rollout devices once, when the worker starts (quantised then,
under weight_dtype int8 / float8_e4m3fn), and the worker runs `lora.merge(adapters, base)`
(`worker.WeightSlot`). The
rollout programs use this process's devices only, so no collective of theirs can
interleave with the train step's across processes (two programs with collectives, run by
two threads on a `jax.distributed` CPU cluster, hang).

Batch `i` holds the prompts `i * B .. (i + 1) * B - 1` of the task's stream: its rows'
`group_id_B` are those prompt ids, which is how a checkpoint keeps a resumed run from
losing or repeating prompts.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from m2po_jax import config as config_lib
from m2po_jax.common.types import RolloutBatch
from m2po_jax.learner import batching
from m2po_jax.models import lora
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.rollout import staleness
from m2po_jax.rollout import worker as worker_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.trainer.setup import RunSetup


class AsyncRollouts:
    """Worker, buffer, admission counters and weight publication of one async run.

    Args:
      run: the run's setup (`run.rollout_placement` set).
      rng: the run's base key; batch `i` samples with `fold_in(gen_stream, i)`, folded
        with the process index.
      gen_stream: the key stream of rollouts (the trainer's `_GEN`).
    """

    def __init__(self, run: RunSetup, rng: jax.Array, gen_stream: int):
        cfg = self.cfg = run.cfg
        self.run = run
        self.batch_size = cfg.rollout.batch_size
        self.k = cfg.rollout.max_head_offpolicyness
        self.timeout = cfg.rollout.worker_timeout_s
        n = cfg.gconfig.n_samples
        self.rows = self.batch_size * n
        local = run.placement.local_rows(self.rows)
        self.prompts = slice(local.start // n, local.stop // n)
        self.rng = jax.random.fold_in(jax.random.fold_in(rng, gen_stream), 0)
        # the rollouts' weights (`setup.rollout_model_config`): converted at each publish
        shardings = run.rollout_placement.sample_params
        dtype = config_lib.rollout_weight_dtype(cfg)
        # Under LoRA: one publisher for the adapters (every step), one for the base (once).
        self.lora = bool(run.model_config.lora_rank)
        self.base_publisher = None
        if self.lora:
            adapter_shardings, base_shardings = lora.split(shardings)
            shardings = adapter_shardings
            self.base_publisher = placement_lib.WeightPublisher(base_shardings, dtype)
        self.publisher = placement_lib.WeightPublisher(shardings, dtype)
        self.unreported_bytes = 0  # published since the last step's record
        self.timeline = worker_lib.Timeline()
        self.engine_records: dict[int, dict] = {}  # batch index -> its decode metrics
        self.buffer = worker_lib.RolloutBuffer()
        self.worker: worker_lib.RolloutWorker | None = None
        self.admission: staleness.Admission | None = None
        self.weights: worker_lib.WeightSlot | None = None

    # ---- the worker's batches -----------------------------------------------------------

    def _examples_and_rng(self, index: int):
        """This process's examples of batch `index` and their sampling key."""
        examples = self.run.task.train_examples(index * self.batch_size, self.batch_size)
        rng = jax.random.fold_in(jax.random.fold_in(self.rng, index), jax.process_index())
        return examples[self.prompts], rng

    def _tagged(self, index: int, sampled: rollout_lib.SampledRollout):
        """`sampled` with the global prompt ids of batch `index` and its decode metrics kept."""
        self.engine_records[index] = metrics_lib.rollout_stats(sampled)
        first = index * self.batch_size + self.prompts.start
        batch = sampled.batch.replace(group_id_B=sampled.batch.group_id_B + np.int32(first))
        return dataclasses.replace(sampled, batch=batch)

    def generate_many(self, first: int, count: int, version: int, params):
        """Batches first .. first + count - 1 (this process's share) through one streaming
        call of the continuous engine, each yielded as soon as its sequences end."""
        shares = [self._examples_and_rng(i) for i in range(first, first + count)]
        made = rollout_lib.stream_rollouts(
            params,
            self.run.sampling_config,
            [examples for examples, _ in shares],
            self.run.prompts,
            [rng for _, rng in shares],
            n_samples=self.cfg.gconfig.n_samples,
            version=version,
            max_prompt_len=self.cfg.task.max_prompt_len,
            engine=self.run.engine,
            weights=self._newest if self.cfg.rollout.inflight_updates else None,
        )
        for i, sampled in enumerate(made):
            yield self._tagged(first + i, sampled)

    def generate(self, index: int, version: int, params) -> rollout_lib.SampledRollout:
        """This process's share of batch `index`, sampled with `params`, not scored yet."""
        run = self.run
        examples, rng = self._examples_and_rng(index)
        sampled = rollout_lib.sample_rollout(
            params,
            run.model_config,
            run.sampling_config,
            examples,
            run.prompts,
            rng,
            n_samples=self.cfg.gconfig.n_samples,
            version=version,
            max_prompt_len=self.cfg.task.max_prompt_len,
            placement=run.rollout_placement,
            engine=run.engine,
            weights=self._newest if self.cfg.rollout.inflight_updates else None,
            agent=run.agent,
        )
        return self._tagged(index, sampled)

    def _newest(self):
        """(params, version) of the newest published weights, polled by the continuous
        engine between decode calls (`rollout.inflight_updates`)."""
        version, params = self.weights.latest()
        return params, version

    def score(self, sampled: rollout_lib.SampledRollout) -> RolloutBatch:
        """The rewards of a sampled batch (the task's reward function, on the host)."""
        workers = self.cfg.rollout.reward_workers
        return rollout_lib.score_rollout(sampled, self.run.rewards or self.run.task.reward, workers)

    # ---- start, publish, take -----------------------------------------------------------

    def start(self, params, version: int, buffered: list[RolloutBatch], next_index: int) -> None:
        """Starts the worker at batch `next_index` with `buffered` batches (this process's
        rows) waiting and the counters of a run at `version`."""
        self.buffer = worker_lib.RolloutBuffer(buffered)
        self.admission = staleness.Admission.restored(
            self.k, self.batch_size, version, len(buffered) * self.batch_size
        )
        self.weights = worker_lib.WeightSlot(version, *self._copies(params, with_base=True))
        self.worker = worker_lib.RolloutWorker(
            self.generate,
            self.score,
            self.admission,
            self.weights,
            self.buffer,
            batch_size=self.batch_size,
            first_index=next_index,
            end_index=self.cfg.total_steps,
            timeline=self.timeline,
            generate_many=self.generate_many,
            batches_per_call=self.cfg.rollout.stream_batches,
        )
        self.worker.start()

    def _copies(self, params, with_base: bool) -> tuple:
        """(the published copy, its base or None) of the learner's `params` on the rollout
        devices, waited for: the whole params, or under LoRA the adapters (and the base
        when `with_base`). Adds their bytes to `unreported_bytes`."""
        base = None
        if self.lora:
            params, frozen = lora.split(params)
            if with_base:
                base = jax.block_until_ready(self.base_publisher(frozen))
        copy = jax.block_until_ready(self.publisher(params))
        self.unreported_bytes += tree_bytes(copy) + (0 if base is None else tree_bytes(base))
        return copy, base

    def publish(self, params, version: int, base_changed: bool = False) -> float:
        """Publishes `params` (policy `version`) to the worker; returns the seconds taken
        (the copy waited for, so the time is the copy's). Under LoRA only the adapters are
        copied: the base the worker holds is the learner's (the train step leaves it
        bit-identical), unless `base_changed` says it is not."""
        t0 = time.perf_counter()
        copy, base = self._copies(params, with_base=base_changed)
        self.weights.publish(version, copy, base)
        t1 = time.perf_counter()
        self.timeline.add("learner/publish", t0, t1)
        return t1 - t0

    def take(self, step: int) -> RolloutBatch:
        """The oldest finished batch (this process's rows) for update `step`; waits for it.

        Raises RolloutWorkerError (the worker's traceback, or what it was stuck in after
        `rollout.worker_timeout_s`), and RuntimeError if a row is staler than k (the
        admission rule makes that impossible; training on it would break the bound).
        """
        t0 = time.perf_counter()
        batch = self.buffer.get(self.timeout, self.worker.describe)
        self.timeline.add("learner/wait", t0, time.perf_counter())
        oldest = int(batch.version_B.min())
        if step - oldest > self.k:
            raise RuntimeError(
                f"async rollouts: batch {int(batch.group_id_B[0]) // self.batch_size} "
                f"(policy version {oldest}) is {step - oldest} updates stale at step {step}; "
                f"rollout.max_head_offpolicyness={self.k}"
            )
        return batch

    def train_input(self, local: RolloutBatch):
        """(the global train batch, every process's [B] fields, completion width) for this
        process's rows of a batch: every process cuts to the same width (the longest
        completion of any process's rows)."""
        cfg = self.cfg
        prompt_len = cfg.task.max_prompt_len
        rows = local.rewards_B.shape[0]
        shared = self.gather(
            {
                "version_B": local.version_B,
                "rewards_B": local.rewards_B,
                "completion_len_B": local.completion_len_B,
                "stopped_B": local.stopped_B,
                "group_id_B": local.group_id_B,
                "tokens_B": local.loss_mask_BxT.sum(axis=1),
                "token_versions_B": (local.version_BxT * local.loss_mask_BxT).sum(axis=1),
                "longest_B": np.full(
                    (rows,), batching.longest_completion(local.valid_BxT, prompt_len)
                ),
            }
        )
        trimmed, width = batching.trim_completions(
            local.arrays(),
            prompt_len,
            cfg.gconfig.max_new_tokens,
            longest=int(shared["longest_B"].max()),
        )
        batching.check_prompt_groups(
            local.tokens_BxT, local.valid_BxT, prompt_len, cfg.gconfig.n_samples
        )
        train = rollout_lib.train_batch(local.replace(**trimmed))
        return self.run.placement.from_local(train, self.rows), shared, width

    def step_record(self, shared: dict, width: int, step: int, times, publish_s: float) -> dict:
        """A learner step's metrics row (host part). `times`: (start, batch taken, update
        done, weights published), perf_counter seconds."""
        t0, t1, t2, t3 = times
        wall = max(t3 - t0, 1e-9)
        tokens = int(shared["tokens_B"].sum())
        rollout_s = self.timeline.busy("rollout", t0, t3)
        record = metrics_lib.staleness_stats(shared["version_B"], step)
        mean_version = shared["token_versions_B"].sum() / max(tokens, 1)
        record["staleness/token_mean"] = float(step - mean_version)
        index = int(shared["group_id_B"].min()) // self.batch_size
        record.update(self.engine_records.pop(index, {}))
        for older in [i for i in list(self.engine_records) if i < index]:
            del self.engine_records[older]  # batches discarded, or made before a resume
        record.update(
            {
                "reward/mean": float(shared["rewards_B"].mean()),
                "reward/std": float(shared["rewards_B"].std()),
                "rollout/completion_len_mean": float(shared["completion_len_B"].mean()),
                "rollout/stopped_fraction": float(shared["stopped_B"].mean()),
                "rollout/buffer_batches": len(self.buffer),
                # the prompts trained on: batch i holds prompts i * B .. (i + 1) * B - 1
                "data/first_prompt": int(shared["group_id_B"].min()),
                "data/prompts": int(np.unique(shared["group_id_B"]).size),
                "train/completion_width": width,
                "train/padding_fraction": 1.0 - tokens / max(len(shared["tokens_B"]) * width, 1),
                "time/wait_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/publish_s": publish_s,
                # bytes copied to the rollout devices since the last record (one copy of
                # each published leaf): the first step's count has the start's whole
                # weights too; under LoRA the later ones are the adapters' only
                "rollout/published_bytes": self.unreported_bytes,
                "time/rollout_s": rollout_s,
                "time/tokens_per_s": tokens / wall,
                "busy/learner": (t3 - t1) / wall,
                "busy/rollout": rollout_s / wall,
            }
        )
        for reason, prompts in self.admission.counts().discarded.items():
            record[f"rollout/discarded/{reason.replace(' ', '_')}"] = prompts
        self.unreported_bytes = 0
        return record

    # ---- checkpoints and the end --------------------------------------------------------

    def checkpoint_view(self, pause: bool = True) -> tuple[list[RolloutBatch], int]:
        """(the buffered batches with every process's rows, the next batch to generate):
        what a checkpoint stores. Pauses the worker (its batch in flight finishes first);
        `resume()` lets it go on. Batches that some process has not finished yet are
        left out (a resumed run generates them again). `pause=False`: a failed or stuck
        worker, whose buffer no longer changes."""
        if pause and self.worker.is_alive():
            self.worker.pause(self.timeout)
        local = self.buffer.state()
        mine = self.worker.next_index
        agreed = int(self.gather({"n": np.full((self.rows_local,), mine)})["n"].min())
        kept = [b for b in local if self.index_of(b) < agreed]
        return [self.gather(b) for b in kept], agreed

    def resume(self) -> None:
        if self.worker is not None and self.worker.is_alive():
            self.worker.resume()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the worker after its batches in flight (`timeout`: default
        `rollout.worker_timeout_s`)."""
        if self.worker is not None:
            self.worker.stop(self.timeout if timeout is None else timeout)

    def local_share(self, full: RolloutBatch) -> RolloutBatch:
        """This process's rows of a batch with every process's rows."""
        rows = self.run.placement.local_rows(self.rows)
        return jax.tree.map(lambda x: x[rows], full)

    def index_of(self, batch: RolloutBatch) -> int:
        return int(batch.group_id_B[0]) // self.batch_size

    @property
    def rows_local(self) -> int:
        r = self.run.placement.local_rows(self.rows)
        return r.stop - r.start

    def gather(self, tree):
        """Every process's rows of `tree` (arrays of this process's rows), on every
        process: one small all-gather over the train mesh (none with one process)."""
        if jax.process_count() == 1:
            return tree
        placement = self.run.placement
        return placement.to_host(placement.from_local(tree, self.rows))


def tree_bytes(tree) -> int:
    """Bytes of a tree's arrays (one copy of each leaf, at its dtype)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
