"""Qwen3-MoE: the mixture-of-experts block against transformers' `Qwen3MoeForCausalLM`
(torch, eager attention, float32) and against a dense numpy reference.

Tiny random models are built with transformers and saved with its own `save_pretrained`,
so the checkpoint layout (one tensor per expert) and the reference logits, router logits,
load-balancing loss and greedy tokens are independent of `model.py`, `moe.py` and
`hf_format.py`. Weights are re-drawn larger than transformers' init so that routing,
norms and attention all move the logits.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from m2po_jax.learner import memory
from m2po_jax.models import hf, hf_format, lora, model, moe
from m2po_jax.models.model_config import ModelConfig
from m2po_jax.parallel import sharding
from m2po_jax.rollout import sampling
from m2po_jax.run import export as export_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

VOCAB = 96
# Float32 sums of <= 64 products per matmul through 2 layers: measured <= 1.7e-6 (logits
# up to ~3.3); 2e-4 leaves room for other CPUs' summation orders.
TOL = 2e-4
# (num_experts, num_experts_per_tok, norm_topk_prob, tie_word_embeddings)
CASES = {
    "x8_top2_norm_untied": (8, 2, True, False),
    "x4_top1_tied": (4, 1, False, True),
    "x4_top4_norm_untied": (4, 4, True, False),
    "x6_top3_tied": (6, 3, False, True),
}


def _hf_config(experts, top_k, norm, tied):
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        router_aux_loss_coef=0.02,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, transformers model in eval mode, our loaded model)."""
    torch.set_num_threads(1)
    out = {}
    for seed, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(seed)
        tm = transformers.AutoModelForCausalLM.from_config(
            _hf_config(*case), attn_implementation="eager"
        )
        with torch.no_grad():
            for pname, p in tm.named_parameters():
                scale = 0.3 if "norm" in pname else 0.15
                p.copy_((1.0 if "norm" in pname else 0.0) + scale * torch.randn_like(p))
        tm.eval()
        path = tmp_path_factory.mktemp(name)
        tm.save_pretrained(path)
        out[name] = (path, tm, hf.load_pretrained(path))
    return out


def _ids(seed, shape=(2, 10)):
    return np.random.default_rng(seed).integers(1, VOCAB, shape)


def _torch(tm, ids, mask=None, **kwargs):
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(mask, np.int64))
        kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    with torch.no_grad():
        return tm(torch.tensor(np.asarray(ids, np.int64)), **kwargs)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoints, name):
    """Top-1, top-k < X with and without renormalisation, top-k = X; tied and untied."""
    path, tm, ours = checkpoints[name]
    experts, top_k, norm, tied = CASES[name]
    c = ours.config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", experts, top_k)
    assert (c.norm_topk_prob, c.tie_word_embeddings, c.moe_intermediate_size) == (norm, tied, 24)
    assert c.qk_norm and c.dim_per_head == 16 and c.router_aux_loss_coef == 0.02
    ids = _ids(1)
    ref = _torch(tm, ids).logits.numpy()
    got = np.asarray(ours(ids))
    assert np.abs(ref).max() > 1.0  # the weights are not trivially small
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_router_logits_and_load_balancing_loss_match_transformers(checkpoints):
    """On a left-padded batch: each layer's router logits at the real tokens (layers
    unrolled and scanned) and the load-balancing loss, with the padding left out, equal
    transformers' (`aux_loss` of `output_router_logits=True`, which uses
    `load_balancing_loss_func`); without a mask our loss equals that function's too."""
    _, tm, ours = checkpoints["x8_top2_norm_untied"]
    c = ours.config
    ids = _ids(2, (3, 9))
    valid = np.arange(9)[None, :] >= np.array([0, 2, 5])[:, None]
    out = _torch(tm, ids, valid, output_router_logits=True)
    ref_LxNxX = np.stack([r.numpy() for r in out.router_logits])
    for scan in (False, True):
        cfg = c.replace(scan_layers=scan)
        _, state = model.CausalLM(cfg).apply(
            {"params": ours.params}, jnp.asarray(ids), valid_BxT=jnp.asarray(valid),
            mutable=["intermediates"],
        )  # fmt: skip
        got = np.asarray(model.router_logits(state["intermediates"], cfg))
        assert got.shape == (2, 3, 9, 8)
        np.testing.assert_allclose(
            got[:, valid], ref_LxNxX.reshape(2, 3, 9, 8)[:, valid], atol=1e-5
        )
        loss = float(moe.load_balancing_loss(got, c.num_experts_per_tok, valid))
        np.testing.assert_allclose(loss, out.aux_loss.item(), rtol=1e-5)
    # A mask that is ignored would count the pad rows' routing: the test can tell.
    assert abs(float(moe.load_balancing_loss(got, 2)) - out.aux_loss.item()) > 1e-3
    plain = modeling.load_balancing_loss_func(tuple(out.router_logits), 8, 2, None).item()
    np.testing.assert_allclose(
        float(moe.load_balancing_loss(ref_LxNxX[:, None], 2)), plain, rtol=1e-6
    )
    # The loss out of HF's training path: coef x aux added to the cross-entropy.
    labels = torch.tensor(ids)
    with torch.no_grad():
        hf_loss = tm(torch.tensor(ids), labels=labels, output_router_logits=True)
        ce = tm(torch.tensor(ids), labels=labels).loss.item()
    np.testing.assert_allclose(hf_loss.loss.item() - ce, 0.02 * hf_loss.aux_loss.item(), rtol=1e-4)


