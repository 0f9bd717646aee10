"""QLoRA: int8 and NF4 bases against a numpy reference, their packing, the quantised model's
logits, a train step that moves the adapters alone, the memory plan's bytes, config errors."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from m2po_jax import config as config_lib
from m2po_jax.common.types import TrainBatch
from m2po_jax.configs import arith
from m2po_jax.learner import memory, optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import lora, model_config, quant
from m2po_jax.models import model as model_lib
from m2po_jax.parallel import sharding

# The QLoRA paper's NF4 values (bitsandbytes), written out here, not taken from quant.py.
NF4 = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    np.float32,
)  # fmt: skip

# Every adapted kernel holds whole 64-weight blocks (E = 64, D = 16, F = 128).
CONFIG = model_config.ModelConfig(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
ALL = model_config.LORA_TARGETS
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 61, (3, 12)), jnp.int32)
_apply = jax.jit(model_lib.apply, static_argnums=1)


def qlora(base: str, targets=ALL, **changes):
    return CONFIG.replace(
        lora_rank=4, lora_alpha=8.0, lora_targets=targets, lora_base=base, **changes
    )


def _flat(params):
    return traverse_util.flatten_dict(params)


# ----------------------------------------------------------------------------- numpy


def ref_int8(w: np.ndarray, n_in: int):
    """(codes, scale, dequantised): symmetric per output channel, absmax / 127."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=tuple(range(n_in))) / np.float32(127)
    q = np.clip(np.rint(w / np.where(scale > 0, scale, 1)), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32), q.astype(np.float32) * scale


def hf_weight(w: np.ndarray, n_in: int) -> np.ndarray:
    """The torch Linear weight [out, in] of kernel `w` [in..., out...] (`hf_format`'s
    flattening: kernel.reshape(in, out).T)."""
    i = math.prod(w.shape[:n_in])
    return np.ascontiguousarray(np.asarray(w).reshape(i, -1).T)


