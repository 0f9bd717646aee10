"""`m2po-train`: parses flags and runs the trainer.

  m2po-train                                     # built-in default, workdir runs/default
  m2po-train --config=configs/arith.py:grpo --workdir=/tmp/grpo \
      --config.actor.m2_threshold=0.04 --overrides=my_run.yaml
  m2po-train --workdir=/tmp/grpo --restore_step=200   # continue from an older checkpoint

Errors a user can fix (config, data, model, workdir, checkpoints, a full disk) print one
line, `m2po-train: <what>: <file or field>: <problem>`, and exit with status 2;
`--verbose` adds the traceback. A run stopped by SIGTERM or Ctrl-C checkpoints, then exits
with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a
process a signal ended, so a preemption wrapper tells it from a finished run (exit 0);
running the same command again resumes it. With several processes (a pod), a stop on any
one stops all of them after the same step, and each exits so; a process that loses another
(killed, out of memory, its host gone) says which in one line and exits 75 (EX_TEMPFAIL:
run the same command on every host again). A rollout worker that stalls past
`rollout.worker_timeout_s` ends the run in one line, exit 2, after a checkpoint; an error of
the project's own prints its traceback and exits 1.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

import m2po_jax.configs
from m2po_jax.common.errors import ConfigError, M2poError
from m2po_jax.rollout.worker import RolloutWorkerError

DEFAULT_CONFIG = str(Path(m2po_jax.configs.__file__).parent / "default.py")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the flags (at run time: config_flags reads `--config.*` overrides eagerly)."""
    config_flags.DEFINE_config_file(
        "config",
        DEFAULT_CONFIG,
        "Config file FILE.py[:PRESET,...], or a shipped one by name (arith:m2po, gsm8k).",
        lock_config=True,
    )
    flags.DEFINE_string(
        "workdir", "runs/default", "Output directory (resumes if it holds checkpoints)."
    )
    flags.DEFINE_string(
        "overrides", None, "YAML or JSON file with nested config keys to overlay (AReaL-style)."
    )
    flags.DEFINE_integer(
        "restore_step",
        None,
        "Resume from this checkpoint step instead of the newest verified one; newer "
        "checkpoints are moved to <workdir>/checkpoints_aside.",
        lower_bound=0,
    )
    flags.DEFINE_bool("verbose", False, "On an error, print the traceback too.")
    flags.DEFINE_bool(
        "allow_config_change",
        False,
        "Resume even where training settings differ from the ones the workdir's checkpoints "
        "were trained with (<workdir>/config.json).",
    )
    flags.DEFINE_bool(
        "compile_only",
        False,
        "Compile every program of the run (train step, warm-up, samplers, evaluation, "
        "reshard) for --topology or this host's devices, print memory per chip and a "
        "roofline, and exit: 0 if it fits, 2 with the setting that would make it fit.",
    )
    flags.DEFINE_string(
        "topology",
        "",
        "With --compile_only: devices to compile for without having them: a TPU slice "
        "(v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:2x4; the tpu extra) or GPUs (h100:8, h200:2x8 "
        "for 2 hosts of 8; jax's CUDA plugin). Empty: this host's devices.",
    )
    flags.DEFINE_string(
        "architecture",
        "",
        "With --compile_only: the model's architecture by name (qwen2.5-0.5b, qwen2.5-7b, "
        "qwen3-8b, ...) when model.path does not hold its config.json.",
    )
    flags.DEFINE_string(
        "compile_cache",
        None,
        "Directory of JAX's persistent compilation cache, so that a restarted run skips "
        "compiling; 'off' disables it. Default: $M2PO_COMPILE_CACHE or ~/.cache/m2po_jax/xla.",
    )


# `--config.a.b=None` sets a field to None (config_flags cannot parse None itself).
_NONE_ARG = re.compile(r"--config\.([\w.]+)=(None|none|null)")
_none_keys: list[str] = []
# verl's `algorithm.rollout_correction.rollout_is=token` (Hydra's spelling, or with `--`):
# m2po_jax.config.verl translates them; values are read as YAML (null, 2.0, token).
_VERL_ARG = re.compile(r"(?:--)?(algorithm\.[\w.]+)=(.*)")
_verl_args: dict[str, object] = {}


def verl_section(args: dict) -> dict:
    """verl's `algorithm.*` command-line keys as its rollout_correction section (without
    the prefix); any other `algorithm.*` key is refused."""
    from m2po_jax.config import verl

    nested: dict = {}
    for dotted, value in args.items():
        *parents, leaf = dotted.split(".")
        node = nested
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"command line: {dotted}: {name} is given a value too")
        node[leaf] = value
    return verl.split(nested, "command line")[1]


def _fail(message: str, what: str = "config error") -> None:
    print(f"m2po-train: {what}: {message}", file=sys.stderr)
    sys.exit(2)


