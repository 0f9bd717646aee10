"""Load and save Hugging Face checkpoints (Llama 3.x, Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE).

A checkpoint directory holds `config.json` and either `model.safetensors` or a sharded
`model.safetensors.index.json` with its shard files. Nothing here touches the network
or needs torch: tensors are read with safetensors' numpy backend (bfloat16 through
ml_dtypes) and mapped onto the `model.py` param tree as `hf_format.tensor_layout` says
(the table there); `config.json` is translated by `hf_format` too (re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from m2po_jax.common.checks import read_json
from m2po_jax.common.errors import ModelError
from m2po_jax.models.hf_format import (
    HFTensor,
    config_from_hf,
    config_to_hf,
    tensor_layout,
)
from m2po_jax.models.model import apply, check_token_ids, init_params
from m2po_jax.models.model_config import ModelConfig, as_dtype
from m2po_jax.models.tokenizer import HFTokenizer, load_tokenizer

# safetensors' numpy backend reads BF16 tensors as numpy's "bfloat16", a type that exists
# once ml_dtypes is imported (it registers it); jax imports it.

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
# Buffers some exporters write that carry no learned weights.
_BENIGN_EXTRA = re.compile(r".*rotary_emb\.inv_freq$")
# Tensors are only read from disk through these tags (see safetensors' dtype names).
_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
PathLike = str | os.PathLike


@contextlib.contextmanager
def _open_weights(file: str):
    """`safe_open`, with a damaged file named in the error (safetensors does not name it)."""
    try:
        with safe_open(file, framework="np") as fh:
            yield fh
    except SafetensorError as e:
        raise ModelError(f"{file}: not a readable safetensors file ({e})") from None


def _weight_files(path: str) -> dict[str, str]:
    """Tensor name -> file that holds it, from the index or the single file."""
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: expected a non-empty 'weight_map'")
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        absent = sorted({f for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {absent}")
        return files
    if os.path.isfile(single_path):
        with _open_weights(single_path) as fh:
            return dict.fromkeys(fh.keys(), single_path)
    found = sorted(
        n for n in os.listdir(path) if n.endswith((".safetensors", ".bin", ".pt", ".pth"))
    )
    raise FileNotFoundError(
        f"{path}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE} "
        f"(safetensors only) but found {found or 'no weight files'}"
    )


def _header(files: Mapping[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype tag) read from file headers, without loading data."""
    info = {}
    for file in sorted(set(files.values())):
        with _open_weights(file) as fh:
            for name in fh.keys():
                if files.get(name) == file:
                    sl = fh.get_slice(name)
                    info[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return info


def _plan(path: PathLike, config: ModelConfig) -> tuple[list[HFTensor], dict[str, str]]:
    """The tensors to read and their files, after checking names, shapes and dtypes."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
    files = _weight_files(path)
    info = _header(files)
    missing_in_files = sorted(set(files) - set(info))
    if missing_in_files:
        raise ValueError(
            f"{path}: index lists tensors its shard files lack: {missing_in_files[:5]}"
        )
    layout = tensor_layout(config)
    expected = {t.hf_name for t in layout}
    missing = [t.hf_name for t in layout if t.hf_name not in info]
    if missing:
        raise ValueError(
            f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} in all) for {config.model_type} with {config.num_layers} layers"
        )
    for t in layout:
        shape, tag = info[t.hf_name]
        if shape != t.hf_shape:
            raise ValueError(
                f"{t.hf_name}: checkpoint shape {shape} does not match expected shape "
                f"{t.hf_shape} from config.json"
            )
        if tag not in _FLOAT_TAGS:
            raise ValueError(f"{t.hf_name}: dtype {tag} is not a float type {_FLOAT_TAGS}")
    extra = sorted(set(info) - expected)
    benign = [n for n in extra if _BENIGN_EXTRA.match(n)]
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        benign.append("lm_head.weight")  # tied models sometimes store the copy anyway
    unexpected = [n for n in extra if n not in benign]
    if unexpected:
        raise ValueError(
            f"{path}: unexpected tensor(s) {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} for {config.model_type} "
            f"with {config.num_layers} layers"
        )
    if benign:
        warnings.warn(f"{path}: ignoring tensors {benign}", stacklevel=3)
    return layout, files


def iter_hf_params(
    path: PathLike, config: ModelConfig, dtype: Any = None
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """Yields (param_path, array) one checkpoint tensor at a time, in the param layout.

    All names and shapes are checked against `config` before the first tensor is read,
    so a caller can `device_put` each array onto its sharding as it arrives without
    holding the whole model in host memory.

    Args:
      path: checkpoint directory.
      config: the model the tensors must fit.
      dtype: numpy dtype of the yielded arrays; None means `config.param_dtype`.
    """
    layout, files = _plan(path, config)
    np_dtype = as_dtype(config.param_dtype if dtype is None else dtype)
    by_param: dict[tuple[str, ...], list[HFTensor]] = {}
    for t in layout:
        by_param.setdefault(t.param_path, []).append(t)
    with contextlib.ExitStack() as stack:
        handles = {
            file: stack.enter_context(_open_weights(file))
            for file in sorted({files[t.hf_name] for t in layout})
        }

        def read(t: HFTensor) -> np.ndarray:
            return t.to_param(handles[files[t.hf_name]].get_tensor(t.hf_name))

        for param_path, tensors in by_param.items():
            if tensors[0].expert is None:
                yield param_path, read(tensors[0]).astype(np_dtype)
                continue
            # Stacked over experts: one tensor per expert (maybe in several files), each
            # written into its slice.
            array = np.empty(tensors[0].shape, np_dtype)
            for t in tensors:
                array[t.expert] = read(t)
            yield param_path, array


def _set_in(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_params(path: PathLike, config: ModelConfig, dtype: Any = None) -> dict:
    """The param tree of a checkpoint as jax arrays (dtype defaults to `config.param_dtype`)."""
    params: dict = {}
    for param_path, array in iter_hf_params(path, config, dtype):
        _set_in(params, param_path, jnp.asarray(array))
    expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise AssertionError("hf.tensor_layout does not cover the model's param tree")
    return params


def read_hf_config(path: PathLike) -> dict:
    """The parsed `config.json` of a checkpoint directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
    file = os.path.join(path, CONFIG_FILE)
    hf = read_json(file)
    if hf is None:
        raise FileNotFoundError(f"{file}: not found; a checkpoint dir needs {CONFIG_FILE}")
    return hf


# ----------------------------------------------------------------------------- model


class PretrainedModel:
    """A loaded checkpoint: `config`, `params`, the source `hf_config`, and a jitted forward."""

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        hf_config: Mapping[str, Any] | None = None,
        path: PathLike | None = None,
    ):
        self.config = config
        self.params = params
        self.hf_config = dict(hf_config) if hf_config is not None else config_to_hf(config)
        self.path = None if path is None else os.fspath(path)
        self._tokenizer: HFTokenizer | None | bool = False  # False: not looked for yet
        self._forward = jax.jit(
            lambda params, tokens, valid: apply(params, config, tokens, valid_BxT=valid)
        )

    def __call__(self, input_ids_BxT, valid_BxT=None) -> jax.Array:
        """float32 logits [B, T, V]; `valid_BxT` marks real tokens of left-padded rows."""
        tokens = jnp.asarray(input_ids_BxT, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"input_ids_BxT: expected rank 2 [B, T], got shape {tokens.shape}")
        check_token_ids(tokens, self.config.vocab_size, "input_ids_BxT")
        valid = jnp.ones(tokens.shape, bool) if valid_BxT is None else jnp.asarray(valid_BxT, bool)
        if valid.shape != tokens.shape:
            raise ValueError(
                f"valid_BxT: shape {valid.shape} != input_ids_BxT shape {tokens.shape}"
            )
        return self._forward(self.params, tokens, valid)

    @property
    def tokenizer(self) -> HFTokenizer | None:
        """The checkpoint's tokenizer, loaded on first use; None without tokenizer.json."""
        if self._tokenizer is False:
            has = self.path is not None and os.path.isfile(
                os.path.join(self.path, "tokenizer.json")
            )
            self._tokenizer = load_tokenizer(self.path, self.config) if has else None
        return self._tokenizer

    def __repr__(self) -> str:
        return f"PretrainedModel(path={self.path!r}, config={self.config})"