def ref_nf4(w: np.ndarray, n_in: int):
    """(codes, block absmax, dequantised kernel) as bitsandbytes' `quantize_4bit(weight,
    blocksize=64, quant_type="nf4")` of the torch weight [out, in]: that weight flattened
    row-major in blocks of 64 (the last zero-padded), each element the nearest NF4 value
    over its block's absmax; the dequantised weight is reshaped back to the kernel."""
    weight = hf_weight(w, n_in)
    flat = weight.reshape(-1)
    n = flat.size
    blocks = -(-n // 64)
    padded = np.zeros(blocks * 64, np.float32)
    padded[:n] = flat
    padded = padded.reshape(blocks, 64)
    absmax = np.abs(padded).max(axis=1)
    x = padded / np.where(absmax > 0, absmax, 1)[:, None]
    codes = np.argmin(np.abs(x[..., None] - NF4), axis=-1)  # first of equals: the lower
    deq_weight = (NF4[codes] * absmax[:, None]).reshape(-1)[:n].reshape(weight.shape)
    return codes.reshape(-1)[:n], absmax, deq_weight.T.reshape(w.shape)


def unpack_high_first(packed: np.ndarray, n: int) -> np.ndarray:
    """Element 2i in a byte's high nibble, 2i + 1 in its low nibble."""
    b = np.asarray(packed).reshape(-1)
    return np.stack([b >> 4, b & 0xF], axis=-1).reshape(-1)[:n]


def _weights(shape, seed, zero_channel=False):
    w = np.random.default_rng(seed).normal(0, 0.02, shape).astype(np.float32)
    if zero_channel:
        w.reshape(-1, shape[-1])[:, 0] = 0.0  # an all-zero output channel / block column
    return w


# ----------------------------------------------------------------------------- int8 / nf4

INT8_CASES = [((64, 4, 16), 1), ((4, 16, 64), 2), ((48, 32), 1), ((5, 3), 1)]


@pytest.mark.parametrize("shape, n_in", INT8_CASES)
def test_int8_matches_numpy_and_errs_by_at_most_half_a_step(shape, n_in):
    w = _weights(shape, seed=len(shape) + n_in, zero_channel=True)
    q, scale = quant.quantize_int8(jnp.asarray(w), n_in)
    assert q.dtype == jnp.int8 and q.shape == shape
    assert scale.dtype == jnp.float32 and scale.shape == shape[n_in:]
    want_q, want_scale, _ = ref_int8(w, n_in)
    # XLA divides by 127 as a multiply by its reciprocal: within an ulp of numpy's.
    np.testing.assert_allclose(scale, want_scale, rtol=2.5e-7, atol=0)
    np.testing.assert_array_equal(q, want_q)
    got = np.asarray(quant.dequantize_int8(q, scale))
    np.testing.assert_array_equal(got, want_q.astype(np.float32) * np.asarray(scale))
    # |w - q scale| <= scale / 2 in every output channel (float32 rounding aside).
    assert np.all(np.abs(got - w) <= want_scale / 2 * (1 + 1e-5) + 1e-12)
    assert np.max(np.abs(got - w) / np.maximum(want_scale, 1e-30)) > 0.4  # the bound is tight
    assert np.all(got.reshape(-1, shape[-1])[:, 0] == 0) if n_in < len(shape) else True


@pytest.mark.parametrize("shape, n_in", INT8_CASES)
def test_fp8_matches_numpy_and_errs_within_e4m3_rounding(shape, n_in):
    """float8_e4m3fn codes: scale = absmax / 448 per output channel, q = w / scale rounded
    to the nearest e4m3 value (ml_dtypes' cast of the same quotient). e4m3 keeps 3
    mantissa bits: a normal value (|x| >= 2^-6) is off by at most half a step, 2^-4 of
    |x|; a subnormal one by at most 2^-10 (its steps are 2^-9). Times the scale:
    |w - q scale| <= max(2^-4 |w|, 2^-10 scale)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = _weights(shape, seed=len(shape) + n_in, zero_channel=True)
    w.reshape(-1, shape[-1])[:3, -1] = [1e-6, -3e-5, 2e-4]  # subnormal quotients too
    q, scale = quant.quantize_fp8(jnp.asarray(w), n_in)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == shape
    assert scale.dtype == jnp.float32 and scale.shape == shape[n_in:]
    absmax = np.abs(w).max(axis=tuple(range(n_in)))
    np.testing.assert_allclose(scale, absmax / np.float32(448), rtol=2.5e-7, atol=0)
    s = np.asarray(scale)
    want_q = (w / np.where(s > 0, s, 1)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
    assert np.max(np.abs(np.asarray(q).astype(np.float32))) == 448.0  # each channel's absmax
    got = np.asarray(quant.dequantize_fp8(q, scale))
    assert np.all(np.isfinite(got))
    bound = np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10) * (1 + 1e-5) + 1e-12
    assert np.all(np.abs(got - w) <= bound)
    assert np.max(np.abs(got - w) / bound) > 0.5  # the bound is near tight
    assert np.all(got.reshape(-1, shape[-1])[:, 0] == 0) if n_in < len(shape) else True


# (shape, n_in, packed shape, scale shape): stored transposed, [out..., in...] (the torch
# weight's order), in that layout where whole blocks fit; (9, 7) and (30, 5) fall back to
# flat, zero-padded layouts.
NF4_CASES = [
    ((64, 4, 16), 1, (4, 16, 32), (4, 16, 1)),
    ((4, 16, 128), 2, (128, 4, 8), (128, 1)),
    ((4, 8, 4), 2, (4, 4, 4), (2,)),
    ((30, 5), 1, (5, 15), (3,)),
    ((9, 7), 1, (32,), (1,)),
]


@pytest.mark.parametrize("shape, n_in, packed_shape, scale_shape", NF4_CASES)
def test_nf4_matches_numpy_bitsandbytes_layout(shape, n_in, packed_shape, scale_shape):
    w = _weights(shape, seed=math.prod(shape), zero_channel=shape[-1] > 8)
    if shape == (64, 4, 16):
        w[:, 1] = 0.0  # all-zero blocks (torch weight rows): scale 0, dequantised 0
    packed, scale = quant.quantize_nf4(jnp.asarray(w), n_in)
    assert packed.dtype == jnp.uint8 and packed.shape == packed_shape
    assert scale.dtype == jnp.float32 and scale.shape == scale_shape
    layout = quant.leaf_layout("nf4", shape, n_in, ("a",) * len(shape))
    assert (layout["kernel"][0], layout["kernel_scale"][0]) == (packed_shape, scale_shape)
    codes, absmax, want = ref_nf4(w, n_in)
    if shape == (64, 4, 16):
        assert np.sum(absmax == 0) == 19  # head 1's 16 rows, the zero channel of 3 more
    np.testing.assert_array_equal(np.asarray(scale).reshape(-1), absmax)
    np.testing.assert_array_equal(unpack_high_first(packed, w.size), codes)
    got = np.asarray(quant.dequantize_nf4(packed, scale, shape, n_in))
    assert got.shape == shape
    # Every dequantised value is exactly code * block scale of the nearest code.
    np.testing.assert_array_equal(got, want)
    # ... so at most half the widest gap between codes (0.152, at -1) of the block absmax away.
    per_weight = np.repeat(absmax, 64)[: w.size].reshape(hf_weight(w, n_in).shape)
    bound = per_weight.T.reshape(shape) * np.max(np.diff(NF4)) / 2 * (1 + 1e-6)
    assert np.all(np.abs(got - w) <= bound)


def test_nf4_blocks_run_along_the_torch_weight_not_the_kernel():
    """A kernel [in=64, out=2] whose two output channels differ 100-fold: bitsandbytes'
    blocks are the torch weight's rows (one output channel each), so each channel keeps
    its own absmax; blocks along the kernel's rows would mix them."""
    w = np.random.default_rng(3).normal(0, 1, (64, 2)).astype(np.float32)
    w[:, 1] *= 0.01
    packed, scale = quant.quantize_nf4(jnp.asarray(w), 1)
    np.testing.assert_array_equal(np.asarray(scale).reshape(-1), np.abs(w).max(axis=0))
    got = np.asarray(quant.dequantize_nf4(packed, scale, w.shape, 1))
    assert np.max(np.abs(got[:, 1] - w[:, 1])) <= 0.08 * np.abs(w[:, 1]).max()


def test_nf4_equals_bitsandbytes_quantize_4bit_of_the_torch_weight():
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes.functional")
    for shape, n_in in [((64, 4, 16), 1), ((4, 16, 64), 2), ((30, 5), 1)]:
        w = _weights(shape, seed=7)
        weight = torch.from_numpy(hf_weight(w, n_in))
        q, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4")
        deq = bnb.dequantize_4bit(q, state).numpy()
        packed, scale = quant.quantize_nf4(jnp.asarray(w), n_in)
        np.testing.assert_array_equal(np.asarray(packed).reshape(-1), q.numpy().reshape(-1))
        np.testing.assert_array_equal(np.asarray(scale).reshape(-1), state.absmax.numpy())
        got = np.asarray(quant.dequantize_nf4(packed, scale, shape, n_in))
        np.testing.assert_allclose(hf_weight(got, n_in), deq, rtol=1e-6, atol=0)


def test_nf4_packs_two_codes_per_byte_the_even_element_in_the_high_nibble():
    idx = np.array(
        [15, 0, 7, 8, 3, 12, *range(16), *range(16), *range(16), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    )
    assert idx.size == 64
    w = (NF4[idx] * 2.5).astype(np.float32)  # absmax 2.5: every value exactly on a code
    packed, scale = quant.quantize_nf4(jnp.asarray(w.reshape(2, 32)), 0)  # no transpose
    assert np.asarray(scale).tolist() == [2.5] and packed.shape == (2, 16)
    b = np.asarray(packed).reshape(-1)
    assert b[:3].tolist() == [0xF0, 0x78, 0x3C]  # (15, 0), (7, 8), (3, 12)
    np.testing.assert_array_equal(b, (idx[0::2] << 4) | idx[1::2])
    got = quant.dequantize_nf4(packed, scale, (2, 32), 0)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), w)