def test_greedy_generation_matches_transformers(checkpoints):
    """The static sampler's greedy rows (KV-cached prefill and decode through the MoE
    layers) equal transformers' `generate(do_sample=False)`, for same-length prompts and
    left-padded ones of different lengths."""
    _, tm, ours = checkpoints["x8_top2_norm_untied"]
    greedy = sampling.SamplingConfig(max_new_tokens=8, greedy=True, pad_id=0)
    same = [[5, 17, 3, 44, 9], [8, 2, 90, 1, 3], [61, 30, 12, 7, 7]]
    ragged = [[5, 17, 3], [8, 2, 90, 1, 3, 33, 4], [61]]
    for prompts in (same, ragged):
        tokens, valid = sampling.pad_prompts(prompts, 0)
        with torch.no_grad():
            want = tm.generate(
                input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(valid.astype(np.int64)),
                do_sample=False,
                max_new_tokens=8,
                min_new_tokens=8,
                pad_token_id=0,
            )
        out = sampling.generate(ours.params, ours.config, tokens, valid, jax.random.key(0), greedy)
        np.testing.assert_array_equal(np.asarray(out.tokens_BxT), want.numpy())


# ----------------------------------------------------------------------------- the block


def _dense_reference(x_NxE, logits_NxX, top_k, norm, gate, up, down):
    """Every expert on every token (float64), weighted by the routing, zero elsewhere."""
    x, logits = np.float64(x_NxE), np.float64(logits_NxX)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weight = np.zeros_like(probs)
    np.put_along_axis(weight, chosen, np.take_along_axis(probs, chosen, -1), -1)
    if norm:
        weight /= weight.sum(-1, keepdims=True)
    h = np.einsum("ne,xef->nxf", x, gate)
    h = h / (1 + np.exp(-h)) * np.einsum("ne,xef->nxf", x, up)
    return np.einsum("nxf,xfe,nx->ne", h, down, weight)


