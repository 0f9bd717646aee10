"""Rollout engines: one interface, the static sampler and a continuous-batching engine.

`RolloutEngine.generate(params, prompts, valid, rng, n_samples=, version=, weights=)`
returns a `Generation`: the `sampling.SampleOutput` layout (rows b * n .. b * n + n - 1
answer prompt b; completions start at column P), the policy version of every generated
token, and what the decode loop spent.

- `StaticEngine` is `sampling.generate`: one batch decoded until its longest row stops.
- `ContinuousEngine` keeps a fixed number of decode slots, each with its own position,
  stop state and KV-cache row (JetStream's prefill / insert / generate). Every prompt is
  prefilled once; its `n_samples` sequences are inserted into slots as slots free up,
  and one decode step advances every live slot by a token. A slot whose sequence stops
  takes the next queued sequence at the next step, so no slot waits for the longest
  completion. The whole loop (insert, decode, write the finished tokens into the output
  rows) runs inside one `lax.while_loop`; the host calls it once per batch, or once per
  `chunk_steps` decode steps when it takes new weights in flight (`weights=`): the
  sequences in flight then continue under the new weights, each token records the
  version that produced it, and the queued prompts are prefilled again.

`ContinuousEngine.stream` runs several batches ("units") through the same slots and yields
each as soon as its last sequence ends: the next batch's sequences fill the slots the
previous one's short completions free.

Sampling keys: the continuous engine draws row j's token t with
`fold_in(fold_in(rng, j), t)` (rng: its batch's key), whatever slot it runs in and
whichever batches stream with it, so the same key gives the same tokens for a fixed prompt
order (not the static sampler's tokens: it draws one key per column for the whole batch).
Greedy decoding gives the static sampler's completions.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config as model_config_lib
from m2po_jax.parallel import sharding
from m2po_jax.rollout import sampling

ENGINES = ("static", "continuous")

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
    """

    out: sampling.SampleOutput
    version_BxN: np.ndarray
    decode_steps: int
    slot_steps: int
    live_steps: int
    weight_updates: int = 0

    @property
    def idle_fraction(self) -> float:
        """The share of decode work spent on finished (or empty) rows (0 without any)."""
        return 1.0 - self.live_steps / self.slot_steps if self.slot_steps else 0.0


class RolloutEngine(abc.ABC):
    """Generates `n_samples` completions per left-padded prompt (see the module doc)."""

    name: str

    def __init__(self, model_config: model_config_lib.ModelConfig, sampling_config):
        if not isinstance(sampling_config, sampling.SamplingConfig):
            raise TypeError(
                f"sampling: expected a SamplingConfig, got {type(sampling_config).__name__}"
            )
        self.model_config = model_config
        self.sampling = sampling_config

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


class StaticEngine(RolloutEngine):
    """`sampling.generate`: every row decodes until the batch's longest completion ends.
    It takes no weights in flight (`weights` is ignored)."""

    name = "static"

    def generate(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        *,
        n_samples=1,
        version=0,
        weights=None,
    ) -> Generation:
        out = sampling.generate(
            params,
            self.model_config,
            prompt_tokens_BxP,
            prompt_valid_BxP,
            rng,
            self.sampling,
            n_samples=n_samples,
        )
        rows, new = out.tokens_BxT.shape[0], self.sampling.max_new_tokens
        completion_len_B, steps = jax.device_get((out.completion_len_B, out.num_steps))
        # Step 0 is the prefill's token; decode steps 1 .. num_steps - 1 run every row.
        decode = int(steps) - 1
        return Generation(
            out=out,
            version_BxN=np.full((rows, new), version, np.int32),
            decode_steps=decode,
            slot_steps=decode * rows,
            live_steps=int(np.sum(np.asarray(completion_len_B) - 1)),
        )


@flax.struct.dataclass
class _Prefixes:
    """The queued prompts' prefill: keys / values of their P columns, validity, and the
    next-token logits at their last column (each sample's first token is drawn there)."""

    k: tuple[jax.Array, ...]  # per layer [Q, K, P, D]
    v: tuple[jax.Array, ...]
    valid_QxP: jax.Array
    logits_QxV: jax.Array
    prompt_len_Q: jax.Array
    version: jax.Array  # int32 scalar: the weights' version


@flax.struct.dataclass
class _Slots:
    """The decode slots and the output rows (J = prompts * n_samples sequences)."""

    cache: model_lib.KVCache  # [S, K, P + N, D] per layer
    job_S: jax.Array  # int32: sequence in each slot (J = none)
    step_S: jax.Array  # int32: completion tokens the slot's sequence has
    last_token_S: jax.Array
    prompt_len_S: jax.Array
    live_S: jax.Array  # bool: the slot's sequence is still generating
    held_S: jax.Array  # bool: the slot's episode ended a turn and waits for the host (turns)
    next_job_1: jax.Array  # int32 [1]: the next sequence to start (of this device's)
    unit_J: jax.Array  # int32: the unit (batch of a stream) of each sequence: its key
    seq_id_J: jax.Array  # int32: each sequence's id within its unit (the key's fold)
    tokens_JxN: jax.Array
    logp_JxN: jax.Array
    valid_JxN: jax.Array
    sampled_JxN: jax.Array  # bool: drawn by the policy (not appended by the host)
    version_JxN: jax.Array
    stopped_J: jax.Array
    done_J: jax.Array
    decode_steps_1: jax.Array  # int32 [1]: loop counters (one per device when sharded)
    live_steps_1: jax.Array