def _verbose() -> bool:
    try:
        return bool(FLAGS.verbose)
    except (AttributeError, flags.Error):  # not parsed yet
        return "--verbose" in sys.argv


def _report(error: BaseException, what: str) -> None:
    """Prints `error` in one line (the traceback too with --verbose) and exits 2."""
    if _verbose():
        traceback.print_exception(error)
    _fail(_clean(error), what)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors for config typos and `=None` overrides."""
    import yaml

    kept = [argv[0]]
    for arg in argv[1:]:
        match = _NONE_ARG.fullmatch(arg)
        verl = _VERL_ARG.fullmatch(arg)
        if match:
            _none_keys.append(match.group(1))
        elif verl:
            try:
                _verl_args[verl.group(1)] = yaml.safe_load(verl.group(2))
            except yaml.YAMLError:
                _verl_args[verl.group(1)] = verl.group(2)
        else:
            kept.append(arg)
    for arg in kept:
        if arg.startswith("--config="):
            _check_config_file(arg.removeprefix("--config="))
    try:
        return flags.FLAGS(kept)
    except flags.Error as e:
        _fail(str(e))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        _fail(_clean(e))


def config_from_flags():
    """The run's typed config from the parsed flags: `--config` and its overrides, the
    `--overrides` file (the command line wins over it), `=None` keys and verl's keys."""
    from m2po_jax import config as config_lib
    from m2po_jax.config import overrides as overrides_lib

    config = FLAGS.config
    # The command line's own keys: none may be one verl's section decides.
    native = {*config_flags.get_override_values(FLAGS["config"]), *_none_keys}
    verl_args = verl_section(_verl_args)
    if FLAGS.overrides:
        ignored = overrides_lib.overlay_file(config, FLAGS.overrides, verl_args, native)
        if ignored:
            print(
                f"m2po-train: {FLAGS.overrides}: AReaL keys not used here (launcher, "
                f"servers, services): {', '.join(ignored)}",
                file=sys.stderr,
            )
        # The command line wins over the file.
        config.update_from_flattened_dict(config_flags.get_override_values(FLAGS["config"]))
    else:
        overrides_lib.apply_verl(config, verl_args, native, "command line")
    config_lib.apply_dotted(config, dict.fromkeys(_none_keys))
    return config_lib.from_configdict(config)


def main(argv) -> None:
    del argv
    from m2po_jax import config as config_lib

    if not FLAGS["verbosity"].present:
        # orbax logs every file it writes at INFO; the progress bar says what matters.
        logging.set_verbosity(logging.WARNING)

    try:
        cfg = config_from_flags()
    except (config_lib.ConfigError, ValueError, TypeError) as e:
        _report(e, "config error")

    from m2po_jax.common import errors
    from m2po_jax.parallel import distributed
    from m2po_jax.run import paths, workdir
    from m2po_jax.trainer import compile_cache

    if FLAGS.compile_only:
        _compile_only(cfg)
        return
    if FLAGS.topology or FLAGS.architecture:
        _fail("--topology and --architecture go with --compile_only", "usage error")

    try:  # a URL without its backend, or an unknown scheme: refused before any work
        directory = paths.workdir(FLAGS.workdir)
    except errors.M2poError as e:
        _report(e, e.what)

    compile_cache.enable(FLAGS.compile_cache)
    # Multi-host: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or a TPU pod.
    try:
        distributed.initialize_distributed()
    except ValueError as e:
        _report(e, "config error")
    logging.info("workdir %s", FLAGS.workdir)
    import jax

    fresh = not directory.exists()
    try:
        # Taken before the trainer is built, so a second run is refused at once; the
        # trainer's own hold nests inside this one.
        with workdir.hold(FLAGS.workdir, enabled=jax.process_index() == 0):
            result = _train(cfg)
    except errors.M2poError as e:
        _report(e, e.what)
    except MemoryError as e:
        _report(e, "memory error")
    except RolloutWorkerError as e:
        if not str(e).startswith("rollout.worker_timeout_s:"):
            raise  # the worker crashed: its traceback is in the message (a bug of ours)
        # Stalled (a hung reward or device): one line, after the checkpoint of the steps so far.
        _report(e, "rollout worker stalled")
    except SystemExit:
        if fresh:  # a run that failed before writing anything leaves no empty workdir
            _remove_if_empty(directory)
        raise
    except Exception as e:
        if jax.process_count() > 1 and _collective_failure(e):
            # gloo (CPU) fails at once when a peer is gone: the peer watch names it.
            distributed.wait_if_peer_lost(distributed.heartbeat_timeout_s() + 15)
        raise
    distributed.leaving()  # every process ends here together: no lost peer
    _print_result(result, cfg.actor.m2_threshold)


