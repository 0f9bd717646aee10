"""m2po_jax: stable off-policy RL for language models with M2PO, in JAX/Flax.

The package by role, each importing only those above it in this list:
`common` (errors, checks, the batch records, the config schema, mesh axis names),
`algorithm` (the pure M2PO math), `models` (the LM, attention, Hugging Face files,
tokenizers, prompts), `tasks`, `parallel` (meshes, shardings, multi-host), `learner` (the
jitted update) and `rollout` (sampling, episodes, the stale queue), `config` (validation and
overrides), `run` (what a run writes: workdir, checkpoints, metrics, plots, exports),
`trainer` (the loop and what it is built from), `cli` (`m2po-train`, `m2po-export`,
`m2po-study`).

Importing `m2po_jax` or the masking function loads no Flax, orbax or transformers.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from m2po_jax.algorithm.advantages import grpo_token_advantages
from m2po_jax.algorithm.losses import policy_loss
from m2po_jax.algorithm.masking import m2po_clip_bound, m2po_mask, m2po_mask_with_stats
from m2po_jax.algorithm.rejection import RejectionSampling

__version__ = "0.1.0"

__all__ = [
    "RejectionSampling",
    "grpo_token_advantages",
    "m2po_clip_bound",
    "m2po_mask",
    "m2po_mask_with_stats",
    "policy_loss",
]

# The flat module paths of 0.1 and where each module lives now. Each keeps working for one
# release: importing it warns with the new path and gives the same module object.
MOVED = {
    "advantages": "algorithm.advantages",
    "architectures": "models.architectures",
    "areal": "config.areal",
    "attention": "models.attention",
    "attention_kernels": "models.attention_kernels",
    "batching": "learner.batching",
    "chat": "models.chat",
    "checkpoint": "run.checkpoint",
    "checks": "common.checks",
    "compile_cache": "trainer.compile_cache",
    "config_schema": "common.config_schema",
    "distributed": "parallel.distributed",
    "errors": "common.errors",
    "evaluate": "trainer.evaluate",
    "hf_format": "models.hf_format",
    "logprobs": "learner.logprobs",
    "losses": "algorithm.losses",
    "main": "cli.train",
    "masking": "algorithm.masking",
    "masking_kernels": "algorithm.masking_kernels",
    "masking_stats": "algorithm.masking_stats",
    "memory": "learner.memory",
    "metrics": "run.metrics",
    "model": "models.model",
    "model_config": "models.model_config",
    "optim": "learner.optim",
    "overrides": "config.overrides",
    "paths": "run.paths",
    "penalties": "algorithm.penalties",
    "placement": "parallel.placement",
    "plots": "run.plots",
    "prompts": "models.prompts",
    "proximal": "algorithm.proximal",
    "rejection": "algorithm.rejection",
    "rope": "models.rope",
    "run_record": "run.run_record",
    "sampling": "rollout.sampling",
    "scopes": "algorithm.scopes",
    "setup": "trainer.setup",
    "sft": "trainer.sft",
    "sharding": "parallel.sharding",
    "step_math": "learner.step_math",
    "step_metrics": "learner.step_metrics",
    "step_plan": "learner.step_plan",
    "tensorboard": "run.tensorboard",
    "tokenizer": "models.tokenizer",
    "train_step": "learner.train_step",
    "types": "common.types",
    "variants": "algorithm.variants",
    "workdir": "run.workdir",
    # 0.2: the trainer's command-line programs and what a run writes left the trainer
    "trainer.workdir": "run.workdir",
    "trainer.paths": "run.paths",
    "trainer.checkpoint": "run.checkpoint",
    "trainer.metrics": "run.metrics",
    "trainer.tensorboard": "run.tensorboard",
    "trainer.plots": "run.plots",
    "trainer.run_record": "run.run_record",
    "trainer.export": "run.export",
    "trainer.main": "cli.train",
    "trainer.export_main": "cli.export",
    "trainer.study": "cli.study",
    # 0.3: one module per rollout engine
    "rollout.engine": "rollout.engines",
}
# Old paths that stay public without a warning.
PUBLIC = {"hf": "models.hf"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `m2po_jax.<old>` as the module at its new path (`MOVED`, `PUBLIC`)."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.partition(".")
        if head == __name__ and (name in MOVED or name in PUBLIC):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        name = spec.name.partition(".")[2]
        new = f"{__name__}.{PUBLIC.get(name) or MOVED[name]}"
        if name in MOVED:
            warnings.warn(
                f"{spec.name} moved to {new}; the old path goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at its new path is already executed


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name):
    """`m2po_jax.masking` after `import m2po_jax` (attribute access, not an import)."""
    if name in MOVED or name in PUBLIC:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