# ----------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def float_base():
    return model_lib.init_params(CONFIG, jax.random.key(0))


@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_the_quantised_model_runs_its_dequantised_base(float_base, base):
    cfg = qlora(base, targets=("q", "o", "down"))
    params = model_lib.init_params(cfg, jax.random.key(0))
    flat, plain = _flat(params), _flat(float_base)
    # Adapted kernels quantised (codes + scale), the others float and as initialised.
    for path, x in plain.items():
        target = str(path[-1])[: -len("_kernel")]
        if target in ("q", "o", "down") and path[-1].endswith("_kernel"):
            assert flat[path].dtype == (jnp.int8 if base == "int8" else jnp.uint8)
            assert flat[(*path[:-1], f"{target}_kernel_scale")].dtype == jnp.float32
        else:
            np.testing.assert_array_equal(flat[path], x, err_msg=str(path))
    # The shapes, dtypes and axes the module declares are those of the quantised tree.
    boxed = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0), boxed=True))
    shapes = _flat(jax.tree.map(lambda s: (s.shape, s.dtype), nn.meta.unbox(boxed)))
    assert shapes == {p: (x.shape, x.dtype) for p, x in flat.items()}
    axes = _flat(model_lib.logical_axes(cfg))
    assert tuple(axes[("layers_0", "attn", "o_kernel_scale")]) == (
        ("embed",) if base == "int8" else ("embed", None)
    )
    # The logits are the float model's with the numpy-dequantised kernels (B = 0).
    deq = dict(plain)
    for path in plain:
        target = str(path[-1])[: -len("_kernel")]
        if target in ("q", "o", "down") and path[-1].endswith("_kernel"):
            w = np.asarray(plain[path])
            n_in = 2 if target == "o" else 1
            deq[path] = jnp.asarray(ref_int8(w, n_in)[2] if base == "int8" else ref_nf4(w, n_in)[2])
    logits = _apply(params, cfg, TOKENS)
    np.testing.assert_allclose(
        logits, _apply(traverse_util.unflatten_dict(deq), CONFIG, TOKENS), atol=1e-5
    )
    # ... and close to the float base's: relative error norm (measured 0.49% int8, 7.7% nf4).
    want = _apply(float_base, CONFIG, TOKENS)
    rel = float(jnp.linalg.norm(logits - want) / jnp.linalg.norm(want))
    assert rel < (0.01 if base == "int8" else 0.15), rel
    assert rel > 0  # it is quantised
    # scanned layers and remat dequantise inside the layer: the same logits.
    scanned = cfg.replace(scan_layers=True, remat=True)
    np.testing.assert_allclose(_apply(params, scanned, TOKENS), logits, atol=1e-5)


