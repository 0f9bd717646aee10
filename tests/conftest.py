"""Test session setup: eight fake CPU devices for the sharding tests, shared fixtures.

The device count is set before jax is imported anywhere, so every test process (xdist
workers included) sees the same count; single-device code runs on device 0.
"""

import json
import os
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The suite compiles hundreds of small programs, each run a few times: XLA's CPU backend
# without LLVM's optimisation passes compiles them about twice as fast, and without the
# MLIR fusion emitters (fusions go through the classic elemental emitter) about twice as
# fast again (a tiny train step: 7.2 s -> 3.3 s -> 1.4 s; suite time). The HLO passes are
# the same, and so nearly the buffer assignment the memory tests compare (that step's
# temporaries: 556,976 bytes with the emitters, 557,168 without); what changes is how fast
# the machine code runs. Subprocesses that set their own XLA_FLAGS add
# M2PO_TEST_XLA_FLAGS to them.
# XLA:CPU ends the process when a collective's participants have not all arrived within
# 40 s; the 8 fake devices' threads of a sharded test on a 2-core host loaded by the other
# xdist worker (and anything else the machine runs) may take longer than that, so the tests
# give them 300 s. The whole-suite aborts seen in shard tests were not slowness but a
# deadlock (7 of 8 participants waiting for good, with many eager 8-device programs in
# flight: docs/contributing.md, "The suite's time"); such a worker aborts after the 300 s.
os.environ["M2PO_TEST_XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_collective_call_terminate_timeout_seconds=300"
)
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + os.environ["M2PO_TEST_XLA_FLAGS"]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole session, shared by the xdist workers and
# the subprocesses tests start (m2po-train reads M2PO_COMPILE_CACHE): the many tiny runs
# compile the same programs, and a cache hit is the same executable (suite time). A fresh
# directory per session, so no result depends on an earlier run.
_session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
_cache = os.path.join(tempfile.gettempdir(), f"m2po_tests_xla_cache_{_session}")
os.environ.setdefault("M2PO_COMPILE_CACHE", _cache)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["M2PO_COMPILE_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer.json with special ids in tokenizer_ and generation_config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<eot>"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ate 12 apples"], trainer)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "pad_token": "<pad>", "bos_token": "<s>"})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    return path


def pytest_sessionfinish(session):
    """The session's compilation cache goes with it (the controller removes it, after the
    workers are done)."""
    if not hasattr(session.config, "workerinput"):
        import shutil

        shutil.rmtree(_cache, ignore_errors=True)


# The slowest tests (each 30 s or more on 2 cores: whole runs in subprocesses, several
# processes) start first, so that the two xdist workers do not end on one of them while
# the other idles (suite time). Matched on the start of a test's node id.
HEAVY_FIRST = (
    "tests/parallel/parallel_test.py::test_two_processes_",
    "tests/trainer/async_test.py::test_an_async_run_learns",
    "tests/trainer/agent_run_test.py::test_the_calculator_demonstration",
    "tests/e2e/device_check_test.py::",
    "tests/e2e/colab_test.py::",
    "tests/e2e/main_test.py::test_a_resume_with_another_model",
    "tests/e2e/export_test.py::test_two_processes",
    "tests/trainer/faults_test.py::",
)


def pytest_collection_modifyitems(config, items):
    heavy = lambda item: not item.nodeid.startswith(HEAVY_FIRST)  # False sorts first
    items.sort(key=heavy)
