"""Environments of multi-turn episodes, and the default one: tools the model calls.

    env = ToolEnv(load_tools(["my_pkg.tools:search"]), "hermes", timeout_s=5.0)
    messages = env.reset(example)        # the messages that open the episode
    result = env.step(assistant_text)    # StepResult: tool messages, or done

The shape is Tunix's `BaseEnv` / TRL's environments: `reset` opens an episode, `step`
answers one assistant turn with messages to append (or ends the episode). One instance
serves one episode. Either method may be `async def`: the episode driver runs every async
call of every episode on one long-lived event loop (`EnvLoop`), so an episode's `reset` and
`step`s share a loop (loop-bound objects made in `reset` work in `step`) and many episodes'
steps overlap without a thread each; plain methods run on the driver's worker threads.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

from m2po_jax.common.workers import WorkerPool
from m2po_jax.tasks.base import Example, import_by_name
from m2po_jax.tasks.tool_calls import MalformedToolCall, parse_tool_calls, parser
from m2po_jax.tasks.tools import Tool, call_tool, tool

# How an episode ended.
DONE = "done"  # the environment ended it (ToolEnv: a turn without a tool call)
MAX_TURNS = "max_turns"  # still calling tools after the last allowed turn
MAX_TOKENS = "max_tokens"  # the completion budget ran out, or an answer did not fit
BAD_TOOL_CALL = "bad_tool_call"  # a tool call that could not be read
TOOL_ERROR = "tool_error"  # a tool failed (ToolEnv with on_tool_error="end")
TOOL_TIMEOUT = "tool_timeout"  # a tool timed out (ToolEnv with on_tool_error="end")
ENV_ERROR = "env_error"  # the environment raised
ENV_TIMEOUT = "env_timeout"  # a reset or step ran past the driver's bound (agent.step_timeout_s)
PROMPT_TOO_LONG = "prompt_too_long"  # not run: its prompt is over task.max_prompt_len ("filter")
STATUSES = (
    DONE,
    MAX_TURNS,
    MAX_TOKENS,
    BAD_TOOL_CALL,
    TOOL_ERROR,
    TOOL_TIMEOUT,
    ENV_ERROR,
    ENV_TIMEOUT,
    PROMPT_TOO_LONG,
)


@dataclasses.dataclass
class StepResult:
    """An environment's answer to one assistant turn.

    messages: what to append (e.g. {"role": "tool", ...}); unused when `done`.
    reward: the episode's reward, when the environment scores it (else the task's reward
      of the final assistant turn).
    done: the episode ends here; `status` says why (one of `STATUSES`, "done" if None).
    info: counters for the episode's metrics (ToolEnv: tool_calls, tool_errors,
      tool_timeouts, tool_latency_s).
    """

    messages: list[dict]
    reward: float | None = None
    done: bool = False
    status: str | None = None
    info: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status is not None and self.status not in STATUSES:
            raise ValueError(
                f"StepResult.status: expected one of {', '.join(STATUSES)} or None, "
                f"got {self.status!r}"
            )


class Environment(abc.ABC):
    """One episode's environment. `tools` are listed in the prompt (their schemas go to
    the chat template); `reset` and `step` may be plain or `async def`."""

    tools: Sequence[Tool] = ()

    def reset(self, example: Example) -> list[dict]:
        """The messages that open the episode: by default the problem as a user message."""
        return [{"role": "user", "content": example.prompt}]

    @abc.abstractmethod
    def step(self, assistant_text: str) -> StepResult:
        """The answer to an assistant turn (its decoded text, end-of-turn token excluded)."""


class EnvLoop:
    """One event loop running on a daemon thread, for the async methods of environments:
    `run(awaitable)` waits for it on the loop from any thread, `submit` returns a
    `concurrent.futures.Future`. `close()` stops the loop (pending calls are cancelled)."""

    def __init__(self, name: str = "m2po-env-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, awaitable) -> futures.Future:
        if self.loop.is_closed():
            raise RuntimeError("EnvLoop: the loop is closed")
        return asyncio.run_coroutine_threadsafe(_wait(awaitable), self.loop)

    def run(self, awaitable, timeout_s: float | None = None):
        """The awaitable's result; TimeoutError (the call cancelled) past `timeout_s`."""
        job = self.submit(awaitable)
        try:
            return job.result(timeout_s)
        except futures.TimeoutError:
            job.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all():
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        if not self.loop.is_running():
            self.loop.close()


def run_env(fn: Callable, *args, loop: EnvLoop | None = None):
    """`fn(*args)`, run to completion when it returns an awaitable (an `async def`
    method): on `loop` (the episode driver's: one loop for all episodes), or without one
    with `asyncio.run` in the calling thread, which must have no running loop."""
    result = fn(*args)
    if inspect.isawaitable(result):
        if loop is not None:
            return loop.run(result)
        return asyncio.run(_wait(result))
    return result


async def _wait(awaitable):
    return await awaitable


def _run_one(t: Tool, arguments: dict) -> tuple[str, bool, float]:
    """(the tool message's content, whether it failed, seconds) of one call."""
    start = time.perf_counter()
    try:
        content, failed = call_tool(t, arguments), False
    except BaseException as e:  # noqa: BLE001 (in a worker thread: any failure is the answer)
        content, failed = _error_text(e), True
    return content, failed, time.perf_counter() - start