def load_pretrained(
    path: PathLike, dtype: Any = jnp.float32, *, param_dtype: Any = None
) -> PretrainedModel:
    """Loads a local Hugging Face checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or a sharded index).
      dtype: compute dtype.
      param_dtype: parameter dtype; None means the same as `dtype`.

    Returns:
      A `PretrainedModel`; `model(input_ids_BxT)` gives float32 logits [B, T, V].
    """
    hf = read_hf_config(path)
    config = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
    return PretrainedModel(config, load_params(path, config), hf, path)


# ----------------------------------------------------------------------------- save


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size: expected bytes or e.g. '5GB', got {size!r}")
    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(float(match.group(1)) * units[(match.group(2) or "").upper()])


def save_pretrained(
    model_or_params: PretrainedModel | Mapping,
    path: PathLike,
    *,
    config: ModelConfig | None = None,
    hf_config: Mapping[str, Any] | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    source_dir: PathLike | None = None,
    fetch=None,
    write: bool = True,
) -> None:
    """Writes a checkpoint `transformers.AutoModelForCausalLM.from_pretrained` can load.

    Tensors reach the host one at a time and each safetensors file is written when it is
    full, so the host holds at most one file's worth of weights.

    Args:
      model_or_params: a `PretrainedModel`, or a param tree (then `config` is required).
      path: output directory (created if needed).
      config: architecture of the params; defaults to the model's.
      hf_config: source `config.json` whose non-architecture keys (token ids, ...) are
        kept; defaults to the model's.
      dtype: dtype of the stored tensors; None keeps each param's dtype.
      max_shard_size: bytes per file (int or '5GB'); larger models are sharded with an
        index.
      source_dir: a Hugging Face directory whose tokenizer, chat template and generation
        files (`TOKENIZER_FILES`) are copied; defaults to the model's.
      fetch: brings one param to the host as a numpy array (default `jax.device_get`; a
        multi-host run passes an all-gather that every process takes part in).
      write: False takes part in the fetches and writes nothing (processes other than 0).
    """
    if isinstance(model_or_params, PretrainedModel):
        params = model_or_params.params
        config = config or model_or_params.config
        hf_config = hf_config if hf_config is not None else model_or_params.hf_config
        source_dir = source_dir if source_dir is not None else model_or_params.path
    else:
        params = nn.meta.unbox(model_or_params)
        if config is None:
            raise TypeError("save_pretrained: `config` is required when saving a bare param tree")
    limit = _parse_size(max_shard_size)
    hf = config_to_hf(config, hf_config)
    layout = tensor_layout(config)
    flat = _checked_flat(params, layout)
    fetch = fetch or jax.device_get
    path = os.fspath(path)
    if write:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):  # weights of an earlier save would shadow or confuse
            if (
                name in (SINGLE_FILE, INDEX_FILE)
                or _SHARD_NAME.fullmatch(name)
                or name.startswith(".part-")
            ):
                os.remove(os.path.join(path, name))
    shards = _ShardWriter(path, limit, write)
    fetched: tuple[tuple[str, ...] | None, np.ndarray | None] = (None, None)
    for t in layout:
        if fetched[0] != t.param_path:  # a param stacked over experts: fetched once
            array = np.asarray(fetch(flat[t.param_path]))
            if dtype is not None:
                array = array.astype(as_dtype(dtype))
            fetched = (t.param_path, array)
        shards.add(t.hf_name, t.to_hf(fetched[1]))
    stored = shards.close()
    if not write:
        return
    hf["torch_dtype"] = stored.pop() if len(stored) == 1 else "float32"
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(hf, fh, indent=2, sort_keys=True)
    if source_dir is not None and os.path.abspath(source_dir) != os.path.abspath(path):
        for name in TOKENIZER_FILES:
            src = os.path.join(source_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def _checked_flat(params, layout) -> dict:
    """The param tree by path, after checking it holds exactly the layout's shapes."""
    flat = {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_leaves_with_path(params)}
    names = {t.param_path for t in layout}
    if set(flat) != names:
        raise ValueError(
            f"model_or_params: param tree does not match config; missing "
            f"{sorted(names - set(flat))[:5]}, unexpected {sorted(set(flat) - names)[:5]}"
        )
    for t in layout:
        if tuple(flat[t.param_path].shape) != t.shape:
            raise ValueError(
                f"{'/'.join(t.param_path)}: shape {tuple(flat[t.param_path].shape)} != "
                f"{t.shape} expected from config"
            )
    return flat


class _ShardWriter:
    """Safetensors files of at most `limit` bytes, each written as soon as it is full;
    `close` names them (one `model.safetensors`, or numbered shards with an index)."""

    def __init__(self, path: str, limit: int, write: bool):
        self.path, self.limit, self.write = path, limit, write
        self.current: dict[str, np.ndarray] = {}
        self.files: list[tuple[str, list[str], int]] = []  # (temporary name, tensors, bytes)
        self.dtypes: set[str] = set()

    def add(self, name: str, array: np.ndarray) -> None:
        if (
            self.current
            and sum(a.nbytes for a in self.current.values()) + array.nbytes > self.limit
        ):
            self._flush()
        self.current[name] = array
        self.dtypes.add(array.dtype.name)

    def _flush(self) -> None:
        part = f".part-{len(self.files):05d}.safetensors"
        if self.write:  # transformers refuses safetensors without the format metadata
            save_file(self.current, os.path.join(self.path, part), metadata={"format": "pt"})
        size = sum(a.nbytes for a in self.current.values())
        self.files.append((part, list(self.current), size))
        self.current = {}

    def close(self) -> set[str]:
        """Names the files; returns the stored dtypes."""
        if self.current or not self.files:
            self._flush()
        if not self.write:
            return self.dtypes
        n = len(self.files)
        if n == 1:
            os.replace(
                os.path.join(self.path, self.files[0][0]), os.path.join(self.path, SINGLE_FILE)
            )
            return self.dtypes
        weight_map, total = {}, 0
        for i, (part, tensors, size) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.path, part), os.path.join(self.path, name))
            weight_map.update(dict.fromkeys(tensors, name))
            total += size
        with open(os.path.join(self.path, INDEX_FILE), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        return self.dtypes