@pytest.mark.parametrize(("top_k", "norm"), [(1, False), (3, True), (5, False)])
def test_grouped_matmul_equals_a_dense_reference(top_k, norm):
    """`moe_experts` after `route` (ragged_dot over assignments sorted by expert) against
    every expert computed on every token and masked by the routing. Logits biased so that
    one expert gets no token and another most of them (empty and large groups)."""
    rng = np.random.default_rng(top_k)
    n, e, f, x = 40, 8, 6, 5
    x_NxE = rng.standard_normal((n, e)).astype(np.float32)
    logits = rng.standard_normal((n, x)).astype(np.float32) + np.array([0, 2, 0, 0, -9])
    gate, up, down = (rng.standard_normal(s).astype(np.float32) for s in
                      ((x, e, f), (x, e, f), (x, f, e)))  # fmt: skip
    weights, experts = moe.route(logits, top_k, norm)
    got = np.asarray(jax.jit(moe.moe_experts)(x_NxE, experts, weights, gate, up, down))
    want = _dense_reference(x_NxE, logits, top_k, norm, gate, up, down)
    # float32 sums of <= 8 products of O(1) terms: ~1e-5 relative to the O(10) outputs
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=x)
    assert (counts[4] == 0 or top_k == x) and counts[1] == counts.max()


def test_route_renormalises_and_breaks_ties_to_the_lower_expert():
    logits = np.log(np.array([[1.0, 4.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], np.float32))
    weights, experts = moe.route(logits, 2, norm_topk_prob=False)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 3], [0, 1]])  # ties: lower index
    np.testing.assert_allclose(np.asarray(weights), [[0.4, 0.3], [0.25, 0.25]], rtol=1e-6)
    weights, _ = moe.route(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(weights), [[4 / 7, 3 / 7], [0.5, 0.5]], rtol=1e-6)
    # Uniform routing: the load-balancing loss is top_k exactly.
    uniform = np.zeros((3, 2, 5, 4), np.float32)
    np.testing.assert_allclose(float(moe.load_balancing_loss(uniform, 2)), 2.0, rtol=1e-6)


def test_sharded_forward_and_gradients_match_one_device(checkpoints):
    """Under TRAIN_RULES on fsdp=2 x tensor=2 (experts' hidden dim over fsdp, their hidden
    width over tensor, the expert axis replicated) the logits and the gradients of every
    param equal one device's."""
    _, _, ours = checkpoints["x6_top3_tied"]
    c, params = ours.config, ours.params
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    specs = sharding.param_specs(c, mesh, sharding.TRAIN_RULES)["layers_0"]["mlp"]
    assert specs["gate_experts"] == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert specs["down_experts"] == jax.sharding.PartitionSpec(None, "tensor", "fsdp")
    ids = jnp.asarray(_ids(3, (4, 6)))

    def loss(p):
        return jnp.sum(jax.nn.log_softmax(model.apply(p, c, ids))[..., 7])

    shardings = sharding.param_shardings(c, mesh, sharding.TRAIN_RULES)
    on_mesh = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings,))
    value, grads = on_mesh(jax.device_put(params, shardings))
    want_value, want_grads = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, want_grads)
    assert float(jnp.abs(grads["layers_1"]["mlp"]["gate_experts"]).max()) > 1e-3


# ----------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("targets", [("gate", "up", "down"), ("up",), ("gate", "down")])
def test_expert_adapters_are_each_experts_merged_kernel_in_a_numpy_reference(targets):
    """`moe_experts` with per-expert adapters on `targets` against the float64 dense
    reference on the merged kernels W_e + (alpha / r) A_e B_e; the untargeted kernels as
    they are. Routing as in the grouped-matmul test: one expert empty, one crowded."""
    rng = np.random.default_rng(len(targets))
    n, e, f, x, r, scale = 40, 8, 6, 5, 3, 0.75
    x_NxE = rng.standard_normal((n, e)).astype(np.float32)
    logits = rng.standard_normal((n, x)).astype(np.float32) + np.array([0, 2, 0, 0, -9])
    shapes = {"gate": (x, e, f), "up": (x, e, f), "down": (x, f, e)}
    kernels = {t: rng.standard_normal(s).astype(np.float32) for t, s in shapes.items()}
    adapters = {
        t: (
            rng.standard_normal((x, shapes[t][1], r)).astype(np.float32) * 0.5,
            rng.standard_normal((x, r, shapes[t][2])).astype(np.float32) * 0.5,
        )
        for t in targets
    }
    merged = dict(kernels)
    for t, (a, b) in adapters.items():
        merged[t] = kernels[t] + scale * np.einsum("xir,xro->xio", np.float64(a), np.float64(b))
    weights, experts = moe.route(logits, 2, True)
    lora = {f"{t}_lora": ab for t, ab in adapters.items()}
    run = jax.jit(functools.partial(moe.moe_experts, lora_scale=scale))
    got = np.asarray(run(x_NxE, experts, weights, *kernels.values(), **lora))
    want = _dense_reference(x_NxE, logits, 2, True, *merged.values())
    # float32 sums of <= 8 + 3 products of O(1) terms: ~1e-5 relative to the O(10) outputs
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    base = _dense_reference(x_NxE, logits, 2, True, *kernels.values())
    assert np.max(np.abs(want - base)) > 1.0  # the adapters move the output


