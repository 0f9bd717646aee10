"""`m2po-train` reports what a user can fix in one line and exits 2 (`--verbose`: traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m2po_jax.models import hf_format, model_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config=configs/arith.py:m2po,tiny", "--config.mesh.data=1"]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "m2po_jax.cli.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line(result, prefix, *needles):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith("m2po-train:")]
    assert len(lines) == 1 and lines[0].startswith(f"m2po-train: {prefix}: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tokenizer, a config.json, weights and GSM8K-style data (the tests damage copies)."""
    import shutil

    path = tmp_path_factory.mktemp("model")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    config = model_config.ModelConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, model_type="llama", dtype="float32",
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(hf_format.config_to_hf(config)))
    (path / "model.safetensors").write_bytes(b"\xff" * 256)
    good = [{"question": "the cat ate 12 ?", "answer": "a dog #### 12"}] * 24
    lines = b"".join((json.dumps(r) + "\n").encode() for r in good)
    (path / "train.jsonl").write_bytes(lines)
    (path / "latin1.jsonl").write_bytes(lines[:100] + b'{"question": "caf\xe9"}\n')
    return path


def _gsm8k_args(path, workdir, data="train.jsonl"):
    return [
        "--config=configs/gsm8k.py",
        f"--config.model.path={path}",
        f"--config.task.train_path={path / data}",
        f"--workdir={workdir}",
        "--config.task.eval_size=8",
        "--config.task.max_prompt_len=32",
        "--config.gconfig.n_samples=2",
        "--config.gconfig.max_new_tokens=4",
        "--config.rollout.batch_size=2",
        "--config.eval.num_examples=8",
        "--config.eval.batch_size=8",
        "--config.mesh.data=1",
    ]


def test_corrupt_safetensors_names_the_file(model_dir, tmp_path):
    result = _cli(*_gsm8k_args(model_dir, tmp_path))
    _one_line(result, "model error", f"{model_dir / 'model.safetensors'}: not a readable")


def test_non_utf8_data_names_the_file_and_line(model_dir, tmp_path):
    result = _cli(*_gsm8k_args(model_dir, tmp_path, "latin1.jsonl"))
    _one_line(result, "setup error", "latin1.jsonl:2: not UTF-8 text")


def test_config_and_override_errors_are_one_line(tmp_path):
    _one_line(
        _cli(*TINY, "--config.actor.m2_threshold=inf", f"--workdir={tmp_path}"),
        "config error",
        "actor.m2_threshold=inf is not a finite number",
    )
    _one_line(
        _cli(*TINY, "--config.gconfig.temperature=1e-30", f"--workdir={tmp_path}"),
        "config error",
        "gconfig.temperature=1e-30 is out of range",
    )
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("actor:\n  eps_clip: [0.1\n")
    _one_line(
        _cli(*TINY, f"--overrides={bad_yaml}", f"--workdir={tmp_path}"),
        "config error",
        f"{bad_yaml}:3:",
        "not valid YAML",
    )
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("actor:\n  eps_clip: abc\n")
    _one_line(
        _cli(*TINY, f"--overrides={wrong}", f"--workdir={tmp_path}"),
        "config error",
        "actor.eps_clip: expected a float, got 'abc'",
    )
    verbose = _cli(*TINY, f"--overrides={wrong}", f"--workdir={tmp_path}", "--verbose")
    assert verbose.returncode == 2 and "Traceback" in verbose.stderr


def test_unusable_checkpoints_stop_in_one_line(tmp_path):
    step_dir = tmp_path / "checkpoints" / "2"
    (step_dir / "state").mkdir(parents=True)
    (step_dir / "_CHECKPOINT_METADATA").write_bytes(b"\xff\xfe\x00garbage")
    (step_dir / "m2po_manifest.json").write_text('{"version": 1, "files": {"state/x": {}}}')
    _one_line(
        _cli(*TINY, f"--workdir={tmp_path}"),
        "checkpoint error",
        f"{tmp_path / 'checkpoints'}: no checkpoint verifies (step 2: m2po_manifest.json",
    )
    _one_line(
        _cli(*TINY, f"--workdir={tmp_path / 'fresh'}", "--restore_step=7"),
        "checkpoint error",
        "checkpoints/7: no such checkpoint (restore_step=7",
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.actor.rejection_sampling.upper=0.5"], "rejection_sampling.upper must be > 1"),
        (
            ["--config.actor.rejection_sampling.lower=3.0", "--config.actor.rejection_sampling.upper=2.0"],
            "actor.rejection_sampling.lower (3.0) must be <= upper (2.0)",
        ),
        (
            ["--config.actor.rejection_sampling.action=clamp", "--config.actor.rejection_sampling.metric=kl_k1"],
            "actor.rejection_sampling.action 'clamp' needs metric 'ratio', got 'kl_k1'",
        ),
    ],
)  # fmt: skip
def test_rejection_sampling_errors_stop_before_any_work(args, message, tmp_path):
    workdir = tmp_path / "run"
    _one_line(_cli(*TINY, *args, f"--workdir={workdir}"), "config error", message)
    assert not workdir.exists()  # refused before the workdir (or anything else) was made


