"""What a run is built from: task, model, tokenizer, prompt encoding, placement, sampling.

`build(cfg)` makes them once and refuses a config that cannot run (rows that do not split
over the mesh, a memory plan over the device's memory) before anything compiles. The
trainer, the evaluation (`evaluate.py`) and the warm-up (`sft.py`) read the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from m2po_jax import config as config_lib
from m2po_jax.common.config_schema import Config
from m2po_jax.common.types import PromptGroups, TrainBatch
from m2po_jax.learner import batching, memory, optim
from m2po_jax.learner import step_plan as step_plan_lib
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import families, hf_format, lora, paged, quant
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.models import prompts as prompts_lib
from m2po_jax.models import tokenizer as tokenizer_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.parallel import sharding
from m2po_jax.rollout import engines, sampling
from m2po_jax.rollout import episodes as episodes_lib
from m2po_jax.rollout import rewards as rewards_lib
from m2po_jax.run import metrics as metrics_lib
from m2po_jax.tasks import Task, make_task, parse_eval_sets, task_class
from m2po_jax.trainer import memory_check


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """The parts of a run fixed by its config (built by `build`)."""

    cfg: Config
    task: Task
    tokenizer: Any
    prompts: prompts_lib.PromptEncoder
    model_config: model_config_lib.ModelConfig  # the trained one (`rollout_model_config`)
    placement: placement_lib.Placement
    sampling_config: sampling.SamplingConfig
    memory_plan: memory.MemoryPlan
    # rollout.mode="async": this process's rollout devices (a mesh of them alone) and the
    # rollouts' weights (`rollout_model_config`), else None
    rollout_placement: placement_lib.Placement | None = None
    # the rollout engine of `rollout.engine` ("auto" resolved): the training rollouts' (on
    # the rollout devices in an async run), running `rollout_model_config`
    engine: engines.RolloutEngine | None = None  # set by `build`
    # scores the rollouts (and evaluations with eval.reward="train"): the task's reward,
    # rollout.reward_workers at once, rollout.reward_timeout_s each
    rewards: rewards_lib.RewardScorer | None = None
    # agent.env: multi-turn episodes (environments, tools, the chat format), else None
    agent: episodes_lib.Agent | None = None


def build(cfg: Config) -> RunSetup:
    """Task, model config, tokenizer, prompts and placement of `cfg`, checked to fit."""
    if cfg.model.path:
        model_config, tokenizer = build_model(cfg, 0)
        prompts = build_prompts(cfg, tokenizer)
        task = build_task(cfg, tokenizer, prompts)
    else:
        task = build_task(cfg)
        model_config, _ = build_model(cfg, task.tokenizer.vocab_size)
        prompts = build_prompts(cfg, task.tokenizer)
    mesh_shape = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    rollout_placement = None
    if cfg.rollout.mode == "async":
        rollout_devices, train_devices = placement_lib.split_devices(cfg.mesh.rollout_devices)
        placement = placement_lib.Placement.from_shape(mesh_shape, model_config, train_devices)
        tensor = cfg.mesh.tensor if len(rollout_devices) % cfg.mesh.tensor == 0 else 1
        rollout_placement = placement_lib.Placement(
            sharding.make_mesh({"data": -1, "tensor": tensor}, rollout_devices),
            rollout_model_config(cfg, model_config),
        )
    else:
        placement = placement_lib.Placement.from_shape(mesh_shape, model_config)
    check_rows(cfg, placement, rollout_placement)
    processes = jax.process_count() if rollout_placement is not None else 1
    check_engine_sizes(
        cfg, model_config, placement, rollout_placement, cfg.rollout.batch_size // processes
    )
    decoding = sampling_config(cfg, task.tokenizer)
    return RunSetup(
        cfg=cfg,
        task=task,
        tokenizer=task.tokenizer,
        prompts=prompts,
        model_config=model_config,
        placement=placement,
        sampling_config=decoding,
        memory_plan=check_memory(cfg, model_config, placement),
        rollout_placement=rollout_placement,
        engine=build_engine(cfg, model_config, decoding, rollout_placement or placement),
        rewards=rewards_lib.RewardScorer(
            task, workers=cfg.rollout.reward_workers, timeout_s=cfg.rollout.reward_timeout_s
        ),
        agent=build_agent(cfg, task, prompts),
    )


def build_agent(cfg: Config, task: Task, prompts) -> episodes_lib.Agent | None:
    """The multi-turn `Agent` of `agent.env` (None for single-turn runs): the task's own
    chat format (`task.chat_format()`) or the chat template's, and per episode a new
    environment: `ToolEnv` over `agent.tools` for "tools", else the named class."""
    ag = cfg.agent
    if not ag.env:
        return None
    from m2po_jax.tasks import environments, tool_calls, tools

    tool_list = tools.load_tools(config_lib.tool_names(ag.tools))
    own = getattr(task, "chat_format", None)
    chat_format = own() if own is not None else episodes_lib.TemplateFormat(prompts)
    family = ag.parser
    if family == "auto":
        family = getattr(chat_format, "parser", None) or tool_calls.family_of_template(
            prompts.chat_template
        )
        if family is None:
            raise ValueError(
                "agent.parser='auto': the chat template shows no known tool-call format; set "
                f"agent.parser to one of {sorted(tool_calls.PARSERS)}"
            )
    pools = ()
    if ag.env == "tools":
        pool = environments.WorkerPool(2 * ag.workers, "m2po-tool")
        pools = (pool,)

        def factory():
            return environments.ToolEnv(
                tool_list,
                family,
                timeout_s=ag.tool_timeout_s,
                on_tool_error=ag.on_tool_error,
                pool=pool,
            )

    else:
        factory = environments.env_factory_from_name(ag.env)
    return episodes_lib.Agent(
        factory,
        chat_format,
        max_turns=ag.max_turns,
        max_append=ag.max_append_tokens,
        bad_tool_call_reward=ag.bad_tool_call_reward,
        workers=ag.workers,
        step_timeout_s=ag.step_timeout_s,
        mask_failed=ag.mask_failed_episodes,
        mask_truncated=ag.mask_truncated_episodes,
        long_prompts=cfg.task.long_prompts,
        pools=pools,
    )


def build_engine(
    cfg: Config,
    model_config,
    decoding,
    placement,
    limit: int | None = None,
    *,
    trained_weights: bool = False,
) -> engines.RolloutEngine:
    """The rollout engine of `rollout.engine` ("auto" resolved by the budget) with
    `decoding`, over `placement`'s batch shards, running the rollouts' weights
    (`rollout_model_config` of the trainer's `model_config`), or with `trained_weights`
    (the evaluation) `model_config` itself and its own pool (`eval_pool_pages`); its KV
    takes what the memory plan leaves of `limit` bytes per device (default
    `device_limit(cfg)`; `kv_budget`). `model_config` is the trainer's, never the
    rollouts' (refused: the budget would count the train state at the rollouts' bytes)."""
    engine = engines.engine_class(config_lib.rollout_engine(cfg))
    limit = device_limit(cfg) if limit is None else limit
    budget = kv_budget(cfg, model_config, placement, limit)
    runs = model_config if trained_weights else rollout_model_config(cfg, model_config)
    rollout = cfg.rollout
    if trained_weights:
        rollout = dataclasses.replace(rollout, kv_pages=eval_pool_pages(cfg, placement))
    return engine.from_config(rollout, runs, decoding, placement.mesh, budget)


def rollout_model_config(
    cfg: Config, model_config: model_config_lib.ModelConfig
) -> model_config_lib.ModelConfig:
    """The model config the training rollouts' engine runs (sync and async): the trainer's
    `model_config` with its stored weights as `rollout.weight_dtype` says
    (`config.rollout_weight_dtype`; `quant.convert_weights` makes them): int8 /
    float8_e4m3fn every projection kernel quantised (`weight_quant`), bfloat16 the
    param dtype; and its KV cache in `rollout.kv_dtype` ("" = the compute dtype); the
    compute dtype (`model.dtype`) unchanged. A teacher-forced pass of it gives the
    engine's log-probs; the evaluation runs the trained config (`model_config`)."""
    config = model_config.replace(kv_dtype=cfg.rollout.kv_dtype)
    dtype = config_lib.rollout_weight_dtype(cfg)
    if dtype in model_config_lib.WEIGHT_QUANTS[1:]:
        return config.replace(weight_quant=dtype)
    return config.replace(param_dtype=dtype) if dtype else config


