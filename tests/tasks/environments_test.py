"""Environments: the interface, sync or async, and ToolEnv's handling of calls that fail."""

import asyncio
import json
import sys
import threading
import time
from concurrent import futures

import pytest

from m2po_jax.tasks import environments as env_lib
from m2po_jax.tasks.base import Example
from m2po_jax.tasks.environments import (
    STATUSES,
    Environment,
    StepResult,
    ToolEnv,
    env_factory_from_name,
    run_env,
)
from m2po_jax.tasks.tools import tool

EXAMPLE = Example("What is 2+3?", "5", 7)


def add(a: int, b: int) -> int:
    """Adds.

    Args:
        a: a summand.
        b: a summand.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divides.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def where() -> str:
    """The thread the call runs in."""
    return threading.current_thread().name


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_statuses_and_step_result():
    assert STATUSES == (
        "done",
        "max_turns",
        "max_tokens",
        "bad_tool_call",
        "tool_error",
        "tool_timeout",
        "env_error",
        "env_timeout",
        "prompt_too_long",
    )
    constants = ["DONE", "MAX_TURNS", "MAX_TOKENS", "BAD_TOOL_CALL", "TOOL_ERROR"]
    constants += ["TOOL_TIMEOUT", "ENV_ERROR", "ENV_TIMEOUT", "PROMPT_TOO_LONG"]
    assert tuple(getattr(env_lib, c) for c in constants) == STATUSES
    for status in (*STATUSES, None):
        assert StepResult([], status=status).status == status
    with pytest.raises(ValueError, match="StepResult.status: expected one of done, .* got 'ok'"):
        StepResult([], done=True, status="ok")
    assert StepResult([]).info == {} and StepResult([]).info is not StepResult([]).info


class Echo(Environment):
    def step(self, assistant_text):
        return StepResult([{"role": "user", "content": assistant_text.upper()}])


class AsyncEcho(Environment):
    async def reset(self, example):
        await asyncio.sleep(0)
        return [{"role": "user", "content": f"async {example.prompt}"}]

    async def step(self, assistant_text):
        await asyncio.sleep(0)
        return StepResult([], reward=1.0, done=True)


def test_environment_interface_sync_and_async():
    with pytest.raises(TypeError):
        Environment()  # step is abstract
    env = Echo()
    assert env.tools == ()
    assert run_env(env.reset, EXAMPLE) == [{"role": "user", "content": "What is 2+3?"}]
    assert run_env(env.step, "hi").messages == [{"role": "user", "content": "HI"}]
    env = AsyncEcho()
    assert run_env(env.reset, EXAMPLE) == [{"role": "user", "content": "async What is 2+3?"}]
    result = run_env(env.step, "x")
    assert isinstance(result, StepResult) and result.reward == 1.0 and result.done
    # From worker threads, as the episode driver calls environments.
    with futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_env(AsyncEcho().step, "x").done, range(4)))
    assert results == [True] * 4


def test_tool_env_runs_every_call_in_order():
    env = ToolEnv([add, tool(divide)], "hermes")
    assert [t.name for t in env.tools] == ["add", "divide"]
    result = env.step("Let me compute.\n" + call("divide", a=7, b=2) + "\n" + call("add", a=1, b=2))
    assert result.messages == [
        {"role": "tool", "name": "divide", "content": "3.5"},
        {"role": "tool", "name": "add", "content": "3"},
    ]
    assert not result.done and result.status is None and result.reward is None
    info = result.info
    assert (info["tool_calls"], info["tool_errors"], info["tool_timeouts"]) == (2, 0, 0)
    assert len(info["tool_latency_s"]) == 2 and all(0 <= t < 1 for t in info["tool_latency_s"])


def test_tool_env_ends_on_an_answer_or_a_bad_call():
    env = ToolEnv([add], "hermes")
    result = env.step("The answer is 5.")
    assert (result.messages, result.done, result.status, result.reward) == ([], True, "done", None)
    assert result.info["tool_calls"] == 0
    result = env.step("ok " + call("add", a=1, b=2)[: -len("</tool_call>")])
    assert (result.messages, result.done, result.status) == ([], True, "bad_tool_call")
    assert "not closed" in result.info["error"]
    llama = ToolEnv([add], "llama3_json")
    result = llama.step('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert result.messages == [{"role": "tool", "name": "add", "content": "5"}]


def test_tool_failures_are_answers_not_crashes():
    env = ToolEnv([add, divide], "hermes")
    text = (
        call("divide", a=1, b=0)  # raises inside the tool
        + call("nope", x=1)  # no such tool
        + call("add", a=1)  # missing argument
        + call("add", a=1, b="2")  # wrong type
        + call("add", a=2, b=2)  # fine
    )
    result = env.step(text)
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "error: ZeroDivisionError: division by zero"
    assert contents[1] == "error: ValueError: unknown tool 'nope' (tools: add, divide)"
    assert contents[2] == "error: ToolArgumentError: tool 'add': missing required argument 'b'"
    assert contents[3].startswith("error: ToolArgumentError: tool 'add': argument 'b' expected")
    assert contents[4] == "4"
    assert [m["name"] for m in result.messages] == ["divide", "nope", "add", "add", "add"]
    assert not result.done and result.status is None  # "reply": the model sees the errors
    assert (result.info["tool_calls"], result.info["tool_errors"]) == (5, 4)
    assert len(result.info["tool_latency_s"]) == 4  # the unknown tool never ran

    ended = ToolEnv([add, divide], "hermes", on_tool_error="end").step(text)
    assert ended.done and ended.status == "tool_error" and ended.messages == result.messages


def test_a_slow_tool_times_out_without_blocking_the_turn():
    release = threading.Event()

    def slow(x: int) -> str:
        """Sleeps up to 5 s.

        Args:
            x: ignored.
        """
        release.wait(5.0)
        return "late"

    try:
        for on_error, done, status in [("reply", False, None), ("end", True, "tool_timeout")]:
            env = ToolEnv([slow, add], "hermes", timeout_s=0.2, on_tool_error=on_error)
            start = time.perf_counter()
            result = env.step(call("slow", x=1) + call("add", a=1, b=1) + call("add", a=1))
            elapsed = time.perf_counter() - start
            assert elapsed < 2.0, elapsed
            assert [m["content"] for m in result.messages][:2] == [
                "error: timed out after 0.2s",
                "2",
            ]
            assert (result.done, result.status) == (done, status)  # a timeout wins over an error
            info = result.info
            assert (info["tool_calls"], info["tool_errors"], info["tool_timeouts"]) == (3, 1, 1)
            assert 0.15 < info["tool_latency_s"][0] < 2.0
    finally:
        release.set()  # let the abandoned threads finish


def test_calls_of_a_turn_run_concurrently_and_in_the_given_pool():
    barrier = threading.Barrier(2, timeout=3.0)

    def meet(n: int) -> str:
        """Waits for the other call.

        Args:
            n: which call.
        """
        barrier.wait()
        return f"met {n}"

    result = ToolEnv([meet], "hermes").step(call("meet", n=1) + call("meet", n=2))
    assert [m["content"] for m in result.messages] == ["met 1", "met 2"]
    pool = env_lib.WorkerPool(2, "shared-pool")
    env = ToolEnv([where], "hermes", pool=pool)
    result = env.step(call("where"))
    assert result.messages[0]["content"].startswith("shared-pool")
    assert env.step(call("where")).messages[0]["content"].startswith("shared-pool")
    pool.shutdown()
    with pytest.raises(TypeError, match="ToolEnv.pool: expected a WorkerPool or None, got Thread"):
        ToolEnv([where], "hermes", pool=futures.ThreadPoolExecutor(1))


def sleeps(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "slept"


def test_a_hung_tool_does_not_poison_a_shared_pool():
    # One thread, a 1 s call that times out at 0.2 s, then a fast call of another episode:
    # the stuck thread is replaced, so the fast call runs (it is not a "timeout").
    pool = env_lib.WorkerPool(1, "shared")
    first = ToolEnv([sleeps, add], "hermes", timeout_s=0.2, pool=pool)
    result = first.step(call("sleeps", seconds=1.0))
    assert result.messages[0]["content"] == "error: timed out after 0.2s"
    assert (result.info["tool_timeouts"], result.info["tool_abandoned"]) == (1, 1)
    assert (pool.abandoned, pool.stuck) == (1, 1)
    other = ToolEnv([sleeps, add], "hermes", timeout_s=0.2, pool=pool)
    answers = []  # stepped in a daemon thread: a pool without threads would wait forever
    waiter = threading.Thread(
        target=lambda: answers.append(other.step(call("add", a=1, b=2))), daemon=True
    )
    waiter.start()
    waiter.join(3.0)
    assert answers, "the fast call never ran: the pool has no thread left"
    result = answers[0]
    assert result.messages[0]["content"] == "3"
    assert (result.info["tool_timeouts"], result.info["tool_abandoned"]) == (0, 0)
    # Time queued behind a busy thread does not count: two 0.15 s calls through one thread
    # at a 0.2 s timeout both finish (the second starts 0.15 s after it was submitted).
    result = other.step(call("sleeps", seconds=0.15) + call("sleeps", seconds=0.15))
    assert [m["content"] for m in result.messages] == ["slept", "slept"]
    assert result.info["tool_timeouts"] == 0
    pool.shutdown()


def test_the_calls_of_a_turn_share_one_deadline():
    # Two hung calls in one turn (a thread each) time out together at timeout_s, not one
    # after the other (per-call timeouts would take 2 x timeout_s).
    env = ToolEnv([sleeps], "hermes", timeout_s=0.3)
    start = time.perf_counter()
    result = env.step(call("sleeps", seconds=1.0) + call("sleeps", seconds=1.0))
    elapsed = time.perf_counter() - start
    assert [m["content"] for m in result.messages] == ["error: timed out after 0.3s"] * 2
    assert 0.28 < elapsed < 0.5, elapsed


def test_worker_pool_abandons_only_running_calls():
    pool = env_lib.WorkerPool(1, "p")
    job = pool.submit(time.sleep, 0.0)
    assert pool.wait(job, 1.0) is None and not pool.abandon(job)  # ended: nothing to abandon
    failing = pool.submit(divide, 1, 0)
    with pytest.raises(ZeroDivisionError):
        pool.wait(failing, 1.0)
    assert pool.abandoned == 0
    with pytest.raises(ValueError, match="WorkerPool.workers: expected an int >= 1, got 0"):
        env_lib.WorkerPool(0)
    pool.shutdown()


class LoopBound(Environment):
    """Makes loop-bound objects in `reset` and uses them in `step`, as an HTTP client
    session or a queue would be."""

    async def reset(self, example):
        self.queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        await self.queue.put(example.prompt)
        return [{"role": "user", "content": example.prompt}]

    async def step(self, assistant_text):
        prompt = await asyncio.wait_for(self.queue.get(), 1.0)
        same = asyncio.get_running_loop() is self.loop
        return StepResult([], reward=float(same), done=True, info={"prompt": prompt})


def test_an_async_episode_keeps_its_loop_from_reset_to_step():
    loop = env_lib.EnvLoop()
    try:
        env = LoopBound()
        with futures.ThreadPoolExecutor(1) as pool:  # from another thread, as the driver
            pool.submit(run_env, env.reset, EXAMPLE, loop=loop).result()
            result = pool.submit(run_env, env.step, "x", loop=loop).result()
        assert result.reward == 1.0 and result.info["prompt"] == EXAMPLE.prompt
    finally:
        loop.close()
    assert loop.loop.is_closed()


def test_tool_env_validation():
    for kwargs, message in [
        ({"timeout_s": 0}, "ToolEnv.timeout_s: expected seconds > 0, got 0"),
        ({"timeout_s": -1.0}, "ToolEnv.timeout_s"),
        ({"timeout_s": True}, "ToolEnv.timeout_s"),
        ({"timeout_s": float("inf")}, "ToolEnv.timeout_s"),
        (
            {"on_tool_error": "crash"},
            "ToolEnv.on_tool_error: expected 'reply' or 'end', got 'crash'",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            ToolEnv([add], "hermes", **kwargs)
    with pytest.raises(ValueError, match="'xml': unknown; known: hermes, llama3_json"):
        ToolEnv([add], "xml")
    with pytest.raises(ValueError, match="tool name 'add' is given twice"):
        ToolEnv([add, tool(add)], "hermes")


def test_env_factory_from_name(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from m2po_jax.tasks.environments import Environment, StepResult, ToolEnv\n"
        "class Mine(Environment):\n"
        "    def step(self, text):\n"
        "        return StepResult([], done=True)\n"
        "class Abstract(Environment):\n"
        "    pass\n"
        "class NotEnv:\n"
        "    pass\n"
        "class NeedsArgs(Mine):\n"
        "    def __init__(self, x):\n"
        "        self.x = x\n"
        "def make():\n"
        "    return ToolEnv([], 'hermes')\n"
        "def wrong():\n"
        "    return 3\n"
        "def takes(x):\n"
        "    return Mine()\n"
        "VALUE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        factory = env_factory_from_name("my_envs:Mine")
        first, second = factory(), factory()
        assert type(first).__name__ == "Mine" and first is not second
        assert isinstance(env_factory_from_name("my_envs:make")(), ToolEnv)
        wrong = env_factory_from_name("my_envs:wrong")  # its return is checked when called
        with pytest.raises(TypeError, match="'my_envs:wrong': returned a int, not an Environment"):
            wrong()
        for name, message in [
            ("my_envs:NotEnv", "NotEnv is not a subclass of"),
            ("my_envs:Abstract", "Abstract is abstract"),
            ("my_envs:NeedsArgs", r"must be callable with no arguments, takes \(x\)"),
            ("my_envs:takes", r"must be callable with no arguments"),
            ("my_envs:VALUE", "expected an Environment subclass or a callable, got int"),
        ]:
            with pytest.raises(TypeError, match=f"agent.env '{name}': {message}"):
                env_factory_from_name(name)
        with pytest.raises(ValueError, match="agent.env 'my_envs:missing'.*no attribute"):
            env_factory_from_name("my_envs:missing")
        with pytest.raises(ValueError, match="agent.env: expected 'package.module:name'"):
            env_factory_from_name("my_envs.Mine")
    finally:
        sys.modules.pop("my_envs", None)