@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_merging_dequantises_into_float_kernels_of_the_param_dtype(base):
    cfg = qlora(base, param_dtype="bfloat16")
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    params = traverse_util.unflatten_dict(
        {
            p: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype) if p[-1].endswith("_lora_b") else x
            for p, x in _flat(params).items()
        }
    )
    merged, merged_cfg = lora.merged(params, cfg)
    assert merged_cfg == CONFIG.replace(param_dtype="bfloat16") and merged_cfg.lora_base == "float"
    flat, out = _flat(params), _flat(merged)
    assert not any(str(p[-1]).endswith("_kernel_scale") for p in out)
    path = ("layers_1", "attn", "o_kernel")
    a, b = (np.asarray(flat[(*path[:-1], f"o_lora_{x}")]) for x in "ab")
    w = quant.dequantize(base, flat[path], flat[(*path[:-1], "o_kernel_scale")], (4, 16, 64), 2)
    want = np.asarray(w) + 2.0 * np.tensordot(a, b, axes=([2], [0]))
    assert out[path].dtype == jnp.bfloat16 and out[path].shape == (4, 16, 64)
    np.testing.assert_allclose(np.asarray(out[path], np.float32), want, rtol=1e-2, atol=1e-3)
    f32 = cfg.replace(param_dtype="float32")
    merged32, cfg32 = lora.merged(params, f32)
    np.testing.assert_allclose(
        _apply(merged32, cfg32, TOKENS), _apply(params, f32, TOKENS), atol=5e-5
    )


