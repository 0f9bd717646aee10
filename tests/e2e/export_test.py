"""Hugging Face exports: the trainer's `<workdir>/hf/step_<N>` and `m2po-export`, loaded
back by transformers; interrupted exports; the CLI's one-line errors."""

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gsm8k_run_test import checkpoint, completion_length_reward, small_gsm8k  # noqa: F401
from safetensors.numpy import load_file

from m2po_jax import trainer as trainer_lib
from m2po_jax.cli import export as export_main
from m2po_jax.common.errors import CheckpointError
from m2po_jax.models import hf
from m2po_jax.models import model as model_lib
from m2po_jax.run import checkpoint as ckpt_lib
from m2po_jax.run import export as export_lib

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def source(checkpoint):  # noqa: F811
    """The tiny checkpoint with a chat template and a generation config, as instruct
    models ship them."""
    (checkpoint / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (checkpoint / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 3, "do_sample": True, "temperature": 0.7})
    )
    return checkpoint


def _trainer(source, workdir, **checkpoint_changes):
    reward_fn = f"{completion_length_reward.__module__}:completion_length_reward"
    cfg = small_gsm8k(source, chat_template="off", reward_fn=reward_fn)
    changes = {"every": 1, "hf_dtype": "float32", **checkpoint_changes}
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **changes))
    return trainer_lib.Trainer(cfg, workdir)


def _tensors(path):
    return load_file(os.path.join(path, hf.SINGLE_FILE))


@pytest.fixture(scope="module")
def run(source, tmp_path_factory):
    """Two steps in two runs (the second resumes): the trainer exports at the end."""
    workdir = tmp_path_factory.mktemp("export_run")
    _trainer(source, workdir).run(stop_after=1)
    assert export_lib.exported_steps(workdir) == []  # not the end yet
    trainer = _trainer(source, workdir)
    trainer.run()
    return workdir, trainer


