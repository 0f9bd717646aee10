"""The trainer: the loop that wires rollouts to the learner, and what a run is built from.

The face of `m2po_jax.trainer`: `Trainer(cfg, workdir).run()`; the run's parts are built in
`setup`, the loop is `loop`. What a run writes is `m2po_jax.run`; the command-line programs
are `m2po_jax.cli`.
"""

from m2po_jax.trainer.loop import NonFiniteError, RunResult, Trainer
from m2po_jax.trainer.setup import build_model, build_prompts, build_task

__all__ = ["NonFiniteError", "RunResult", "Trainer", "build_model", "build_prompts", "build_task"]
