"""The training loop: rollout -> stale queue -> train step -> metrics -> eval -> checkpoint.

What the run is built from is in `setup.py`, the held-out evaluation in `evaluate.py`, the
supervised warm-up in `sft.py`; this module holds the run's state and the loop over steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from m2po_jax import config as config_lib
from m2po_jax.common.config_schema import Config
from m2po_jax.common.errors import (
    M2poError,
    RewardError,
    WorkdirError,
    WriterError,
    describe_os_error,
)
from m2po_jax.common.types import RolloutBatch, TrainBatch
from m2po_jax.learner import batching, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import prompts as prompts_lib
from m2po_jax.parallel import distributed, sharding
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.rollout.worker import RolloutWorkerError
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import export as export_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.run import paths, plots, run_record
from m2po_jax.run import workdir as workdir_lib
from m2po_jax.trainer import async_rollouts as async_lib
from m2po_jax.trainer import evaluate as evaluate_lib
from m2po_jax.trainer import setup as setup_lib
from m2po_jax.trainer import sft, stopping

# Streams of the base PRNG key: every use derives its key with fold_in(stream, index).
_GEN, _TRAIN, _FILL, _INIT, _EVAL = range(5)

# The RL step: (state, batch, rng, ref_params or None) -> (new state, metrics).
StepFn = Callable[[step_lib.TrainState, TrainBatch, jax.Array, Any], tuple[Any, dict]]


class NonFiniteError(M2poError, RuntimeError):
    """Too many consecutive steps had non-finite loss or gradients."""

    what = "training stopped"


@dataclasses.dataclass
class RunResult:
    workdir: Path
    final_step: int
    eval_accuracy: list[tuple[int, float]]
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run (SIGTERM, SIGINT)
    already_finished: bool = False  # the workdir had finished before: nothing was done
    scored_by: str = ""  # what decided eval/accuracy: the reward's name (`Task.reward_name`)


class Trainer:
    """Owns the run's state; `run()` trains until `cfg.total_steps` (resuming if possible).

    Args:
      cfg: the run's config.
      workdir: where metrics, checkpoints and plots go (created if needed).
      allow_config_change: resume even where settings that change training differ from
        the ones the workdir's checkpoints were trained with (`run_record`).
      train_step: the RL step, `(state, batch, rng, ref_params) -> (state, metrics)` like
        `train_step.make_train_step`'s; None builds that jitted step for this run. The
        step in use is `self.train_step`: wrapping it observes or alters each update
        (the tests and `benchmarks/fault_drill.py` inject faults that way).
      initial_params: the params RL starts from (shaped as the model's), instead of
        `model.path` or a random init followed by the `sft` warm-up (`m2po-study` starts
        every cell from one shared warm-up so).
    """

    def __init__(
        self,
        cfg: Config,
        workdir: str | Path,
        *,
        train_step: StepFn | None = None,
        allow_config_change: bool = False,
        initial_params=None,
    ):
        self.cfg = cfg
        self.allow_config_change = allow_config_change
        self.workdir = paths.workdir(workdir)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WorkdirError(describe_os_error(e, self.workdir)) from e
        self.rng = jax.random.key(cfg.seed)
        s = self.setup = setup_lib.build(cfg)
        self.task, self.tokenizer, self.prompts = s.task, s.tokenizer, s.prompts
        self.model_config, self.placement = s.model_config, s.placement
        self.sampling_config, self.memory_plan = s.sampling_config, s.memory_plan
        total_updates = cfg.total_steps * cfg.actor.ppo_n_minibatches
        self.tx, self.schedule = optim.make_optimizer(cfg.actor.optimizer, total_updates)
        self.warm_started = initial_params is not None
        if initial_params is None:
            initial_params = setup_lib.initial_params(s, jax.random.fold_in(self.rng, _INIT))
        self.state = setup_lib.init_state(s, initial_params, self.tx)
        # sync rollouts' weights: `rollout.weight_dtype`'s copy in the engine's layout
        self.rollout_weights = placement_lib.SamplingCopy(
            sharding.param_shardings(
                s.engine.model_config, self.placement.mesh, sharding.SAMPLE_RULES
            ),
            config_lib.rollout_weight_dtype(cfg),
        )
        self.train_step = self._jitted_step() if train_step is None else train_step
        self.ref_params = None
        self.queue = rollout_lib.StaleQueue(cfg.rollout.max_head_offpolicyness)
        self.data_position = 0
        self.sft_steps = 0
        self.sft_log: list[dict] = []
        self.checkpointer = ckpt_lib.Checkpointer(self.workdir, keep=cfg.checkpoint.keep)
        # rollout.mode="async": the worker side, made when the run starts (`_start_async`)
        self.async_rollouts: async_lib.AsyncRollouts | None = None
        self.stop = stopping.RunStop()
        self._warmup_resume: sft.Warmup | None = None
        self._base_identity: dict | None = None  # `lora_base`'s, once computed

    def _jitted_step(self) -> StepFn:
        """The jitted train step (`setup.build_train_step`: what the benchmarks compile)."""
        return setup_lib.build_train_step(
            self.cfg, self.model_config, self.tx, self.schedule, self.placement, self.state
        )

    # ---- evaluation and warm-up ---------------------------------------------------------

    def evaluate(self, params=None) -> float:
        """Held-out accuracy of `params` (default: the current policy): `eval/accuracy`."""
        return self.evaluate_all(params)["eval/accuracy"]

    @property
    def scored_by(self) -> str:
        """What decides `eval/accuracy` (`eval.reward`): the training reward or the verifier."""
        if self.cfg.eval.reward == "train":
            return self.task.reward_name
        return self.task.verifier_name

    def evaluate_all(self, params=None) -> dict[str, float]:
        """Every held-out metric of `params` (`evaluate.evaluate`: per set, avg@k, pass@k)."""
        params = self.state.params if params is None else params
        return evaluate_lib.evaluate(self.setup, params, jax.random.fold_in(self.rng, _EVAL))

    def supervised_warmup(self) -> bool:
        """The warm-up of `cfg.sft` (nothing when `sft.max_steps` is 0); RL starts from it.

        A stop agreed during it (a signal) ends it after that warm-up step with a
        checkpoint of the warm-up (step 0), which a resume continues; returns True then."""
        if self.cfg.sft.max_steps == 0 or self.warm_started:
            return False
        warm = sft.supervised_warmup(
            self.setup,
            self.state.params,
            self.evaluate,
            resume=self._warmup_resume,
            should_stop=self.stop.agreed,
        )
        self._warmup_resume = None
        self.sft_steps = warm.steps
        self.sft_log = list(warm.log)
        self.state = setup_lib.init_state(self.setup, warm.params, self.tx)
        if not warm.stopped:
            return False
        self.checkpointer.save(
            0,
            state=self.state,
            rng=self.rng,
            queue=[],
            meta={
                "data_position": 0,
                "sft_steps": warm.steps,
                "warmup_unfinished": True,
                "sft_log": warm.log,
            },
            warmup_opt_state=warm.opt_state,
        )
        if jax.process_index() == 0:
            metrics_lib.say(
                f"warm-up stopped after step {warm.steps} of {self.cfg.sft.max_steps}; saved "
                f"{self.checkpointer.step_dir(0)} (the same command continues it)"
            )
        return True

    # ---- checkpoints --------------------------------------------------------------------

    def save(
        self, writer: metrics_lib.MetricsWriter | None = None, *, pause_worker: bool = True
    ) -> None:
        """Checkpoints the state unless its step is committed already (never rewritten)."""
        step = int(self.state.step)
        if step in self.checkpointer.all_steps():
            return
        if writer is not None:
            # The rows (and events) of the steps before the checkpoint reach the disk first.
            writer.flush()
        queue, position = self.queue.state(), self.data_position
        stuck = None
        if self.async_rollouts is not None and self.async_rollouts.worker is not None:
            # The worker pauses; its buffer (every process's rows) is what the queue holds.
            try:
                batches, next_index = self.async_rollouts.checkpoint_view(pause=pause_worker)
            except RolloutWorkerError as e:  # stuck: its buffer no longer changes
                stuck = e
                batches, next_index = self.async_rollouts.checkpoint_view(pause=False)
            queue, position = batches, next_index * self.cfg.rollout.batch_size
        try:
            self.checkpointer.save(
                step,
                state=self.state,
                rng=self.rng,
                queue=queue,
                meta={"data_position": position, "sft_steps": self.sft_steps},
                ref_params=self.ref_params,
                base=self.lora_base(),
            )
        finally:
            if self.async_rollouts is not None:
                self.async_rollouts.resume()
        if stuck is not None:
            raise stuck

    def try_resume(self, restore_step: int | None = None) -> bool:
        """Restores the newest checkpoint that verifies (or `restore_step`); False if none."""
        step = self.checkpointer.choose(restore_step, warn=logging.warning)
        if step is None:
            return False
        if self.checkpointer.meta(step).get("warmup_unfinished"):
            return self._resume_warmup(step)
        # (Under LoRA the reference is the model with its adapters off: none is saved.)
        need_ref = setup_lib.needs_reference(self.cfg, self.model_config)
        restored = self.checkpointer.restore(
            step,
            state_like=self.state,
            ref_like=self.state.params if need_ref else None,
            base=self.lora_base(),
        )
        if jax.process_index() == 0:
            metrics_lib.say(f"resuming from checkpoint {self.checkpointer.step_dir(step)}")
        self.state = restored["state"]
        self.rng = restored["rng"]
        self.queue = rollout_lib.StaleQueue(
            self.cfg.rollout.max_head_offpolicyness, restored["queue"]
        )
        self.data_position = restored["meta"]["data_position"]
        self.sft_steps = restored["meta"]["sft_steps"]
        self.ref_params = restored["ref_params"]
        return True

    def lora_base(self) -> dict | None:
        """The frozen base's `checkpoint.base_identity` when checkpoints hold the LoRA
        adapters alone: a LoRA run whose base is `model.path`'s weights as loaded (no
        warm-up trained it, no `initial_params` replaced it), which a resume loads again.
        A warm-up under a quantised base trains the adapters alone (`sft.warmup_split`),
        so such a run keeps its base. None otherwise: the whole params are saved."""
        if not (self.model_config.lora_rank and self.cfg.model.path):
            return None
        base_trained = self.sft_steps and self.model_config.lora_base == "float"
        if self.warm_started or base_trained:
            return None
        if self._base_identity is None:
            self._base_identity = ckpt_lib.base_identity(self.cfg.model.path, self.state.params)
        return self._base_identity

    def _resume_warmup(self, step: int) -> bool:
        """An unfinished warm-up (checkpoint 0): `_begin` continues it. Returns False (RL
        has not begun)."""
        restored = self.checkpointer.restore(
            step,
            state_like=self.state,
            warmup_like=sft.init_opt_state(self.setup, self.state.params),
        )
        meta = restored["meta"]
        self.rng = restored["rng"]
        self._warmup_resume = sft.Warmup(
            restored["state"].params,
            meta["sft_steps"],
            list(meta.get("sft_log", [])),
            opt_state=restored["warmup_opt_state"],
        )
        if jax.process_index() == 0:
            metrics_lib.say(
                f"continuing the warm-up from step {meta['sft_steps']} "
                f"({self.checkpointer.step_dir(step)})"
            )
        return False

    def _where_saved(self) -> str:
        """Where the last checkpoint is, for the line of a process that ends at once."""
        steps = [s for s in self.checkpointer.all_steps() if self.checkpointer.verify(s) is None]
        if not steps:
            return "no checkpoint yet"
        return f"the last checkpoint is {self.checkpointer.step_dir(steps[-1])}"

    # ---- the loop -----------------------------------------------------------------------

    def run(self, stop_after: int | None = None, restore_step: int | None = None) -> RunResult:
        """Trains to `total_steps` (or `stop_after` more steps, for tests); resumes if possible.

        Holds the workdir's lock throughout (process 0). Resumes from the newest checkpoint
        that verifies, or from `restore_step` (newer checkpoints are then set aside). The
        metrics writers and the progress bar are closed however the run ends.
        """
        cfg = self.cfg
        primary = jax.process_index() == 0
        accuracies: list[tuple[int, float]] = []
        wandb = {"project": cfg.logging.wandb_project} if cfg.logging.wandb_project else None
        with workdir_lib.hold(self.workdir, enabled=primary):
            changed = run_record.check_and_record(
                self.workdir,
                run_record.describe(cfg, self.model_config),
                resuming=bool(self.checkpointer.all_steps()),
                allow_change=self.allow_config_change,
                write=primary,
            )
            if changed and primary:
                logging.warning("resuming with changed settings: %s", ", ".join(changed))
            resumed = self.try_resume(restore_step)
            start = int(self.state.step)
            if resumed and start >= cfg.total_steps and stop_after is None:
                return RunResult(self.workdir, start, [], already_finished=True)
            with contextlib.ExitStack() as stack:
                writer = stack.enter_context(
                    metrics_lib.MetricsWriter(
                        self.workdir,
                        tensorboard=cfg.logging.tensorboard,
                        is_primary=primary,
                        wandb=wandb,
                        resume_step=start if resumed else 0,
                    )
                )
                stack.enter_context(self.stop.signals(self._where_saved))
                if self.setup.rewards is not None:  # its worker processes end with the run
                    stack.callback(self.setup.rewards.close)
                if self.setup.agent is not None:  # and the agent's threads, after the worker's
                    stack.callback(self.setup.agent.close)
                distributed.set_lost_peer_note(self._where_saved)
                interrupted = not resumed and self._begin()
                end = cfg.total_steps if stop_after is None else start + stop_after
                end = min(end, cfg.total_steps)
                if not interrupted:
                    # opened after the warm-up, whose lines are its own (no bar at 0/N)
                    progress = stack.enter_context(
                        metrics_lib.ProgressBar(
                            cfg.total_steps, initial=start, enabled=cfg.logging.progress and primary
                        )
                    )
                    if cfg.rollout.mode == "async":
                        stack.push(self._stop_async)
                        self._start_async()
                    interrupted = self._loop(writer, progress, start, end, accuracies)
            if cfg.logging.plots and primary:
                self._plot()
        signum = self.stop.signal if interrupted else None
        return RunResult(
            self.workdir,
            int(self.state.step),
            accuracies,
            interrupted,
            signum,
            scored_by=self.scored_by,
        )

    def _plot(self) -> None:
        """The run's PNGs in the workdir (an async run's timeline too)."""
        try:
            plots.plot_metrics(
                self.workdir / metrics_lib.METRICS_FILE,
                self.workdir,
                tau=self.cfg.actor.m2_threshold,
            )
            if self.async_rollouts is not None:
                spans = self.async_rollouts.timeline.spans()
                plots.plot_timeline(spans, self.workdir / "timeline.png")
        except OSError as e:
            raise WriterError(describe_os_error(e, self.workdir)) from e

    def _begin(self) -> bool:
        """A new run: the warm-up, the KL reference policy, and k batches in the queue.
        True if a stop ended it during the warm-up."""
        if self.supervised_warmup():
            return True
        # The step's KL reference (`setup.reference_params`: None under LoRA, where the
        # step takes the model with its adapters off).
        ref = setup_lib.reference_params(self.cfg, self.model_config, self.state.params)
        self.ref_params = None if ref is None else jax.tree.map(jnp.copy, ref)
        if self.cfg.rollout.mode == "async":
            return False  # the worker fills its buffer as soon as it starts
        for i in range(self.cfg.rollout.max_head_offpolicyness):
            rng = jax.random.fold_in(jax.random.fold_in(self.rng, _FILL), i)
            self.queue.push(self._rollout(rng, version=0)[0])
        self.rollout_weights.release()  # before step 0's evaluation
        return False

    def _start_async(self) -> None:
        """Starts the rollout worker with the buffered batches of the queue (a resume)."""
        a = self.async_rollouts = async_lib.AsyncRollouts(self.setup, self.rng, _GEN)
        buffered = [a.local_share(b) for b in self.queue.state()]
        self.queue = rollout_lib.StaleQueue(0)
        next_index = self.data_position // self.cfg.rollout.batch_size
        a.start(self.state.params, int(self.state.step), buffered, next_index)

    def _stop_async(self, exc_type, exc, tb) -> bool:
        """Ends the rollout worker with the run. After an error, a worker that does not
        stop within 10 s is left behind (a daemon thread) with a warning: the error that
        ended the run is what gets reported, and the process does not hang."""
        if self.async_rollouts is None:
            return False
        timeout = self.cfg.rollout.worker_timeout_s
        try:
            self.async_rollouts.stop(timeout if exc is None else min(timeout, 10.0))
        except RolloutWorkerError as e:
            if exc is None:
                raise
            logging.warning("%s", e)
        return False

    def _loop(self, writer, progress, start: int, end: int, accuracies: list) -> bool:
        """Steps `start` .. `end - 1`, then a checkpoint; True if a stop ended them early.

        A stop (a signal or `request_stop` on any process) ends every process after the
        same step (`RunStop.agreed`), with one checkpoint; one agreed at the run's last step
        lets the run finish.

        Each step's row is written; its evaluations are appended to `accuracies` too. A
        step's device metrics are fetched one step late, after the next update has been
        dispatched (its rollout has waited for the update by then), so the host never
        waits for them; a step that evaluates, saves, stops or ends the loop has its row
        written at once.
        """
        cfg = self.cfg
        pending = None  # (step, record, device metrics) of the previous step
        for step in range(start, end):
            # Step 0 evaluates the initial policy; later evaluations follow the update.
            evaluation = self.evaluate_all() if step == 0 else None
            try:
                record, device_metrics = self._step(step)
            except (RolloutWorkerError, RewardError):
                # The learner's state so far; the worker's unfinished batch is made again.
                # (With several processes a save is a collective the others, waiting in the
                # step, never join: they notice this one is gone and stop.)
                if jax.process_count() == 1:
                    self.save(writer, pause_worker=False)
                raise
            if self.setup.rewards is not None:
                record["reward/timeouts"] = self.setup.rewards.take_timeouts()
            # which sampler made the rollouts (rollout.engine=auto decides by the budget)
            record["rollout/continuous_engine"] = float(self.setup.engine.name == "continuous")
            record["rollout/paged_engine"] = float(self.setup.engine.name == "paged")
            stop = self.stop.agreed() and step + 1 < cfg.total_steps
            if pending is not None:
                self._finish(writer, progress, *pending, current=(step, record, device_metrics))
                pending = None
            last = step + 1 == cfg.total_steps
            if evaluation is None and (
                last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)
            ):
                evaluation = self.evaluate_all()
            accuracy = None
            if evaluation is not None:
                record.update(evaluation)
                accuracy = evaluation["eval/accuracy"]
                accuracies.append((step, accuracy))
            save = cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0
            export = cfg.checkpoint.hf_every and (step + 1) % cfg.checkpoint.hf_every == 0
            if not (save or export or accuracy is not None or stop or step + 1 == end):
                pending = (step, record, device_metrics)
                continue
            self._finish(writer, progress, step, record, device_metrics)
            if stop:
                self.save(writer)
                return True
            if save:
                self.save(writer)
            if export and step + 1 < cfg.total_steps:
                self.export_hf()
        self.save(writer)
        if int(self.state.step) >= cfg.total_steps:
            self.export_hf()
        return False

    def export_hf(self):
        """`<workdir>/hf/step_<N>` for the current params (`trainer.export`), when the model
        came from a Hugging Face directory; returns its path, or None."""
        c = self.cfg.checkpoint
        if not self.cfg.model.path:
            return None
        return export_lib.export_run_step(
            self.workdir,
            int(self.state.step),
            self.state.params,
            self.model_config,
            self.cfg.model.path,
            dtype=c.hf_dtype,
            keep=c.hf_keep,
        )

    def _finish(self, writer, progress, step, record, device_metrics, current=None) -> None:
        """Writes `step`'s row with its device metrics; stops the run after too many
        non-finite steps in a row. `current`: the step dispatched since, whose row is
        written too before such a stop (the checkpoint then holds its state)."""
        record.update(metrics_lib.host_metrics(device_metrics))
        writer.write(step, record)
        progress.update(step + 1, record)
        if not record.get("train/nonfinite"):
            return
        skipped = int(record["train/nonfinite_steps"])
        logging.warning(
            "step %d: non-finite loss or gradients; update skipped (%d in a row)", step, skipped
        )
        if skipped < self.cfg.max_nonfinite_steps:
            return
        if current is not None:
            step, record, device_metrics = current
            record.update(metrics_lib.host_metrics(device_metrics))
            writer.write(step, record)
            progress.update(step + 1, record)
        # The failing steps have their rows; the checkpoint holds the last good params.
        self.save(writer)
        raise NonFiniteError(
            f"max_nonfinite_steps: {skipped} consecutive steps had non-finite loss or "
            f"gradients (the last of them: step {step}); the last good state is saved in "
            f"{self.checkpointer.directory}"
        )

    def _rollout(self, rng, version: int) -> tuple[RolloutBatch, int, dict]:
        """The next prompts' rollout batch, how many of its prompts were cut to fit, and
        the engine's decode metrics (none for the static sampler)."""
        cfg = self.cfg
        examples = self.task.train_examples(self.data_position, cfg.rollout.batch_size)
        self.data_position += cfg.rollout.batch_size
        known = self.task.prompt_lengths
        truncated = prompts_lib.count_long(examples, self.prompts, cfg.task.max_prompt_len, known)
        sampled = rollout_lib.sample_rollout(
            self.rollout_weights(self.state.params, version),
            self.setup.engine.model_config,
            self.sampling_config,
            examples,
            self.prompts,
            rng,
            n_samples=cfg.gconfig.n_samples,
            version=version,
            max_prompt_len=cfg.task.max_prompt_len,
            placement=self.placement,
            engine=self.setup.engine,
            agent=self.setup.agent,
        )
        if sampled.episodes is not None:  # an agent's prompts are its resets' (counted there)
            truncated = sampled.episodes.prompts_truncated
        rewards = self.setup.rewards or self.task.reward
        batch = rollout_lib.score_rollout(sampled, rewards, cfg.rollout.reward_workers)
        return batch, truncated, metrics_lib.rollout_stats(sampled)

    def _step(self, step: int) -> tuple[dict, dict]:
        """One RL step: a fresh rollout into the queue, an update on the stale one.

        Returns its row's host part and the update's metrics, still on the device: the
        update is dispatched, not waited for. "time/rollout_s" includes waiting for the
        previous update (the sampler needs its params); "time/train_s" is preparing and
        dispatching this one.
        """
        if self.async_rollouts is not None:
            return self._step_async(step)
        t0 = time.perf_counter()
        gen_rng = jax.random.fold_in(jax.random.fold_in(self.rng, _GEN), step)
        fresh, truncated, engine_record = self._rollout(gen_rng, version=step)
        self.rollout_weights.release()  # not held beside the train step
        self.queue.push(fresh)
        host = self.queue.pop()
        t1 = time.perf_counter()
        # Train on the columns that were generated: the longest completion, rounded up to
        # a bucket so that only a few shapes are ever compiled.
        trimmed, width = batching.trim_completions(
            host.arrays(), self.cfg.task.max_prompt_len, self.cfg.gconfig.max_new_tokens
        )
        batching.check_prompt_groups(
            host.tokens_BxT,
            host.valid_BxT,
            self.cfg.task.max_prompt_len,
            self.cfg.gconfig.n_samples,
        )
        batch = self.placement.to_global(rollout_lib.train_batch(host.replace(**trimmed)))
        train_rng = jax.random.fold_in(jax.random.fold_in(self.rng, _TRAIN), step)
        self.state, device_metrics = self.train_step(self.state, batch, train_rng, self.ref_params)
        t2 = time.perf_counter()
        rewards = host.rewards_B
        record = metrics_lib.staleness_stats(host.version_B, step)
        record.update(metrics_lib.token_staleness(host.version_BxT, host.loss_mask_BxT, step))
        record.update(engine_record)
        tokens = int(host.loss_mask_BxT.sum()) + int(fresh.loss_mask_BxT.sum())
        record.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()),
                "rollout/fresh_reward_mean": float(fresh.rewards_B.mean()),
                "rollout/completion_len_mean": float(host.completion_len_B.mean()),
                "rollout/stopped_fraction": float(host.stopped_B.mean()),
                "train/completion_width": width,
                "train/padding_fraction": 1.0
                - float(host.loss_mask_BxT.sum()) / max(host.loss_mask_BxT.shape[0] * width, 1),
                "rollout/prompts_truncated": truncated,
                "time/rollout_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/tokens_per_s": tokens / max(t2 - t0, 1e-9),
            }
        )
        filtered = self.task.prompts_filtered
        if filtered is not None:
            record["data/prompts_filtered"] = filtered["train"]
            record["data/eval_prompts_filtered"] = filtered["eval"]
        return record, device_metrics

    def _step_async(self, step: int) -> tuple[dict, dict]:
        """One learner step of an async run: take the oldest finished batch (waiting if
        none is), train on it, publish the new weights to the rollout devices.

        Unlike the sync step, it waits for the update to finish, so "time/train_s" is the
        update's time and the busy fractions are measured, not guessed.
        """
        a = self.async_rollouts
        t0 = time.perf_counter()
        local = a.take(step)
        t1 = time.perf_counter()
        batch, shared, width = a.train_input(local)
        train_rng = jax.random.fold_in(jax.random.fold_in(self.rng, _TRAIN), step)
        self.state, device_metrics = self.train_step(self.state, batch, train_rng, self.ref_params)
        jax.block_until_ready(self.state)
        t2 = time.perf_counter()
        a.timeline.add("learner/train", t1, t2)
        publish_s = a.publish(self.state.params, step + 1)
        record = a.step_record(shared, width, step, (t0, t1, t2, time.perf_counter()), publish_s)
        return record, device_metrics

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stops `run()` after the step it is on, with a checkpoint, as SIGTERM does; before
        `run()` has begun, after its first step. With several processes, every one stops
        after the same step. Its `RunResult` names `signum`."""
        self.stop.request(signum)
