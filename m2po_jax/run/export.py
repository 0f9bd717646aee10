"""Hugging Face checkpoints of a run's policy: what transformers, vLLM and SGLang load.

    <workdir>/hf/step_<N>/   config.json (the source's, with the trained params'
                             architecture), model*.safetensors (bfloat16 by default), the
                             source's tokenizer files, chat template and generation config,
                             and m2po_manifest.json (size and CRC-32 of every file)

A LoRA run's export is the merged model (`lora.merged`: each adapted kernel W + (alpha/r) A B,
merged on its devices one tensor at a time), a plain Hugging Face directory like a full
fine-tune's. `export_peft` writes the adapters alone instead, as a PEFT LoRA adapter of the
source checkpoint (what `peft.PeftModel.from_pretrained` and vLLM's `--lora-modules` load):

    <out>/   adapter_config.json, adapter_model.safetensors, README.md (the base it
             needs: under an NF4 base, bitsandbytes' NF4 of the source, also as
             base_quantization_config.json), m2po_manifest.json

The trainer writes one at the end of a run whose model came from a Hugging Face directory
(`model.path`) and every `checkpoint.hf_every` steps, keeping `checkpoint.hf_keep`;
`m2po-export` writes one from any verified orbax checkpoint of a workdir. An export is
written into a hidden temporary directory, hashed, verified and only then renamed into
place: a kill leaves no half directory under its final name (the next export removes the
leftovers). Tensors reach the host one at a time; in a multi-host run every process takes
part in each tensor's all-gather and process 0 writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import jax
import numpy as np
from etils import epath
from flax import traverse_util
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from m2po_jax.common.errors import CheckpointError, WriterError, describe_os_error
from m2po_jax.models import hf, lora
from m2po_jax.models import model as model_lib
from m2po_jax.models.model_config import ModelConfig, as_dtype
from m2po_jax.parallel import placement
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import paths

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
    `out_dir`. LoRA params (`model_config.lora_rank > 0`) are written merged, as the base
    architecture. Every process calls it (the gathers are collective); process 0 writes."""

    def write(tmp, primary):
        base_params, base_config, fetch = _merged_lazily(params, model_config)
        hf.save_pretrained(
            base_params,
            tmp,
            config=base_config,
            hf_config=hf.read_hf_config(source_dir),
            dtype=dtype,
            max_shard_size="2GB",
            source_dir=source_dir,
            fetch=fetch,
            write=primary,
        )

    return _export(out_dir, write)


class _Adapted:
    """An adapted kernel with its adapters (and, under a quantised base, its scale):
    merged (`lora.merged`) when it is fetched, so the export holds one merged kernel at a
    time, not a second copy of the model."""

    def __init__(self, leaves: dict, shape):
        self.leaves, self.shape = leaves, tuple(shape)


def _merged_lazily(params, config: ModelConfig):
    """(params shaped as the base model's, its config, a `fetch` for `hf.save_pretrained`
    that merges each adapted kernel on its devices before bringing it to the host)."""
    if not config.lora_rank:
        return params, config, placement.to_host
    flat = traverse_util.flatten_dict(params)
    base_config = lora.base_config(config)
    shapes = traverse_util.flatten_dict(
        jax.eval_shape(lambda: model_lib.init_params(base_config, jax.random.key(0)))
    )
    out = {}
    for path, x in flat.items():
        name = str(path[-1])
        if path not in shapes:  # an adapter, or a quantised kernel's scale: merged below
            continue
        stem = lora.adapter_stem(name)
        if stem is not None and (*path[:-1], f"{stem}_lora_a") in flat:
            # The kernel, its adapters and any other leaf of its own (a quantised scale),
            # renamed to one projection "w" (`w_kernel`, or experts' `w_experts`) for
            # `lora.merged`.
            projection = name.split("_")[0]
            leaves = {
                "w" + str(p[-1])[len(projection) :]: v
                for p, v in flat.items()
                if p[:-1] == path[:-1] and str(p[-1]).startswith((name, f"{stem}_lora_"))
            }
            x = _Adapted(leaves, shapes[path].shape)
        out[path] = x

    def fetch(x):
        if isinstance(x, _Adapted):
            (x,) = lora.merged(x.leaves, config)[0].values()  # the merged kernel alone
        return placement.to_host(x)

    return traverse_util.unflatten_dict(out), base_config, fetch


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# Our projection name -> (its Flax module, the Hugging Face module it adapts).
_PEFT_MODULES = {
    "q": ("attn", "self_attn.q_proj"),
    "k": ("attn", "self_attn.k_proj"),
    "v": ("attn", "self_attn.v_proj"),
    "o": ("attn", "self_attn.o_proj"),
    "gate": ("mlp", "mlp.gate_proj"),
    "up": ("mlp", "mlp.up_proj"),
    "down": ("mlp", "mlp.down_proj"),
}


def peft_config(model_config: ModelConfig, source_dir: str) -> dict:
    """`adapter_config.json` of the run's adapters on the checkpoint at `source_dir`."""
    alpha = model_config.lora_alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(source_dir)
        if paths.is_local(source_dir)
        else str(source_dir),
        "r": model_config.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": sorted(
            _PEFT_MODULES[t][1].split(".")[-1] for t in model_config.lora_targets
        ),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_tensors(params, model_config: ModelConfig, fetch=None):
    """Yields (PEFT tensor name, [out, in] numpy array) of every adapter of `params`.

    Our A [in..., r] is `lora_A.weight` [r, in] = A.reshape(-1, r).T and B [r, out...] is
    `lora_B.weight` [out, r] = B.reshape(r, -1).T: the flattening of the kernels' head
    axes is `hf_format.tensor_layout`'s (q: [E, H, D] -> [H*D, E]; o: [H, D, E] -> [E, H*D]).
    """
    fetch = fetch or placement.to_host
    r = model_config.lora_rank
    for i in range(model_config.num_layers):
        for target in model_config.lora_targets:
            module, hf_module = _PEFT_MODULES[target]
            prefix = f"base_model.model.model.layers.{i}.{hf_module}"
            layer = params[f"layers_{i}"][module]
            a = np.asarray(fetch(layer[f"{target}_lora_a"]))
            b = np.asarray(fetch(layer[f"{target}_lora_b"]))
            yield f"{prefix}.lora_A.weight", np.ascontiguousarray(a.reshape(-1, r).T)
            yield f"{prefix}.lora_B.weight", np.ascontiguousarray(b.reshape(r, -1).T)