LORA_MOE = ModelConfig(
    model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
    num_layers=2, num_heads=2, num_kv_heads=1, qk_norm=True, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
    lora_rank=2, lora_alpha=4.0, lora_targets=("q", "gate", "up", "down"),
)  # fmt: skip


def _random_b(params, seed=1, std=0.3):
    """`params` with every adapter's B drawn at random (a new adapter's is zero)."""
    rng = np.random.default_rng(seed)
    flat = traverse_util.flatten_dict(params)
    for path, leaf in flat.items():
        if path[-1].endswith("_lora_b"):
            flat[path] = jnp.asarray(rng.normal(0, std, leaf.shape), leaf.dtype)
    return traverse_util.unflatten_dict(flat)


def test_lora_adapts_every_expert_trains_no_router_and_merges_to_the_same_model():
    """Adapters [X, in, r] / [X, r, out] beside each expert kernel (A at one expert's
    fan-in, B zero: the base model's logits), none on the router; gradients reach every
    expert's B; the merged kernels give the adapter forward's logits."""
    params = model.add_adapters(
        model.init_params(lora.base_config(LORA_MOE), jax.random.key(0)),
        LORA_MOE,
        jax.random.key(1),
    )
    mlp = params["layers_0"]["mlp"]
    assert {k: v.shape for k, v in mlp.items() if "lora" in k} == {
        "gate_experts_lora_a": (4, 16, 2), "gate_experts_lora_b": (4, 2, 8),
        "up_experts_lora_a": (4, 16, 2), "up_experts_lora_b": (4, 2, 8),
        "down_experts_lora_a": (4, 8, 2), "down_experts_lora_b": (4, 2, 16),
    }  # fmt: skip
    assert LORA_MOE.lora_params() * 4 == lora.adapter_bytes(params)
    a = np.asarray(mlp["down_experts_lora_a"])  # U(-1/sqrt(8), 1/sqrt(8)): one expert's F
    assert 1 / np.sqrt(32) < np.abs(a).max() <= 1 / np.sqrt(8)
    assert np.all(np.asarray(mlp["gate_experts_lora_b"]) == 0)
    ids = jnp.asarray(_ids(5, (2, 9)))
    apply = jax.jit(model.apply, static_argnums=1)
    base_config = lora.base_config(LORA_MOE)
    base = model.init_params(base_config, jax.random.key(0))
    # B = 0 adds exact zeros; the compiled programs differ, so their sums' rounding may
    np.testing.assert_allclose(
        apply(params, LORA_MOE, ids), apply(base, base_config, ids), atol=1e-6
    )
    trainable, frozen = lora.split(params)
    assert "router_kernel" in frozen["layers_0"]["mlp"]
    assert not [k for k in trainable["layers_0"]["mlp"] if "router" in k]

    def loss(t):
        return jnp.sum(
            jax.nn.log_softmax(model.apply(lora.merge(t, frozen), LORA_MOE, ids))[..., 3]
        )

    grads = jax.jit(jax.grad(loss))(trainable)["layers_1"]["mlp"]["up_experts_lora_b"]
    assert np.all(np.abs(np.asarray(grads)).reshape(4, -1).max(-1) > 0)  # every expert
    params = _random_b(params)
    logits = apply(params, LORA_MOE, ids)
    merged, merged_config = lora.merged(params, LORA_MOE)
    assert merged_config == base_config and not lora.has_adapters(merged)
    # float32 sums of <= 32 products through 2 layers, logits ~1: measured ~1e-6
    np.testing.assert_allclose(apply(merged, base_config, ids), logits, atol=2e-5)
    assert float(jnp.max(jnp.abs(logits - apply(base, base_config, ids)))) > 1e-2


