"""Exports of a LoRA model: the merged Hugging Face directory (transformers loads it as a
plain model) and the PEFT adapter (peft loads it onto the source checkpoint), both giving
our LoRA model's logits; `m2po-export`'s refusals of a PEFT export without LoRA or without
a Hugging Face source.

The source is a tiny random Llama with grouped-query attention built by transformers, and
the adapters have random nonzero A and B on every target, so a wrong head order, transpose
or scale in either export moves the logits."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

from m2po_jax import config as config_lib
from m2po_jax.cli import export as export_main
from m2po_jax.configs import default
from m2po_jax.models import hf, lora, quant
from m2po_jax.models import model as model_lib
from m2po_jax.run import export as export_lib
from m2po_jax.run import run_record

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96
TOL = 1e-4
ALL = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Llama (4 query heads sharing 2 key/value heads, head_dim 8)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _with_adapters(source, rank, alpha, targets, seed):
    """(params, config): the source's weights with rank-`rank` adapters on `targets`, B
    drawn at random (not zero) so that the adapters change the model."""
    base = hf.load_pretrained(source)
    config = dataclasses.replace(
        base.config, lora_rank=rank, lora_alpha=alpha, lora_targets=targets
    )
    params = model_lib.add_adapters(base.params, config, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    flat = traverse_util.flatten_dict(params)
    for path, x in flat.items():
        if str(path[-1]).endswith("_lora_b"):
            flat[path] = jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype)
    return traverse_util.unflatten_dict(flat), config


def _ids():
    return np.random.default_rng(1).integers(0, VOCAB, (2, 11))


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _ours(params, config, ids):
    return np.asarray(model_lib.apply(params, config, jnp.asarray(ids, jnp.int32)))


def _load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize(
    "rank,alpha,targets", [(4, 8.0, ALL), (3, 7.5, ("q", "o", "down"))], ids=["all", "some"]
)
def test_the_merged_and_the_peft_exports_give_the_lora_models_logits(
    source, tmp_path, rank, alpha, targets
):
    params, config = _with_adapters(source, rank, alpha, targets, seed=rank)
    ids = _ids()
    want = _ours(params, config, ids)
    base_logits = _ours(*lora.merged(lora.adapters_off(params), config), ids)
    assert np.abs(want - base_logits).max() > 0.1  # the adapters matter

    # (a) The merged model, a plain Hugging Face directory of the source's architecture.
    merged = export_lib.export_params(params, config, str(source), tmp_path / "hf", dtype="float32")
    export_lib.verify_export(merged)
    assert sorted(load_file(os.path.join(merged, hf.SINGLE_FILE))) == sorted(
        load_file(os.path.join(source, hf.SINGLE_FILE))
    )
    assert hf.read_hf_config(merged)["num_key_value_heads"] == 2
    np.testing.assert_allclose(_torch_logits(_load_hf(merged), ids), want, atol=TOL, rtol=0)

    # (b) The PEFT adapter, loaded by peft onto the source checkpoint.
    adapter = export_lib.export_peft(
        params, config, str(source), tmp_path / "peft", dtype="float32"
    )
    export_lib.verify_export(adapter)
    adapter_config = json.loads((adapter / export_lib.PEFT_CONFIG).read_text())
    hf_names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
    hf_names.update(gate="gate_proj", up="up_proj", down="down_proj")
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == rank
    assert adapter_config["lora_alpha"] == alpha
    assert adapter_config["target_modules"] == sorted(hf_names[t] for t in targets)
    assert adapter_config["base_model_name_or_path"] == os.path.abspath(source)
    assert adapter_config["bias"] == "none" and adapter_config["task_type"] == "CAUSAL_LM"
    tensors = load_file(os.path.join(adapter, export_lib.PEFT_WEIGHTS))
    assert len(tensors) == 2 * 2 * len(targets)  # layers x (A, B) x targets
    q_or_o = "self_attn.o_proj" if "o" in targets else "self_attn.q_proj"
    a = tensors[f"base_model.model.model.layers.1.{q_or_o}.lora_A.weight"]
    b = tensors[f"base_model.model.model.layers.1.{q_or_o}.lora_B.weight"]
    assert a.shape == (rank, 32) and b.shape == (32, rank)  # [r, in], [out, r]
    model = peft.PeftModel.from_pretrained(_load_hf(source), str(adapter)).eval()
    np.testing.assert_allclose(_torch_logits(model, ids), want, atol=TOL, rtol=0)
    # peft's own merge gives the merged export's weights.
    ours = load_file(os.path.join(merged, hf.SINGLE_FILE))
    theirs = {k: v.numpy() for k, v in model.merge_and_unload().state_dict().items()}
    for name, x in ours.items():
        np.testing.assert_allclose(theirs[name], x, atol=1e-6, rtol=0, err_msg=name)


def unpack_high_first(packed: np.ndarray, n: int) -> np.ndarray:
    """4-bit codes, element 2i in a byte's high nibble, 2i + 1 in its low nibble."""
    b = np.asarray(packed).reshape(-1)
    return np.stack([b >> 4, b & 0xF], axis=-1).reshape(-1)[:n]


def _with_quantised_adapters(source, base, seed=5):
    """`_with_adapters` on every target with the base quantised to `base` as the trainer
    quantises `model.path`'s (`quant.quantize_base`)."""
    params, config = _with_adapters(source, 4, 8.0, ALL, seed)
    config = dataclasses.replace(config, lora_base=base)
    adapters, float_base = lora.split(params)
    return lora.merge(adapters, quant.quantize_base(float_base, config)), config