def _error_text(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {e}"


class ToolEnv(Environment):
    """Runs the tool calls of each assistant turn and answers with their results.

    A turn without a call ends the episode ("done", no reward: the task scores the final
    answer); a call the format cannot read ends it as "bad_tool_call" (`info["error"]`).
    Otherwise every call runs in `pool` (a `WorkerPool`; or a private thread per call) and
    the answer is one message per call, in order: {"role": "tool", "name": ..., "content":
    result}. An unknown tool, arguments that do not fit its schema, or an exception of the
    tool answer "error: <Type>: <message>" (a tool error). `timeout_s` is per turn: the
    calls of a turn share one deadline, `timeout_s` after they were submitted; a call that
    waited in a busy pool's queue gets `timeout_s` from its own start instead (waiting does
    not count). A call still running then answers "error: timed out after <t>s" (a
    timeout). A thread cannot be stopped: the timed-out call runs on to its end in its
    thread, which leaves the pool (a fresh thread replaces it; `info["tool_abandoned"]`
    counts them, `WorkerPool.stuck` those still running), so tools that wait on I/O should
    carry their own timeouts too. `pool` must not be the pool the steps themselves run in.

    Args:
      tools: the tools (functions are made into tools with `tools.tool`).
      family: the tool-call format (`tool_calls.PARSERS`), e.g. "hermes".
      timeout_s: seconds the calls of one turn may take.
      on_tool_error: "reply" (the model sees the error and goes on) or "end" (a turn with
        an error or timeout ends the episode as "tool_error" / "tool_timeout"; a timeout
        wins when both happen).
      pool: the `WorkerPool` for the calls (shared by episodes); None: a thread per call.
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable],
        family: str,
        *,
        timeout_s: float = 10.0,
        on_tool_error: str = "reply",
        pool: WorkerPool | None = None,
    ):
        self.tools = [tool(t) for t in tools]
        self._by_name: dict[str, Tool] = {}
        for t in self.tools:
            if t.name in self._by_name:
                raise ValueError(f"ToolEnv.tools: tool name {t.name!r} is given twice")
            self._by_name[t.name] = t
        parser(family)  # an unknown family fails here, not at the first step
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(f"ToolEnv.timeout_s: expected seconds > 0, got {timeout_s!r}")
        if on_tool_error not in ("reply", "end"):
            raise ValueError(
                f"ToolEnv.on_tool_error: expected 'reply' or 'end', got {on_tool_error!r}"
            )
        if pool is not None and not isinstance(pool, WorkerPool):
            raise TypeError(
                f"ToolEnv.pool: expected a WorkerPool or None, got {type(pool).__name__}"
            )
        self.family = family
        self.timeout_s = float(timeout_s)
        self.on_tool_error = on_tool_error
        self.pool = pool

    def step(self, assistant_text: str) -> StepResult:
        info = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_abandoned": 0}
        info["tool_latency_s"] = []
        try:
            _, calls = parse_tool_calls(self.family, assistant_text)
        except MalformedToolCall as e:
            return StepResult([], done=True, status=BAD_TOOL_CALL, info={**info, "error": str(e)})
        if not calls:
            return StepResult([], done=True, status=DONE, info=info)
        info["tool_calls"] = len(calls)
        known = [c for c in calls if c.name in self._by_name]
        pool = self.pool or WorkerPool(max(len(known), 1), "m2po-tool-turn")
        messages = []
        try:
            start = time.perf_counter()
            deadline = start + self.timeout_s
            jobs = [
                pool.submit(_run_one, self._by_name[c.name], c.arguments)
                if c.name in self._by_name
                else None
                for c in calls
            ]
            for call, job in zip(calls, jobs, strict=True):
                if job is None:
                    names = ", ".join(self._by_name) or "none"
                    content = _error_text(
                        ValueError(f"unknown tool {call.name!r} (tools: {names})")
                    )
                    info["tool_errors"] += 1
                else:
                    try:
                        content, failed, seconds = pool.wait(job, self.timeout_s, deadline)
                        info["tool_errors"] += failed
                    except TimeoutError:
                        content = f"error: timed out after {self.timeout_s:g}s"
                        seconds = time.perf_counter() - job.started_at
                        info["tool_timeouts"] += 1
                        info["tool_abandoned"] += 1
                    info["tool_latency_s"].append(seconds)
                messages.append({"role": "tool", "name": call.name, "content": content})
        finally:
            if pool is not self.pool:
                pool.shutdown()
        if self.on_tool_error == "end" and (info["tool_timeouts"] or info["tool_errors"]):
            status = TOOL_TIMEOUT if info["tool_timeouts"] else TOOL_ERROR
            return StepResult(messages, done=True, status=status, info=info)
        return StepResult(messages, info=info)


def env_factory_from_name(name: str) -> Callable[[], Environment]:
    """A new-environment-per-call factory from "package.module:Class" (an `Environment`
    subclass) or "package.module:make_env" (a callable of no arguments returning one).
    ValueError on a bad name; TypeError when the target cannot make environments (a
    callable's return is checked at each call)."""
    target = import_by_name(name, "agent.env")
    if isinstance(target, type):
        if not issubclass(target, Environment):
            raise TypeError(
                f"agent.env {name!r}: {target.__name__} is not a subclass of "
                "m2po_jax.tasks.environments.Environment"
            )
        if inspect.isabstract(target):
            raise TypeError(f"agent.env {name!r}: {target.__name__} is abstract (define step)")
    elif not callable(target):
        raise TypeError(
            f"agent.env {name!r}: expected an Environment subclass or a callable, got "
            f"{type(target).__name__}"
        )
    try:
        signature = inspect.signature(target)
    except ValueError:  # no signature to read (a builtin): checked when called
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            raise TypeError(
                f"agent.env {name!r}: must be callable with no arguments, takes {signature}"
            ) from None

    def factory() -> Environment:
        env = target()
        if not isinstance(env, Environment):
            raise TypeError(
                f"agent.env {name!r}: returned a {type(env).__name__}, not an Environment"
            )
        return env

    return factory