def test_an_expert_lora_export_is_the_adapter_forward_in_transformers(checkpoints, tmp_path):
    """A checkpoint with adapters on q and every expert's gate, up and down, exported merged
    (`export_params`, float32): transformers' logits of the export equal our adapter
    forward's; a PEFT export of expert adapters is refused."""
    path, _, ours = checkpoints["x4_top1_tied"]
    config = ours.config.replace(lora_rank=2, lora_alpha=4.0, lora_targets=("q", "up", "down"))
    params = _random_b(model.add_adapters(ours.params, config, jax.random.key(3)), std=0.5)
    export_lib.export_params(params, config, str(path), tmp_path / "out", dtype="float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32
    )
    ids = _ids(6)
    want = np.asarray(model.apply(params, config, jnp.asarray(ids)))
    np.testing.assert_allclose(_torch(back, ids).logits.numpy(), want, atol=TOL)
    base = np.asarray(model.apply(ours.params, ours.config, jnp.asarray(ids)))
    assert np.max(np.abs(want - base)) > 0.1  # the adapters moved the logits
    with pytest.raises(ValueError, match=r"LoRA on qwen3_moe's experts \(down,up\) has no PEFT"):
        export_lib.export_peft(params, config, str(path), tmp_path / "peft")


# ----------------------------------------------------------------------------- load, export


def test_export_round_trip(checkpoints, tmp_path):
    """Load -> save (sharded small, so an expert-stacked param spans files) -> reload (and
    the sharded loader, straight onto fsdp=2): the same params; the same tensor names and
    config as transformers' own save; and transformers loads the export to the same logits
    as the model it came from."""
    path, tm, ours = checkpoints["x8_top2_norm_untied"]
    hf.save_pretrained(ours, tmp_path, max_shard_size=20_000)
    written = json.loads((tmp_path / "config.json").read_text())
    assert hf_format.config_from_hf(written) == ours.config
    assert written["num_experts"] == 8 and "num_local_experts" not in written
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / "model.safetensors"), "np") as fh:
        assert set(index) == set(fh.keys())
    gate_files = {index[f"model.layers.0.mlp.experts.{j}.gate_proj.weight"] for j in range(8)}
    assert len(gate_files) > 1  # the stacked param is read from several files
    again = hf.load_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, again.params, ours.params)
    mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
    placed = sharding.load_pretrained_sharded(tmp_path, ours.config, mesh, sharding.TRAIN_RULES)
    jax.tree.map(np.testing.assert_array_equal, placed, ours.params)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    )
    ids = _ids(4)
    np.testing.assert_array_equal(_torch(back, ids).logits.numpy(), _torch(tm, ids).logits.numpy())


def test_layout_maps_each_expert_to_its_slice(checkpoints):
    """Expert 5's gate projection and the router, against the torch modules' weights."""
    _, tm, ours = checkpoints["x6_top3_tied"]
    layer = tm.model.layers[1].mlp
    p = ours.params["layers_1"]["mlp"]
    f = 24
    gate_up = layer.experts.gate_up_proj.detach().numpy()  # [X, 2F, E], gate rows first
    np.testing.assert_array_equal(p["gate_experts"][5], gate_up[5, :f].T)
    np.testing.assert_array_equal(p["up_experts"][5], gate_up[5, f:].T)
    np.testing.assert_array_equal(
        p["down_experts"][5], layer.experts.down_proj[5].detach().numpy().T
    )
    np.testing.assert_array_equal(p["router_kernel"], layer.gate.weight.detach().numpy().T)


# ----------------------------------------------------------------------------- counts, errors