# The share of a device's memory a run plans to fill: the paged engine's default pool
# (`rollout.kv_pages` 0) takes what the memory plan's other lines leave of it.
POOL_MEMORY_FRACTION = 0.9


def device_limit(cfg: Config) -> int | None:
    """Bytes per device: `mesh.device_memory_gib`, else what device 0 reports (None: a CPU)."""
    limit = int(cfg.mesh.device_memory_gib * 2**30) if cfg.mesh.device_memory_gib else None
    return limit or memory_check.device_memory_limit()


def kv_budget(
    cfg: Config,
    model_config: model_config_lib.ModelConfig,
    placement: placement_lib.Placement,
    limit: int | None,
) -> int:
    """Bytes per device the paged engine's default pool may take: POOL_MEMORY_FRACTION of
    `limit` less what a rollout holds beside the pool (the memory plan's `sampling` phase:
    the train state, the sampling weights, the engine's other buffers, the rollouts' or the
    evaluation's, whichever hold more; the train step's activations are not held while it
    samples), at least 1; 0 (no cap) where `limit` is
    None, `rollout.kv_pages` is set or the run's engine is not paged. `model_config` is
    the trainer's (the plan counts the rollouts' `rollout_model_config` and the
    evaluation's trained config; a pool's pages take its engine's `cache_dtype`). Under async rollouts
    the plan is the train devices' (an upper bound on the rollout devices', which hold no
    train state)."""
    _check_trained(cfg, model_config)
    if limit is None or cfg.rollout.kv_pages or config_lib.rollout_engine(cfg) != "paged":
        return 0
    shards = _engine_shards(placement.mesh)
    one_page = _page_bytes(cfg, model_config, placement)
    plan = _memory_plan(cfg, model_config, placement, pages=shards, eval_pages=shards)[0]
    return max(int(POOL_MEMORY_FRACTION * limit) - (plan.sampling - one_page), 1)