def test_param_shardings_cover_the_quantised_leaves_and_a_sharded_init_matches():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    for base in ("int8", "nf4"):
        cfg = qlora(base, targets=("q", "down"))
        shard = _flat(sharding.param_shardings(cfg, mesh, sharding.TRAIN_RULES))
        q = ("layers_0", "attn")
        # int8: codes like the kernel, scales like its outputs; nf4: packed bytes like the
        # transposed kernel [out..., in...] (last dim halved), block scales like its
        # leading dims.
        want = P("fsdp", "tensor", None) if base == "int8" else P("tensor", None, "fsdp")
        assert shard[(*q, "q_kernel")].spec == want
        want = P("tensor", None) if base == "int8" else P("tensor", None, None)
        assert shard[(*q, "q_kernel_scale")].spec == want
        if base == "int8":
            continue  # one sharded init (nf4's, the reshaped layout) keeps the test quick
        params = sharding.shard_init(cfg, jax.random.key(0), mesh, sharding.TRAIN_RULES)
        # (jitted like shard_init: eager sampling differs from jitted in the last bit)
        init = jax.jit(model_lib.init_params, static_argnums=0)
        plain = _flat(init(cfg, jax.random.key(0)))
        for path, x in _flat(params).items():
            assert x.sharding.is_equivalent_to(shard[path], x.ndim), path
            np.testing.assert_array_equal(x, plain[path], err_msg=str(path))


def test_publishing_in_bfloat16_keeps_the_codes_and_the_float32_scales():
    """rollout.publish_dtype=bfloat16 casts float weights only: the sampler dequantises
    the learner's kernels exactly (rounded scales would shift every behaviour log-prob)."""
    from m2po_jax.parallel import placement as placement_lib

    cfg = qlora("nf4", targets=("q", "down"))
    params = model_lib.init_params(cfg, jax.random.key(0))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, params)
    published = _flat(placement_lib.WeightPublisher(shardings, "bfloat16")(params))
    learner = _flat(params)
    for path, x in learner.items():
        if quant.is_quantized_leaf(path, x.dtype):
            assert published[path].dtype == x.dtype, path
            np.testing.assert_array_equal(published[path], x, err_msg=str(path))
        else:
            assert published[path].dtype == jnp.bfloat16, path
    at = ("layers_0", "mlp")
    kernel = lambda f: quant.dequantize(  # noqa: E731
        "nf4", f[(*at, "down_kernel")], f[(*at, "down_kernel_scale")], (128, 64), 1
    )
    np.testing.assert_array_equal(kernel(published), kernel(learner))


# ----------------------------------------------------------------------------- rollout weights

PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def ref_channel(base: str, w: np.ndarray, n_in: int) -> np.ndarray:
    """The numpy-dequantised kernel under int8 or float8_e4m3fn (per output channel)."""
    if base == "int8":
        return ref_int8(w, n_in)[2]
    import ml_dtypes

    scale = np.abs(w).max(axis=tuple(range(n_in))) / np.float32(448)
    q = (w / np.where(scale > 0, scale, 1)).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale


@pytest.mark.parametrize("base", ["int8", "float8_e4m3fn"])
def test_rollout_weights_quantise_every_projection_and_the_model_runs_them(float_base, base):
    """`weight_quant`: all seven projections held as codes and a float32 scale per output
    channel (embedding, head and norms as trained), the layout the module declares; under
    LoRA the adapters stay float32 and are added as ever."""
    cfg = qlora("float", targets=("q", "down")).replace(weight_quant=base)
    rng = np.random.default_rng(1)
    params = model_lib.add_adapters(float_base, cfg.replace(weight_quant=""), jax.random.key(1))
    params = traverse_util.unflatten_dict(
        {
            p: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype) if p[-1].endswith("_lora_b") else x
            for p, x in _flat(params).items()
        }
    )  # B != 0: the adapters change the logits
    converted = _flat(quant.convert_weights(params, base))
    code = jnp.int8 if base == "int8" else jnp.float8_e4m3fn
    deq = {}
    for path, x in _flat(params).items():
        name = str(path[-1])
        target = name[: -len("_kernel")]
        if target in PROJECTIONS and name.endswith("_kernel"):
            assert converted[path].dtype == code and converted[path].shape == x.shape, path
            scale = converted[(*path[:-1], f"{target}_kernel_scale")]
            assert scale.dtype == jnp.float32 and scale.shape == x.shape[PROJECTIONS[target] :]
            deq[path] = jnp.asarray(ref_channel(base, np.asarray(x), PROJECTIONS[target]))
        else:  # embedding, head, norms, adapters: the same arrays
            assert converted[path] is x, path
            deq[path] = x
    assert len(converted) == len(deq) + 7 * CONFIG.num_layers  # a scale per projection
    boxed = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0), boxed=True))
    shapes = _flat(jax.tree.map(lambda s: (s.shape, s.dtype), nn.meta.unbox(boxed)))
    assert shapes == {p: (x.shape, x.dtype) for p, x in converted.items()}
    init = _flat(model_lib.init_params(cfg, jax.random.key(0)))
    assert {p: x.dtype for p, x in init.items()} == {p: x.dtype for p, x in converted.items()}
    # The logits are the float model's (LoRA included) with the numpy-dequantised kernels.
    logits = _apply(traverse_util.unflatten_dict(converted), cfg, TOKENS)
    float_cfg = cfg.replace(weight_quant="")
    want = _apply(traverse_util.unflatten_dict(deq), float_cfg, TOKENS)
    np.testing.assert_allclose(logits, want, atol=1e-5)
    assert float(jnp.max(jnp.abs(logits - _apply(params, float_cfg, TOKENS)))) > 1e-3