def test_param_counts_total_and_active():
    c = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=40,
        num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
    )  # fmt: skip
    shapes = jax.eval_shape(lambda: model.init_params(c, jax.random.key(0)))
    leaves = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    attn = 16 * 8 * (2 + 2) + 2 * 8 * 16 + 2 * 8
    per_layer = attn + 2 * 16 + 16 * 5  # + norms + router
    embed_head_norm = 2 * 64 * 16 + 16
    assert c.num_params() == leaves == 3 * (per_layer + 5 * 3 * 16 * 12) + embed_head_norm
    assert c.num_params(active=True) == 3 * (per_layer + 2 * 3 * 16 * 12) + embed_head_norm
    dense = c.replace(model_type="qwen3", num_experts=0, num_experts_per_tok=0,
                      moe_intermediate_size=0)  # fmt: skip
    assert dense.num_params() == dense.num_params(active=True)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    plan = memory.memory_plan(c, mesh, batch=2, seq_len=8)
    assert plan.params == leaves * 4


def test_memory_plan_counts_experts_split_over_fsdp():
    """fsdp=4 with expert_axis="fsdp": each device holds 2 of 8 experts whole (not all 8 with
    their hidden dim split: the same bytes), and the activations grow by the routed rows of
    the 4 x gathered tokens, by hand: (s - 1) x (3KF + 2KE) + s x E x (1 + 4 / 2 bytes) per
    token and layer, bfloat16 compute, no remat, less the experts the unsplit layer gathers."""
    c = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=16, intermediate_size=40,
        num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, dtype="bfloat16",
    )  # fmt: skip
    mesh = sharding.make_mesh({"fsdp": 4}, jax.devices()[:4])
    split = c.replace(expert_axis="fsdp")
    specs = sharding.param_specs(split, mesh, sharding.TRAIN_RULES)["layers_0"]["mlp"]
    assert specs["up_experts"] == P("fsdp", None, "tensor")  # tensor: size 1 here
    whole, parted = (memory.memory_plan(x, mesh, batch=8, seq_len=8) for x in (c, split))
    assert parted.params == whole.params and parted.optimizer == whole.optimizer
    s, k, e, f, tokens = 4, 2, 16, 12, 2 * 8  # 2 rows of 8 tokens a device
    per_token = (s - 1) * (3 * k * f + 2 * k * e) + s * e * (1 + 2)
    # Without the split one layer's 8 experts are gathered whole, with their gradient: 2 x
    # (gate, up, down) x [8, 16, 12] in float32, which the split does not hold.
    gathered = 2 * 3 * 8 * e * f * 4
    assert parted.activations - whole.activations == 3 * tokens * per_token * 2 - gathered


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step: 2 leaves some qwen3_moe layers dense"),
        ({"mlp_only_layers": [1]}, r"mlp_only_layers: \[1\]"),
        ({"num_experts": None}, r"missing \['num_experts'\]"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok: expected 1..num_experts \(8\), got 9"),
        ({"moe_intermediate_size": 0}, r"num_experts \(8\) and moe_intermediate_size \(0\)"),
    ],
)
def test_config_from_hf_refuses_what_the_model_cannot_run(changes, match):
    base = _hf_config(*CASES["x8_top2_norm_untied"]).to_dict()
    base.pop("num_local_experts", None)
    hf_format.config_from_hf({**base, "num_experts": 8})  # the base config is fine
    with pytest.raises(ValueError, match=match):
        hf_format.config_from_hf({**base, "num_experts": 8, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "qwen3"}, r"num_experts: qwen3 is dense \(0\), got 4"),
        (
            {"lora_rank": 4, "lora_targets": "q,up", "lora_base": "nf4"},
            r"lora_base: qwen3_moe's expert kernels \(up\) are not quantised yet; got 'nf4'",
        ),
        ({"weight_quant": "int8"}, r"weight_quant: qwen3_moe's expert kernels are not quantised"),
    ],
)
def test_model_config_refuses_combinations_that_do_not_compose(changes, match):
    moe_config = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=8)  # fmt: skip
    ModelConfig(**moe_config, lora_rank=4, lora_targets="q,v,gate,up,down")  # float adapters
    ModelConfig(**moe_config, lora_rank=4, lora_targets="q,v", lora_base="nf4")  # QLoRA on q, v
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**moe_config, **changes})
    with pytest.raises(ValueError, match=r"router_logits: qwen3 has no router"):
        model.router_logits({}, ModelConfig(model_type="qwen3", qk_norm=True))