def _print_result(result, tau: float | None = None) -> None:
    """What the run did: where it stopped, the held-out accuracy by step and what the M2PO
    mask did; exits 128 + the signal when it was interrupted."""
    metrics_file = result.workdir / "metrics.jsonl"
    if result.already_finished:
        print(
            f"m2po-train: {result.workdir} finished at step {result.final_step} already; "
            "nothing to do (raise --config.total_steps to train further); metrics in "
            f"{metrics_file}"
        )
        return
    status = "interrupted" if result.interrupted else "finished"
    print(f"m2po-train: {status} at step {result.final_step}; metrics in {metrics_file}")
    accuracy = _accuracy_by_step(metrics_file, result.eval_accuracy)
    if accuracy:
        steps = ", ".join(f"{s}: {a:.3f}" for s, a in accuracy)
        scored = f" (scored by {result.scored_by})" if result.scored_by else ""
        print(f"m2po-train: held-out accuracy by step: {steps}{scored}")
    for line in _mask_summary(metrics_file, tau):
        print(f"m2po-train: {line}")
    if result.interrupted:
        sys.stdout.flush()
        sys.exit(128 + (result.signal or 15))


def _collective_failure(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return any(w in text for w in ("gloo", "connection", "peer", "unavailable", "collective"))


def _mask_summary(metrics_file, tau: float | None) -> list[str]:
    """The closing lines on the M2PO mask, over every step of the workdir's run."""
    from m2po_jax.run import metrics as metrics_lib

    try:
        rows = metrics_lib.read_metrics(metrics_file)
    except (OSError, ValueError):
        return []
    return metrics_lib.mask_summary(rows, tau)


def _accuracy_by_step(metrics_file, this_run: list) -> list[tuple[int, float]]:
    """Every held-out evaluation of the workdir's run, before a resume too."""
    from m2po_jax.run import metrics as metrics_lib

    try:
        rows = metrics_lib.read_metrics(metrics_file)
    except (OSError, ValueError):
        return list(this_run)
    found = {int(r["step"]): float(r["eval/accuracy"]) for r in rows if "eval/accuracy" in r}
    found.update(dict(this_run))
    return sorted(found.items())


def _compile_only(cfg) -> None:
    """`--compile_only`: every program of the run compiled for `--topology`; nothing runs."""
    from m2po_jax.trainer import compile_only

    try:
        compile_only.run(cfg, FLAGS.topology, FLAGS.architecture)
    except MemoryError as e:
        _report(e, "memory error")
    except (ValueError, OSError) as e:
        _report(e, "setup error")
    print("m2po-train: compile-only: every program compiled; the run fits")


def _remove_if_empty(directory) -> None:
    """Removes `directory` if it holds nothing but the workdir lock."""
    try:
        if {p.name for p in directory.iterdir()} <= {".lock"}:
            (directory / ".lock").unlink(missing_ok=True)
            directory.rmdir()
    except OSError:
        pass


def _train(cfg):
    """Builds the trainer (setup errors are the user's: model, data, mesh) and runs it."""
    from m2po_jax import trainer
    from m2po_jax.common import errors

    try:
        run = trainer.Trainer(cfg, FLAGS.workdir, allow_config_change=FLAGS.allow_config_change)
    except errors.M2poError:
        raise
    except (ValueError, OSError) as e:
        # The setup's checks (model, data, mesh) raise ValueError / OSError naming the file
        # or field; errors once training runs are the project's own types only.
        _report(e, "setup error")
    return run.run(restore_step=FLAGS.restore_step)


# Top-level sections of the config: AReaL's command lines set `actor.m2_threshold=...`.
_SECTIONS = (
    "actor", "checkpoint", "eval", "gconfig", "logging", "mesh", "model", "rollout", "sft",
    "task",
)  # fmt: skip


def spelled_our_way(arg: str) -> str:
    """AReaL's `--actor.m2_threshold=0.05` -> `--config.actor.m2_threshold=0.05`; a shipped
    config by name (`--config=gsm8k:qwen2.5-7b`, `--config=arith.py:m2po`) -> its file."""
    name = arg[2:].split("=", 1)[0]
    if arg.startswith("--") and name.split(".", 1)[0] in _SECTIONS and "." in name:
        return "--config." + arg[2:]
    if arg.startswith("--config="):
        value = arg.removeprefix("--config=")
        path, colon, preset = value.partition(":")
        packaged = Path(m2po_jax.configs.__file__).parent / (
            path if path.endswith(".py") else f"{path}.py"
        )
        if "/" not in path and not Path(path).is_file() and packaged.is_file():
            return f"--config={packaged}{colon}{preset}"
    return arg


def _check_config_file(value: str) -> None:
    """Loads `--config`'s file and preset once before config_flags does, so that a file
    that is missing, does not parse, has no `get_config` or refuses the preset stops in one
    line naming it (config_flags would print its traceback)."""
    path, _, preset = value.partition(":")

    def fail(message: str) -> None:
        # A file's own message may name it already (`configs/arith.py: unknown preset`).
        message = re.sub(rf"^(\S*/)?{re.escape(Path(path).name)}: ", "", message)
        _fail(f"{path}: {message}")

    if not Path(path).is_file():
        fail("no such config file (a Python file with get_config(), e.g. configs/arith.py:m2po)")
    try:
        spec = importlib.util.spec_from_file_location("m2po_config_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except SyntaxError as e:
        fail(f"line {e.lineno}: syntax error: {e.msg}")
    except Exception as e:  # noqa: BLE001 (the user's file: any error is theirs)
        fail(f"{type(e).__name__}: {_clean(e)}")
    if not callable(getattr(module, "get_config", None)):
        fail("defines no get_config() function")
    try:
        module.get_config(*([preset] if preset else []))
    except Exception as e:  # noqa: BLE001 (e.g. an unknown preset)
        fail(_clean(e))


def _clean(error: BaseException) -> str:
    text = str(error)
    # KeyError and config_flags quote their whole message: drop that pair of quotes only.
    if not isinstance(error, M2poError) and len(text) > 1 and text[0] == text[-1] in "'\"":
        text = text[1:-1]
    text = text.replace("\\n", " ").replace("\n", " ")
    return text.replace("\\'", "'")


def run() -> None:
    # Before the flags are defined: config_flags reads the `--config.*` overrides from argv.
    sys.argv = sys.argv[:1] + [spelled_our_way(arg) for arg in sys.argv[1:]]
    if "--compile_only" in sys.argv and any(
        re.match(r"--topology=h\d00:", arg) for arg in sys.argv
    ):
        # Compile-only GPUs: jax's CUDA plugin must skip its cuInit check, which fails on a
        # host without a GPU, before jax starts its backends (`gpu_targets`).
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        define_flags()
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # config_flags reports an unknown override key as an AttributeError with a suggestion.
        _fail(_clean(e))
    if any(arg in ("--help", "-h", "-?", "--helpshort") for arg in sys.argv[1:]):
        print(usage())
        sys.exit(0)
    app.run(main, flags_parser=parse_flags)


_OWN_FLAGS = (
    "config", "workdir", "overrides", "restore_step", "allow_config_change", "compile_cache",
    "compile_only", "topology", "architecture", "verbose",
)  # fmt: skip


def usage() -> str:
    """`m2po-train --help`: the flags, the override syntax and examples (absl's `--helpfull`
    lists its own sixty flags too)."""
    lines = [
        "usage: m2po-train [--config=FILE[:PRESET,...]] [--workdir=DIR] "
        "[--config.SECTION.FIELD=VALUE ...]",
        "",
        "Trains a language model with M2PO on stale rollouts (default: the built-in",
        "arithmetic task, output in runs/default).",
        "",
        "flags:",
    ]
    for name in _OWN_FLAGS:
        flag = FLAGS[name]
        default = "" if flag.default in (None, "") else f" (default: {flag.default})"
        if name == "config":
            default = " (default: the built-in default config)"
        lines.append(f"  --{name}: {flag.help}{default}")
    lines += [
        "",
        "Any config field: --config.SECTION.FIELD=VALUE (AReaL's --SECTION.FIELD=VALUE too);",
        "=None sets a field to None. Every field: m2po_jax/common/config_schema.py.",
        "verl's algorithm.rollout_correction.KEY=VALUE too (docs/algorithm.md, the loss).",
        f"Sections: {', '.join(_SECTIONS)}.",
        "",
        "examples:",
        "  m2po-train --config=arith:stale_grpo --workdir=/tmp/stale_grpo",
        "  m2po-train --config=gsm8k:qwen2.5-7b --workdir=/tmp/qwen7b \\",
        "      --config.model.path=/models/Qwen2.5-7B-Instruct \\",
        "      --config.task.train_path=/data/gsm8k/train.jsonl --actor.m2_threshold=0.04",
        "  m2po-train --config=gsm8k:qwen3-8b --architecture=qwen3-8b --compile_only \\",
        "      --topology=v5e:4x4    # every program built for a v5e-16, on this host",
        "",
        "Exit status: 0 finished (--compile_only: it fits); 2 a config, data, model, workdir,",
        "disk or reward error, a stalled rollout worker, or a run that does not fit (one line);",
        "128 + N stopped by signal N after a checkpoint (143 SIGTERM, 130 Ctrl-C); 75 another",
        "process of the run was lost (run the same command on every host); 1 a bug of ours",
        "(its traceback).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    run()
