"""The training loop: rollout -> stale queue -> train step -> metrics -> eval -> checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from m2po_jax import batching, memory, sampling, sharding
from m2po_jax import checkpoint as ckpt_lib
from m2po_jax import metrics as metrics_lib
from m2po_jax import model as model_lib
from m2po_jax import placement as placement_lib
from m2po_jax import prompts as prompts_lib
from m2po_jax import rollout as rollout_lib
from m2po_jax import tokenizer as tokenizer_lib
from m2po_jax import train_step as step_lib
from m2po_jax import workdir as workdir_lib
from m2po_jax.config import Config
from m2po_jax.errors import M2poError, WriterError, describe_os_error
from m2po_jax.tasks import Task, make_task
from m2po_jax.types import TrainBatch

# Streams of the base PRNG key: every use derives its key with fold_in(stream, index).
_GEN, _TRAIN, _FILL, _INIT, _SFT, _EVAL = range(6)


class NonFiniteError(M2poError, RuntimeError):
    """Too many consecutive steps had non-finite loss or gradients."""

    what = "training stopped"


@dataclasses.dataclass
class RunResult:
    workdir: Path
    final_step: int
    eval_accuracy: list[tuple[int, float]]
    interrupted: bool = False


def build_prompts(cfg: Config, tokenizer) -> prompts_lib.PromptEncoder:
    """How prompts become ids for rollouts, evaluation and the warm-up (chat template or not)."""
    return prompts_lib.make_prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.enable_thinking
    )


def build_task(
    cfg: Config, tokenizer=None, prompts: prompts_lib.PromptEncoder | None = None
) -> Task:
    """The configured task; a gsm8k task screens its prompts with `prompts` once, here."""
    t = cfg.task
    reward_fn = t.reward_fn or None
    if t.name == "arith":
        kwargs = dict(
            seed=t.seed,
            ops=t.ops,
            min_digits=t.min_digits,
            max_digits=t.max_digits,
            eval_size=cfg.eval.num_examples,
            format_reward=t.format_reward,
            reward_fn=reward_fn,
        )
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        return make_task("arith", **kwargs)
    if tokenizer is None:
        raise ValueError("task.name='gsm8k' needs a tokenizer: set model.path to a HF checkpoint")
    if not t.train_path:
        raise ValueError(
            "task.train_path: required for task.name='gsm8k' (a local JSONL or .parquet file)"
        )
    prompts = prompts or build_prompts(cfg, tokenizer)
    return make_task(
        "gsm8k",
        path=t.train_path,
        tokenizer=tokenizer,
        eval_path=t.eval_path or None,
        num_eval=t.eval_size,
        seed=t.seed,
        reward_fn=reward_fn,
        question_key=t.question_key,
        answer_key=t.answer_key,
        prompt_encode=prompts.encode,
        max_prompt_len=t.max_prompt_len,
        long_prompts=t.long_prompts,
    )


def build_model(cfg: Config, vocab_size: int):
    """(ModelConfig, tokenizer or None): from a HF checkpoint dir or a new architecture."""
    m = cfg.model
    if m.path:
        from m2po_jax import hf

        model_config = hf.config_from_hf(
            hf.read_hf_config(m.path), dtype=m.dtype, param_dtype=m.param_dtype
        ).replace(
            remat=m.remat,
            remat_policy=m.remat_policy,
            attention=m.attention,
            scan_layers=m.scan_layers,
        )
        return model_config, tokenizer_lib.load_tokenizer(m.path, model_config)
    model_config = model_lib.ModelConfig(
        vocab_size=m.vocab_size or vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim or None,
        model_type=m.model_type,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=m.model_type == "qwen2",
        qk_norm=m.model_type == "qwen3",
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        remat_policy=m.remat_policy,
        attention=m.attention,
        scan_layers=m.scan_layers,
    )
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({vocab_size})"
        )
    return model_config, None


class Trainer:
    """Owns the run's state; `run()` trains until `cfg.total_steps` (resuming if possible)."""

    def __init__(self, cfg: Config, workdir: str | Path):
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rng = jax.random.key(cfg.seed)

        if cfg.model.path:
            self.model_config, tokenizer = build_model(cfg, 0)
            self.prompts = build_prompts(cfg, tokenizer)
            self.task = build_task(cfg, tokenizer, self.prompts)
        else:
            self.task = build_task(cfg)
            self.model_config, _ = build_model(cfg, self.task.tokenizer.vocab_size)
            self.prompts = build_prompts(cfg, self.task.tokenizer)
        self.tokenizer = self.task.tokenizer
        mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
        self.placement = placement_lib.Placement.from_shape(mesh_shape, self.model_config)
        rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
        self._check_rows(rows)
        self.memory_plan = self._check_memory(rows)
        self.sampling_config = self._sampling_config()
        self.eval_sampling = dataclasses.replace(self.sampling_config, greedy=True)
        total_updates = cfg.total_steps * cfg.actor.ppo_n_minibatches
        self.tx, self.schedule = step_lib.make_optimizer(cfg.actor.optimizer, total_updates)
        self.state = self._init_state(self._initial_params())
        self.train_step = self._make_train_step()
        self.ref_params = None
        self.queue = rollout_lib.StaleQueue(cfg.rollout.max_head_offpolicyness)
        self.data_position = 0
        self.sft_steps = 0
        self.checkpointer = ckpt_lib.Checkpointer(self.workdir, keep=cfg.checkpoint.keep)
        self._stop_requested = False
        self.sft_log: list[dict] = []

    def _check_rows(self, rows: int) -> None:
        """Every batch the run makes must split evenly over the mesh's batch shards."""
        cfg, check = self.cfg, self.placement.check_rows
        check("rollout.batch_size", cfg.rollout.batch_size)
        rows_mb = rows // cfg.actor.ppo_n_minibatches
        check("rows per minibatch", rows_mb)
        mb = cfg.actor.mb_spec
        seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
        n_micro = batching.micro_batch_count(rows_mb, seq_len, mb.n_mbs, mb.max_tokens_per_mb)
        check(f"rows per micro-batch ({n_micro} per minibatch)", rows_mb // n_micro)
        check("eval.batch_size", cfg.eval.batch_size)
        if cfg.sft.max_steps:
            check("sft.batch_size", cfg.sft.batch_size)

    def _initial_params(self):
        """The checkpoint's params (`model.path`) or a random init, in the train shardings."""
        cfg = self.cfg
        if cfg.model.path:
            return sharding.load_pretrained_sharded(
                cfg.model.path,
                self.model_config,
                self.placement.mesh,
                sharding.TRAIN_RULES,
                dtype=cfg.model.param_dtype,
            )
        return self.placement.init_params(jax.random.fold_in(self.rng, _INIT))

    def _sampling_config(self) -> sampling.SamplingConfig:
        g = self.cfg.gconfig
        stop_ids = tuple(getattr(self.tokenizer, "eos_ids", None) or (self.tokenizer.eos_id,))
        return sampling.SamplingConfig(
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            greedy=g.greedy,
            stop_token_ids=stop_ids,
            pad_id=self.tokenizer.pad_id,
        )

    def _make_train_step(self):
        """The jitted train step, with the state donated and laid out by the placement."""
        a = self.cfg.actor
        return step_lib.make_train_step(
            self.model_config,
            a,
            self.tx,
            self.schedule,
            jit_kwargs=self.placement.train_step_shardings(self.state, with_ref=a.kl_ctl > 0),
            layout=self.placement.layout,
        )

    def _init_state(self, params) -> step_lib.TrainState:
        """A fresh train state laid out in the train shardings (optimizer state included)."""
        init_fn = functools.partial(step_lib.init_train_state, tx=self.tx)
        shape = jax.eval_shape(init_fn, params)
        init = jax.jit(init_fn, out_shardings=self.placement.state_shardings(shape))
        return init(params)

    def _check_memory(self, rows: int):
        cfg, a = self.cfg, self.cfg.actor
        seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
        rows_mb = rows // a.ppo_n_minibatches
        n_micro = batching.micro_batch_count(
            rows_mb, seq_len, a.mb_spec.n_mbs, a.mb_spec.max_tokens_per_mb
        )
        kwargs = dict(
            batch=rows_mb,
            seq_len=seq_len,
            micro_batch=rows_mb // n_micro,
            kv_cache_batch=rows,
            kv_cache_len=seq_len,
            logp_chunk=a.logp_chunk_size,
        )
        plan = memory.memory_plan(self.model_config, self.placement.mesh, **kwargs)
        if jax.process_index() == 0:
            logging.warning("memory plan per device:\n%s", plan.format())
        limit = int(cfg.mesh.device_memory_gib * 2**30) if cfg.mesh.device_memory_gib else None
        limit = limit or memory.device_memory_limit()
        if limit is not None and plan.total > limit:
            fixes = memory.remedies(self.model_config, self.placement.mesh, limit, **kwargs)
            memory.check_fits(plan, limit, fixes)
        return plan

    # ---- rollouts and evaluation -------------------------------------------------------

    def _rollout(self, rng, version: int) -> dict:
        cfg = self.cfg
        examples = self.task.train_examples(self.data_position, cfg.rollout.batch_size)
        self.data_position += cfg.rollout.batch_size
        known = getattr(self.task, "prompt_lengths", {})
        self.prompts_truncated = prompts_lib.count_long(
            examples, self.prompts, cfg.task.max_prompt_len, known
        )
        batch, _ = rollout_lib.generate_rollout(
            self.placement.for_sampling(self.state.params),
            self.model_config,
            self.sampling_config,
            examples,
            self.prompts,
            self.task.reward,
            rng,
            n_samples=cfg.gconfig.n_samples,
            version=version,
            max_prompt_len=cfg.task.max_prompt_len,
            placement=self.placement,
        )
        return batch

    def evaluate(self, params=None) -> float:
        """Held-out greedy accuracy: the task's verifier gives 1 (not a custom reward_fn)."""
        verify = lambda example, text: self.task.verify(text, example.answer)
        params = self.placement.for_sampling(self.state.params if params is None else params)
        examples = self.task.eval_examples()[: self.cfg.eval.num_examples]
        size = self.cfg.eval.batch_size
        correct = []
        for start in range(0, len(examples), size):
            chunk = examples[start : start + size]
            # Pad the last chunk so every call has the same shape (no recompile).
            padded = chunk + [chunk[-1]] * (size - len(chunk))
            batch, _ = rollout_lib.generate_rollout(
                params,
                self.model_config,
                self.eval_sampling,
                padded,
                self.prompts,
                verify,
                jax.random.fold_in(self.rng, _EVAL),
                n_samples=1,
                version=0,
                max_prompt_len=self.cfg.task.max_prompt_len,
                placement=self.placement,
            )
            correct.extend((batch["rewards_B"][: len(chunk)] >= 1.0).tolist())
        return float(np.mean(correct))

    # ---- supervised warm-up -------------------------------------------------------------

    def _sft_batch(self, start: int, count: int):
        pairs = self.task.sft_examples(start, count)
        width = self.cfg.task.max_prompt_len
        new = self.cfg.gconfig.max_new_tokens
        eos = self.tokenizer.eos_id
        tokens = np.full((count, width + new), self.tokenizer.pad_id, np.int32)
        valid = np.zeros_like(tokens, bool)
        target = np.zeros_like(tokens, bool)
        for row, (prompt, answer) in enumerate(pairs):
            p = self.prompts.encode(prompt)[-width:]
            c = (list(self.tokenizer.encode(answer)) + [eos])[:new]
            tokens[row, width - len(p) : width] = p
            tokens[row, width : width + len(c)] = c
            valid[row, width - len(p) : width + len(c)] = True
            target[row, width : width + len(c)] = True
        return tokens, valid, target

    def supervised_warmup(self) -> None:
        s = self.cfg.sft
        if s.max_steps == 0:
            return
        tx = optax.adamw(s.lr, weight_decay=0.0)
        sft_step = step_lib.make_sft_step(self.model_config, tx)
        params = jax.tree.map(jnp.copy, self.state.params)
        opt_state = jax.jit(tx.init)(params)
        for i in range(s.max_steps):
            batch = self.placement.to_global(self._sft_batch(i * s.batch_size, s.batch_size))
            params, opt_state, loss = sft_step(params, opt_state, *batch)
            self.sft_steps = i + 1
            if (i + 1) % s.eval_every == 0 or i + 1 == s.max_steps:
                accuracy = self.evaluate(params)
                logging.warning(
                    "warm-up step %d: loss %.3f, held-out accuracy %.3f",
                    i + 1,
                    float(loss),
                    accuracy,
                )
                self.sft_log.append(
                    {"sft_step": i + 1, "sft/loss": float(loss), "sft/accuracy": accuracy}
                )
                if accuracy >= s.stop_at_accuracy:
                    break
        self.state = self._init_state(params)

    # ---- checkpoints --------------------------------------------------------------------

    def _meta(self) -> dict:
        return {"data_position": self.data_position, "sft_steps": self.sft_steps}

    def save(self, writer: metrics_lib.MetricsWriter | None = None) -> None:
        """Checkpoints the state unless its step is committed already (never rewritten)."""
        step = int(self.state.step)
        if step in self.checkpointer.all_steps():
            return
        if writer is not None:
            # The rows (and events) of the steps before the checkpoint reach the disk first.
            writer.flush()
        self.checkpointer.save(
            step,
            state=self.state,
            rng=self.rng,
            queue=self.queue.state(),
            meta=self._meta(),
            ref_params=self.ref_params,
        )

    def try_resume(self, restore_step: int | None = None) -> bool:
        """Restores the newest checkpoint that verifies (or `restore_step`); False if none."""
        step = self.checkpointer.choose(restore_step, warn=logging.warning)
        if step is None:
            return False
        need_ref = self.cfg.actor.kl_ctl > 0
        restored = self.checkpointer.restore(
            step, state_like=self.state, ref_like=self.state.params if need_ref else None
        )
        logging.warning("resuming from checkpoint %s", self.checkpointer.step_dir(step))
        self.state = restored["state"]
        self.rng = restored["rng"]
        self.queue = rollout_lib.StaleQueue(
            self.cfg.rollout.max_head_offpolicyness, restored["queue"]
        )
        self.data_position = restored["meta"]["data_position"]
        self.sft_steps = restored["meta"]["sft_steps"]
        self.ref_params = restored["ref_params"]
        return True

    # ---- the loop -----------------------------------------------------------------------

    def _train_batch(self, host: dict) -> TrainBatch:
        behav = host["behav_logp_BxT"]
        bad = ~np.isfinite(behav) & host["loss_mask_BxT"]
        if bad.any():
            raise ValueError(
                f"behaviour log-probs: {int(bad.sum())} non-finite values on completion tokens "
                f"(batch of policy version {int(host['version_B'][0])})"
            )
        return self.placement.to_global(
            TrainBatch(
                tokens_BxT=host["tokens_BxT"],
                valid_BxT=host["valid_BxT"],
                behav_logp_BxT=behav,
                loss_mask_BxT=host["loss_mask_BxT"],
                rewards_B=host["rewards_B"],
                version_B=host["version_B"],
            )
        )

    @contextlib.contextmanager
    def _signals(self):
        def handler(signum, frame):
            if self._stop_requested:
                # A second signal ends the process now, whatever the main thread waits on.
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self._stop_requested = True
            logging.warning(
                "signal %d: stopping after this step (send it again to stop now)", signum
            )

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def run(self, stop_after: int | None = None, restore_step: int | None = None) -> RunResult:
        """Trains to `total_steps` (or `stop_after` more steps, for tests); resumes if possible.

        Holds the workdir's lock throughout (process 0). Resumes from the newest checkpoint
        that verifies, or from `restore_step` (newer checkpoints are then set aside).
        """
        with workdir_lib.hold(self.workdir, enabled=jax.process_index() == 0):
            return self._run(stop_after, restore_step)

    def _run(self, stop_after: int | None, restore_step: int | None) -> RunResult:
        cfg = self.cfg
        resumed = self.try_resume(restore_step)
        start = int(self.state.step)
        primary = jax.process_index() == 0
        self._nonfinite_stop = None
        writer = metrics_lib.MetricsWriter(
            self.workdir,
            tensorboard=cfg.logging.tensorboard,
            is_primary=primary,
            wandb={"project": cfg.logging.wandb_project} if cfg.logging.wandb_project else None,
            resume_step=start if resumed else 0,
        )
        progress = metrics_lib.ProgressBar(
            cfg.total_steps, initial=start, enabled=cfg.logging.progress and primary
        )
        accuracies = []
        interrupted = False
        try:
            interrupted = self._loop(writer, progress, resumed, start, stop_after, accuracies)
            writer.close()
        finally:
            progress.close()
            with contextlib.suppress(OSError):
                writer.close()  # after an error: close what is open, keep the first error
        if cfg.logging.plots and jax.process_index() == 0:
            try:
                metrics_lib.plot_metrics(self.workdir / "metrics.jsonl", self.workdir)
            except OSError as e:
                raise WriterError(describe_os_error(e, self.workdir)) from e
        return RunResult(self.workdir, int(self.state.step), accuracies, interrupted)

    def _loop(self, writer, progress, resumed, start, stop_after, accuracies) -> bool:
        """The steps from `start`; True if a signal stopped them."""
        cfg = self.cfg
        interrupted = False
        with self._signals():
            if not resumed:
                self.supervised_warmup()
                if cfg.actor.kl_ctl > 0:
                    self.ref_params = jax.tree.map(jnp.copy, self.state.params)
                for i in range(cfg.rollout.max_head_offpolicyness):
                    rng = jax.random.fold_in(jax.random.fold_in(self.rng, _FILL), i)
                    self.queue.push(self._rollout(rng, version=0))
            end = (
                cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
            )
            for step in range(start, end):
                # Step 0 evaluates the initial policy; later evaluations follow the update.
                accuracy = self.evaluate() if step == 0 else None
                record = self._one_step(step)
                last = step + 1 == cfg.total_steps
                if accuracy is None and (
                    last or (cfg.eval.every and (step + 1) % cfg.eval.every == 0)
                ):
                    accuracy = self.evaluate()
                if accuracy is not None:
                    record["eval/accuracy"] = accuracy
                    accuracies.append((step, accuracy))
                writer.write(step, record)
                progress.update(step + 1, record)
                if self._nonfinite_stop:
                    # The failing step has its row; the checkpoint holds the last good params.
                    self.save(writer)
                    raise NonFiniteError(self._nonfinite_stop)
                if self._stop_requested:
                    interrupted = True
                    break
                if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                    self.save(writer)
            self.save(writer)
        return interrupted

    def _one_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        record = {}
        gen_rng = jax.random.fold_in(jax.random.fold_in(self.rng, _GEN), step)
        fresh = self._rollout(gen_rng, version=step)
        self.queue.push(fresh)
        host = self.queue.pop()
        t1 = time.perf_counter()
        batch = self._train_batch(host)
        train_rng = jax.random.fold_in(jax.random.fold_in(self.rng, _TRAIN), step)
        self.state, metrics = self.train_step(self.state, batch, train_rng, self.ref_params)
        metrics = metrics_lib.host_metrics(metrics)
        t2 = time.perf_counter()
        if metrics["train/nonfinite"]:
            skipped = int(self.state.nonfinite_steps)
            logging.warning(
                "step %d: non-finite loss or gradients; update skipped (%d in a row)", step, skipped
            )
            if skipped >= self.cfg.max_nonfinite_steps:
                # Raised by the loop once this step's metrics row is written.
                self._nonfinite_stop = (
                    f"max_nonfinite_steps: {skipped} consecutive steps had non-finite loss or "
                    f"gradients (last: step {step}); the last good state is saved in "
                    f"{self.checkpointer.directory}"
                )
        rewards = host["rewards_B"]
        record.update(metrics)
        record.update(metrics_lib.staleness_stats(host["version_B"], step))
        tokens = int(host["loss_mask_BxT"].sum()) + int(fresh["loss_mask_BxT"].sum())
        record.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()),
                "rollout/fresh_reward_mean": float(fresh["rewards_B"].mean()),
                "rollout/completion_len_mean": float(host["completion_len_B"].mean()),
                "rollout/stopped_fraction": float(host["stopped_B"].mean()),
                "rollout/prompts_truncated": self.prompts_truncated,
                "time/rollout_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/tokens_per_s": tokens / max(t2 - t0, 1e-9),
            }
        )
        filtered = getattr(self.task, "prompts_filtered", None)
        if filtered is not None:
            record["data/prompts_filtered"] = filtered["train"]
            record["data/eval_prompts_filtered"] = filtered["eval"]
        return record
