"""The rollout engine interface, its records and the registry of engines.

`RolloutEngine.generate(params, prompts, valid, rng, n_samples=, version=, weights=)`
returns a `Generation`: the `sampling.SampleOutput` layout (rows b * n .. b * n + n - 1
answer prompt b; completions start at column P), the policy version of every generated
token, and what the decode loop spent. `stream` yields one `Generation` per batch
("unit"), in order; `episodes` runs multi-turn episodes where an engine supports them.
`programs` names the jitted programs an engine runs for a batch shape, with abstract
arguments, so that the compile-only dry run compiles exactly what a run would.

Every implementation registers under its `rollout.engine` name (`register`); the config's
choices and the trainer's `build_engine` read `ENGINES`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding
from m2po_jax.rollout import sampling

# (params, version) of the newest published weights, or None to keep the current ones.
WeightSource = Callable[[], "tuple[object, int] | None"]


@dataclasses.dataclass(frozen=True)
class Generation:
    """What an engine's `generate` returns.

    Attributes:
      out: the rollouts (device arrays), laid out as `sampling.SampleOutput`.
      version_BxN: int32 [B, max_new_tokens] host array, the policy version that produced
        each completion token (the call's `version` where nothing changed in flight, and
        after a row's end).
      decode_steps: decode-loop iterations (each advances every row or slot by a token).
      slot_steps: rows (static) or slots (continuous) times decode steps: the work done.
      live_steps: of those, the steps that produced a token of an unfinished sequence.
      weight_updates: new weights taken in flight.
      decode_steps_while_waiting: of `decode_steps`, those run while the host's answer to
        a held turn was pending (`episodes` on an engine that does not wait for it).
    """

    out: sampling.SampleOutput
    version_BxN: np.ndarray
    decode_steps: int
    slot_steps: int
    live_steps: int
    weight_updates: int = 0
    decode_steps_while_waiting: int = 0

    @property
    def idle_fraction(self) -> float:
        """The share of decode work spent on finished (or empty) rows (0 without any)."""
        return 1.0 - self.live_steps / self.slot_steps if self.slot_steps else 0.0


@dataclasses.dataclass(frozen=True)
class OutputOf:
    """An argument of an `EngineProgram` that is an earlier program's output (the caller
    compiles that one first and passes its output's abstract value)."""

    program: str


@dataclasses.dataclass(frozen=True)
class EngineProgram:
    """One of an engine's jitted programs, for compiling ahead of a run.

    Attributes:
      name: the program's name ("sampler", "engine_prefill", ...).
      what: one line on what it runs at these sizes.
      jitted: the `jax.jit` function the engine calls.
      args: its arguments: `jax.ShapeDtypeStruct`s with their shardings, or `OutputOf`
        an earlier program of the list.
    """

    name: str
    what: str
    jitted: Any
    args: tuple


class RolloutEngine(abc.ABC):
    """Generates `n_samples` completions per left-padded prompt (see the module doc).

    Args:
      model_config, sampling_config: as for `sampling.generate`.
      mesh: the device mesh the engine's programs run on (None = one device).
    """

    name: str  # set by `register`
    multi_turn = False  # runs `episodes`

    def __init__(
        self,
        model_config: model_config_lib.ModelConfig,
        sampling_config,
        *,
        mesh: jax.sharding.Mesh | None = None,
    ):
        if not isinstance(sampling_config, sampling.SamplingConfig):
            raise TypeError(
                f"sampling: expected a SamplingConfig, got {type(sampling_config).__name__}"
            )
        self.model_config = model_config
        self.sampling = sampling_config
        self.mesh = mesh

    @classmethod
    def from_config(
        cls, rollout, model_config, sampling_config, mesh, kv_budget: int = 0
    ) -> RolloutEngine:
        """The engine of a run's `rollout` config section (`Config.rollout`). `kv_budget`:
        bytes per device the engine's KV may take where its size is not set (the paged
        engine's default pool); 0 = no cap. Engines whose KV is fixed by their slots ignore
        it."""
        return cls(model_config, sampling_config, mesh=mesh)

    @abc.abstractmethod
    def generate(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng: jax.Array,
        *,
        n_samples: int = 1,
        version: int = 0,
        weights: WeightSource | None = None,
    ) -> Generation:
        """Samples the batch with `params` (policy `version`); `weights`, polled between
        decode calls where the engine supports it, gives newer weights in flight."""

    def stream(
        self,
        params,
        units: Iterable,
        *,
        n_samples: int = 1,
        version: int = 0,
        weights: WeightSource | None = None,
    ) -> Iterator[Generation]:
        """Generates several batches ("units": (prompt_tokens_QxP, prompt_valid_QxP, rng)
        each) and yields each one's `Generation`, in order; each unit keyed by its own rng
        as `generate` keys a batch. Here: one `generate` per unit."""
        for tokens, valid, rng in units:
            yield self.generate(
                params, tokens, valid, rng, n_samples=n_samples, version=version, weights=weights
            )

    def episodes(self, params, prompt_tokens_BxP, prompt_valid_BxP, rng, on_turns, **kwargs):
        """Multi-turn episodes (`ContinuousEngine.episodes`, `PagedEngine.episodes`);
        ValueError where the engine has none."""
        raise self._no_episodes()

    def _no_episodes(self) -> ValueError:
        turns = [n for n, c in ENGINES.items() if c.multi_turn]
        return ValueError(
            f"rollout.engine={self.name!r} runs no multi-turn episodes (agent.env); "
            f"engines that do: {', '.join(turns)}"
        )

    @abc.abstractmethod
    def programs(
        self, params, prompts: int, n_samples: int, *, prompt_len: int, max_append: int = 0
    ) -> list[EngineProgram]:
        """The jitted programs `generate` (with `max_append` > 0: `episodes` with appends
        of up to that many tokens) runs for `prompts` prompts of `prompt_len` columns, in
        the order they run, with abstract arguments on the engine's mesh. `params`: the
        params' abstract values (their shardings included)."""

    def _batch(self, dtype, *dims) -> jax.ShapeDtypeStruct:
        """An abstract batch array [rows, ...], rows split over the mesh's batch axes."""
        spec = None if self.mesh is None else sharding.batch_sharding(self.mesh, len(dims))
        return jax.ShapeDtypeStruct(dims, dtype, sharding=spec)

    def _replicated(self, dtype, *dims) -> jax.ShapeDtypeStruct:
        """An abstract array replicated over the mesh."""
        spec = None if self.mesh is None else sharding.replicated(self.mesh)
        return jax.ShapeDtypeStruct(dims, dtype, sharding=spec)


def typed_key(rng) -> jax.Array:
    """A typed PRNG key (raw uint32 key data is wrapped)."""
    if not jax.dtypes.issubdtype(jax.numpy.asarray(rng).dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(rng)
    return rng


ENGINES: dict[str, type[RolloutEngine]] = {}


def register(name: str):
    """A class decorator: the engine of `rollout.engine=name`."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register: an engine name is a non-empty string but 'auto', got {name!r}")

    def add(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise ValueError(f"register {name!r}: {cls!r} is not a RolloutEngine")
        cls.name = name
        ENGINES[name] = cls
        return cls

    return add


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine registered as `name`; ValueError listing the known ones."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r}: unknown; known: {', '.join(ENGINES)}")
    return ENGINES[name]
