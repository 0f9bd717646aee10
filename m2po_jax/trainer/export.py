"""Hugging Face checkpoints of a run's policy: what transformers, vLLM and SGLang load.

    <workdir>/hf/step_<N>/   config.json (the source's, with the trained params'
                             architecture), model*.safetensors (bfloat16 by default), the
                             source's tokenizer files, chat template and generation config,
                             and m2po_manifest.json (size and CRC-32 of every file)

The trainer writes one at the end of a run whose model came from a Hugging Face directory
(`model.path`) and every `checkpoint.hf_every` steps, keeping `checkpoint.hf_keep`;
`m2po-export` writes one from any verified orbax checkpoint of a workdir. An export is
written into a hidden temporary directory, hashed, verified and only then renamed into
place: a kill leaves no half directory under its final name (the next export removes the
leftovers). Tensors reach the host one at a time; in a multi-host run every process takes
part in each tensor's all-gather and process 0 writes.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from m2po_jax.common.errors import CheckpointError, WriterError, describe_os_error
from m2po_jax.models import hf
from m2po_jax.models.model_config import ModelConfig
from m2po_jax.parallel import placement
from m2po_jax.trainer import checkpoint as ckpt_lib
from m2po_jax.trainer import paths

HF_DIR = "hf"
_STEP = re.compile(r"step_(\d+)")
_TMP = ".tmp-export-"


def export_dir(workdir, step: int) -> epath.Path:
    return paths.as_path(workdir) / HF_DIR / f"step_{step}"


def exported_steps(workdir) -> list[int]:
    """Steps with a complete export under `<workdir>/hf`, oldest first."""
    root = paths.as_path(workdir) / HF_DIR
    if not root.exists():
        return []
    found = (_STEP.fullmatch(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def _agree(flag: bool) -> bool:
    """Process 0's `flag` on every process (what it sees on its disk decides)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def export_params(
    params,
    model_config: ModelConfig,
    source_dir: str,
    out_dir,
    *,
    dtype: str = "bfloat16",
) -> epath.Path:
    """Writes `params` as a Hugging Face directory at `out_dir` (which must not exist),
    with `source_dir`'s config keys, tokenizer, chat template and generation files; returns
    `out_dir`. Every process calls it (the gathers are collective); process 0 writes."""
    out = paths.as_path(out_dir)
    primary = jax.process_index() == 0
    if _agree(primary and out.exists()):
        raise CheckpointError(f"{out}: already exists; an export is never written over")
    try:
        hf_config = hf.read_hf_config(source_dir)
        local = paths.is_local(out)
        parent = os.fspath(out.parent) if local else None
        if primary:
            if local:
                os.makedirs(parent, exist_ok=True)
                _remove_leftovers(parent)
            tmp = tempfile.mkdtemp(prefix=f"{_TMP}{out.name}-", dir=parent)
        else:
            tmp = None
        hf.save_pretrained(
            params,
            tmp or "",
            config=model_config,
            hf_config=hf_config,
            dtype=dtype,
            max_shard_size="2GB",
            source_dir=source_dir,
            fetch=placement.to_host,
            write=primary,
        )
        if not primary:
            return out
        tmp_path = epath.Path(tmp)
        ckpt_lib.write_manifest(tmp_path)
        problem = ckpt_lib.verify_step_dir(tmp_path)
        if problem:
            raise CheckpointError(f"{out}: the export did not verify ({problem})")
        _publish(tmp, out)
    except OSError as e:
        raise WriterError(describe_os_error(e, out)) from e
    return out


def _remove_leftovers(parent: str) -> None:
    """Temporary directories of exports that a kill interrupted."""
    for name in os.listdir(parent):
        if name.startswith(_TMP):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _follow_umask(directory: str) -> None:
    """The modes any file the user writes would have: `tempfile.mkdtemp` makes the
    directory 0700 and the tensor files come out 0600 whatever the umask, so a serving
    container running as another user could not read the export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _publish(tmp: str, out: epath.Path) -> None:
    """Moves a finished export into place: one rename locally; to an object store every
    file, the manifest last (a reader verifies against it)."""
    if paths.is_local(out):
        _follow_umask(tmp)
        os.replace(tmp, os.fspath(out))
        return
    names = sorted(os.listdir(tmp), key=lambda n: n == ckpt_lib.MANIFEST)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / name).write_bytes(epath.Path(tmp, name).read_bytes())
    shutil.rmtree(tmp, ignore_errors=True)


def export_run_step(
    workdir,
    step: int,
    params,
    model_config: ModelConfig,
    source_dir: str,
    *,
    dtype: str,
    keep: int,
) -> epath.Path:
    """`<workdir>/hf/step_<step>`: exported unless it is there already, then the oldest
    exports beyond `keep` removed. Every process calls it."""
    out = export_dir(workdir, step)
    primary = jax.process_index() == 0
    if _agree(primary and step not in exported_steps(workdir)):
        export_params(params, model_config, source_dir, out, dtype=dtype)
    if primary:
        try:
            for old in exported_steps(workdir)[:-keep]:
                export_dir(workdir, old).rmtree()
        except OSError as e:
            raise WriterError(describe_os_error(e, out.parent)) from e
    return out


def verify_export(path) -> None:
    """Raises CheckpointError (one line) unless every file of the export matches its
    manifest."""
    problem = ckpt_lib.verify_step_dir(paths.as_path(path))
    if problem:
        raise CheckpointError(f"{path}: {problem}")