def test_the_sampling_copy_is_quantised_in_place_laid_out_for_sampling_once_per_version():
    """Sync rollouts' `SamplingCopy` on 8 devices: train-layout params (fsdp x tensor) in,
    the int8 copy out in the rollout config's sampling layout (codes as the kernel, scales
    as its outputs), equal to the unsharded conversion; made once per version, again for a
    new one."""
    from m2po_jax.parallel import placement as placement_lib

    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rollout = CONFIG.replace(weight_quant="int8")
    params = sharding.shard_init(CONFIG, jax.random.key(0), mesh, sharding.TRAIN_RULES)
    shardings = sharding.param_shardings(rollout, mesh, sharding.SAMPLE_RULES)
    copy = placement_lib.SamplingCopy(shardings, "int8")
    first = copy(params, 0)
    flat, want = _flat(first), _flat(shardings)
    q = ("layers_0", "attn")
    assert want[(*q, "q_kernel")].spec == P(None, "tensor", None)
    assert want[(*q, "q_kernel_scale")].spec == P("tensor", None)
    plain = _flat(quant.convert_weights(jax.device_get(params), "int8"))
    assert flat.keys() == plain.keys()
    for path, x in flat.items():
        assert x.sharding.is_equivalent_to(want[path], x.ndim), path
        np.testing.assert_array_equal(x, plain[path], err_msg=str(path))
    assert copy(params, 0) is first and copy.made == 1  # the queue's k batches share it
    moved = jax.tree.map(lambda x: x * 2, params)
    second = _flat(copy(moved, 1))
    assert copy.made == 2
    np.testing.assert_array_equal(second[(*q, "q_kernel")], plain[(*q, "q_kernel")])
    np.testing.assert_allclose(
        second[(*q, "q_kernel_scale")], 2 * plain[(*q, "q_kernel_scale")], rtol=1e-6
    )
    copy.release()
    assert not copy.held


# ----------------------------------------------------------------------------- training