def _check_trained(cfg: Config, model_config: model_config_lib.ModelConfig) -> None:
    """Refuses the rollouts' model config (`rollout_model_config`: KV in `rollout.kv_dtype`,
    weights in `rollout.weight_dtype`) where the trainer's is expected: a budget made from
    it counts the train state at the rollouts' bytes (int8: a quarter) and oversizes the
    pool."""
    dtype = config_lib.rollout_weight_dtype(cfg)
    converted = model_config.weight_quant or (dtype and model_config.param_dtype == dtype)
    if model_config.kv_dtype or converted:
        raise ValueError(
            "setup: expected the trainer's model config, got the rollouts' "
            f"(kv_dtype={model_config.kv_dtype!r}, weight_quant={model_config.weight_quant!r}, "
            f"param_dtype={model_config.param_dtype!r}); pass the trained config: the "
            "rollouts' is derived from it (`rollout_model_config`)"
        )


def least_pool_pages(cfg: Config, prompts: int, shards: int) -> int:
    """The least pool the paged engine runs `prompts` prompts of `task.max_prompt_len`
    tokens with, on `shards` batch shards: each shard's prompts' pages and one whole
    completion (`PagedEngine.sizes`: one sequence at a time)."""
    page = cfg.rollout.page_size
    own = engines.own_pages(cfg.gconfig.max_new_tokens, page)
    return shards * (prompts // shards * -(-cfg.task.max_prompt_len // page) + own)


def eval_pool_pages(cfg: Config, placement: placement_lib.Placement) -> int:
    """The evaluation's paged pool: `rollout.kv_pages` (sized for the rollouts; 0: its own
    default), but at least the least pool of an evaluation batch (`eval.batch_size`
    prompts, `least_pool_pages`): a pool set for fewer or shorter rollout prompts would
    refuse the evaluation's. Multi-turn episodes run one pool over the whole mesh."""
    pages = cfg.rollout.kv_pages
    if not pages:
        return 0
    shards = 1 if cfg.agent.env else _engine_shards(placement.mesh)
    return max(pages, least_pool_pages(cfg, cfg.eval.batch_size, shards))


def check_engine_sizes(
    cfg: Config,
    model_config: model_config_lib.ModelConfig,
    placement: placement_lib.Placement,
    rollout_placement: placement_lib.Placement | None,
    prompts: int,
) -> None:
    """The paged engines' sizes against the batches they run, before any program: the
    rollouts' engine (on `rollout_placement`, else `placement`; `prompts` a call, each
    process's share of `rollout.batch_size`, times `rollout.stream_batches` prefilled at
    once) and the evaluation's (on `placement`, `eval.batch_size`): slots and pages divide
    over the batch shards, and the rollouts' pool holds its prompts and one whole
    completion (the evaluation's takes what its batch needs, `eval_pool_pages`). Raises
    ValueError naming the field, in one line."""
    if config_lib.rollout_engine(cfg) != "paged":
        return
    r, width, turns = cfg.rollout, cfg.task.max_prompt_len, bool(cfg.agent.env)
    decoding = sampling.from_gconfig(cfg.gconfig)  # sizes only
    evaluator = build_engine(cfg, model_config, decoding, placement, trained_weights=True)
    evaluator.sizes(cfg.eval.batch_size, width, cfg.eval.n_samples, turns)  # divisibility
    engine = build_engine(cfg, model_config, decoding, rollout_placement or placement)
    size = engine.sizes(prompts * r.stream_batches, width, cfg.gconfig.n_samples, turns)
    least = least_pool_pages(cfg, prompts * r.stream_batches, size["shards"])
    if size["pages"] * size["shards"] >= least:
        return
    streamed = f" x rollout.stream_batches={r.stream_batches}" if r.stream_batches > 1 else ""
    share = "" if prompts == r.batch_size else f" ({prompts} a process)"
    shards = f", on each of {size['shards']} batch shards" if size["shards"] > 1 else ""
    raise ValueError(
        f"rollout.kv_pages={r.kv_pages}: the rollouts' pool must hold every prompt "
        f"(rollout.batch_size={r.batch_size}{share}{streamed} of task.max_prompt_len={width} "
        f"tokens, {size['prompt']} pages of rollout.page_size={r.page_size} each) and one "
        f"whole completion (gconfig.max_new_tokens={cfg.gconfig.max_new_tokens}: "
        f"{size['own']} pages){shards}: at least {least}"
    )


def _page_bytes(cfg: Config, model_config, placement) -> int:
    """`PagedEngine.page_bytes` of the run's engine on `placement`."""
    tensor = 1 if placement.mesh is None else placement.mesh.shape.get("tensor", 1)
    split = tensor if model_config.num_kv_heads % tensor == 0 else 1
    return paged.pool_bytes(model_config, 1, cfg.rollout.page_size) // split


def build_prompts(cfg: Config, tokenizer) -> prompts_lib.PromptEncoder:
    """How prompts become ids for rollouts, evaluation and the warm-up (chat template or not)."""
    return prompts_lib.make_prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.enable_thinking
    )


