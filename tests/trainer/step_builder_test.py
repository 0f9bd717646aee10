"""One builder for the train step: the trainer, the memory check against XLA, the scale
benchmark and the device check all compile what `setup.build_train_step` returns."""

import importlib.util
import inspect
import sys
import types
from pathlib import Path

import jax

from m2po_jax import config as config_lib
from m2po_jax import trainer as trainer_lib
from m2po_jax.configs import arith
from m2po_jax.learner import optim
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import placement as placement_lib
from m2po_jax.trainer import setup as setup_lib

ROOT = Path(__file__).resolve().parents[2]
MODEL = model_config_lib.ModelConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1
)


def _bench(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_trainer_and_memory_check_compile_the_same_builder(monkeypatch):
    calls = []
    real = setup_lib.build_train_step

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(setup_lib, "build_train_step", recorder)
    c = arith.get_config("tiny")
    c.rollout.batch_size, c.gconfig.n_samples = 2, 4
    cfg = config_lib.from_configdict(c)
    placement = placement_lib.Placement.from_shape({"data": 1, "fsdp": 1, "tensor": 1}, MODEL)
    tx, schedule = optim.make_optimizer(cfg.actor.optimizer, 1)
    params = model_lib.init_params(MODEL, jax.random.key(0))
    state = step_lib.init_train_state(params, tx)
    fake = types.SimpleNamespace(
        cfg=cfg, model_config=MODEL, tx=tx, schedule=schedule, placement=placement, state=state
    )
    trainer_lib.Trainer._jitted_step(fake)
    assert calls[-1] == ((cfg, MODEL, tx, schedule, placement, state), {})
    compiled = setup_lib.compiled_step_memory(cfg, MODEL, placement)
    (run, model, _, _, place, abstract), kwargs = calls[-1]
    assert (run, model, place) == (cfg, MODEL, placement) and kwargs == {"share_prompts": True}
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    assert compiled.held_bytes > 0 and compiled.compile_s > 0


def test_scale_bench_and_device_check_use_the_builder(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def fake_compiled(cfg, model_config, placement, *, share_prompts=True):
        seen.append((cfg.actor.ppo_n_minibatches, model_config.num_layers, share_prompts))
        raise Stop

    scale = _bench("scale_bench")
    monkeypatch.setattr(setup_lib, "compiled_step_memory", fake_compiled)
    for share in (True, False):
        try:
            scale.compile_preset("qwen2.5-7b", share_prompts=share, devices=1)
        except Stop:
            pass
    assert seen == [(4, 28, True), (4, 28, False)]  # the preset's own actor and model
    # The device check's train section builds its step with the builder, nothing else.
    sections = _bench("device_check_sections")
    source = inspect.getsource(sections.run_train)
    assert "setup_lib.build_train_step(" in source and "make_train_step(" not in source
    assert sections.setup_lib.build_train_step is setup_lib.build_train_step