# ----------------------------------------------------------------------------- expert parallel


def _dense_experts(x, experts, weights, gate, up, down):
    """moe_experts by the formula, every token through every expert, in float64 numpy."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[n, k])
            y[n] += float(weights[n, k]) * (silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e]
    return y


SKEWED = dict(n=8, k=2, x_=8, e=16, f=8)  # tokens, top-k, experts, width, expert width


def _skewed_problem(seed: int, routing_seed: int):
    """An expert layer's inputs at `SKEWED`'s sizes: tokens x [n, e], expert kernels (gate,
    up [x_, e, f], down [x_, f, e]), routes where experts 3, 4, 6, 7 get no token and the
    others uneven counts (expert 0 most) with their weights, and a probe [n, e] to reduce y
    with."""
    n, k, x_, e, f = SKEWED.values()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, e)).astype(np.float32)
    gate, up = (rng.normal(size=(x_, e, f)).astype(np.float32) * 0.5 for _ in range(2))
    down = rng.normal(size=(x_, f, e)).astype(np.float32) * 0.5
    routes = np.random.default_rng(routing_seed)
    used = np.array([0, 0, 0, 1, 2, 5])
    experts = np.stack([routes.permutation(used)[:k] for _ in range(n)]).astype(np.int32)
    weights = routes.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    probe = rng.normal(size=(n, e)).astype(np.float32)
    return x, gate, up, down, experts, weights, probe


@pytest.mark.parametrize("expert_axis", ["fsdp", "data"])
def test_expert_parallel_forward_and_gradients_match_one_device(expert_axis):
    """8 experts split over a batch axis of data=2 x fsdp=2 x tensor=2 (tokens gathered over
    it, reduce-scattered back), with routing skewed (4 experts get no token, expert 0 most):
    y equals a float64 numpy reference, and y and the gradients of every input equal one
    device's `moe_experts` (float32 sums of <= 16 products: 1e-5)."""
    x, gate, up, down, experts, weights, probe = _skewed_problem(0, 1)
    assert np.bincount(experts.ravel(), minlength=8)[[3, 4, 6, 7]].sum() == 0
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])

    def loss(x, weights, gate, up, down, axis):
        y = moe.moe_experts(x, jnp.asarray(experts), weights, gate, up, down, expert_axis=axis)
        return jnp.sum(y * probe), y

    args = (x, weights, gate, up, down)
    grad = jax.value_and_grad(loss, argnums=range(5), has_aux=True)
    (_, want_y), want = jax.jit(functools.partial(grad, axis=""))(*args)
    split = P(expert_axis, None, "tensor")
    specs = (P(("data", "fsdp")), P(("data", "fsdp")), split, split, P(expert_axis, "tensor"))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    step = jax.jit(sharding.on_mesh(functools.partial(grad, axis=expert_axis), mesh))
    (_, y), grads = step(*placed)
    hlo = step.lower(*placed).as_text()
    assert "all_gather" in hlo and "reduce_scatter" in hlo
    np.testing.assert_allclose(want_y, _dense_experts(x, experts, weights, gate, up, down),
                               atol=1e-4)  # fmt: skip
    np.testing.assert_allclose(y, want_y, atol=1e-5)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    assert float(jnp.abs(grads[2][3]).max()) == 0 and float(jnp.abs(grads[2][0]).max()) > 1e-3


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_expert_parallel_model_matches_one_device(checkpoints, adapted):
    """The whole model with expert_axis="fsdp" on fsdp=4 x tensor=2: experts split over
    fsdp (whole hidden dim), and the logits and every param's gradient equal one device's;
    also with LoRA on every expert projection (random B: the adapters' grouped matmuls run
    on each device's local experts, down's A over the tensor-split width)."""
    _, _, ours = checkpoints["x8_top2_norm_untied"]
    base, params = ours.config, ours.params
    if adapted:
        base = base.replace(lora_rank=2, lora_targets=("gate", "up", "down"))
        params = model.add_adapters(params, base, jax.random.key(5))
        flat = traverse_util.flatten_dict(params)
        for i, path in enumerate(sorted(p for p in flat if lora.is_adapter(p))):
            if path[-1].endswith("_lora_b"):
                noise = jax.random.normal(jax.random.key(i), flat[path].shape) * 0.1
                flat[path] = noise.astype(flat[path].dtype)
        params = traverse_util.unflatten_dict(flat)
    c = base.replace(expert_axis="fsdp")
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2}, jax.devices()[:8])
    specs = sharding.param_specs(c, mesh, sharding.TRAIN_RULES)["layers_0"]["mlp"]
    assert specs["gate_experts"] == P("fsdp", None, "tensor")
    assert specs["down_experts"] == P("fsdp", "tensor", None)
    ids = jnp.asarray(_ids(3, (4, 6)))

    def loss(p, config):
        return jnp.sum(jax.nn.log_softmax(model.apply(p, config, ids))[..., 7])

    shardings = sharding.param_shardings(c, mesh, sharding.TRAIN_RULES)
    step = jax.jit(sharding.on_mesh(jax.value_and_grad(loss), mesh), static_argnums=1)
    value, grads = step(jax.device_put(params, shardings), c)
    want_value, want_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, base)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, want_grads)


