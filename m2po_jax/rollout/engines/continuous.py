"""The continuous-batching engine: decode slots that take the next sequence as one ends.

`ContinuousEngine` keeps a fixed number of decode slots, each with its own position, stop
state and KV-cache row (JetStream's prefill / insert / generate; the device programs are in
`slots.py`). Every prompt is prefilled once; its `n_samples` sequences are inserted into
slots as slots free up, and one decode step advances every live slot by a token. A slot
whose sequence stops takes the next queued sequence at the next step, so no slot waits for
the longest completion. The whole loop (insert, decode, write the finished tokens into the
output rows) runs inside one `lax.while_loop`; the host calls it once per batch, or once
per `chunk_steps` decode steps when it takes new weights in flight (`weights=`): the
sequences in flight then continue under the new weights, each token records the version
that produced it, and the queued prompts are prefilled again.

Layout: the `sampling.SampleOutput` of the static sampler (rows b * n .. b * n + n - 1
answer prompt b; completions start at column P), with the policy version of every token.

`stream` runs several batches ("units") through the same slots and yields each as soon as
its last sequence ends: the next batch's sequences fill the slots the previous one's short
completions free. `episodes` runs multi-turn episodes (`turns.py`): a turn's end holds its
slot for the host's answer.

Sampling keys: row j's token t is drawn with `fold_in(fold_in(rng, j), t)` (rng: its
batch's key), whatever slot it runs in and whichever batches stream with it, so the same
key gives the same tokens for a fixed prompt order (not the static sampler's tokens: it
draws one key per column for the whole batch). Greedy decoding gives the static sampler's
completions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.parallel import sharding
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines.base import (
    EngineProgram,
    Generation,
    OutputOf,
    RolloutEngine,
    WeightSource,
    register,
    typed_key,
)
from m2po_jax.rollout.engines.slots import (
    _empty_slots,
    _finish,
    _finished,
    _insert,
    _prefill,
    _Prefixes,
    _run,
)
from m2po_jax.rollout.engines.turns import (
    Turn,
    _append,
    _bucket,
    _lanes,
    _release,
    check_answer,
    held_turns,
)


@register("continuous")
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

    multi_turn = True

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
        super().__init__(model_config, sampling_config, mesh=mesh)
        for name, value, low in (("slots", slots, 0), ("insert_lanes", insert_lanes, 0)):
            if int(value) < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if int(chunk_steps) < 1:
            raise ValueError(f"chunk_steps: must be >= 1, got {chunk_steps}")
        self.slots, self.insert_lanes, self.chunk_steps = int(slots), int(insert_lanes), chunk_steps
        self._programs: dict = {}

    @classmethod
    def from_config(
        cls, rollout, model_config, sampling_config, mesh, kv_budget: int = 0
    ) -> ContinuousEngine:
        """`rollout.engine_slots`, `rollout.insert_lanes` and `rollout.chunk_steps` (its KV
        is fixed by its slots: `kv_budget` is not used)."""
        return cls(
            model_config,
            sampling_config,
            slots=rollout.engine_slots,
            insert_lanes=rollout.insert_lanes,
            chunk_steps=rollout.chunk_steps,
            mesh=mesh,
        )

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

    def episode_sizes(self, rows: int) -> tuple[int, int]:
        """(slots, insert lanes) of `episodes` for `rows` rows: one program over every
        slot, on a mesh too."""
        slots = self.slots * self.shards or rows
        return slots, min(self.insert_lanes or max(slots // 4, 1), slots)

    def programs(self, params, prompts, n_samples, *, prompt_len, max_append=0):
        """The phases `generate` runs ("engine_prefill", "engine_start", "engine_run"), each
        from the last's outputs; with `max_append` > 0 those of `episodes` and
        "engine_append", its widest append (every slot takes `max_append` tokens)."""
        jobs, extra = prompts * n_samples, int(max_append)
        slots, lanes = self.episode_sizes(jobs) if extra else self.sizes(jobs)
        phases = self._compiled(n_samples, slots, lanes, extra)
        key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
        version, keys = self._replicated(jnp.int32), self._replicated(key_dtype, 1)
        ids = self._batch(jnp.int32, jobs)
        prefixes, state = OutputOf("engine_prefill"), OutputOf("engine_start")
        programs = [
            EngineProgram(
                "engine_prefill",
                f"{prompts} prompts, one prefill each",
                phases["prefill"],
                (
                    params,
                    self._batch(jnp.int32, prompts, prompt_len),
                    self._batch(jnp.bool_, prompts, prompt_len),
                    version,
                ),
            ),
            EngineProgram(
                "engine_start",
                f"{slots} slots per engine, {lanes} insert lanes",
                phases["start"],
                (prefixes, keys, ids, ids),
            ),
            EngineProgram(
                "engine_run",
                "decode loop with refills",
                phases["run"],
                (params, state, prefixes, keys, self._replicated(jnp.int32)),
            ),
        ]
        if extra:
            lane = self._replicated
            programs.append(
                EngineProgram(
                    "engine_append",
                    f"{slots} held slots take {extra}-token answers",
                    phases["append"],
                    (
                        params,
                        state,
                        keys,
                        lane(jnp.int32, slots),
                        lane(jnp.int32, slots, extra),
                        lane(jnp.int32, slots),
                        version,
                    ),
                )
            )
        return programs

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
        keys_U = typed_key(rng)[None]
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
        keys_U = jnp.stack([typed_key(k) for k in keys])
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
                finished, steps_before = _finished_units(
                    state, (tokens_U, valid_U), (emitted, ready), (shards, count, per),
                    n_samples, slots, steps_before, updates,
                )  # fmt: skip
                yield from finished
                emitted, updates = ready, 0
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
        keys_U = typed_key(rng)[None]
        prompts = np.shape(prompt_tokens_BxP)[0]
        jobs = prompts * n_samples
        slots, lanes = self.episode_sizes(jobs)
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
        return held_turns(
            tokens_JxN, job_S[slot_H], step_S[slot_H], turn_start, stop_ids, new, extra
        )

    def _answer(self, programs, params, version, state, keys_U, slot_H, turns, answers, extra):
        """Ends the held slots answered None and appends the others' tokens (the next
        turn's first token drawn under `version`, the weights' policy version)."""
        if len(answers) != len(turns):
            raise ValueError(f"on_turns: expected {len(turns)} answers, got {len(answers)}")
        slots = state.job_S.shape[0]
        ends, goes = [], []
        for slot, turn, delta in zip(slot_H, turns, answers, strict=True):
            check_answer(turn, delta)
            if delta is None:
                ends.append((slot, turn))
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


def _finished_units(state, prompts, span, layout, n_samples, slots, steps_before, updates):
    """The `Generation` of each unit in `span` (first, end): units whose sequences have
    all ended in `state`, read from the slots' shard-major layout (`layout`: shards, units,
    a unit's sequences on one shard). The first carries the decode steps since
    `steps_before` and the weight `updates`; returns (generations, the steps now)."""
    tokens_U, valid_U = prompts
    shards, count, per = layout
    fields = _host(
        (
            state.tokens_JxN,
            state.logp_JxN,
            state.valid_JxN,
            state.version_JxN,
            state.stopped_J,
            state.decode_steps_1,
            state.experts_JxNxLxK,
        )
    )
    by_unit = [np.asarray(f).reshape(shards, count, per, -1) for f in fields[:5]]
    steps = np.asarray(fields[5], np.float64)
    experts = None if fields[6] is None else np.asarray(fields[6])
    if experts is not None:
        experts = experts.reshape(shards, count, per, *experts.shape[1:])
    out = []
    for u in range(*span):
        rows = [f[:, u].reshape(shards * per, -1) for f in by_unit]
        unit_experts = None
        if experts is not None:
            unit_experts = experts[:, u].reshape(shards * per, *experts.shape[3:])
        out.append(
            _unit_generation(
                tokens_U[u],
                valid_U[u],
                rows,
                n_samples,
                slot_steps=int(np.sum(steps - steps_before)) * slots,
                decode_steps=int(np.max(steps - steps_before)),
                updates=updates,
                experts_JxNxLxK=unit_experts,
            )
        )
        steps_before, updates = steps, 0
    return out, steps_before


def _unit_generation(
    tokens_QxP,
    valid_QxP,
    rows,
    n_samples,
    *,
    slot_steps,
    decode_steps,
    updates,
    experts_JxNxLxK=None,
):
    """A streamed unit's `Generation` from its host rows (tokens, log-probs, valid,
    versions [R, N], stopped [R, 1]; recorded experts [R, N, L, K] or None)."""
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
        experts_BxTxLxK=None
        if experts_JxNxLxK is None
        else np.concatenate(
            [
                np.full(valid_BxP.shape + experts_JxNxLxK.shape[2:], -1, experts_JxNxLxK.dtype),
                experts_JxNxLxK,
            ],
            axis=1,
        ),
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