class ContinuousEngine(RolloutEngine):
    """Continuous batching over `slots` decode slots (see the module doc).

    Args:
      model_config, sampling_config: as for `sampling.generate`.
      slots: decode slots (KV-cache rows) of each engine; 0 = one per row it generates.
      insert_lanes: sequences that may start per decode step (0 = max(slots // 4, 1));
        every slot is filled at once at the start.
      chunk_steps: decode steps per call when `weights` is given (between calls the engine
        polls it); a batch without `weights` runs in one call.
      mesh: a device mesh to run one engine per batch shard over its rows (the rows split
        over the mesh's "data" and "fsdp" axes, as the trainer's batches are; devices
        along "tensor" run the same engine; the params are replicated); None = one device.
    """

    name = "continuous"

    def __init__(
        self,
        model_config,
        sampling_config,
        *,
        slots: int = 0,
        insert_lanes: int = 0,
        chunk_steps: int = 32,
        mesh: jax.sharding.Mesh | None = None,
    ):
        super().__init__(model_config, sampling_config)
        for name, value, low in (("slots", slots, 0), ("insert_lanes", insert_lanes, 0)):
            if int(value) < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if int(chunk_steps) < 1:
            raise ValueError(f"chunk_steps: must be >= 1, got {chunk_steps}")
        self.slots, self.insert_lanes, self.chunk_steps = int(slots), int(insert_lanes), chunk_steps
        self.mesh = mesh
        self._programs: dict = {}

    @property
    def shards(self) -> int:
        """Engines that run side by side: one per batch shard of the mesh."""
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in row_axes(self.mesh)]))

    def sizes(self, rows: int) -> tuple[int, int]:
        """(slots, insert lanes) per device for a batch of `rows` rows."""
        shards = self.shards
        if rows % shards:
            raise ValueError(
                f"rollout engine: {rows} rows must divide over the mesh's {shards} batch shards"
            )
        per = self.slots or rows // shards
        lanes = min(self.insert_lanes or max(per // 4, 1), per)
        return per, lanes

    def generate(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        *,
        n_samples=1,
        version=0,
        weights=None,
    ) -> Generation:
        sampling.check_inputs(
            self.model_config, self.sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples
        )
        keys_U = _typed(rng)[None]
        prompts = np.shape(prompt_tokens_BxP)[0]
        slots, lanes = self.sizes(prompts * n_samples)
        programs = self._compiled(n_samples, slots, lanes)
        version_ = jnp.int32(version)
        prefixes = programs["prefill"](params, prompt_tokens_BxP, prompt_valid_BxP, version_)
        # One unit: sequence ids are the rows' indices in the batch.
        rows = np.arange(prompts * n_samples, dtype=np.int32)
        ids = self._put(rows, rows.size)
        state = programs["start"](prefixes, keys_U, ids * 0, ids)
        updates = 0
        if weights is None:
            state = programs["run"](params, state, prefixes, keys_U, np.int32(2**30))
        else:
            while True:
                state = programs["run"](params, state, prefixes, keys_U, np.int32(self.chunk_steps))
                if bool(_host(programs["finished"](state))):
                    break
                newer = weights()
                if newer is not None and int(newer[1]) != int(version):
                    params, version = newer
                    updates += 1
                    # The queued prompts start from the new weights' prefill; the sequences
                    # in flight keep their cache and go on under the new weights.
                    prefixes = programs["prefill"](
                        params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version)
                    )
        return _generation(programs, state, prompt_tokens_BxP, prompt_valid_BxP, slots, updates)

    def _put(self, host_R, rows: int):
        """A host array split by rows over the batch shards (as the prompts are)."""
        if self.mesh is None:
            return jnp.asarray(host_R)
        spec = jax.sharding.PartitionSpec(row_axes(self.mesh))
        return jax.device_put(host_R, jax.sharding.NamedSharding(self.mesh, spec))

    def stream(
        self,
        params,
        units,
        *,
        n_samples: int = 1,
        version: int = 0,
        weights: WeightSource | None = None,
    ):
        """Generates several batches ("units") through the same slots and yields each one's
        `Generation` as soon as its last sequence ends, in order: the slots a batch's
        short completions free take the next batch's sequences while its long ones finish.

        `units`: (prompt_tokens_QxP, prompt_valid_QxP, rng) host arrays and keys, one per
        batch, all of one shape. Each unit's sequences are keyed by its own rng exactly as
        `generate` keys a batch, so with the same params a unit gets the tokens `generate`
        gives it alone. The engine polls `weights` between decode calls of `chunk_steps`
        steps. Single-process meshes only (the rollout side of an async run).
        """
        tokens_U, valid_U, keys = zip(*units, strict=True)
        for tokens, valid in zip(tokens_U, valid_U, strict=True):
            sampling.check_inputs(self.model_config, self.sampling, tokens, valid, n_samples)
        count, prompts = len(units), np.shape(tokens_U[0])[0]
        shards = self.shards
        slots, lanes = self.sizes(prompts * n_samples)  # slots=0: one per row of a unit
        programs = self._compiled(n_samples, slots, lanes)
        # Shard-major layout: shard d holds its share of every unit, unit after unit.
        share = prompts // shards
        order = np.asarray(
            [
                u * prompts + d * share + i
                for d in range(shards)
                for u in range(count)
                for i in range(share)
            ]
        )
        tokens = self._put(np.concatenate(tokens_U)[order], order.size)
        valid = self._put(np.concatenate(valid_U)[order], order.size)
        per = share * n_samples  # a unit's sequences on one shard
        unit_J = np.tile(np.repeat(np.arange(count, dtype=np.int32), per), shards)
        seq_id_J = np.arange(shards)[:, None, None] * per + np.arange(per)[None, None, :]
        seq_id_J = np.broadcast_to(seq_id_J, (shards, count, per)).reshape(-1).astype(np.int32)
        keys_U = jnp.stack([_typed(k) for k in keys])
        prefixes = programs["prefill"](params, tokens, valid, jnp.int32(version))
        state = programs["start"](
            prefixes, keys_U, self._put(unit_J, unit_J.size), self._put(seq_id_J, unit_J.size)
        )
        emitted, updates, steps_before = 0, 0, np.zeros(shards)
        while emitted < count:
            state = programs["run"](params, state, prefixes, keys_U, np.int32(self.chunk_steps))
            done = np.asarray(_host(state.done_J)).reshape(shards, count, per)
            ready = emitted
            while ready < count and done[:, ready].all():
                ready += 1
            if ready > emitted:
                fields = _host(
                    (
                        state.tokens_JxN,
                        state.logp_JxN,
                        state.valid_JxN,
                        state.version_JxN,
                        state.stopped_J,
                        state.decode_steps_1,
                    )
                )
                by_unit = [np.asarray(f).reshape(shards, count, per, -1) for f in fields[:5]]
                steps = np.asarray(fields[5], np.float64)
                for u in range(emitted, ready):
                    rows = [f[:, u].reshape(shards * per, -1) for f in by_unit]
                    yield _unit_generation(
                        tokens_U[u],
                        valid_U[u],
                        rows,
                        n_samples,
                        slot_steps=int(np.sum(steps - steps_before)) * slots,
                        decode_steps=int(np.max(steps - steps_before)),
                        updates=updates,
                    )
                    steps_before, updates = steps, 0
                emitted = ready
            elif bool(_host(programs["finished"](state))):
                raise RuntimeError("rollout engine: every sequence ended but a unit is not done")
            newer = None if weights is None or emitted == count else weights()
            if newer is not None and int(newer[1]) != int(version):
                params, version = newer
                updates += 1
                prefixes = programs["prefill"](params, tokens, valid, jnp.int32(version))

    def _compiled(self, n_samples: int, slots: int, lanes: int, extra: int = 0) -> dict:
        """The engine's jitted programs for these sizes (built once, reused)."""
        key = (n_samples, slots, lanes, extra)
        if key not in self._programs:
            self._programs[key] = _programs(
                self.model_config, self.sampling, n_samples, slots, lanes, self.mesh, extra
            )
        return self._programs[key]

    def episodes(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        on_turns: Callable[[list[Turn]], list[list[int] | None]],
        *,
        n_samples: int = 1,
        version: int = 0,
        weights: WeightSource | None = None,
        max_append: int = 256,
    ) -> Generation:
        """Multi-turn episodes: `generate` where a sequence's stop token ends a turn, not
        the sequence (token in, token out: the host never re-renders the history).

        A slot whose turn ends (a stop token, or the completion budget) is held; the
        engine hands the held turns to `on_turns`, which answers each with the token ids
        to append (a tool's answer and the next turn's header: the slot resumes, its cache
        extended by one prefill of those tokens) or None (the episode ends; its slot takes
        the next queued sequence). Other slots wait meanwhile. Appended tokens are
        completion tokens with validity but no loss mask (`completion_mask_BxT` marks
        the sampled ones) and version -1. An append must fit the turn's `room`.
        `max_append`: the most tokens one append may add (cache columns kept free).
        """
        if self.mesh is not None and not all(
            d.process_index == jax.process_index() for d in self.mesh.devices.flat
        ):
            raise ValueError(
                "rollout engine: multi-turn episodes run on this process's devices (the "
                "engine's mesh spans several processes)"
            )
        if int(max_append) < 1:
            raise ValueError(f"max_append: must be >= 1, got {max_append}")
        sampling.check_inputs(
            self.model_config, self.sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples
        )
        keys_U = _typed(rng)[None]
        prompts = np.shape(prompt_tokens_BxP)[0]
        jobs = prompts * n_samples
        slots = self.slots * self.shards or jobs  # one program over every slot, on a mesh too
        lanes = min(self.insert_lanes or max(slots // 4, 1), slots)
        extra = int(max_append)
        programs = self._compiled(n_samples, slots, lanes, extra)
        prefixes = programs["prefill"](
            params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version)
        )
        ids = jnp.arange(jobs, dtype=jnp.int32)
        state = programs["start"](prefixes, keys_U, ids * 0, ids)
        turn_start = np.zeros(jobs, np.int64)  # where each sequence's current turn began
        steps = np.int32(self.chunk_steps if weights is not None else 2**30)
        updates = 0
        while True:
            state = programs["run"](params, state, prefixes, keys_U, steps)
            held_S, job_S, step_S = _host((state.held_S, state.job_S, state.step_S))
            slot_H = np.flatnonzero(np.asarray(held_S))
            if slot_H.size:
                turns = self._held_turns(state, slot_H, job_S, step_S, turn_start, extra)
                answers = list(on_turns(turns))
                state = self._answer(
                    programs, params, prefixes.version, state, keys_U, slot_H, turns, answers, extra
                )
                for t, delta in zip(turns, answers, strict=True):
                    if delta is not None:  # the next turn starts after the appended tokens
                        turn_start[t.row] = t.start + len(t.tokens) + len(delta)
            elif bool(_host(programs["finished"](state))):
                break
            newer = None if weights is None else weights()
            if newer is not None and int(newer[1]) != int(version):
                params, version = newer
                updates += 1
                prefixes = programs["prefill"](
                    params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version)
                )
        return _generation(programs, state, prompt_tokens_BxP, prompt_valid_BxP, slots, updates)

    def _held_turns(self, state, slot_H, job_S, step_S, turn_start, extra) -> list[Turn]:
        """The turns that ended in the held slots `slot_H`."""
        tokens_JxN = np.asarray(_host(state.tokens_JxN))
        stop_ids = set(self.sampling.stop_token_ids)
        new = self.sampling.max_new_tokens
        turns = []
        for slot in slot_H:
            row, step = int(job_S[slot]), int(step_S[slot])
            start = int(turn_start[row])
            turns.append(
                Turn(
                    row=row,
                    tokens=tokens_JxN[row, start:step].tolist(),
                    cut=int(tokens_JxN[row, step - 1]) not in stop_ids,
                    room=max(0, min(new - step - 1, extra)),
                    start=start,
                )
            )
        return turns

    def _answer(self, programs, params, version, state, keys_U, slot_H, turns, answers, extra):
        """Ends the held slots answered None and appends the others' tokens (the next
        turn's first token drawn under `version`, the weights' policy version)."""
        if len(answers) != len(turns):
            raise ValueError(f"on_turns: expected {len(turns)} answers, got {len(answers)}")
        slots = state.job_S.shape[0]
        ends, goes = [], []
        for slot, turn, delta in zip(slot_H, turns, answers, strict=True):
            if delta is None:
                ends.append((slot, turn))
            elif not 1 <= len(delta) <= turn.room:
                raise ValueError(
                    f"on_turns: row {turn.row} appends {len(delta)} tokens; its room is "
                    f"1..{turn.room}"
                )
            else:
                goes.append((slot, list(delta)))
        if ends:
            slot_L = _lanes([slot for slot, _ in ends], slots)
            stopped_L = np.zeros(slot_L.size, bool)
            stopped_L[: len(ends)] = [not turn.cut for _, turn in ends]
            state = programs["release"](state, slot_L, stopped_L)
        if goes:
            slot_L = _lanes([slot for slot, _ in goes], slots)
            width = _bucket(max(len(delta) for _, delta in goes), extra)
            delta_LxM = np.full((slot_L.size, width), self.sampling.pad_id, np.int32)
            len_L = np.zeros(slot_L.size, np.int32)
            for i, (_, delta) in enumerate(goes):
                delta_LxM[i, : len(delta)] = delta
                len_L[i] = len(delta)
            state = programs["append"](params, state, keys_U, slot_L, delta_LxM, len_L, version)
        return state


def _generation(programs, state, tokens_QxP, valid_QxP, slots: int, updates: int) -> Generation:
    """The finished state's `Generation` (its rows and decode counters)."""
    out, version_BxN, counters = programs["finish"](state, tokens_QxP, valid_QxP)
    version_BxN, (decode_steps, live_steps) = _host((version_BxN, counters))
    return Generation(
        out=out,
        version_BxN=np.asarray(version_BxN, np.int32),
        decode_steps=int(np.max(decode_steps)),
        slot_steps=int(np.sum(decode_steps)) * slots,
        live_steps=int(np.sum(live_steps)),
        weight_updates=updates,
    )


@dataclasses.dataclass(frozen=True)
class Turn:
    """A turn that ended in a held slot (`ContinuousEngine.episodes`).

    Attributes:
      row: the sequence's output row (prompt b's samples are rows b * n .. b * n + n - 1).
      tokens: the turn's tokens, its stop token included when it has one.
      cut: the turn ended at the completion budget, not at a stop token.
      room: the most tokens an append may add (the budget left for them and one drawn
        token, within `max_append`); 0 = none fit.
    """

    row: int
    tokens: list[int]
    cut: bool
    room: int
    start: int = 0  # the turn's first token's index in the row's completion


def _lanes(slots: list[int], count: int) -> np.ndarray:
    """Slot indices padded with `count` (unused) to a power of two (few compiled shapes)."""
    size = min(1 << max(len(slots) - 1, 0).bit_length(), count)
    lanes = np.full(max(size, len(slots)), count, np.int32)
    lanes[: len(slots)] = slots
    return lanes


def _bucket(n: int, cap: int) -> int:
    """The append width for `n` tokens: a power of two from 8, at most `cap`."""
    return min(max(8, 1 << (n - 1).bit_length()), cap)


def _typed(rng):
    """A typed PRNG key (raw uint32 key data is wrapped)."""
    if not jax.dtypes.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(rng)
    return rng


def _unit_generation(tokens_QxP, valid_QxP, rows, n_samples, *, slot_steps, decode_steps, updates):
    """A streamed unit's `Generation` from its host rows (tokens, log-probs, valid,
    versions [R, N], stopped [R, 1])."""
    tokens_JxN, logp_JxN, valid_JxN, version_JxN, stopped_J = rows
    valid_JxN = valid_JxN.astype(bool)
    tokens_BxP = np.repeat(np.asarray(tokens_QxP, np.int32), n_samples, axis=0)
    valid_BxP = np.repeat(np.asarray(valid_QxP, bool), n_samples, axis=0)
    no_BxP = np.zeros(valid_BxP.shape, bool)
    completion_len_B = valid_JxN.sum(axis=1).astype(np.int32)
    out = sampling.SampleOutput(
        tokens_BxT=np.concatenate([tokens_BxP, tokens_JxN.astype(np.int32)], axis=1),
        valid_BxT=np.concatenate([valid_BxP, valid_JxN], axis=1),
        behav_logp_BxT=np.concatenate([no_BxP.astype(np.float32), logp_JxN], axis=1),
        completion_mask_BxT=np.concatenate([no_BxP, valid_JxN], axis=1),
        prompt_len_B=valid_BxP.sum(axis=1).astype(np.int32),
        completion_len_B=completion_len_B,
        stopped_B=stopped_J.reshape(-1).astype(bool),
        num_steps=np.int32(completion_len_B.max()),
    )
    return Generation(
        out=out,
        version_BxN=version_JxN.astype(np.int32),
        decode_steps=decode_steps,
        slot_steps=slot_steps,
        live_steps=int(np.sum(completion_len_B - 1)),
        weight_updates=updates,
    )


def row_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over (the trainer's batch axes)."""
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    return axes or tuple(mesh.axis_names)


def _host(tree):
    from m2po_jax.parallel import placement

    return placement.to_host(tree)


# ------------------------------------------------------------------------- device programs


def _prefill(params, tokens_QxP, valid_QxP, version, *, model_config, sampling_config):
    """Each prompt once, as the static sampler prefills it (same cache width, same mask)."""
    tokens_QxP, valid_QxP = tokens_QxP.astype(jnp.int32), valid_QxP.astype(bool)
    prompts, width = tokens_QxP.shape
    cache = model_lib.init_cache(model_config, prompts, width + sampling_config.max_new_tokens)
    logits_Qx1xV, cache = model_lib.apply(
        params,
        model_config,
        tokens_QxP,
        model_lib.make_positions(valid_QxP),
        valid_QxP,
        cache,
        0,
        last_only=True,
    )
    return _Prefixes(
        k=tuple(k[:, :, :width] for k in cache.k),
        v=tuple(v[:, :, :width] for v in cache.v),
        valid_QxP=valid_QxP,
        logits_QxV=logits_Qx1xV[:, 0],
        prompt_len_Q=jnp.sum(valid_QxP, axis=-1, dtype=jnp.int32),
        version=version,
    )


def _sequence_keys(keys_U, state, job_L, step_L):
    """The key of a sequence's token t: fold_in(fold_in(its unit's key, its id), t)."""
    job_L = jnp.minimum(job_L, state.done_J.shape[0] - 1)  # dropped lanes: any valid row
    fold = jax.vmap(jax.random.fold_in)
    return fold(fold(keys_U[state.unit_J[job_L]], state.seq_id_J[job_L]), step_L)


def _empty_slots(prefixes, slots: int, unit_J, seq_id_J, model_config, sampling_config, extra=0):
    """Free slots; `extra` cache columns past the completion's (turns: room for a padded
    append near the end of an episode's budget)."""
    jobs = seq_id_J.shape[0]
    width = prefixes.valid_QxP.shape[1]
    new = sampling_config.max_new_tokens
    cache = model_lib.init_cache(model_config, slots, width + new + extra)
    # An empty slot sees one (zero) key column, so its unused attention row stays finite.
    cache = cache.replace(valid_BxS=cache.valid_BxS.at[:, 0].set(True))
    zeros_S = jnp.zeros(slots, jnp.int32)
    return _Slots(
        cache=cache,
        job_S=zeros_S + jobs,
        step_S=zeros_S,
        last_token_S=zeros_S + sampling_config.pad_id,
        prompt_len_S=zeros_S + 1,
        live_S=jnp.zeros(slots, bool),
        held_S=jnp.zeros(slots, bool),
        next_job_1=jnp.zeros(1, jnp.int32),
        unit_J=unit_J.astype(jnp.int32),
        seq_id_J=seq_id_J.astype(jnp.int32),
        tokens_JxN=jnp.full((jobs, new), sampling_config.pad_id, jnp.int32),
        logp_JxN=jnp.zeros((jobs, new), jnp.float32),
        valid_JxN=jnp.zeros((jobs, new), bool),
        sampled_JxN=jnp.zeros((jobs, new), bool),
        version_JxN=jnp.zeros((jobs, new), jnp.int32) + prefixes.version,
        stopped_J=jnp.zeros(jobs, bool),
        done_J=jnp.zeros(jobs, bool),
        decode_steps_1=jnp.zeros(1, jnp.int32),
        live_steps_1=jnp.zeros(1, jnp.int32),
    )


def _write_tokens(
    state: _Slots, job_L, step_L, token_L, logp_L, version, stop_L, ends_L, *, turns=False
):
    """Writes each lane's sampled token into its sequence's row (lanes with job J are
    dropped). With `turns` a sequence's end is its turn's: the host ends the episode."""
    at = (job_L, step_L)
    state = state.replace(
        tokens_JxN=state.tokens_JxN.at[at].set(token_L, mode="drop"),
        logp_JxN=state.logp_JxN.at[at].set(logp_L, mode="drop"),
        valid_JxN=state.valid_JxN.at[at].set(True, mode="drop"),
        sampled_JxN=state.sampled_JxN.at[at].set(True, mode="drop"),
        version_JxN=state.version_JxN.at[at].set(version, mode="drop"),
    )
    if turns:
        return state
    return state.replace(
        stopped_J=state.stopped_J.at[job_L].max(stop_L, mode="drop"),
        done_J=state.done_J.at[job_L].max(ends_L, mode="drop"),
    )


def _insert(
    state: _Slots, prefixes: _Prefixes, keys_U, lanes, n_samples, sampling_config, turns=False
):
    """Starts up to `lanes` queued sequences in free slots: copies their prompt's prefill
    into the slot's cache row (clearing the rest of the row) and draws their first token."""
    slots = state.job_S.shape[0]
    jobs = state.done_J.shape[0]
    width = prefixes.valid_QxP.shape[1]
    free_S = ~state.live_S & ~state.held_S
    (slot_L,) = jnp.nonzero(free_S, size=lanes, fill_value=slots)
    job_L = state.next_job_1[0] + jnp.arange(lanes, dtype=jnp.int32)
    use_L = (slot_L < slots) & (job_L < jobs)
    slot_L = jnp.where(use_L, slot_L, slots)  # out of range: the scatters drop the lane
    job_L = jnp.where(use_L, job_L, jobs)
    prompt_L = jnp.minimum(job_L // n_samples, prefixes.valid_QxP.shape[0] - 1)

    def put(cache_SxKxWxD, prefix_QxKxPxD):
        return cache_SxKxWxD.at[slot_L, :, :width].set(prefix_QxKxPxD[prompt_L], mode="drop")

    new = state.cache.valid_BxS.shape[1] - width
    row_valid_LxW = jnp.concatenate(
        [prefixes.valid_QxP[prompt_L], jnp.zeros((lanes, new), bool)], axis=1
    )
    cache = model_lib.KVCache(
        k=tuple(map(put, state.cache.k, prefixes.k)),
        v=tuple(map(put, state.cache.v, prefixes.v)),
        valid_BxS=state.cache.valid_BxS.at[slot_L].set(row_valid_LxW, mode="drop"),
    )
    zero_L = jnp.zeros(lanes, jnp.int32)
    token_L, logp_L = sampling.sample_token(
        prefixes.logits_QxV[prompt_L], _sequence_keys(keys_U, state, job_L, zero_L), sampling_config
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = use_L & (stop_L | (sampling_config.max_new_tokens == 1))
    state = _write_tokens(
        state, job_L, zero_L, token_L, logp_L, prefixes.version, use_L & stop_L, ends_L, turns=turns
    )
    if turns:
        state = state.replace(held_S=state.held_S.at[slot_L].set(ends_L, mode="drop"))
    return state.replace(
        cache=cache,
        job_S=state.job_S.at[slot_L].set(job_L, mode="drop"),
        step_S=state.step_S.at[slot_L].set(1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_L].set(token_L, mode="drop"),
        prompt_len_S=state.prompt_len_S.at[slot_L].set(
            prefixes.prompt_len_Q[prompt_L], mode="drop"
        ),
        live_S=state.live_S.at[slot_L].set(~ends_L, mode="drop"),
        next_job_1=state.next_job_1 + jnp.sum(use_L, dtype=jnp.int32),
    )


def _decode(
    state: _Slots, params, keys_U, version, *, model_config, sampling_config, width, turns=False
):
    """One token for every live slot, written into its sequence's row (`width`: the
    prompts' columns). With `turns` a slot whose turn ends is held for the host."""
    live_S = state.live_S
    total = state.cache.valid_BxS.shape[1]
    column_S = jnp.where(live_S, width + state.step_S - 1, total)

    # Attention reads the columns up to the furthest live slot's, bucketed: a long-tailed
    # batch's slots mostly hold short sequences, far from the cache's last column.
    needed = jnp.max(jnp.where(live_S, column_S + 1, 1))
    logits_Sx1xV, cache = model_lib.apply(
        params,
        model_config,
        state.last_token_S[:, None],
        (state.prompt_len_S + state.step_S - 1)[:, None],
        live_S[:, None],
        state.cache,
        column_S,
        last_only=True,
        columns=model_lib.Columns(needed, sampling.decode_buckets(width, total)),
    )
    job_S = jnp.where(live_S, state.job_S, state.done_J.shape[0])
    token_S, logp_S = sampling.sample_token(
        logits_Sx1xV[:, 0], _sequence_keys(keys_U, state, job_S, state.step_S), sampling_config
    )
    stop_S = live_S & sampling.is_stop(token_S, sampling_config.stop_token_ids)
    ends_S = stop_S | (live_S & (state.step_S + 1 >= sampling_config.max_new_tokens))
    state = _write_tokens(
        state, job_S, state.step_S, token_S, logp_S, version, stop_S, ends_S, turns=turns
    )
    if turns:
        state = state.replace(held_S=state.held_S | ends_S)
    return state.replace(
        cache=cache,
        step_S=state.step_S + live_S,
        last_token_S=jnp.where(live_S, token_S, state.last_token_S),
        live_S=live_S & ~ends_S,
        decode_steps_1=state.decode_steps_1 + 1,
        live_steps_1=state.live_steps_1 + jnp.sum(live_S, dtype=jnp.int32),
    )


def _run(
    params,
    state,
    prefixes,
    keys_U,
    max_steps,
    *,
    model_config,
    sampling_config,
    lanes,
    n,
    turns=False,
):
    """Insert, then decode, until every sequence is done or `max_steps` decode steps ran
    (with `turns`: or until a slot's turn ended, for the host to take it)."""
    first = state.decode_steps_1[0]

    def cond(state):
        go = ~_finished(state) & (state.decode_steps_1[0] - first < max_steps)
        return go & ~jnp.any(state.held_S) if turns else go

    def body(state):
        # Most steps free no slot: skip the insert's gathers and scatters then.
        jobs = state.done_J.shape[0] // state.next_job_1.shape[0]
        refill = jnp.any(~state.live_S & ~state.held_S) & (state.next_job_1[0] < jobs)
        state = jax.lax.cond(
            refill,
            lambda s: _insert(s, prefixes, keys_U, lanes, n, sampling_config, turns),
            lambda s: s,
            state,
        )
        return _decode(
            state,
            params,
            keys_U,
            prefixes.version,
            model_config=model_config,
            sampling_config=sampling_config,
            width=prefixes.valid_QxP.shape[1],
            turns=turns,
        )

    return jax.lax.while_loop(cond, body, state)


def _finished(state: _Slots) -> jax.Array:
    """Every sequence started and ended (on every device, for a sharded state)."""
    jobs = state.done_J.shape[0] // state.next_job_1.shape[0]
    return ~jnp.any(state.live_S | state.held_S) & jnp.all(state.next_job_1 >= jobs)


def _finish(state: _Slots, tokens_QxP, valid_QxP, *, n_samples: int):
    """The `SampleOutput` of the finished sequences (rows in prompt order)."""
    repeat = functools.partial(jnp.repeat, repeats=n_samples, axis=0)
    tokens_BxP, valid_BxP = repeat(tokens_QxP.astype(jnp.int32)), repeat(valid_QxP.astype(bool))
    rows, width = tokens_BxP.shape
    completion_len_B = jnp.sum(state.valid_JxN, axis=-1, dtype=jnp.int32)
    out = sampling.SampleOutput(
        tokens_BxT=jnp.concatenate([tokens_BxP, state.tokens_JxN], axis=1),
        valid_BxT=jnp.concatenate([valid_BxP, state.valid_JxN], axis=1),
        behav_logp_BxT=jnp.concatenate(
            [jnp.zeros((rows, width), jnp.float32), state.logp_JxN], axis=1
        ),
        completion_mask_BxT=jnp.concatenate([jnp.zeros((rows, width), bool), state.sampled_JxN], 1),
        prompt_len_B=jnp.sum(valid_BxP, axis=-1, dtype=jnp.int32),
        completion_len_B=completion_len_B,
        stopped_B=state.stopped_J,
        num_steps=jnp.max(completion_len_B),
    )
    return out, state.version_JxN, (state.decode_steps_1, state.live_steps_1)


def _append(
    params,
    state: _Slots,
    keys_U,
    slot_L,
    delta_LxM,
    len_L,
    version,
    *,
    model_config,
    sampling_config,
    extra: int,
):
    """Appends host tokens to held slots' sequences and resumes them (multi-turn).

    Lane l (slot `slot_L[l]`, out of range = unused) takes `delta_LxM[l, :len_L[l]]`
    (a tool's answer and the next turn's header, rendered by the host): they are written
    into its sequence's row as appended tokens (not sampled, version -1), run through the
    model with the turn's pending last token into the slot's cache row (one prefill of
    len + 1 tokens at the row's own column: the history is never recomputed), and the
    next turn's first token is drawn from the last one's logits. The host guarantees
    that step + len < max_new_tokens and len <= M <= `extra` (the cache's columns past
    the completion's).
    """
    slots = state.job_S.shape[0]
    jobs, new = state.tokens_JxN.shape
    lanes, m = delta_LxM.shape
    width = state.cache.valid_BxS.shape[1] - new - extra
    use_L = slot_L < slots
    s_L = jnp.minimum(slot_L, slots - 1)
    job_L = jnp.where(use_L, state.job_S[s_L], jobs)
    step_L = state.step_S[s_L]  # the sequence's tokens; its last is not in the cache yet
    state = _write_appended(state, job_L, step_L, use_L, delta_LxM, len_L)
    tokens_LxT = jnp.concatenate([state.last_token_S[s_L][:, None], delta_LxM], axis=1)
    t_T = jnp.arange(m + 1, dtype=jnp.int32)
    positions_LxT = (state.prompt_len_S[s_L] + step_L - 1)[:, None] + t_T[None]
    hidden_LxTxE, cache = _prefill_rows(
        params,
        state.cache,
        slot_L,
        s_L,
        tokens_LxT,
        positions_LxT,
        t_T[None] <= len_L[:, None],
        width + step_L - 1,
        model_config,
    )
    last_LxE = hidden_LxTxE[jnp.arange(lanes), len_L]
    logits_LxV = model_lib.dense(last_LxE, model_lib.head_weight(params, model_config))
    step_L = step_L + len_L  # the drawn token's index
    token_L, logp_L = sampling.sample_token(
        logits_LxV.astype(jnp.float32),
        _sequence_keys(keys_U, state, job_L, step_L),
        sampling_config,
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = stop_L | (step_L + 1 >= new)
    state = _write_tokens(
        state, job_L, step_L, token_L, logp_L, version, stop_L, ends_L, turns=True
    )
    return state.replace(
        cache=cache,
        step_S=state.step_S.at[slot_L].set(step_L + 1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_L].set(token_L, mode="drop"),
        live_S=state.live_S.at[slot_L].set(~ends_L, mode="drop"),
        held_S=state.held_S.at[slot_L].set(ends_L, mode="drop"),
    )


def _write_appended(state: _Slots, job_L, step_L, use_L, delta_LxM, len_L) -> _Slots:
    """Writes each lane's appended tokens into its sequence's row from column `step_L`:
    valid, not sampled (no loss), version -1 (padding lanes and columns dropped)."""
    jobs = state.tokens_JxN.shape[0]
    t_M = jnp.arange(delta_LxM.shape[1], dtype=jnp.int32)
    at = (job_L[:, None], step_L[:, None] + t_M[None])
    real_LxM = use_L[:, None] & (t_M[None] < len_L[:, None])
    drop = jnp.where(real_LxM, at[0], jobs)  # padding lanes and columns are dropped
    return state.replace(
        tokens_JxN=state.tokens_JxN.at[drop, at[1]].set(delta_LxM, mode="drop"),
        valid_JxN=state.valid_JxN.at[drop, at[1]].set(True, mode="drop"),
        version_JxN=state.version_JxN.at[drop, at[1]].set(-1, mode="drop"),
    )


def _prefill_rows(
    params, cache, slot_L, s_L, tokens_LxT, positions_LxT, valid_LxT, column_L, model_config
):
    """Runs each lane's tokens through the model into its slot's own cache row, from the
    row's column `column_L` (a batch-1 forward per lane, vmapped: the rows write at
    different columns). Returns the lanes' hidden states [L, T, E] and the updated cache
    (lanes with slot `slot_L` out of range leave it as it was)."""

    def one(k_rows, v_rows, valid_row, tokens_T, positions_T, valid_T, column):
        row = model_lib.KVCache(
            k=tuple(k[None] for k in k_rows),
            v=tuple(v[None] for v in v_rows),
            valid_BxS=valid_row[None],
        )
        hidden_1xTxE, row = model_lib.apply(
            params,
            model_config,
            tokens_T[None],
            positions_T[None],
            valid_T[None],
            row,
            column,
            hidden_only=True,
        )
        return (
            hidden_1xTxE[0],
            tuple(k[0] for k in row.k),
            tuple(v[0] for v in row.v),
            row.valid_BxS[0],
        )

    rows = lambda x: x[s_L]
    hidden_LxTxE, k_rows, v_rows, valid_rows = jax.vmap(one)(
        tuple(map(rows, cache.k)),
        tuple(map(rows, cache.v)),
        rows(cache.valid_BxS),
        tokens_LxT,
        positions_LxT,
        valid_LxT,
        column_L,
    )
    put = lambda cache_SxKxWxD, rows_L: cache_SxKxWxD.at[slot_L].set(rows_L, mode="drop")
    return hidden_LxTxE, model_lib.KVCache(
        k=tuple(map(put, cache.k, k_rows)),
        v=tuple(map(put, cache.v, v_rows)),
        valid_BxS=put(cache.valid_BxS, valid_rows),
    )


def _release(state: _Slots, slot_L, stopped_L):
    """Ends the episodes in held slots `slot_L` (out of range = unused): their sequences
    are done (`stopped_L`: ended as the episode should, not cut by a budget) and their
    slots free for the next queued sequence."""
    slots = state.job_S.shape[0]
    jobs = state.done_J.shape[0]
    use_L = slot_L < slots
    job_L = jnp.where(use_L, state.job_S[jnp.minimum(slot_L, slots - 1)], jobs)
    return state.replace(
        held_S=state.held_S.at[slot_L].set(False, mode="drop"),
        job_S=state.job_S.at[slot_L].set(jobs, mode="drop"),
        stopped_J=state.stopped_J.at[job_L].set(stopped_L, mode="drop"),
        done_J=state.done_J.at[job_L].set(True, mode="drop"),
    )


def _programs(model_config, sampling_config, n_samples, slots, lanes, mesh, extra=0) -> dict:
    """The jitted phases; with a mesh, prefill / start / run are `shard_map`s: one engine
    per device over its block of prompts, with its own slots and its own loop.

    `extra` > 0: multi-turn episodes (`ContinuousEngine.episodes`): the cache has `extra`
    columns for the host's appends, a slot whose turn ends is held, and "append" /
    "release" resume or end held slots (one program over every slot, even on a mesh)."""
    statics = dict(model_config=model_config, sampling_config=sampling_config)
    turns = extra > 0
    prefill = functools.partial(_prefill, **statics)
    run = functools.partial(_run, **statics, lanes=lanes, n=n_samples, turns=turns)
    axes = None if mesh is None else row_axes(mesh)

    def start(prefixes, keys_U, unit_J, seq_id_J):
        state = _empty_slots(
            prefixes, slots, unit_J, seq_id_J, model_config, sampling_config, extra
        )
        return _insert(state, prefixes, keys_U, slots, n_samples, sampling_config, turns)

    programs = {
        "finish": jax.jit(functools.partial(_finish, n_samples=n_samples)),
        "finished": jax.jit(_finished),
    }
    if turns:  # one program over all slots (on a mesh, partitioned by XLA: correct, not fast)
        on = lambda fn: fn if mesh is None else sharding.on_mesh(fn, mesh)
        return programs | {
            "prefill": jax.jit(on(prefill)),
            "start": jax.jit(on(start)),
            "run": jax.jit(on(run), donate_argnums=(1,)),
            "append": jax.jit(
                on(functools.partial(_append, **statics, extra=extra)), donate_argnums=(1,)
            ),
            "release": jax.jit(_release, donate_argnums=(0,)),
        }
    if mesh is None:
        return programs | {
            "prefill": jax.jit(prefill),
            "start": jax.jit(start),
            "run": jax.jit(run, donate_argnums=(1,)),
        }
    from jax.sharding import PartitionSpec as P

    rows, rep = P(axes), P()

    def shard(fn, **specs):  # traced with the mesh in context (`sharding.on_mesh`)
        return sharding.on_mesh(jax.shard_map(fn, mesh=mesh, check_vma=False, **specs), mesh)

    # Every prefix and slot-state leaf is split by rows but the prefill's version.
    prefix_spec = _Prefixes(
        k=rows, v=rows, valid_QxP=rows, logits_QxV=rows, prompt_len_Q=rows, version=rep
    )
    return programs | {
        "prefill": jax.jit(shard(prefill, in_specs=(rep, rows, rows, rep), out_specs=prefix_spec)),
        "start": jax.jit(shard(start, in_specs=(prefix_spec, rep, rows, rows), out_specs=rows)),
        "run": jax.jit(
            shard(run, in_specs=(rep, rows, prefix_spec, rep, rep), out_specs=rows),
            donate_argnums=(1,),
        ),
    }