def test_config_file_errors_are_one_line_naming_the_file(tmp_path):
    """A missing file, a syntax error, no get_config, an unknown preset, a preset on the
    default config: one line, exit 2, the file named (config_flags printed tracebacks)."""
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n")
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    cases = [
        ("configs/nonexistent.py", "configs/nonexistent.py: no such config file"),
        (str(bad), f"{bad}: line 1: syntax error"),
        (str(empty), f"{empty}: defines no get_config() function"),
        ("configs/arith.py:nope", "configs/arith.py: unknown preset 'nope'"),
        ("configs/default.py:tiny", "configs/default.py: no presets (got 'tiny')"),
    ]
    for config, needle in cases:
        result = _cli(f"--config={config}", f"--workdir={tmp_path / 'w'}")
        _one_line(result, "config error", needle)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_areal_spelling_and_shipped_configs_by_name(tmp_path):
    # AReaL's command lines write `actor.m2_threshold=...`: taken as --config.actor....
    _one_line(
        _cli(*TINY, "--actor.m2_threshold=-1", f"--workdir={tmp_path}"),
        "config error",
        "actor.m2_threshold=-1.0 is out of range",
    )
    # A shipped config by name, from any directory (here: the preset is checked in it).
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "m2po_jax.cli.train",
            "--config=arith:nope",
            f"--workdir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    _one_line(result, "config error", "arith.py: unknown preset 'nope'; choose from")


def test_help_shows_the_flags_the_override_syntax_and_examples():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    for needle in (
        "--config:",
        "--workdir:",
        "--overrides:",
        "--restore_step:",
        "--config.SECTION.FIELD=VALUE",
        "examples:",
        "m2po-train --config=arith",
    ):
        assert needle in result.stdout, needle
    assert "--stderrthreshold" not in result.stdout  # not absl's sixty


def test_a_resume_with_another_model_or_changed_settings_is_refused_in_one_line(tmp_path):
    run = [*TINY, "--config.total_steps=1", f"--workdir={tmp_path}"]
    first = _cli(*run)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "config.json").is_file()
    _one_line(
        _cli(*run, "--config.model.num_layers=3"),
        "workdir error",
        f"{tmp_path / 'config.json'}: the checkpoints' model differs from this run's",
    )
    _one_line(
        _cli(*run, "--config.actor.eps_clip=0.3"),
        "workdir error",
        "actor.eps_clip=0.2 -> 0.3; pass --allow_config_change",
    )
    again = _cli(*run, "--config.actor.eps_clip=0.3", "--allow_config_change")
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_failed_setup_leaves_no_empty_workdir(tmp_path):
    workdir = tmp_path / "new"
    _one_line(_cli("--config=gsm8k", f"--workdir={workdir}"), "setup error", "needs a tokenizer")
    assert not workdir.exists()


def test_a_workdir_url_without_its_backend_is_refused_before_any_work():
    _one_line(
        _cli(*TINY, "--workdir=gs://bucket/run"),
        "workdir error",
        "gs://bucket/run: no filesystem backend for gs:// is installed",
    )
    assert not (REPO / "gs:").exists()


def test_an_areal_experiment_file_runs_with_its_launcher_keys_listed_and_flags_winning():
    example = REPO / "tests" / "data" / "areal_gsm8k_m2po.yaml"
    result = _cli("--config=gsm8k", f"--overrides={example}", "--config.model.path=/no/model")
    notes = [x for x in result.stderr.splitlines() if "AReaL keys not used here" in x]
    assert len(notes) == 1 and "cluster, allocation_mode" in notes[0] and "sglang, vllm" in notes[0]
    # Past the file to the model: the command line's model.path won over actor.path.
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("m2po-train: setup error")]
    assert errors == ["m2po-train: setup error: /no/model: checkpoint directory does not exist"]


def test_a_paged_pool_too_small_for_a_batch_is_refused_before_any_work(tmp_path):
    """rollout.kv_pages below a batch's prompts and one completion: the setup's one line and
    exit 2 before the warm-up (it was a traceback and exit 1 at its first accuracy check)."""
    workdir = tmp_path / "run"
    paged = ["--config.rollout.engine=paged", "--config.rollout.kv_pages=5"]
    _one_line(
        _cli(*TINY, *paged, f"--workdir={workdir}"),
        "setup error",
        "rollout.kv_pages=5: the rollouts' pool must hold every prompt",
        "at least 6",
    )
    assert not workdir.exists()
