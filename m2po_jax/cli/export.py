"""`m2po-export`: a Hugging Face directory from a workdir's checkpoint.

  m2po-export runs/gsm8k --out /tmp/policy                 # the newest verified checkpoint
  m2po-export runs/gsm8k --step 40 --out /tmp/policy_40 --dtype float32
  m2po-export runs/gsm8k_lora --format peft --out /tmp/adapter   # a LoRA run's adapters

Works on a finished or an interrupted run: the model is rebuilt from the config the
workdir recorded (`config.json`) and its Hugging Face source (`model.path`), the params
come from the checkpoint (verified against its manifest), and the directory is written as
the trainer writes `<workdir>/hf/step_<N>` (`trainer.export`). A LoRA run exports the
merged model (`--format hf`, the default) or its adapters as a PEFT adapter of
`model.path` (`--format peft`). A LoRA checkpoint that holds the adapters alone is put on
the base loaded from `model.path` again, which must have the hash the checkpoint recorded
(`checkpoint.base_identity`). Errors a user can fix (no
such workdir or step, a damaged checkpoint, a run without a Hugging Face source, an
existing output) print one line, `m2po-export: <problem>`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from m2po_jax.common.errors import CheckpointError, M2poError, WorkdirError
from m2po_jax.learner import optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import hf, lora, quant
from m2po_jax.models import model as model_lib
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import export as export_lib
from m2po_jax.run import paths, run_record
from m2po_jax.trainer import setup as setup_lib

FORMATS = ("hf", "peft")


def export_workdir(
    workdir, out, *, step: int | None = None, dtype: str = "bfloat16", fmt: str = "hf"
):
    """Writes checkpoint `step` (None: the newest that verifies) of `workdir` to `out`: a
    Hugging Face directory (`fmt="hf"`, a LoRA run's model merged) or a PEFT adapter of
    the run's `model.path` (`fmt="peft"`, LoRA runs only); returns (the step, the path)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    workdir = paths.workdir(workdir)
    record = run_record.read_record(workdir)
    where = os.fspath(workdir / run_record.CONFIG_FILE)
    cfg = run_record.recorded_config(record, where)
    source = cfg.model.path
    if fmt == "peft" and not cfg.model.lora.rank:
        raise WorkdirError(
            f"{where}: --format peft needs a run with model.lora.rank > 0 (this run trained "
            "every param; export it with --format hf)"
        )
    if not source:
        what = "a base for a PEFT adapter" if fmt == "peft" else "config.json or tokenizer"
        raise WorkdirError(
            f"{where}: model.path is empty: the run trained a new model, not a Hugging Face "
            f"checkpoint, so there is no {what} to export with"
        )
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise WorkdirError(
            f"{where}: model.path={source} has no config.json any more; the export needs "
            "the run's Hugging Face source directory"
        )
    model_config, _ = setup_lib.build_model(cfg, 0)
    if run_record.describe(cfg, model_config)["params"] != record["params"]:
        raise WorkdirError(
            f"{where}: the checkpoints' params differ from {source}'s architecture now"
        )
    checkpointer = ckpt_lib.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    chosen = _verified_step(checkpointer, step)
    meta = checkpointer.meta(chosen)
    saved_base = meta.get("base")  # set: the checkpoint holds the LoRA adapters alone
    state_like = _abstract_state(cfg, model_config, adapters_only=saved_base is not None)
    base_params, base = None, None
    if saved_base is not None:
        # The base from model.path again, as the trainer loads it: its hash must be the
        # checkpoint's (`Checkpointer.restore` refuses another base in one line).
        base_params, base = _model_path_base(cfg, model_config, where)
    if fmt == "peft":
        if cfg.model.lora.base == "int8":
            raise WorkdirError(
                f"{where}: model.lora.base='int8' has no PEFT base to match (bitsandbytes' "
                "load_in_8bit also quantises the activations, so its logits are not the "
                "run's); export the merged model (dequantised base + adapters) with "
                "--format hf"
            )
        if saved_base is None and meta.get("sft_steps") and cfg.model.lora.base == "float":
            raise WorkdirError(
                f"{checkpointer.step_dir(chosen)}: the run's supervised warm-up "
                f"({meta['sft_steps']} steps) trained the base, so its adapters do not fit "
                f"model.path={source}; export the merged model with --format hf"
            )
        # The adapters are exported for the base they were trained on (model.path's).
        restored = checkpointer.restore(chosen, state_like=state_like, base=base)
        adapters, saved = lora.split(restored["state"].params)
        if saved_base is None:  # the whole params: their base must be model.path's
            _, base = _model_path_base(cfg, model_config, where)
            if ckpt_lib.params_hash(saved) != base["hash"]:
                raise WorkdirError(
                    f"{checkpointer.step_dir(chosen)}: its LoRA adapters were trained on "
                    f"a base (hash {ckpt_lib.params_hash(saved)[:16]}) that is not "
                    f"model.path={source} (hash {base['hash'][:16]}); export the merged "
                    "model with --format hf"
                )
        path = export_lib.export_peft(adapters, model_config, source, out, dtype=dtype)
        return chosen, path
    if base_params is not None:
        state_like = state_like.replace(params=lora.merge(state_like.params, base_params))
    restored = checkpointer.restore(chosen, state_like=state_like, base=base)
    path = export_lib.export_params(
        restored["state"].params, model_config, source, out, dtype=dtype
    )
    return chosen, path


def _model_path_base(cfg, model_config, where: str):
    """(base params, `checkpoint.base_identity`) of the run's `model.path` loaded again
    as the trainer loads it (quantised under QLoRA)."""
    source = cfg.model.path
    try:
        base_params = hf.load_params(
            source, lora.base_config(model_config), dtype=cfg.model.param_dtype or None
        )
        base_params = quant.quantize_base(base_params, model_config)  # (QLoRA)
    except (OSError, ValueError) as e:
        raise WorkdirError(f"{where}: model.path={source}: {e}") from e
    return base_params, {"path": source, "hash": ckpt_lib.params_hash(base_params)}


def _verified_step(checkpointer: ckpt_lib.Checkpointer, step: int | None) -> int:
    """`step`, or the newest checkpoint, after checking it against its manifest; unlike a
    resume, nothing in the workdir is moved."""
    steps = checkpointer.all_steps()
    if step is not None and step not in steps:
        raise CheckpointError(
            f"{checkpointer.step_dir(step)}: no such checkpoint (available: {steps or 'none'})"
        )
    problems = []
    for candidate in [step] if step is not None else reversed(steps):
        problem = checkpointer.verify(candidate)
        if problem is None:
            return candidate
        problems.append(f"{checkpointer.step_dir(candidate)}: {problem}")
    if not problems:
        raise CheckpointError(f"{checkpointer.directory}: no checkpoint to export")
    raise CheckpointError("; ".join(problems))


def _abstract_state(cfg, model_config, *, adapters_only: bool = False):
    """The shapes of the run's `TrainState`, on one device: under LoRA its params hold the
    base and the adapters, and its optimizer state covers the adapters
    (`init_train_state`); `adapters_only` leaves the base out of the params (what a LoRA
    checkpoint of a `model.path` base holds)."""
    tx, _ = optim.make_optimizer(cfg.actor.optimizer, cfg.total_steps)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def init():
        params = model_lib.init_params(model_config, jax.random.key(0))
        state = step_lib.init_train_state(params, tx)
        if adapters_only:
            state = state.replace(params=lora.trainable(params))
        return state

    shapes = jax.eval_shape(init)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="m2po-export",
        description="Write a workdir's checkpoint as a Hugging Face directory (a LoRA run's "
        "merged) or, with --format peft, a LoRA run's adapters as a PEFT adapter.",
    )
    parser.add_argument("workdir", help="the m2po-train workdir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--format",
        default="hf",
        choices=FORMATS,
        help="hf: the model (a LoRA run's merged); peft: a LoRA run's adapters, for "
        "peft or vLLM on model.path",
    )
    args = parser.parse_args(argv)
    try:
        step, path = export_workdir(
            args.workdir, args.out, step=args.step, dtype=args.dtype, fmt=args.format
        )
    except M2poError as e:
        print(f"m2po-export: {e}", file=sys.stderr)
        return 2
    print(f"m2po-export: step {step} of {args.workdir} -> {path}")
    return 0


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
