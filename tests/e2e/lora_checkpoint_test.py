"""Checkpoints of a LoRA run on a Hugging Face checkpoint: they hold the adapters and their
optimizer state with the base's identity (path and hash), a resume puts the adapters back
on the base loaded from `model.path` again, and a changed base is refused in one line;
`m2po-export` writes such a checkpoint merged (`--format hf`) or as a PEFT adapter."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from gsm8k_run_test import checkpoint, completion_length_reward, small_gsm8k_dict  # noqa: F401
from safetensors.numpy import load_file, save_file

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.cli import export as export_main
from m2po_jax.common.errors import CheckpointError
from m2po_jax.models import hf, lora
from m2po_jax.models import model as model_lib
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import export as export_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(checkpoint, tmp_path_factory):  # noqa: F811
    """A copy of the tiny checkpoint (a test changes its weights)."""
    path = tmp_path_factory.mktemp("lora_base") / "model"
    shutil.copytree(checkpoint, path)
    return path


def _cfg(base, **changes):
    reward_fn = f"{completion_length_reward.__module__}:completion_length_reward"
    c = small_gsm8k_dict(base, chat_template="off", reward_fn=reward_fn)
    settings = {
        "model.lora.rank": 4,
        "model.lora.alpha": 8.0,
        "actor.optimizer.lr": 1e-2,  # the adapters move visibly in two steps
        "actor.kl_ctl": 0.01,  # the reference is the adapters off: none is saved
        "checkpoint.every": 1,
        "checkpoint.hf_dtype": "float32",
        "eval.every": 0,
        "logging.tensorboard": False,
    }
    config_lib.apply_dotted(c, {**settings, **changes})
    return config_lib.from_configdict(c)


def _split(params):
    flat = traverse_util.flatten_dict(jax.device_get(params))
    adapters = {p: np.asarray(x) for p, x in flat.items() if lora.is_adapter(p)}
    rest = {p: np.asarray(x) for p, x in flat.items() if not lora.is_adapter(p)}
    return adapters, rest


def _assert_equal(a, b):
    assert a.keys() == b.keys() and a
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """One step, then a resumed run to the end (step 2)."""
    workdir = tmp_path_factory.mktemp("lora_run")
    first = trainer_lib.Trainer(_cfg(base), workdir)
    first.run(stop_after=1)
    saved = _split(first.state.params)
    second = trainer_lib.Trainer(_cfg(base), workdir)
    loaded = _split(second.state.params)
    assert second.try_resume()
    resumed = _split(second.state.params)
    second.run()
    return workdir, saved, loaded, resumed, second


def test_a_lora_checkpoint_holds_the_adapters_and_the_bases_identity(base, run):
    workdir, saved, loaded, resumed, trainer = run
    checkpointer = ckpt_lib.Checkpointer(workdir, keep=2)
    meta = checkpointer.meta(1)
    expected_hash = ckpt_lib.params_hash(lora.split(trainer.state.params)[1])
    assert meta["base"] == {"path": str(base), "hash": expected_hash}
    # The saved state: the adapters, their AdamW moments; no base param, no reference.
    tree = json.loads((checkpointer.step_dir(1) / "state" / "_METADATA").read_text())
    names = list(tree["tree_metadata"])
    params = [n for n in names if "'params'" in n]
    assert params and all("_lora_" in n for n in params), params
    assert any("'opt_state'" in n and "_lora_" in n for n in names)
    assert not (checkpointer.step_dir(1) / "ref_params").exists()
    # The resume: the saved adapters on the base as loaded from model.path.
    _assert_equal(resumed[0], saved[0])
    _assert_equal(resumed[1], loaded[1])
    assert any(np.abs(x).max() > 0 for p, x in saved[0].items() if p[-1].endswith("_lora_b"))
    assert int(trainer.state.step) == 2


def test_m2po_export_of_a_lora_checkpoint_merged_and_as_peft(base, run, tmp_path):
    workdir, _, _, _, trainer = run
    ids = np.array([[2, 5, 9, 4, 7, 11, 3]], np.int32)
    want = np.asarray(model_lib.apply(trainer.state.params, trainer.model_config, ids))
    # The merged model: what the trainer exported at the end, tensor for tensor.
    out = tmp_path / "merged"
    assert export_main.main([str(workdir), "--out", str(out), "--dtype", "float32"]) == 0
    ours = load_file(os.path.join(out, hf.SINGLE_FILE))
    theirs = load_file(os.path.join(workdir, "hf", "step_2", hf.SINGLE_FILE))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # The adapters, for peft on model.path.
    adapter = tmp_path / "adapter"
    argv = [str(workdir), "--out", str(adapter), "--format", "peft", "--dtype", "float32"]
    assert export_main.main(argv) == 0
    source = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(source, str(adapter)).eval()
    with torch.no_grad():
        got = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert json.loads((adapter / export_lib.PEFT_CONFIG).read_text())["r"] == 4


def test_a_changed_base_is_refused_in_one_line(base, run, tmp_path, capsys):
    workdir, *_ = run
    meta = ckpt_lib.Checkpointer(workdir, keep=2).meta(2)
    file = os.path.join(base, hf.SINGLE_FILE)
    original = load_file(file)
    changed = dict(original)
    changed["model.norm.weight"] = changed["model.norm.weight"] * 1.01
    save_file(changed, file, metadata={"format": "pt"})
    try:
        trainer = trainer_lib.Trainer(_cfg(base), workdir)
        with pytest.raises(CheckpointError) as e:
            trainer.try_resume()
        message = str(e.value)
        assert "\n" not in message and message.count(str(base)) == 2, message
        assert meta["base"]["hash"][:16] in message
        assert trainer.lora_base()["hash"][:16] in message
        assert trainer.lora_base()["hash"] != meta["base"]["hash"]
        # m2po-export (merged) loads the base too, and refuses it alike.
        capsys.readouterr()
        assert export_main.main([str(workdir), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("m2po-export: ") and "\n" not in err
        assert "its LoRA adapters were trained on the base" in err
        # ... and so does the PEFT export: its adapters would go onto another base.
        argv = [str(workdir), "--out", str(tmp_path / "p"), "--format", "peft"]
        assert export_main.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("m2po-export: ") and "\n" not in err
        assert "its LoRA adapters were trained on the base" in err
        assert not (tmp_path / "p").exists()
    finally:
        save_file(original, file, metadata={"format": "pt"})


def test_params_hash_sees_one_changed_value_and_not_the_layout():
    x = {"a": {"w": jnp.arange(12.0).reshape(3, 4)}, "b": jnp.ones((5,), jnp.bfloat16)}
    h = ckpt_lib.params_hash(x)
    assert h == ckpt_lib.params_hash(jax.tree.map(lambda v: v.astype(jnp.float32), x))
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    spread = jax.device_put(
        jnp.arange(8.0 * len(jax.devices())), jax.NamedSharding(mesh, jax.P("d"))
    )
    assert ckpt_lib.params_hash({"s": spread}) == ckpt_lib.params_hash({"s": np.asarray(spread)})
    changed = {"a": {"w": x["a"]["w"].at[2, 1].add(1e-6)}, "b": x["b"]}
    assert ckpt_lib.params_hash(changed) != h
    swapped = {"a": {"w": x["a"]["w"][::-1]}, "b": x["b"]}
    assert ckpt_lib.params_hash(swapped) != h


def test_a_lora_checkpoint_of_the_whole_params_exports_too(base, tmp_path, monkeypatch):
    """Where the base is not model.path's as loaded (a warm-up trained it, or the params
    were given), the checkpoint holds the whole params, base and adapters, and m2po-export
    restores them into the LoRA model's shapes."""
    monkeypatch.setattr(trainer_lib.Trainer, "lora_base", lambda self: None)
    workdir = tmp_path / "run"
    trainer = trainer_lib.Trainer(_cfg(base, total_steps=1), workdir)
    trainer.run()
    assert "base" not in ckpt_lib.Checkpointer(workdir, keep=2).meta(1)
    ids = np.array([[2, 5, 9, 4, 7]], np.int32)
    want = np.asarray(model_lib.apply(trainer.state.params, trainer.model_config, ids))
    for fmt in ("hf", "peft"):
        out = tmp_path / fmt
        argv = [str(workdir), "--out", str(out), "--format", fmt, "--dtype", "float32"]
        assert export_main.main(argv) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out if fmt == "hf" else base, torch_dtype=torch.float32
        )
        if fmt == "peft":
            model = peft.PeftModel.from_pretrained(model, str(out))
        with torch.no_grad():
            got = model.eval()(torch.tensor(ids, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=fmt)


@pytest.mark.parametrize("quantised", ["nf4", "int8"])
def test_a_qlora_warmup_trains_the_adapters_and_rl_continues_from_them(base, tmp_path, quantised):
    """Under a quantised base the warm-up trains the adapters (the codes get no gradient):
    the base stays bit-identical, the warm-up loss drops, the first RL step starts from
    the warmed-up adapters, and the checkpoint and the PEFT export keep them."""
    from m2po_jax.trainer import sft

    changes = {
        "model.lora.base": quantised,
        "sft.max_steps": 3,
        "sft.batch_size": 4,
        "sft.eval_every": 3,
        "sft.lr": 3e-2,
        "total_steps": 1,
    }
    workdir = tmp_path / "run"
    trainer = trainer_lib.Trainer(_cfg(base, **changes), workdir)
    initial = _split(trainer.state.params)
    assert not any(np.abs(x).max() for p, x in initial[0].items() if p[-1].endswith("_lora_b"))
    batch = trainer.placement.to_global(sft.sft_batch(trainer.setup, 0, 4))
    loss = jax.jit(sft.sft_loss, static_argnums=1)
    before = float(loss(trainer.state.params, trainer.model_config, *batch))
    first = {}
    step = trainer.train_step

    def watched(state, *args):
        if not first:  # the params as the warm-up left them, before the first RL update
            first["params"] = jax.tree.map(np.asarray, state.params)
        return step(state, *args)

    trainer.train_step = watched
    trainer.run()
    warm = _split(first["params"])
    _assert_equal(warm[1], initial[1])  # codes, scales and float leaves bit-identical
    assert any(not np.array_equal(warm[0][p], initial[0][p]) for p in initial[0])
    assert any(np.abs(x).max() > 0 for p, x in warm[0].items() if p[-1].endswith("_lora_b"))
    after = float(loss(first["params"], trainer.model_config, *batch))
    assert after < before - 0.05, (before, after)
    # The checkpoint holds the adapters RL trained from the warm-up's, on model.path's base.
    meta = ckpt_lib.Checkpointer(workdir, keep=2).meta(1)
    assert meta["sft_steps"] == 3 and meta["base"]["path"] == str(base)
    restored = trainer_lib.Trainer(_cfg(base, **changes), workdir)
    assert restored.try_resume()
    _assert_equal(_split(restored.state.params)[0], _split(trainer.state.params)[0])
    _assert_equal(_split(restored.state.params)[1], initial[1])