def _batch(rows=8, prompt=4, new=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 61, (rows, prompt + new)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    loss_mask = valid.copy()
    loss_mask[:, :prompt] = False
    behav = rng.normal(-4.0, 0.3, tokens.shape).astype(np.float32) * loss_mask
    return TrainBatch(
        tokens_BxT=jnp.asarray(tokens),
        valid_BxT=jnp.asarray(valid),
        behav_logp_BxT=jnp.asarray(behav),
        loss_mask_BxT=jnp.asarray(loss_mask),
        rewards_B=jnp.asarray(np.arange(rows) % 3 == 0, jnp.float32),
        version_B=jnp.zeros(rows, jnp.int32),
        version_BxT=jnp.zeros(tokens.shape, jnp.int32),
    )


def test_a_qlora_step_trains_the_adapters_alone_and_keeps_the_codes_bit_identical():
    cfg = qlora("nf4", targets=("q", "v", "up"))
    params = model_lib.init_params(cfg, jax.random.key(0))
    params = lora.merge(
        *(lambda t, f: (jax.tree.map(lambda x: x + 0.01, t), f))(*lora.split(params))
    )  # B != 0, so A gets a gradient in the first step too
    c = arith.get_config("m2po").to_dict()
    c["actor"]["ppo_n_minibatches"] = 1
    c["actor"]["optimizer"]["lr"] = 1e-2
    actor = config_lib.from_configdict(c).actor
    tx, schedule = optim.make_optimizer(actor.optimizer, 10)
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert all(x.dtype == jnp.float32 for x in moments)  # none for the codes or scales
    assert sum(x.size for x in moments) == 2 * cfg.lora_params()
    step = step_lib.make_train_step(cfg, actor, tx, schedule)
    state, metrics = step(state, _batch(), jax.random.key(0), None)
    assert np.isfinite(float(metrics["loss"]))
    before, after = _flat(params), _flat(state.params)
    assert before.keys() == after.keys()
    for path, x in before.items():
        assert after[path].dtype == x.dtype, path
        if lora.is_adapter(path):
            assert not np.array_equal(after[path], x), path
        else:  # codes, scales and float leaves alike
            np.testing.assert_array_equal(after[path], x, err_msg=str(path))


# ----------------------------------------------------------------------------- memory


def _adapted_weights(c):
    """(weights, output channels) of one layer's adapted kernels, from the config."""
    e, f, d, h, k = c.hidden_size, c.intermediate_size, c.dim_per_head, c.num_heads, c.num_kv_heads
    sizes = {"q": (e, h * d), "k": (e, k * d), "v": (e, k * d), "o": (h * d, e)}
    sizes |= {"gate": (e, f), "up": (e, f), "down": (f, e)}
    chosen = [sizes[t] for t in c.lora_targets]
    return sum(i * o for i, o in chosen), sum(o for _, o in chosen)


@pytest.mark.parametrize("targets", [ALL, ("q", "down")])
def test_the_memory_plan_counts_the_quantised_base_at_its_bytes(targets):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    plans = {
        base: memory.memory_plan(qlora(base, targets), mesh, batch=4, seq_len=16)
        for base in ("float", "int8", "nf4")
    }
    c = qlora("float", targets)
    weights, channels = _adapted_weights(c)
    layers, adapters = c.num_layers, 4 * c.lora_params()
    other = (c.num_params() - layers * weights) * 4  # float32 params that stay float
    assert plans["float"].params == other + layers * weights * 4 + adapters
    assert plans["int8"].params == other + layers * (weights + 4 * channels) + adapters
    assert plans["nf4"].params == other + layers * (weights // 2 + 4 * weights // 64) + adapters
    # For the record (ALL): 32,512 float bytes outside the adapted kernels and 32,768 of
    # adapters; the adapted kernels' 73,728 weights take 294,912 bytes in float32, 77,824
    # in int8 (codes + 2,048 scales) and 41,472 in nf4 (codes + 4,608 block scales).
    if targets == ALL:
        assert [plans[b].params for b in ("float", "int8", "nf4")] == [360192, 143104, 106752]
    for field in ("optimizer", "gradients", "activations", "logits"):
        assert len({getattr(p, field) for p in plans.values()}) == 1, field


def test_the_memory_plan_counts_the_rollouts_copy_at_its_bytes():
    """A rollout config whose weights are stored otherwise (`setup.rollout_model_config`)
    is a copy beside the train state even where the sampling layout is the train layout:
    int8 / float8 1 byte a projection weight + a float32 scale per output channel, the
    rest float32; bfloat16 2 bytes a weight. The train step's lines do not change. Where
    the sampling layout differs (fsdp), the evaluation's float32 copy is the larger."""
    one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    plan = lambda mesh, rollout: memory.memory_plan(  # noqa: E731
        CONFIG, mesh, batch=4, seq_len=16, kv_cache_batch=4, rollout_config=rollout
    )
    trained = plan(one, None)
    assert trained.sampling_weights == 0  # one device: the sampler reads the train state
    c = qlora("float", ALL)
    weights, channels = _adapted_weights(c)  # every projection of a layer
    layers, n = c.num_layers, CONFIG.num_params()
    quantised = layers * (weights + 4 * channels) + (n - layers * weights) * 4
    for rollout, bytes_ in [
        (CONFIG.replace(weight_quant="int8"), quantised),
        (CONFIG.replace(weight_quant="float8_e4m3fn"), quantised),
        (CONFIG.replace(param_dtype="bfloat16"), 2 * n),
    ]:
        got = plan(one, rollout)
        assert got.sampling_weights == bytes_, rollout
        assert got.sampling - trained.sampling == bytes_ and got.train_step == trained.train_step
    # For the record: 81,856 weights; the int8 copy 110,336 bytes (of 327,424 in float32).
    assert (n, quantised) == (81856, 110336)
    fsdp = sharding.make_mesh({"data": 1, "fsdp": 8})
    assert plan(fsdp, CONFIG.replace(weight_quant="int8")).sampling_weights == 4 * n


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model.lora.rank": 8, "model.lora.base": "int4"}, r"model.lora.base='int4' is not one"),
        ({"model.lora.base": "nf4"}, r"model.lora.base='nf4' quantises .* model.lora.rank > 0"),
    ],
)
def test_bad_base_settings_are_named(changes, match):
    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, changes)
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.from_configdict(c)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rollout.weight_dtype": "int4"}, r"rollout.weight_dtype='int4' is not one"),
        (
            {"rollout.weight_dtype": "int8", "rollout.publish_dtype": "bfloat16"},
            r"rollout.weight_dtype='int8' and rollout.publish_dtype='bfloat16' disagree",
        ),
        (
            {
                "rollout.weight_dtype": "float8_e4m3fn",
                "model.lora.rank": 8,
                "model.lora.base": "nf4",
            },
            r"rollout.weight_dtype='float8_e4m3fn' with model.lora.base='nf4'",
        ),
    ],
)
def test_bad_rollout_weight_settings_are_named(changes, match):
    c = arith.get_config("m2po")
    config_lib.apply_dotted(c, changes)
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.from_configdict(c)