def test_a_qlora_nf4_peft_export_on_a_bitsandbytes_nf4_base_gives_the_models_logits(
    source, tmp_path
):
    params, config = _with_quantised_adapters(source, "nf4")
    ids = _ids()
    want = _ours(params, config, ids)
    float_params, float_config = _with_adapters(source, 4, 8.0, ALL, seed=5)
    assert np.abs(want - _ours(float_params, float_config, ids)).max() > 1e-3  # quantised
    # The merged export is the dequantised base + (alpha / r) B A: transformers' logits.
    merged = export_lib.export_params(params, config, str(source), tmp_path / "hf", dtype="float32")
    np.testing.assert_allclose(_torch_logits(_load_hf(merged), ids), want, atol=TOL, rtol=0)
    weights = load_file(os.path.join(merged, hf.SINGLE_FILE))
    layer = traverse_util.flatten_dict(params)
    at = ("layers_1", "attn")
    w = quant.dequantize("nf4", layer[(*at, "o_kernel")], layer[(*at, "o_kernel_scale")],
                         (4, 8, 32), 2)  # fmt: skip
    a, b = np.asarray(layer[(*at, "o_lora_a")]), np.asarray(layer[(*at, "o_lora_b")])
    kernel = np.asarray(w) + 2.0 * np.tensordot(a, b, axes=([2], [0]))  # alpha / r = 2
    np.testing.assert_allclose(
        weights["model.layers.1.self_attn.o_proj.weight"], kernel.reshape(32, 32).T, atol=1e-6
    )
    # The PEFT export names its base: the source under bitsandbytes' NF4.
    adapter = export_lib.export_peft(
        params, config, str(source), tmp_path / "peft", dtype="float32"
    )
    export_lib.verify_export(adapter)
    wanted = json.loads((adapter / export_lib.BASE_QUANTIZATION).read_text())
    assert wanted == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": "float32",
    }
    assert 'bnb_4bit_quant_type="nf4"' in (adapter / export_lib.PEFT_README).read_text()
    # The int8 base has no PEFT counterpart: refused in one line.
    int8_params, int8_config = _with_quantised_adapters(source, "int8")
    with pytest.raises(ValueError, match=r"^model_config: lora_base='int8' has no PEFT base"):
        export_lib.export_peft(int8_params, int8_config, str(source), tmp_path / "int8")
    # With bitsandbytes: the source's target weights as its NF4 base holds them (its own
    # quantize_4bit codes, absmax and code table; a 4-bit Linear dequantises, then
    # multiplies in the compute dtype) plus our adapter give our logits. (bitsandbytes
    # 0.50's CPU dequantize_4bit and 4-bit matmul mishandle rows shorter than a block,
    # in_features < 64 as here, so the lookup is done here.)
    bnb = pytest.importorskip("bitsandbytes.functional")
    base_model = _load_hf(source)
    with torch.no_grad():
        for name, p in base_model.named_parameters():
            if name.endswith("proj.weight"):
                codes, state = bnb.quantize_4bit(p.data, blocksize=64, quant_type="nf4")
                index = unpack_high_first(codes.numpy(), p.numel())
                absmax = np.repeat(state.absmax.numpy(), 64)[: p.numel()]
                deq = state.code.numpy()[index] * absmax
                p.copy_(torch.from_numpy(deq.reshape(p.shape)))
    model = peft.PeftModel.from_pretrained(base_model, str(adapter)).eval()
    np.testing.assert_allclose(_torch_logits(model, ids), want, atol=TOL, rtol=0)


def test_a_model_without_lora_exports_as_before_and_refuses_peft(source, tmp_path):
    base = hf.load_pretrained(source)
    out = export_lib.export_params(base.params, base.config, str(source), tmp_path / "hf")
    assert sorted(load_file(os.path.join(out, hf.SINGLE_FILE))) == sorted(
        load_file(os.path.join(source, hf.SINGLE_FILE))
    )
    with pytest.raises(ValueError, match="lora_rank is 0"):
        export_lib.export_peft(base.params, base.config, str(source), tmp_path / "peft")


def _workdir(tmp_path, name, **changes):
    """A workdir with only the run's record (`config.json`): enough for `m2po-export` to
    refuse before it reads any checkpoint."""
    c = default.get_config()
    config_lib.apply_dotted(c, changes)
    cfg = config_lib.from_configdict(c)
    workdir = tmp_path / name
    workdir.mkdir()
    record = {"config": run_record.describe(cfg, _tiny())["config"], "params": {}}
    (workdir / run_record.CONFIG_FILE).write_text(json.dumps(record))
    return workdir


def _tiny():
    from m2po_jax.models.model_config import ModelConfig

    return ModelConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1
    )


def test_m2po_export_refuses_a_peft_export_in_one_line(source, tmp_path, capsys):
    def error(workdir, *argv):
        code = export_main.main([str(workdir), "--out", str(tmp_path / "out"), *argv])
        message = capsys.readouterr().err.strip()
        assert code == 2 and message.startswith("m2po-export: ") and "\n" not in message
        return message

    full = _workdir(tmp_path, "full", **{"model.path": str(source)})
    message = error(full, "--format", "peft")
    assert "--format peft needs a run with model.lora.rank > 0" in message
    assert str(full / "config.json") in message
    new = _workdir(tmp_path, "new", **{"model.lora.rank": 4})
    message = error(new, "--format", "peft")
    assert "model.path is empty" in message and "PEFT adapter" in message
    assert not (tmp_path / "out").exists()