def build_task(
    cfg: Config, tokenizer=None, prompts: prompts_lib.PromptEncoder | None = None
) -> Task:
    """The configured task; a file task (gsm8k, math) screens its prompts with `prompts`
    once, here; a task named "package.module:Class" is that class's `from_config`."""
    t = cfg.task
    reward_fn = t.reward_fn or None
    if t.name in ("arith", "calculator"):
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
        names = {name: f"task.{name}" for name in ("seed", "ops", "min_digits", "max_digits")}
        names |= {"eval_size": "eval.num_examples", "format_reward": "task.format_reward"}
        if t.name == "calculator":
            kwargs["tool_demos"] = t.tool_demos
            names["tool_demos"] = "task.tool_demos"
        with _named_as_in_the_config(names):
            return make_task(t.name, **kwargs)
    prompts = prompts or (build_prompts(cfg, tokenizer) if tokenizer is not None else None)
    screen = dict(
        prompt_encode=prompts.encode if prompts is not None else None,
        max_prompt_len=t.max_prompt_len,
        long_prompts=t.long_prompts,
    )
    eval_sets = parse_eval_sets(cfg.eval.sets)
    if ":" in t.name:  # a Task subclass of the user's
        cls = task_class(t.name)
        task = cls.from_config(t, tokenizer, num_eval=t.eval_size, eval_sets=eval_sets, **screen)
        if not isinstance(task, Task):
            raise TypeError(
                f"task.name {t.name!r}: {cls.__name__}.from_config returned "
                f"{type(task).__name__}, not a Task"
            )
        return task
    if tokenizer is None:
        raise ValueError(
            f"task.name={t.name!r} needs a tokenizer: set model.path to a HF checkpoint"
        )
    if not t.train_path:
        raise ValueError(
            f"task.train_path: required for task.name={t.name!r} (a local JSONL or .parquet "
            "file, or a datasets.save_to_disk directory)"
        )
    with _named_as_in_the_config({"num_eval": "task.eval_size"}):
        return make_task(
            t.name,
            path=t.train_path,
            tokenizer=tokenizer,
            eval_path=t.eval_path or None,
            num_eval=t.eval_size,
            eval_sets=eval_sets,
            prompt_template=t.prompt_template,
            verifier=t.verifier,
            seed=t.seed,
            reward_fn=reward_fn,
            question_key=t.question_key,
            answer_key=t.answer_key,
            solution_key=t.solution_key,
            **screen,
        )


