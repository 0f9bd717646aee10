"""What a run writes and reads back: the workdir and its lock (`workdir`), local or object-store
paths (`paths`), verified orbax checkpoints (`checkpoint`), metrics (`metrics`: JSONL,
TensorBoard in `tensorboard`, wandb, the progress bar), plots (`plots`), the run record
(`run_record`) and Hugging Face exports (`export`).

The loop (`m2po_jax.trainer`) and the command-line programs (`m2po_jax.cli`) use them; they use
nothing of either.
"""