def test_the_trainer_exports_the_trained_policy_for_transformers(source, run):
    import torch
    import transformers

    workdir, trainer = run
    assert int(trainer.state.step) == 2 and export_lib.exported_steps(workdir) == [2]
    out = workdir / "hf" / "step_2"
    export_lib.verify_export(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert (out / "generation_config.json").read_bytes() == (
        source / "generation_config.json"
    ).read_bytes()
    assert not [p for p in (workdir / "hf").iterdir() if p.name.startswith(".")]

    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ids = np.array([[2, 5, 9, 4, 7, 11, 3]], np.int32)
    with torch.no_grad():
        want = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = model_lib.apply(trainer.state.params, trainer.model_config, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    # Training moved the policy: the export is not the source's weights.
    before = _tensors(source)
    after = _tensors(out)
    assert set(after) <= set(before) | {"lm_head.weight"}
    assert any(not np.array_equal(after[k], before[k]) for k in after if k in before)


def test_m2po_export_of_the_resumed_run_equals_the_trainers_export(run, tmp_path, capsys):
    workdir, _ = run
    out = tmp_path / "policy"
    code = export_main.main([str(workdir), "--out", str(out), "--dtype", "float32"])
    assert code == 0 and "step 2" in capsys.readouterr().out
    ours, theirs = _tensors(out), _tensors(workdir / "hf" / "step_2")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (workdir / "hf" / "step_2" / "config.json").read_text()
    )
    # The default dtype is bfloat16; an older step exports too.
    old = tmp_path / "policy_1"
    assert export_main.main([str(workdir), "--step", "1", "--out", str(old)]) == 0
    config = json.loads((old / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert all(str(a.dtype) == "bfloat16" for a in _tensors(old).values())


def test_an_interrupted_export_leaves_no_half_directory(run, tmp_path, monkeypatch):
    workdir, trainer = run
    real = hf.save_pretrained

    def killed(*args, **kwargs):
        kwargs["fetch"] = _dies_after(2)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "save_pretrained", killed)
    out = tmp_path / "hf" / "step_9"
    source = str(workdir / "hf" / "step_2")
    with pytest.raises(KeyboardInterrupt):
        export_lib.export_params(trainer.state.params, trainer.model_config, source, out)
    assert not out.exists() and [p.name for p in out.parent.iterdir()]  # only a leftover
    monkeypatch.undo()
    # The next export clears the leftover and writes a whole directory.
    old_umask = os.umask(0o022)
    try:
        export_lib.export_params(trainer.state.params, trainer.model_config, source, out)
    finally:
        os.umask(old_umask)
    export_lib.verify_export(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["step_9"]
    # Readable by other users, as any file written under umask 022 (not mkdtemp's 0700).
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


def _dies_after(n):
    count = [0]

    def fetch(x):
        count[0] += 1
        if count[0] > n:
            raise KeyboardInterrupt  # a kill in the middle of the tensors
        return jax.device_get(x)

    return fetch


def test_m2po_export_errors_are_one_line(run, source, tmp_path, capsys):
    workdir, _ = run

    def error(*argv):
        assert export_main.main([str(a) for a in argv]) == 2
        message = capsys.readouterr().err.strip()
        assert message.startswith("m2po-export: ") and "\n" not in message
        return message

    assert "no such checkpoint (available: [1, 2])" in error(
        workdir, "--step", 7, "--out", tmp_path / "x"
    )
    assert "already exists" in error(workdir, "--out", workdir / "hf" / "step_2")
    assert "is not a workdir m2po-train has run in" in error(tmp_path, "--out", tmp_path / "y")
    # A damaged checkpoint is named, and nothing in the workdir is moved.
    step_dir = Path(ckpt_lib.Checkpointer(workdir, keep=2).step_dir(1))
    victim = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        message = error(workdir, "--step", 1, "--out", tmp_path / "z")
        assert "checksum mismatch (damaged)" in message and str(step_dir) in message
        assert step_dir.exists()
    finally:
        victim.write_bytes(data)
    # A run that trained a new model has no Hugging Face source to export with.
    record = json.loads((workdir / "config.json").read_text())
    other = tmp_path / "new_model_run"
    other.mkdir()
    record["config"]["model.path"] = ""
    (other / "config.json").write_text(json.dumps(record))
    assert "model.path is empty" in error(other, "--out", tmp_path / "w")
    with pytest.raises(CheckpointError, match="already exists"):
        export_lib.export_params({}, None, str(source), workdir)


def test_two_processes_export_the_params_they_shard(source, tmp_path):
    """Two processes of one CPU device each, params sharded over both (fsdp=2): the export
    gathers each tensor and process 0 writes it; it equals a one-process `m2po-export` of
    the same checkpoint, tensor for tensor."""
    workdir = tmp_path / "run"
    port = _free_port()
    args = [
        sys.executable, "-m", "m2po_jax.cli.train", "--config=configs/gsm8k.py",
        f"--workdir={workdir}", f"--config.model.path={source}",
        f"--config.task.train_path={source / 'train.jsonl'}", "--config.task.eval_size=8",
        "--config.model.dtype=float32", "--config.model.remat=False",
        "--config.task.max_prompt_len=32", "--config.task.chat_template=off",
        "--config.total_steps=1", "--config.gconfig.n_samples=2",
        "--config.gconfig.max_new_tokens=4", "--config.rollout.batch_size=2",
        "--config.rollout.max_head_offpolicyness=1", "--config.eval.num_examples=8",
        "--config.eval.batch_size=8", "--config.mesh.data=1", "--config.mesh.fsdp=2",
        "--config.checkpoint.hf_dtype=float32", "--config.logging.progress=False",
        "--config.logging.tensorboard=False", "--config.logging.plots=False",
    ]  # fmt: skip
    procs = []
    for pid in range(2):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ['M2PO_TEST_XLA_FLAGS']} --xla_force_host_platform_device_count=1",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(pid),
        )
        procs.append(
            subprocess.Popen(
                args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    exported = workdir / "hf" / "step_1"
    export_lib.verify_export(exported)
    out = tmp_path / "one_process"
    assert export_main.main([str(workdir), "--out", str(out), "--dtype", "float32"]) == 0
    ours, theirs = _tensors(exported), _tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