def build_model(cfg: Config, vocab_size: int):
    """(ModelConfig, tokenizer or None): from a HF checkpoint dir or a new architecture."""
    m = cfg.model
    if m.path:
        from m2po_jax.models import hf

        model_config = hf_format.config_from_hf(
            hf.read_hf_config(m.path), dtype=m.dtype, param_dtype=m.param_dtype
        ).replace(
            remat=m.remat,
            remat_policy=m.remat_policy,
            attention=m.attention,
            scan_layers=m.scan_layers,
            expert_axis=cfg.mesh.expert_axis,
            **lora_fields(m),
        )
        config_lib.check_moe_settings(cfg, model_config.model_type, model_config.is_moe)
        return model_config, tokenizer_lib.load_tokenizer(m.path, model_config)
    fields = [f.name for f in dataclasses.fields(model_config_lib.ModelConfig)]
    with _named_as_in_the_config({name: f"model.{name}" for name in fields}):
        model_config = _new_architecture(m, vocab_size).replace(expert_axis=cfg.mesh.expert_axis)
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({vocab_size})"
        )
    return model_config, None


@contextlib.contextmanager
def _named_as_in_the_config(names: dict[str, str]):
    """A library error about `num_heads` names the config's `model.num_heads`."""
    try:
        yield
    except ValueError as e:
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")\b")
        if e.args and isinstance(e.args[0], str):  # keeps the error's type (DataError, ...)
            e.args = (pattern.sub(lambda m: names[m.group(1)], e.args[0]), *e.args[1:])
        raise


def _new_architecture(m, vocab_size: int) -> model_config_lib.ModelConfig:
    return model_config_lib.ModelConfig(
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
        attention_bias=bool(families.family(m.model_type).attention_bias),
        qk_norm=families.family(m.model_type).qk_norm,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        remat_policy=m.remat_policy,
        attention=m.attention,
        scan_layers=m.scan_layers,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        **lora_fields(m),
    )


def lora_fields(m) -> dict:
    """The `ModelConfig` LoRA fields of a `model` config section (off at rank 0)."""
    if not m.lora.rank:
        return {}
    targets = tuple(t.strip() for t in m.lora.targets.split(",") if t.strip())
    return dict(
        lora_rank=m.lora.rank, lora_alpha=m.lora.alpha, lora_targets=targets, lora_base=m.lora.base
    )


def _train_shapes(cfg: Config) -> tuple[int, int, int, int]:
    """(rollout rows, rows per minibatch, micro-batches per minibatch, sequence length)."""
    a = cfg.actor
    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    rows_mb = rows // a.ppo_n_minibatches
    seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
    n_micro = batching.micro_batch_count(
        rows_mb, seq_len, a.mb_spec.n_mbs, a.mb_spec.max_tokens_per_mb
    )
    return rows, rows_mb, n_micro, seq_len