def test_the_rollout_model_config_is_the_trainers_with_its_stored_weights():
    from m2po_jax.trainer import setup

    def rollout(**changes):
        c = arith.get_config("m2po")
        config_lib.apply_dotted(c, changes)
        return setup.rollout_model_config(config_lib.from_configdict(c), CONFIG)

    assert rollout() == CONFIG
    assert rollout(**{"rollout.weight_dtype": "int8"}) == CONFIG.replace(weight_quant="int8")
    want = CONFIG.replace(param_dtype="bfloat16")
    assert rollout(**{"rollout.weight_dtype": "bfloat16"}) == want
    # publish_dtype is weight_dtype's older name; set alike, they agree.
    assert rollout(**{"rollout.publish_dtype": "bfloat16"}) == want
    both = {"rollout.publish_dtype": "bfloat16", "rollout.weight_dtype": "bfloat16"}
    assert rollout(**both) == want
    assert rollout(**{"rollout.publish_dtype": "float32"}) == CONFIG  # as trained
    with pytest.raises(ValueError, match="weight_quant: expected one of"):
        CONFIG.replace(weight_quant="int4")
    with pytest.raises(ValueError, match="weight_quant='int8' with lora_base='nf4'"):
        qlora("nf4").replace(weight_quant="int8")
    with pytest.raises(ValueError, match="lora.merged: weight_quant='int8'"):
        lora.merged({}, qlora("float").replace(weight_quant="int8"))


def test_the_base_reaches_the_model_config_and_the_model_config_checks_it():
    from m2po_jax.trainer import setup

    c = arith.get_config("m2po")
    assert c.model.lora.base == "float"
    config_lib.apply_dotted(c, {"model.lora.rank": 8, "model.lora.base": "int8"})
    fields = setup.lora_fields(config_lib.from_configdict(c).model)
    assert CONFIG.replace(**fields).lora_base == "int8"
    with pytest.raises(ValueError, match="lora_base: a quantised base .* needs lora_rank > 0"):
        CONFIG.replace(lora_base="nf4")
    with pytest.raises(ValueError, match="lora_base: expected one of float, int8, nf4"):
        CONFIG.replace(lora_rank=2, lora_targets=("q",), lora_base="fp8")
    # A float base given to a quantised config's adapters is named, with the fix.
    with pytest.raises(ValueError, match="quantise it first"):
        model_lib.add_adapters(
            model_lib.init_params(CONFIG, jax.random.key(0)), qlora("nf4"), jax.random.key(1)
        )
    # lora.base_config is the float base.
    assert lora.base_config(qlora("nf4")) == CONFIG