def test_expert_axis_refuses_experts_it_does_not_divide(checkpoints):
    """6 experts over fsdp=4: one line naming expert_axis, 6 and 4."""
    _, _, ours = checkpoints["x6_top3_tied"]
    mesh = sharding.make_mesh({"fsdp": 4}, jax.devices()[:4])
    with pytest.raises(ValueError, match=r"expert_axis: num_experts \(6\) .* 'fsdp' \(4\)"):
        sharding.param_specs(ours.config.replace(expert_axis="fsdp"), mesh, sharding.TRAIN_RULES)
    with pytest.raises(ValueError, match="expert_axis: expected one of"):
        ours.config.replace(expert_axis="tensor")
    with pytest.raises(ValueError, match="moe_kernel: expected one of"):
        ours.config.replace(moe_kernel="dense")


@pytest.mark.parametrize("shards", [1, 4])
def test_megablox_matches_ragged_dot(shards):
    """Pallas' `gmm` (its interpreter on CPU: rows padded to whole tiles, the other experts'
    rows left to the kernel to zero) gives ragged_dot's y and gradients under skewed
    routing: all 8 experts on one device, and the sum of 4 devices' `local_experts` over
    their 2 experts each (what each device of an expert axis of 4 runs; Pallas'
    interpreter does not run inside a CPU `shard_map`)."""
    x, gate, up, down, experts, weights, probe = _skewed_problem(2, 3)
    x_ = SKEWED["x_"]
    per = x_ // shards

    def loss(x, weights, gate, up, down, kernel):
        y = sum(
            moe.local_experts(
                x,
                jnp.asarray(experts),
                weights,
                *(a[s * per : (s + 1) * per] for a in (gate, up, down)),
                s * per,
                x_,
                kernel,
            )  # fmt: skip
            for s in range(shards)
        )
        return jnp.sum(y * probe), y

    grad = jax.value_and_grad(loss, argnums=range(5), has_aux=True)
    args = (x, weights, gate, up, down)
    (_, want_y), want = jax.jit(functools.partial(grad, kernel="ragged_dot"))(*args)
    (_, y), grads = jax.jit(functools.partial(grad, kernel="megablox"))(*args)
    np.testing.assert_allclose(want_y, _dense_experts(x, experts, weights, gate, up, down),
                               atol=1e-4)  # fmt: skip
    np.testing.assert_allclose(y, want_y, atol=1e-5)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)