def check_rows(
    cfg: Config,
    placement: placement_lib.Placement,
    rollout_placement: placement_lib.Placement | None = None,
) -> None:
    """Every batch the run makes must split evenly over the mesh's batch shards (and, in
    an async run, each process's share of the prompts over its rollout devices)."""
    check = placement.check_rows
    if rollout_placement is not None:
        processes = jax.process_count()
        if cfg.rollout.batch_size % processes:
            raise ValueError(
                f"rollout.batch_size={cfg.rollout.batch_size} must be divisible by the "
                f"{processes} processes (each generates its share of the prompts)"
            )
        rollout_placement.check_rows(
            "rollout.batch_size per process", cfg.rollout.batch_size // processes
        )
    check("rollout.batch_size", cfg.rollout.batch_size)
    _, rows_mb, n_micro, _ = _train_shapes(cfg)
    check("rows per minibatch", rows_mb)
    check(f"rows per micro-batch ({n_micro} per minibatch)", rows_mb // n_micro)
    check("eval.batch_size", cfg.eval.batch_size)
    if cfg.sft.max_steps:
        check("sft.batch_size", cfg.sft.batch_size)


def memory_plan(
    cfg: Config,
    model_config: model_config_lib.ModelConfig,
    placement: placement_lib.Placement,
    limit: int | None = None,
) -> tuple[memory.MemoryPlan, dict]:
    """The run's analytic per-device memory plan, and the `memory.memory_plan` keyword
    arguments it was made with (for `memory_check.remedies`); a paged engine's default pool
    as it sizes it within `limit` bytes per device (`kv_budget`; None: uncapped): the
    rollouts' in `rollout.kv_dtype`, the evaluation's in the compute dtype."""
    pages, eval_pages = cfg.rollout.kv_pages, eval_pool_pages(cfg, placement)
    rollout = rollout_model_config(cfg, model_config)
    if budget := kv_budget(cfg, model_config, placement, limit):
        cap = budget // _page_bytes(cfg, rollout, placement)
        pages = _pool_pages(cfg, placement, cfg.rollout.batch_size, cfg.gconfig.n_samples, cap)
        cap = budget // _page_bytes(cfg, model_config, placement)
        eval_pages = _pool_pages(cfg, placement, cfg.eval.batch_size, cfg.eval.n_samples, cap)
    return _memory_plan(cfg, model_config, placement, pages, eval_pages)


def _pool_pages(cfg: Config, placement, prompts: int, n_samples: int, cap: int) -> int:
    """The pages of a paged engine's default pool for `prompts` x `n_samples` within `cap`
    pages per batch shard, on all shards (`PagedEngine.sizes`)."""
    r, shards = cfg.rollout, _engine_shards(placement.mesh)
    local = prompts // shards
    rows = local * n_samples
    slots = min(r.engine_slots // shards or rows, rows)
    prompt = local * -(-cfg.task.max_prompt_len // r.page_size)
    own = engines.own_pages(cfg.gconfig.max_new_tokens, r.page_size)
    return shards * engines.pool_pages(prompt, slots, own, cap)


def _memory_plan(cfg: Config, model_config, placement, pages: int, eval_pages: int = 0):
    """`memory_plan` with the paged engine's pool at `pages` pages (0: its default) for the
    rollouts and `eval_pages` for the evaluation (the same engine, its own batch): the
    engine's line is the larger of the two. `model_config` is the trainer's: the rollouts
    run `rollout_model_config` of it (KV in `rollout.kv_dtype`, weights in
    `rollout.weight_dtype`), the evaluation the trained config."""
    rollout, trained = rollout_model_config(cfg, model_config), model_config
    rows, rows_mb, n_micro, seq_len = _train_shapes(cfg)
    plan = step_plan(cfg, placement)
    kwargs = dict(
        batch=rows_mb,
        seq_len=seq_len,
        micro_batch=rows_mb // n_micro,
        kv_cache_batch=rows,
        kv_cache_len=seq_len,
        logp_chunk=cfg.actor.logp_chunk_size,
        shared_prompt=plan.loss_prompt,  # the path the step runs
        kv_dtype_bytes=rollout.cache_dtype.itemsize,
        rollout_config=rollout,
        router_replay=cfg.actor.router_replay != "off",
        proximal_pass=plan.prox_source == "pass",
    )
    engine = config_lib.rollout_engine(cfg)
    if engine in ("continuous", "paged"):
        r = cfg.rollout
        held = functools.partial(
            memory.engine_bytes,
            engine=engine,
            prompt_len=cfg.task.max_prompt_len,
            max_new=cfg.gconfig.max_new_tokens,
            slots=r.engine_slots,
            page_size=r.page_size,
            insert_lanes=r.insert_lanes,
            shards=_engine_shards(placement.mesh) if engine == "paged" else 1,
            tensor=1 if placement.mesh is None else placement.mesh.shape.get("tensor", 1),
        )
        if engine != "paged":
            pages = eval_pages = 0
        kwargs["kv_cache_bytes"] = max(
            held(rollout, prompts=r.batch_size, n_samples=cfg.gconfig.n_samples, pages=pages),
            held(trained, prompts=cfg.eval.batch_size, n_samples=cfg.eval.n_samples,
                 pages=eval_pages),
        )  # fmt: skip
    return memory.memory_plan(trained, placement.mesh, **kwargs), kwargs


def _engine_shards(mesh) -> int:
    """The batch shards a paged engine splits its pool over (`PagedEngine.shards`)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in engines.row_axes(mesh))


def check_memory(
    cfg: Config, model_config: model_config_lib.ModelConfig, placement: placement_lib.Placement
) -> memory.MemoryPlan:
    """The per-device memory plan (logged); raises with remedies when it exceeds the device."""
    limit = device_limit(cfg)
    plan, kwargs = memory_plan(cfg, model_config, placement, limit)
    if jax.process_index() == 0:
        metrics_lib.say(f"memory plan per device:\n{plan.format()}")
    if limit is not None and plan.peak > limit:
        fixes = memory_check.remedies(model_config, placement.mesh, limit, **kwargs)
        memory_check.check_fits(plan, limit, fixes)
    return plan


def needs_reference(cfg: Config, model_config: model_config_lib.ModelConfig) -> bool:
    """Whether the train step takes a KL reference policy (`ref_params`): a KL penalty
    (`actor.kl_ctl` > 0) without LoRA. Under LoRA the reference is the model with its
    adapters off, made inside the step from the params (no copy: `ref_params` is None)."""
    return cfg.actor.kl_ctl > 0 and not model_config.lora_rank


def reference_params(cfg: Config, model_config: model_config_lib.ModelConfig, params):
    """The step's `ref_params` argument for `params` (the policy RL starts from): `params`
    where `needs_reference`, else None. The trainer, the compile-only dry run and the
    memory check all pass this, so they run one step."""
    return params if needs_reference(cfg, model_config) else None


def build_train_step(
    cfg: Config,
    model_config: model_config_lib.ModelConfig,
    tx,
    schedule,
    placement: placement_lib.Placement,
    state,
    *,
    share_prompts: bool = True,
):
    """The run's jitted train step, built as the trainer builds it.

    State donated and laid out by `placement`; rollout rows come as `gconfig.n_samples`
    completions of each prompt, so the step runs each prompt through the trunk once and
    keeps groups whole in minibatches and micro-batches (`step_plan.plan_step` decides per
    shape what of that runs). `state` may be abstract (`jax.eval_shape`). The memory
    check against XLA (`compiled_step_memory`), `benchmarks/scale_bench.py` and
    `benchmarks/device_check.sh` compile through this function, so what they measure is
    the trainer's step. `share_prompts=False` builds the plain step (every row's whole
    sequence), the benchmarks' baseline.
    """
    a = cfg.actor
    return step_lib.make_train_step(
        model_config,
        a,
        tx,
        schedule,
        # Under LoRA the reference policy is the model with its adapters off: no copy.
        jit_kwargs=placement.train_step_shardings(
            state, with_ref=needs_reference(cfg, model_config), replay=a.router_replay != "off"
        ),
        layout=placement.layout,
        groups=prompt_groups(cfg) if share_prompts else None,
        masked_grad_norm=cfg.logging.masked_grad_norm,
        router_aux_loss_coef=cfg.model.router_aux_loss_coef,
    )


def replayed_experts(cfg: Config, model_config, shape, rows: int, seq_len: int):
    """The train batch's recorded experts under routing replay, `shape(int16, rows,
    seq_len, L, K)`; None when `actor.router_replay` is "off"."""
    if cfg.actor.router_replay == "off":
        return None
    layers, k = model_config.num_layers, model_config.num_experts_per_tok
    return shape(jnp.int16, rows, seq_len, layers, k)


def prompt_groups(cfg: Config) -> PromptGroups:
    """How the sampler lays out a rollout batch: `gconfig.n_samples` completions of each
    prompt, left-padded to `task.max_prompt_len` columns."""
    return PromptGroups(cfg.task.max_prompt_len, cfg.gconfig.n_samples)


def step_plan(cfg: Config, placement: placement_lib.Placement, seq_len: int | None = None):
    """The `step_plan.StepPlan` of the run's train step on its largest batch shape."""
    rows, _, _, full = _train_shapes(cfg)
    a = cfg.actor
    return step_plan_lib.plan_step(
        a,
        rows,
        full if seq_len is None else seq_len,
        groups=prompt_groups(cfg),
        batch_shards=placement.batch_shards,
        blocks_pay=memory.blocks_pay_fn(placement.model_config, placement.mesh, a.logp_chunk_size),
    )


def sampling_config(cfg: Config, tokenizer) -> sampling.SamplingConfig:
    """The rollouts' sampling settings; every stop id the tokenizer names ends a completion.
    Under routing replay (`actor.router_replay`) the engine records each token's experts."""
    g = cfg.gconfig
    stop_ids = tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))
    decoding = sampling.from_gconfig(g, stop_ids, tokenizer.pad_id)
    return dataclasses.replace(decoding, record_experts=cfg.actor.router_replay != "off")


def initial_params(run: RunSetup, rng: jax.Array):
    """The checkpoint's params (`model.path`) or a random init, in the train shardings.

    Under a quantised base (`model.lora.base` int8 / nf4) the checkpoint's adapted kernels
    are quantised as loaded (`quant.quantize_base`; the random init does it itself)."""
    cfg = run.cfg
    if cfg.model.path:
        params = sharding.load_pretrained_sharded(
            cfg.model.path,
            lora.base_config(run.model_config),
            run.placement.mesh,
            sharding.TRAIN_RULES,
            dtype=cfg.model.param_dtype,
        )
        params = quant.quantize_base(params, run.model_config)
        # New adapters (B = 0: the checkpoint's function), laid out like the rest.
        params = model_lib.add_adapters(params, run.model_config, rng)
        return jax.device_put(params, run.placement.train_params)
    return run.placement.init_params(rng)


def init_state(run: RunSetup, params, tx) -> step_lib.TrainState:
    """A fresh train state laid out in the train shardings (optimizer state included)."""
    init_fn = functools.partial(step_lib.init_train_state, tx=tx)
    shape = jax.eval_shape(init_fn, params)
    init = jax.jit(init_fn, out_shardings=run.placement.state_shardings(shape))
    return init(params)


def compiled_step_memory(
    cfg, model_config: model_config_lib.ModelConfig, placement, *, share_prompts: bool = True
) -> memory_check.CompiledStep:
    """XLA's memory analysis of the run's jitted train step, compiled from abstract shapes.

    The step is built by `build_train_step`, the trainer's own builder, for the
    run's largest batch (`rollout.batch_size x gconfig.n_samples` rows of
    `task.max_prompt_len + gconfig.max_new_tokens` tokens). Nothing is allocated: params,
    optimizer state and the batch are `ShapeDtypeStruct`s laid out by `placement`.
    `share_prompts=False` compiles the plain step instead (the baseline).
    """
    import time

    rows = cfg.rollout.batch_size * cfg.gconfig.n_samples
    seq_len = cfg.task.max_prompt_len + cfg.gconfig.max_new_tokens
    tx, schedule = optim.make_optimizer(cfg.actor.optimizer, 1)
    params = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))
    state = jax.eval_shape(lambda p: step_lib.init_train_state(p, tx), params)
    shape = lambda dtype, *dims: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
    batch = TrainBatch(
        tokens_BxT=shape(jnp.int32, rows, seq_len),
        valid_BxT=shape(jnp.bool_, rows, seq_len),
        behav_logp_BxT=shape(jnp.float32, rows, seq_len),
        loss_mask_BxT=shape(jnp.bool_, rows, seq_len),
        rewards_B=shape(jnp.float32, rows),
        version_B=shape(jnp.int32, rows),
        version_BxT=shape(jnp.int32, rows, seq_len),
        routed_experts_BxTxLxK=replayed_experts(cfg, model_config, shape, rows, seq_len),
    )
    rng = jax.eval_shape(lambda: jax.random.key(0))
    ref = reference_params(cfg, model_config, params)
    step = build_train_step(
        cfg, model_config, tx, schedule, placement, state, share_prompts=share_prompts
    )
    start = time.perf_counter()
    lowered = step.lower(state, batch, rng, ref)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return memory_check.CompiledStep(
        analysis=compiled.memory_analysis(),
        lower_s=lowered_at - start,
        compile_s=time.perf_counter() - lowered_at,
    )