PEFT_README = "README.md"
BASE_QUANTIZATION = "base_quantization_config.json"
# The transformers `BitsAndBytesConfig` whose NF4 base dequantises to the run's
# (`quant.py`: bitsandbytes' blocks of 64 along the torch weight, float32 absmax).
NF4_BASE_QUANTIZATION = {
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": False,
    "bnb_4bit_compute_dtype": "float32",
}


def _peft_readme(config: dict, base: str) -> str:
    """README.md of a PEFT export: the base it needs and how to load it."""
    source = config["base_model_name_or_path"]
    if base == "nf4":
        q = NF4_BASE_QUANTIZATION
        return (
            "# LoRA adapter (m2po-jax, QLoRA)\n\n"
            f"Trained on the NF4-quantised weights of `{source}` (the projections "
            f"{', '.join(config['target_modules'])}), not on its float weights: load the "
            "base quantised as the run quantised it, or the logits differ.\n\n"
            "```python\n"
            "import torch, transformers, peft\n"
            "q = transformers.BitsAndBytesConfig(load_in_4bit=True, "
            'bnb_4bit_quant_type="nf4",\n'
            "    bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=torch.float32)\n"
            f'base = transformers.AutoModelForCausalLM.from_pretrained("{source}", '
            "quantization_config=q)\n"
            'model = peft.PeftModel.from_pretrained(base, "<this directory>")\n'
            "```\n\n"
            f"`{BASE_QUANTIZATION}`: {json.dumps(q)}\n"
        )
    return (
        "# LoRA adapter (m2po-jax)\n\n"
        f"For the float weights of `{source}`:\n\n"
        "```python\n"
        "import transformers, peft\n"
        f'base = transformers.AutoModelForCausalLM.from_pretrained("{source}")\n'
        'model = peft.PeftModel.from_pretrained(base, "<this directory>")\n'
        "```\n"
    )


def export_peft(
    params,
    model_config: ModelConfig,
    source_dir: str,
    out_dir,
    *,
    dtype: str = "bfloat16",
) -> epath.Path:
    """Writes the LoRA adapters of `params` at `out_dir` (which must not exist) as a PEFT
    adapter of the Hugging Face checkpoint `source_dir` (which must be the base they were
    trained on); returns `out_dir`. Every process calls it; process 0 writes.

    A README.md says which base the adapters need: under an NF4 base (`lora_base`
    "nf4") the source loaded with bitsandbytes' NF4 (`NF4_BASE_QUANTIZATION`, also
    written as `base_quantization_config.json`), which dequantises to the run's base. An
    int8 base is refused: bitsandbytes' `load_in_8bit` quantises the activations too, so
    no PEFT base gives the run's logits (the merged export does); so are adapters on a
    mixture of experts' experts (peft adapts transformers' fused `gate_up_proj` with one
    adapter for gate and up, not our two)."""
    if not model_config.lora_rank:
        raise ValueError("model_config: lora_rank is 0; a PEFT export needs LoRA adapters")
    if model_config.lora_base == "int8":
        raise ValueError(
            "model_config: lora_base='int8' has no PEFT base that gives the run's logits; "
            "export the merged model (export_params)"
        )
    experts = sorted(set(model_config.lora_targets) & {"gate", "up", "down"})
    if model_config.is_moe and experts:
        raise ValueError(
            f"model_config: LoRA on {model_config.model_type}'s experts ({','.join(experts)}) "
            "has no PEFT layout here; export the merged model (export_params)"
        )
    config = peft_config(model_config, source_dir)

    def write(tmp, primary):
        tensors = {
            name: x.astype(as_dtype(dtype)) for name, x in peft_tensors(params, model_config)
        }
        if not primary:
            return
        save_file(tensors, os.path.join(tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, PEFT_CONFIG), "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
        with open(os.path.join(tmp, PEFT_README), "w") as fh:
            fh.write(_peft_readme(config, model_config.lora_base))
        if model_config.lora_base == "nf4":
            with open(os.path.join(tmp, BASE_QUANTIZATION), "w") as fh:
                json.dump(NF4_BASE_QUANTIZATION, fh, indent=2, sort_keys=True)

    return _export(out_dir, write)


def _export(out_dir, write) -> epath.Path:
    """Runs `write(tmp, primary)` into a hidden temporary directory (process 0's; "" on
    the others, which take part in the gathers and write nothing), then manifests,
    verifies and renames it to `out_dir`, which must not exist."""
    out = paths.as_path(out_dir)
    primary = jax.process_index() == 0
    if _agree(primary and out.exists()):
        raise CheckpointError(f"{out}: already exists; an export is never written over")
    try:
        local = paths.is_local(out)
        parent = os.fspath(out.parent) if local else None
        if primary:
            if local:
                os.makedirs(parent, exist_ok=True)
                _remove_leftovers(parent)
            tmp = tempfile.mkdtemp(prefix=f"{_TMP}{out.name}-", dir=parent)
        else:
            tmp = None
        write(tmp or "", primary)
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
