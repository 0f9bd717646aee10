"""The paged engine: continuous batching over a paged KV cache, a group's prompt stored once.

    engine = PagedEngine(model_config, sampling_config, slots=64, pages=2048, page_size=16)
    generation = engine.generate(params, prompts_BxP, valid_BxP, rng, n_samples=8)

Contract (as the continuous engine's, `rollout.engine`): rows b * n .. b * n + n - 1 answer
prompt b; completions start at column P; row j's token t is drawn with
`fold_in(fold_in(rng, j), t)` whatever slot it runs in, so greedy decoding gives the static
sampler's completions and a sampled run is reproducible under its key.

Memory follows live tokens. Keys and values sit in a pool of `pages` pages of `page_size`
tokens per layer (`models.paged`). Every prompt is prefilled once into its own pages (its
real tokens only, from position 0), whose full pages its `n_samples` sequences reference
and never copy; its partly filled last page is copied into each sequence's first own page
when the sequence takes it (`_copy_tails`: vLLM's layout, one page list per sequence, what
the TPU kernel reads). On the XLA path a decode step reads an instance's prompt pages once
for all of its live rows. A sequence takes a page of its own each time its tokens cross a
page boundary and returns them all when it ends.

Admission and preemption. A free slot takes the next queued sequence (its first token is
drawn from its prompt's prefill). When a decode step needs more pages than are free, the
youngest sequences are preempted (vLLM's rule): their pages return to the pool, their
tokens so far stay in their rows, and they wait. Once a slot and enough pages are free,
a preempted sequence is resumed first: its tokens so far are recomputed into new pages
by one prefill, and it goes on from its next token under its own key, so it gives the
tokens, log-probs and versions it would have given uninterrupted (up to the float
rounding of a prefill against a decode step). `Generation.preemptions` counts them.
The pool must hold every prompt and one whole completion (refused in one line if not).

Weights in flight (`weights=`): polled between decode calls of `chunk_steps` steps; the
sequences go on under the new weights and each token records the version that produced
it. Prompts are not prefilled again: a sequence started after an update draws its first
token from its prompt's prefill (recorded under the prefill's version).

Multi-turn episodes (`episodes`, the continuous engine's contract and `Turn`s): a turn's
end parks its sequence, which keeps its slot and its pages while the others decode on;
held sequences are never preemption victims. The host hands each held turn to its
`TurnQueue` and applies the answers ready between decode calls, so a slow environment
holds back only its own episode: `_append` writes an answer into the sequence's row and
its own pages (one multi-token paged forward from its cached tokens) and draws the next
turn's first token; an append the pool cannot hold parks the sequence out instead (its
pages and slot returned, its row kept) and a resume recomputes it like a preempted one.
`_release` ends the episodes answered None.

On a mesh (`mesh=`): one engine per batch shard, as the continuous engine runs. The
prompts, their sequences (rows b * n .. of prompt b stay with it), the slots (`slots //
shards` each) and the pool (`pages // shards` pages each, with its own free list) are split
over the mesh's row axes (`row_axes`: "data", "fsdp"); each program is a `shard_map` over
them with the params replicated, so every shard prefills, decodes, preempts and resumes
its own sequences in its own pages. The `shard_map` is manual over the row axes only:
"tensor" is left to XLA, which splits the pool's KV heads over it (when they divide; a
constraint on every phase's output) and runs the model tensor-parallel over the params'
sampling layout. The host resumes each shard's preempted sequences into that shard's
slots and pages; arrays read back are shard-major (a shard's jobs are local to it).
`episodes` on a mesh keeps one program over every slot and page, partitioned by XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.models import model as model_lib
from m2po_jax.models import paged
from m2po_jax.parallel import sharding
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines import slots as slots_lib
from m2po_jax.rollout.engines import turns as turns_lib
from m2po_jax.rollout.engines.base import (
    EngineProgram,
    Generation,
    OutputOf,
    RolloutEngine,
    WeightSource,
    register,
    typed_key,
)
from m2po_jax.rollout.engines.continuous import row_axes
from m2po_jax.rollout.engines.slots import _sequence_keys, _write_tokens


@flax.struct.dataclass
class _State:
    """The pool, the prompts' pages, the slots and the output rows (J sequences)."""

    pool: paged.PagedPool
    free_N: jax.Array  # int32: free page ids, the first `free_1[0]` of them
    free_1: jax.Array  # int32 [1]: free pages
    prompt_table_IxM: jax.Array
    prompt_len_I: jax.Array
    logits_IxV: jax.Array  # float32: each prompt's next-token logits (first tokens)
    prefill_version: jax.Array  # int32 scalar
    job_S: jax.Array  # int32: the slot's sequence (J: none)
    step_S: jax.Array  # int32: tokens the sequence has (its last not in the cache yet)
    last_token_S: jax.Array
    live_S: jax.Array
    held_S: jax.Array  # bool: the slot's sequence ended a turn and waits for the host (turns)
    own_table_SxM: jax.Array  # int32: the sequence's own pages (NP: none)
    age_S: jax.Array  # int32: admission order (preemption takes the youngest)
    admitted_1: jax.Array  # int32 [1]: admissions so far
    next_job_1: jax.Array  # int32 [1]: the next queued sequence
    waiting_J: jax.Array  # bool: preempted, to resume
    unit_J: jax.Array
    seq_id_J: jax.Array
    tokens_JxN: jax.Array
    logp_JxN: jax.Array
    valid_JxN: jax.Array
    sampled_JxN: jax.Array
    version_JxN: jax.Array
    stopped_J: jax.Array
    done_J: jax.Array
    decode_steps_1: jax.Array
    live_steps_1: jax.Array
    preemptions_1: jax.Array
    peak_1: jax.Array  # int32 [1]: the most pages in use at once
    # int16: each sampled token's experts from the pass that fed it (a decode step, an
    # append, or a resume's recompute); with `record_experts`, else None
    experts_JxNxLxK: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PagedGeneration(Generation):
    """`Generation` with the pool's figures."""

    preemptions: int = 0
    pages: int = 0  # the pool's pages (per batch shard on a mesh)
    peak_pages: int = 0  # the most pages in use at once (prompts included; the fullest shard's)


def own_pages(max_new: int, page_size: int) -> int:
    """A sequence's own pages at most: its prompt's partly filled last page (copied, up to
    page_size - 1 tokens) and `max_new` tokens after it."""
    return -(-(max_new + page_size - 1) // page_size)


def pool_pages(prompt_pages: int, slots: int, own: int, cap: int | None = None) -> int:
    """A batch shard's default pool: its prompts' pages and every slot's whole completion
    (`own` pages each), at most `cap` pages (None: no cap) but never below the prompts and
    one whole completion, the least the engine runs with (one sequence at a time)."""
    full = prompt_pages + slots * own
    return full if cap is None else max(min(full, cap), prompt_pages + own)


@register("paged")
class PagedEngine(RolloutEngine):
    """Continuous batching over a paged KV cache (see the module doc).

    Args:
      model_config, sampling_config: as for `sampling.generate`.
      slots: sequences decoded at once; 0 = one per row.
      pages: pages in the pool; 0 = enough for every prompt and every slot's whole
        completion (no preemption).
      page_size: tokens per page.
      insert_lanes: sequences that may start per decode step (0 = max(slots // 4, 1)).
      chunk_steps: decode steps per call when `weights` is given, and in `episodes`
        (between calls the host takes the turns' answers).
      mesh: a device mesh to run one engine per batch shard over (prompts, slots and pool
        split over its "data" and "fsdp" axes, `slots` and `pages` the totals, each shard
        taking its share; the pool's KV heads split over "tensor"); None = one device.
    """

    multi_turn = True

    def __init__(
        self,
        model_config,
        sampling_config,
        *,
        slots: int = 0,
        pages: int = 0,
        page_size: int = 16,
        insert_lanes: int = 0,
        chunk_steps: int = 32,
        kv_budget: int = 0,
        mesh: jax.sharding.Mesh | None = None,
    ):
        super().__init__(model_config, sampling_config, mesh=mesh)
        for name, value, low in (  # each under the config field that sets it
            ("rollout.engine_slots", slots, 0),
            ("rollout.kv_pages", pages, 0),
            ("rollout.page_size", page_size, 1),
            ("rollout.insert_lanes", insert_lanes, 0),
            ("rollout.chunk_steps", chunk_steps, 1),
            ("kv_budget", kv_budget, 0),
        ):
            if isinstance(value, bool) or int(value) != value or int(value) < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
        self.slots, self.pages, self.page_size = int(slots), int(pages), int(page_size)
        self.insert_lanes, self.chunk_steps = int(insert_lanes), int(chunk_steps)
        self.kv_budget = int(kv_budget)
        self._programs: dict = {}

    @classmethod
    def from_config(
        cls, rollout, model_config, sampling_config, mesh, kv_budget: int = 0
    ) -> PagedEngine:
        """`rollout.engine_slots`, `rollout.kv_pages`, `rollout.page_size`,
        `rollout.insert_lanes` and `rollout.chunk_steps`; `kv_budget` caps the default
        pool (`rollout.kv_pages` 0) in bytes per device."""
        return cls(
            model_config,
            sampling_config,
            slots=rollout.engine_slots,
            pages=rollout.kv_pages,
            page_size=rollout.page_size,
            insert_lanes=rollout.insert_lanes,
            chunk_steps=rollout.chunk_steps,
            kv_budget=kv_budget,
            mesh=mesh,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes one page of the pool takes on a device (every layer's keys and values; its
        KV heads' share where they split over "tensor")."""
        tensor = 1 if self.mesh is None else self.mesh.shape.get("tensor", 1)
        split = tensor if self.model_config.num_kv_heads % tensor == 0 else 1
        return paged.pool_bytes(self.model_config, 1, self.page_size) // split

    def decode_probe(self, params, prompts, n_samples, *, prompt_len) -> EngineProgram:
        """The model's pass of one decode step over every slot, from "engine_start"'s state
        (`programs`): compiled by `--compile_only` for the decode roofline, not run."""
        phases, size = self._compiled(prompts, prompt_len, n_samples)
        return EngineProgram(
            "paged_decode_step",
            f"one token for {size['slots']} slots per batch shard",
            phases["probe"],
            (params, OutputOf("engine_start")),
        )

    def programs(self, params, prompts, n_samples, *, prompt_len, max_append=0):
        """ "engine_prefill" (every prompt into its pages), "engine_start", "engine_run"
        (the decode loop) and "engine_resume" (its widest: every lane recomputes a whole
        completion), each from the last's outputs; with `max_append` > 0 those of
        `episodes` and "engine_append" (its widest: every slot takes `max_append`
        tokens)."""
        extra = int(max_append)
        phases, size = self._compiled(prompts, prompt_len, n_samples, turns=extra > 0)
        jobs = prompts * n_samples
        # Split over the batch shards as they run (`episodes`: one program, replicated).
        batch = self._replicated if extra else self._batch
        key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
        version, keys = self._replicated(jnp.int32), self._replicated(key_dtype, 1)
        state = OutputOf("engine_start")
        pages = f"{size['pages']} pages of {size['page_size']} tokens"
        if size["shards"] > 1:
            pages += f" on each of {size['shards']} batch shards"
        programs = [
            EngineProgram(
                "engine_prefill",
                f"{prompts} prompts into a pool of {pages}",
                phases["prefill"],
                (
                    params,
                    batch(jnp.int32, prompts, prompt_len),
                    batch(jnp.bool_, prompts, prompt_len),
                    version,
                ),
            ),
            EngineProgram(
                "engine_start",
                f"{size['slots']} slots, {size['lanes']} insert lanes",
                phases["start"],
                (OutputOf("engine_prefill"), keys, batch(jnp.int32, jobs), batch(jnp.int32, jobs)),
            ),  # fmt: skip
            EngineProgram(
                "engine_run",
                "decode loop with refills and preemption",
                phases["run"],
                (params, state, keys, version, self._replicated(jnp.int32)),
            ),
            EngineProgram(
                "engine_resume",
                f"{size['lanes']} preempted sequences recomputed",
                phases["resume"](_width(self.sampling.max_new_tokens), size["lanes"]),
                (params, state, batch(jnp.int32, size["shards"] * size["lanes"]), version),
            ),
        ]
        if extra:
            lane, slots = self._replicated, size["slots"]
            width = turns_lib._bucket(extra, extra)
            programs.append(
                EngineProgram(
                    "engine_append",
                    f"{slots} held sequences take {width}-token answers",
                    phases["append"],
                    (
                        params,
                        state,
                        keys,
                        lane(jnp.int32, slots),
                        lane(jnp.int32, slots, width),
                        lane(jnp.int32, slots),
                        version,
                    ),
                )  # fmt: skip
            )
        return programs

    # ---- sizes ----------------------------------------------------------------------

    @property
    def shards(self) -> int:
        """Engines that run side by side: one per batch shard of the mesh."""
        if self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in row_axes(self.mesh)]))

    def sizes(self, prompts: int, width: int, n_samples: int, turns: bool = False) -> dict:
        """Per batch shard (`shards` of them; one for `turns`, the episodes' program over
        the whole mesh): slots, lanes, own pages per sequence, prompt pages per prompt,
        pool pages and sequences (jobs)."""
        shards = 1 if turns else self.shards
        named = (("prompts", prompts), ("rollout.engine_slots", self.slots),
                 ("rollout.kv_pages", self.pages))  # fmt: skip
        for name, value in named:
            if value % shards:
                raise ValueError(
                    f"{name}={value}: must divide over the mesh's {shards} batch shards "
                    "(the paged engine runs one pool per shard)"
                )
        pg, new = self.page_size, self.sampling.max_new_tokens
        local = prompts // shards
        rows = local * n_samples
        slots = min(self.slots // shards or rows, rows)
        own = own_pages(new, pg)
        prompt = math.ceil(width / pg)
        cap = self.kv_budget // self.page_bytes if self.kv_budget else None
        pages = self.pages // shards or pool_pages(local * prompt, slots, own, cap)
        lanes = min(self.insert_lanes or max(slots // 4, 1), slots)
        return dict(
            slots=slots, lanes=lanes, own=own, prompt=prompt, pages=pages, page_size=pg,
            jobs=rows, shards=shards, layout=paged.layout_for(self.mesh),
        )  # fmt: skip

    def _compiled(self, prompts, width, n_samples, turns=False) -> tuple[dict, dict]:
        size = self.sizes(prompts, width, n_samples, turns)
        key = (prompts, width, n_samples, turns)
        if key not in self._programs:
            self._programs[key] = _programs(
                self.model_config, self.sampling, n_samples, size, self.mesh, turns
            )
        return self._programs[key], size

    def _put(self, host_R):
        """A host array split by rows over the batch shards (as the prompts are)."""
        if self.mesh is None:
            return jnp.asarray(host_R)
        spec = jax.sharding.PartitionSpec(row_axes(self.mesh))
        return jax.device_put(host_R, jax.sharding.NamedSharding(self.mesh, spec))

    # ---- generation -----------------------------------------------------------------

    def generate(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        *,
        n_samples=1,
        version=0,
        weights: WeightSource | None = None,
    ) -> PagedGeneration:
        sampling.check_inputs(
            self.model_config, self.sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples
        )
        prompts, width = np.shape(prompt_tokens_BxP)
        programs, size = self._compiled(prompts, width, n_samples)
        self._check_pool(prompt_valid_BxP, size)
        rows = np.arange(prompts * n_samples, dtype=np.int32)  # sequence ids: the rows
        state = programs["prefill"](params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version))
        state = programs["start"](state, typed_key(rng)[None], self._put(rows * 0), self._put(rows))
        steps = self.chunk_steps if weights is not None else 2**30
        loop = self._loop(
            programs, size, params, state, typed_key(rng)[None], version, weights, steps
        )
        *_, (state, _, updates) = loop  # the last call's state
        out, version_BxN, counters = programs["finish"](state, prompt_tokens_BxP, prompt_valid_BxP)
        version_BxN, (decode, live_steps, preempted, peak) = _host((version_BxN, counters))
        return PagedGeneration(
            out=out,
            version_BxN=np.asarray(version_BxN, np.int32),
            decode_steps=int(np.max(decode)),
            slot_steps=int(np.sum(decode)) * size["slots"],
            live_steps=int(np.sum(live_steps)),
            weight_updates=updates,
            preemptions=int(np.sum(preempted)),
            pages=size["pages"],
            peak_pages=int(np.max(peak)),
        )

    def stream(self, params, units, *, n_samples=1, version=0, weights=None):
        """Several batches ("units": (prompt_tokens_QxP, prompt_valid_QxP, rng), all of one
        shape) through the same slots and pool, each yielded as soon as its last sequence
        ends, in order: the slots and pages a unit's short completions free take the next
        unit's sequences. Each unit is keyed by its own rng as `generate` keys a batch (the
        same params give it the tokens `generate` gives it alone). Every unit's prompts
        are prefilled at the start, so the pool must hold all of them."""
        tokens_U, valid_U, keys = zip(*units, strict=True)
        for tokens, valid in zip(tokens_U, valid_U, strict=True):
            sampling.check_inputs(self.model_config, self.sampling, tokens, valid, n_samples)
        count, (prompts, width) = len(units), np.shape(tokens_U[0])
        programs, size = self._compiled(count * prompts, width, n_samples)
        shards = size["shards"]
        if prompts % shards:
            raise ValueError(
                f"rollout.batch_size: a unit's {prompts} prompts must divide over the mesh's "
                f"{shards} batch shards"
            )
        # Shard-major layout: shard d holds its share of every unit, unit after unit.
        share = prompts // shards
        order = np.arange(count * prompts).reshape(count, shards, share).transpose(1, 0, 2)
        order = order.reshape(-1)
        valid_QxP = np.concatenate([np.asarray(jax.device_get(v), bool) for v in valid_U])[order]
        tokens_QxP = np.concatenate([np.asarray(jax.device_get(t), np.int32) for t in tokens_U])
        tokens_QxP = tokens_QxP[order]
        self._check_pool(valid_QxP, size)
        per = share * n_samples  # a unit's sequences on one shard
        unit_J = np.tile(np.repeat(np.arange(count, dtype=np.int32), per), shards)
        seq_id_J = np.arange(shards)[:, None, None] * per + np.arange(per)[None, None, :]
        seq_id_J = np.broadcast_to(seq_id_J, (shards, count, per)).reshape(-1).astype(np.int32)
        keys_U = jnp.stack([typed_key(k) for k in keys])
        tokens_QxP, valid_QxP = self._put(tokens_QxP), self._put(valid_QxP)
        state = programs["prefill"](params, tokens_QxP, valid_QxP, jnp.int32(version))
        state = programs["start"](state, keys_U, self._put(unit_J), self._put(seq_id_J))
        emitted, counted = 0, np.zeros((2, shards), np.int64)  # decode steps, preemptions
        loop = self._loop(programs, size, params, state, keys_U, version, weights, self.chunk_steps)
        for now_state, done_J, updates in loop:
            done_U = done_J.reshape(shards, count, per).all(axis=(0, 2))
            ready = emitted
            while ready < count and done_U[ready]:
                ready += 1
            if ready == emitted:
                continue
            st = now_state
            fields = _host(
                (st.tokens_JxN, st.logp_JxN, st.valid_JxN, st.sampled_JxN, st.version_JxN,
                 st.stopped_J, st.decode_steps_1, st.preemptions_1, st.peak_1)
            )  # fmt: skip
            by_unit = [np.asarray(f).reshape(shards, count, per, -1) for f in fields[:6]]
            now = np.stack([np.asarray(fields[6]), np.asarray(fields[7])]).astype(np.int64)
            for u in range(emitted, ready):
                rows = [f[:, u].reshape(shards * per, -1) for f in by_unit]
                rows[-1] = rows[-1].reshape(-1)  # stopped
                yield _unit_generation(
                    tokens_U[u], valid_U[u], rows, n_samples, spent=now - counted,
                    slots=size["slots"], updates=updates, pages=size["pages"],
                    peak=int(np.max(fields[8])),
                )  # fmt: skip
                counted = now
            emitted = ready
            if emitted == count:
                return

    def episodes(
        self,
        params,
        prompt_tokens_BxP,
        prompt_valid_BxP,
        rng,
        on_turns,
        *,
        n_samples: int = 1,
        version: int = 0,
        weights: WeightSource | None = None,
        max_append: int = 256,
    ) -> PagedGeneration:
        """Multi-turn episodes, as `ContinuousEngine.episodes` (the same `Turn`s, answers,
        row layout and keys), where a held turn stops only its own sequence.

        A sequence whose turn ends is parked: it keeps its slot and its pages (held
        sequences are never preemption victims) while the others decode on. The engine
        runs decode calls of up to `chunk_steps` steps, each ending early when a turn
        ends; after each it hands the newly held turns to `on_turns` (a `TurnQueue`:
        `submit` starts them and returns; a plain callable answers at once), collects the
        answers ready (`poll(0)`), ends the episodes answered None and appends the others'
        tokens into the sequences' own pages (`_append`: one multi-token paged forward
        from their cached tokens; an append the pool cannot hold parks the sequence out
        of its slot and pages, to be resumed by a recompute, counted in `preemptions`).
        Only when nothing can decode does it wait for the next answer (`poll(None)`).
        `decode_steps_while_waiting` counts the decode steps run while answers were
        pending. `max_append`: the most tokens one append may add.
        """
        if int(max_append) < 1:
            raise ValueError(f"max_append: must be >= 1, got {max_append}")
        sampling.check_inputs(
            self.model_config, self.sampling, prompt_tokens_BxP, prompt_valid_BxP, n_samples
        )
        answers = turns_lib.turn_queue(on_turns)
        prompts, width = np.shape(prompt_tokens_BxP)
        programs, size = self._compiled(prompts, width, n_samples, turns=True)
        self._check_pool(prompt_valid_BxP, size)
        jobs, extra = size["jobs"], int(max_append)
        keys_U = typed_key(rng)[None]
        ids = jnp.arange(jobs, dtype=jnp.int32)
        state = programs["prefill"](params, prompt_tokens_BxP, prompt_valid_BxP, jnp.int32(version))
        state = programs["start"](state, keys_U, ids * 0, ids)
        stop_ids = set(self.sampling.stop_token_ids)
        tail_J = self._host_tails(state, size)[0]
        turn_start = np.zeros(jobs, np.int64)  # where each sequence's current turn began
        pending: set[int] = set()  # rows whose turn the host has not answered yet
        steps_before, waited, updates = 0, 0, 0
        while True:
            state = programs["run"](
                params, state, keys_U, jnp.int32(version), np.int32(self.chunk_steps)
            )
            held_S, job_S, step_S, live_S, waiting_J, valid_JxN, free, next_job, done_J, decoded = (
                jax.device_get((state.held_S, state.job_S, state.step_S, state.live_S,
                                state.waiting_J, state.valid_JxN, state.free_1,
                                state.next_job_1, state.done_J, state.decode_steps_1))
            )  # fmt: skip
            if pending:
                waited += int(decoded[0]) - steps_before
            steps_before = int(decoded[0])
            if done_J.all():
                break
            fresh = [s for s in np.flatnonzero(held_S) if int(job_S[s]) not in pending]
            if fresh:
                turns = turns_lib.held_turns(
                    jax.device_get(state.tokens_JxN), job_S[fresh], step_S[fresh], turn_start,
                    stop_ids, self.sampling.max_new_tokens, extra,
                )  # fmt: skip
                pending.update(t.row for t in turns)
                answers.submit(turns)
            free_slots = int((job_S == jobs).sum())
            job_L = _resumable(waiting_J, valid_JxN, int(free[0]), free_slots, size, tail_J)
            insertable = next_job[0] < jobs and free_slots and not waiting_J.any()
            busy = bool(live_S.any() or job_L.size or insertable)
            if not busy and not pending:
                raise RuntimeError("rollout engine: no sequence can go on and no turn is pending")
            ready = answers.poll(0.0 if busy else None)
            if ready:
                state = self._answer(programs, params, version, state, keys_U, job_S, held_S,
                                     ready, extra)  # fmt: skip
                for turn, delta in ready:
                    pending.discard(turn.row)
                    if delta is not None:  # the next turn starts after the appended tokens
                        turn_start[turn.row] = turn.start + len(turn.tokens) + len(delta)
            elif job_L.size:  # parked sequences recomputed back into slots
                state = _resume_parked(programs, params, state, version, job_L, valid_JxN, jobs)
            newer = None if weights is None else weights()
            if newer is not None and int(newer[1]) != int(version):
                params, version = newer
                updates += 1
        prompts_BxP = (prompt_tokens_BxP, prompt_valid_BxP)
        return _episodes_generation(programs, state, prompts_BxP, size, updates, waited)

    def _answer(self, programs, params, version, state, keys_U, job_S, held_S, ready, extra):
        """Ends the episodes answered None and appends the others' tokens (`ready`: (turn,
        answer) pairs of held sequences)."""
        slots = job_S.shape[0]
        slot_of = {int(job_S[s]): int(s) for s in np.flatnonzero(held_S)}
        ends, goes = [], []
        for turn, delta in ready:
            turns_lib.check_answer(turn, delta)
            if turn.row not in slot_of:
                raise ValueError(f"on_turns: row {turn.row} has no held turn to answer")
            if delta is None:
                ends.append((slot_of[turn.row], turn))
            else:
                goes.append((slot_of[turn.row], list(delta)))
        if ends:
            slot_L = turns_lib._lanes([slot for slot, _ in ends], slots)
            stopped_L = np.zeros(slot_L.size, bool)
            stopped_L[: len(ends)] = [not turn.cut for _, turn in ends]
            state = programs["release"](state, slot_L, stopped_L)
        if goes:
            slot_L = turns_lib._lanes([slot for slot, _ in goes], slots)
            width = turns_lib._bucket(max(len(delta) for _, delta in goes), extra)
            delta_LxM = np.full((slot_L.size, width), self.sampling.pad_id, np.int32)
            len_L = np.zeros(slot_L.size, np.int32)
            for i, (_, delta) in enumerate(goes):
                delta_LxM[i, : len(delta)] = delta
                len_L[i] = len(delta)
            state = programs["append"](
                params, state, keys_U, slot_L, delta_LxM, len_L, jnp.int32(version)
            )
        return state

    def _check_pool(self, valid_QxP, size) -> None:
        """Each shard's pool holds its prompts (shard-major `valid_QxP`) and a completion."""
        shards = size["shards"]
        lengths = np.sum(np.asarray(_host(valid_QxP), bool), axis=1).reshape(shards, -1)
        prompt_pages = int(np.max(np.sum(-(-lengths // self.page_size), axis=1)))
        if size["pages"] < prompt_pages + size["own"]:
            shard = "" if shards == 1 else f" (per batch shard: {shards} of them)"
            raise ValueError(
                f"rollout.kv_pages={size['pages'] * shards}: the pool{shard} must hold "
                f"every prompt ({prompt_pages} pages of {self.page_size} tokens) and one whole "
                f"completion ({size['own']} pages): at least "
                f"{(prompt_pages + size['own']) * shards}"
            )

    def _host_tails(self, state, size) -> np.ndarray:
        """[shards, jobs per shard]: the tokens in each job's prompt's partly filled last
        page (`_tails`), on the host (a shard's jobs are its prompts' samples in order)."""
        lengths = np.asarray(_host(state.prompt_len_I)).reshape(size["shards"], -1)
        n_samples = size["jobs"] // lengths.shape[1]
        return np.repeat(lengths % self.page_size, n_samples, axis=1)

    def _loop(self, programs, size, params, state, keys_U, version, weights, steps):
        """Decode calls of `steps` steps until every sequence is done; between calls,
        preempted sequences resume where they can and newer weights are taken. Yields
        (state, done_J on the host, weight updates so far) after each decode call; the
        consumer reads the state before asking for the next."""
        jobs, shards, pages, updates = size["jobs"], size["shards"], size["pages"], 0
        table = np.asarray(_host(state.prompt_table_IxM)).reshape(shards, -1)
        prompt_pages_D = np.sum(table < pages, axis=1)
        tail_DxJ = self._host_tails(state, size)
        progress = None
        while True:
            state = programs["run"](params, state, keys_U, jnp.int32(version), np.int32(steps))
            waiting_J, valid_JxN, free_D, job_S, done_J, decoded_D = _host(
                (state.waiting_J, state.valid_JxN, state.free_1, state.job_S, state.done_J,
                 state.decode_steps_1)
            )  # fmt: skip
            # Shard-major: shard d's jobs and slots, indexed locally.
            waiting_DxJ, job_DxS = waiting_J.reshape(shards, jobs), job_S.reshape(shards, -1)
            valid_DxJxN = valid_JxN.reshape(shards, jobs, -1)
            now = (int(decoded_D.sum()), int(done_J.sum()), int(valid_JxN.sum()))
            if now == progress:  # a call that neither decoded nor resumed anything
                raise RuntimeError(
                    f"paged engine: stuck with {int(waiting_J.sum())} preempted sequences "
                    f"waiting for pages and {free_D.tolist()} of {pages} free per shard (a "
                    "bookkeeping bug: the pool always holds one whole completion)"
                )
            progress = now
            lost = int(np.sum(np.abs(pages - prompt_pages_D - free_D)))  # per shard
            if done_J.all() and lost:
                raise RuntimeError(
                    f"paged engine: {lost} pages were not returned to the pool once every "
                    "sequence ended (a bookkeeping bug)"
                )
            yield state, done_J, updates
            if done_J.all():
                return
            job_DxL = [
                _resumable(waiting_DxJ[d], valid_DxJxN[d], int(free_D[d]),
                           int((job_DxS[d] == jobs).sum()), size, tail_DxJ[d])
                for d in range(shards)
            ]  # fmt: skip
            if any(job_L.size for job_L in job_DxL):
                tokens = max(
                    int(valid_DxJxN[d][job_L].sum(1).max())
                    for d, job_L in enumerate(job_DxL)
                    if job_L.size
                )
                lanes_DxL = _lanes_per_shard(job_DxL, jobs)
                resume = programs["resume"](_width(tokens - 1), lanes_DxL.shape[1])
                lanes = self._put(lanes_DxL.reshape(-1))
                state = resume(params, state, lanes, jnp.int32(version))
                progress = None
                continue
            newer = None if weights is None else weights()
            if newer is not None and int(newer[1]) != int(version):
                params, version = newer
                updates += 1


def _unit_generation(tokens_QxP, valid_QxP, rows, n_samples, *, spent, slots, updates, pages, peak):
    """A streamed unit's `PagedGeneration` from its host rows (tokens, log-probs, valid,
    sampled, versions [R, N], stopped [R]) and the decode steps and preemptions `spent`
    on it ([2, shards])."""
    tokens_JxN, logp_JxN, valid_JxN, sampled_JxN, version_JxN, stopped_J = rows
    tokens_BxP = np.repeat(np.asarray(jax.device_get(tokens_QxP), np.int32), n_samples, axis=0)
    valid_BxP = np.repeat(np.asarray(jax.device_get(valid_QxP), bool), n_samples, axis=0)
    no_BxP = np.zeros(valid_BxP.shape, bool)
    completion_len_B = valid_JxN.sum(axis=1).astype(np.int32)
    out = sampling.SampleOutput(
        tokens_BxT=np.concatenate([tokens_BxP, tokens_JxN.astype(np.int32)], axis=1),
        valid_BxT=np.concatenate([valid_BxP, valid_JxN], axis=1),
        behav_logp_BxT=np.concatenate([no_BxP.astype(np.float32), logp_JxN], axis=1),
        completion_mask_BxT=np.concatenate([no_BxP, sampled_JxN], axis=1),
        prompt_len_B=valid_BxP.sum(axis=1).astype(np.int32),
        completion_len_B=completion_len_B,
        stopped_B=stopped_J.astype(bool),
        num_steps=np.int32(completion_len_B.max()),
    )
    decode_D, preempted_D = spent  # per shard
    return PagedGeneration(
        out=out,
        version_BxN=version_JxN.astype(np.int32),
        decode_steps=int(np.max(decode_D)),
        slot_steps=int(np.sum(decode_D)) * slots,
        live_steps=int(np.sum(completion_len_B - 1)),
        weight_updates=updates,
        preemptions=int(np.sum(preempted_D)),
        pages=pages,
        peak_pages=peak,
    )


def _resume_parked(programs, params, state, version, job_L, valid_JxN, jobs: int):
    """Recomputes the parked sequences `job_L` (their cached tokens, one paged prefill)
    back into free slots and pages."""
    tokens = int(valid_JxN[job_L].sum(1).max()) - 1
    lanes = turns_lib._lanes(list(job_L), jobs)
    resume = programs["resume"](_width(tokens), lanes.size)
    return resume(params, state, jnp.asarray(lanes), jnp.int32(version))


def _episodes_generation(programs, state, prompts_BxP, size, updates: int, waited: int):
    """`episodes`' result from its final state: the rows, versions and counters."""
    out, version_BxN, counters = programs["finish"](state, *prompts_BxP)
    version_BxN, (decode, live_steps, preempted, peak) = jax.device_get((version_BxN, counters))
    return PagedGeneration(
        out=out,
        version_BxN=np.asarray(version_BxN, np.int32),
        decode_steps=int(decode[0]),
        slot_steps=int(decode[0]) * size["slots"],
        live_steps=int(live_steps[0]),
        weight_updates=updates,
        decode_steps_while_waiting=waited,
        preemptions=int(preempted[0]),
        pages=size["pages"],
        peak_pages=int(peak[0]),
    )


def _resumable(waiting_J, valid_JxN, free: int, free_slots: int, size, tail_J) -> np.ndarray:
    """The preempted sequences to resume now, oldest job first, while slots and pages
    allow (`_resume_need`; `tail_J`: the tokens of each job's prompt in its last, partly
    filled page, which the sequence's first own page holds)."""
    out = []
    for job in np.flatnonzero(waiting_J):
        if len(out) == min(free_slots, size["lanes"]):
            break
        need = math.ceil((int(valid_JxN[job].sum()) + int(tail_J[job])) / size["page_size"])
        if need > free:
            break
        out.append(job)
        free -= need
    return np.asarray(out, np.int32)


def _width(tokens: int) -> int:
    """The resume program's token width for `tokens` tokens: a power of two from 8."""
    return max(8, 1 << max(tokens - 1, 0).bit_length())


def _lanes_per_shard(jobs_DxL: list[np.ndarray], none: int) -> np.ndarray:
    """Each shard's lanes (local jobs), padded with `none` to one power of two [D, L]."""
    width = max(turns_lib._lanes(list(job_L), none).size for job_L in jobs_DxL)
    out = np.full((len(jobs_DxL), width), none, np.int32)
    for d, job_L in enumerate(jobs_DxL):
        out[d, : job_L.size] = job_L
    return out


def _host(tree):
    from m2po_jax.parallel import placement

    return placement.to_host(tree)


def _finished(state: _State) -> jax.Array:
    return jnp.all(state.done_J)


# ------------------------------------------------------------------------- the pool


def _pop(state: _State, need_L) -> tuple[_State, jax.Array]:
    """A free page for each lane that needs one (NP for the others)."""
    n = state.free_N.shape[0]
    top = state.free_1[0]
    index_L = top - jnp.cumsum(need_L.astype(jnp.int32))
    page_L = jnp.where(need_L, state.free_N[jnp.clip(index_L, 0, n - 1)], n)
    free_1 = state.free_1 - jnp.sum(need_L, dtype=jnp.int32)
    return state.replace(free_1=free_1, peak_1=jnp.maximum(state.peak_1, n - free_1)), page_L


def _push(state: _State, pages_X) -> _State:
    """Returns pages to the pool (NP entries are skipped)."""
    n = state.free_N.shape[0]
    pages_X = pages_X.reshape(-1)
    keep = pages_X < n
    at = state.free_1[0] + jnp.cumsum(keep.astype(jnp.int32)) - 1
    free_N = state.free_N.at[jnp.where(keep, at, n)].set(pages_X, mode="drop")
    return state.replace(free_N=free_N, free_1=state.free_1 + jnp.sum(keep, dtype=jnp.int32))


# ------------------------------------------------------------------------- programs


def _view(
    state: _State, rows_table, own_len, inst, *, grouped: bool, n: int, fresh: bool = False
) -> paged.PagedView:
    pool_pages = state.free_N.shape[0]
    # The prompt part is each prompt's full pages; its last, partly filled page is copied
    # into each sequence's first own page (`_copy_tails`).
    table_IxM = state.prompt_table_IxM
    len_I = state.prompt_len_I - state.prompt_len_I % state.pool.page_size
    members_IxN = rank_B = live = None
    instance_widths = ()
    if grouped:
        # Only the instances with a live row: at most one per row, so a step with fewer
        # rows than prompts reads min(I, B) prompts' pages, not every prompt's.
        instances, rows = table_IxM.shape[0], inst.shape[0]
        if rows < instances:
            live_I = jnp.zeros(instances, bool).at[inst].set(True, mode="drop")
            (live_C,) = jnp.nonzero(live_I, size=rows, fill_value=instances)
            slot_I = jnp.full(instances + 1, rows, jnp.int32)
            slot_I = slot_I.at[live_C].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
            inst = slot_I[jnp.minimum(inst, instances)]
            real_C = live_C < instances
            live_C = jnp.minimum(live_C, instances - 1)
            table_IxM = jnp.where(real_C[:, None], table_IxM[live_C], pool_pages)
            len_I = jnp.where(real_C, len_I[live_C], 0)
            # Live ones first: a step reads as many as are live (bucketed from a full
            # group's rows: rows / n when every live row's group is whole).
            live = jnp.sum(real_C, dtype=jnp.int32)
            instance_widths = paged.buckets(rows, smallest=-(-rows // n))
        members_IxN, rank_B = paged.members(inst, table_IxM.shape[0], n)
    own_pages = jnp.max(jnp.sum(rows_table < pool_pages, axis=1))  # free rows hold none
    return paged.PagedView(
        own_table_BxM=rows_table,
        own_len_B=own_len,
        inst_B=inst,
        prompt_table_IxM=table_IxM,
        prompt_len_I=len_I,
        members_IxN=members_IxN,
        rank_B=rank_B,
        own_pages=own_pages,
        prompt_pages=jnp.max(jnp.sum(table_IxM < pool_pages, axis=1)),
        own_widths=paged.buckets(rows_table.shape[1]),
        prompt_widths=paged.buckets(table_IxM.shape[1]),
        instances=live,
        instance_widths=instance_widths,
        fresh=fresh,
    )


def _prefill(params, tokens_QxP, valid_QxP, version, *, model_config, sampling_config, size):
    """An empty state with every prompt's real tokens written into its pages, and their
    next-token logits."""
    tokens_QxP, valid_QxP = tokens_QxP.astype(jnp.int32), valid_QxP.astype(bool)
    prompts, width = tokens_QxP.shape
    n_pages, per = size["pages"], size["prompt"]
    pool = paged.init_pool(model_config, n_pages, size["page_size"], layout=size["layout"])
    len_Q = jnp.sum(valid_QxP, axis=1, dtype=jnp.int32)
    # Left-padded -> from column 0 (the pages hold real tokens only).
    col_QxP = jnp.minimum(jnp.arange(width)[None] + (width - len_Q)[:, None], width - 1)
    tokens = jnp.take_along_axis(tokens_QxP, col_QxP, axis=1)
    valid = jnp.arange(width)[None] < len_Q[:, None]
    # The prompts' pages are the pool's first ones, prompt after prompt; the rest are free.
    used_QxM = jnp.arange(per)[None] < (-(-len_Q // size["page_size"]))[:, None]
    ids = jnp.cumsum(used_QxM.reshape(-1), dtype=jnp.int32).reshape(prompts, per) - 1
    table_QxM = jnp.where(used_QxM, ids, n_pages)
    state = _empty(pool, table_QxM, len_Q, version, size, model_config, sampling_config)
    none_Q = jnp.full((prompts,), prompts, jnp.int32)
    view = _view(state, table_QxM, jnp.zeros(prompts, jnp.int32), none_Q, grouped=False, n=1,
                 fresh=True)  # fmt: skip
    positions = jnp.broadcast_to(jnp.arange(width), (prompts, width))
    hidden, pool = model_lib.apply(
        params, model_config, tokens, positions, valid, hidden_only=True, paged=(pool, view)
    )
    last_QxE = hidden[jnp.arange(prompts), jnp.maximum(len_Q - 1, 0)]
    logits = model_lib.dense(last_QxE, model_lib.head_weight(params, model_config))
    used = jnp.sum(used_QxM, dtype=jnp.int32)
    free_N = (jnp.arange(n_pages, dtype=jnp.int32) + used) % n_pages  # the free ones first
    return state.replace(
        pool=pool,
        logits_IxV=logits.astype(jnp.float32),
        free_N=free_N,
        free_1=jnp.full((1,), n_pages, jnp.int32) - used,
        peak_1=jnp.full((1,), used, jnp.int32),
    )


def _empty(pool, table_QxM, len_Q, version, size, model_config, sampling_config) -> _State:
    slots, jobs, new = size["slots"], size["jobs"], sampling_config.max_new_tokens
    n_pages = pool.pages
    zeros_S = jnp.zeros(slots, jnp.int32)
    return _State(
        pool=pool,
        free_N=jnp.arange(n_pages, dtype=jnp.int32),
        free_1=jnp.full((1,), n_pages, jnp.int32),
        prompt_table_IxM=table_QxM.astype(jnp.int32),
        prompt_len_I=len_Q,
        logits_IxV=jnp.zeros((table_QxM.shape[0], model_config.vocab_size), jnp.float32),
        prefill_version=jnp.asarray(version, jnp.int32),
        job_S=zeros_S + jobs,
        step_S=zeros_S,
        last_token_S=zeros_S + sampling_config.pad_id,
        live_S=jnp.zeros(slots, bool),
        held_S=jnp.zeros(slots, bool),
        own_table_SxM=jnp.full((slots, size["own"]), n_pages, jnp.int32),
        age_S=zeros_S,
        admitted_1=jnp.zeros(1, jnp.int32),
        next_job_1=jnp.zeros(1, jnp.int32),
        waiting_J=jnp.zeros(jobs, bool),
        unit_J=jnp.zeros(jobs, jnp.int32),
        seq_id_J=jnp.arange(jobs, dtype=jnp.int32),
        tokens_JxN=jnp.full((jobs, new), sampling_config.pad_id, jnp.int32),
        logp_JxN=jnp.zeros((jobs, new), jnp.float32),
        valid_JxN=jnp.zeros((jobs, new), bool),
        sampled_JxN=jnp.zeros((jobs, new), bool),
        version_JxN=jnp.zeros((jobs, new), jnp.int32) + version,
        stopped_J=jnp.zeros(jobs, bool),
        done_J=jnp.zeros(jobs, bool),
        decode_steps_1=jnp.zeros(1, jnp.int32),
        live_steps_1=jnp.zeros(1, jnp.int32),
        preemptions_1=jnp.zeros(1, jnp.int32),
        peak_1=jnp.zeros(1, jnp.int32),
        experts_JxNxLxK=sampling.no_experts(model_config, jobs, new)
        if sampling_config.record_experts
        else None,
    )


def _insert(
    state: _State, keys_U, lanes: int, n_samples: int, sampling_config, turns=False
) -> _State:
    """Starts up to `lanes` queued sequences in free slots (none while a preempted one
    waits: it goes first); their first token is drawn from their prompt's prefill (with
    `turns` a first token that ends the turn holds the slot for the host)."""
    slots, jobs = state.job_S.shape[0], state.done_J.shape[0]
    free_S = (state.job_S == jobs) & ~jnp.any(state.waiting_J)
    (slot_L,) = jnp.nonzero(free_S, size=lanes, fill_value=slots)
    job_L = state.next_job_1[0] + jnp.arange(lanes, dtype=jnp.int32)
    use_L = (slot_L < slots) & (job_L < jobs)
    slot_L = jnp.where(use_L, slot_L, slots)
    job_L = jnp.where(use_L, job_L, jobs)
    prompt_L = jnp.minimum(job_L // n_samples, state.prompt_len_I.shape[0] - 1)
    zero_L = jnp.zeros(lanes, jnp.int32)
    token_L, logp_L = sampling.sample_token(
        state.logits_IxV[prompt_L], _sequence_keys(keys_U, state, job_L, zero_L), sampling_config
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = use_L & (stop_L | (sampling_config.max_new_tokens == 1))
    state = _write_tokens(
        state, job_L, zero_L, token_L, logp_L, state.prefill_version, use_L & stop_L, ends_L,
        turns=turns,
    )  # fmt: skip
    age_L = state.admitted_1[0] + jnp.arange(lanes, dtype=jnp.int32)
    take_L = use_L if turns else use_L & ~ends_L
    slot_go = jnp.where(take_L, slot_L, slots)
    if turns:
        state = state.replace(held_S=state.held_S.at[slot_go].set(ends_L, mode="drop"))
    return state.replace(
        job_S=state.job_S.at[slot_go].set(job_L, mode="drop"),
        step_S=state.step_S.at[slot_go].set(1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_go].set(token_L, mode="drop"),
        live_S=state.live_S.at[slot_go].set(~ends_L, mode="drop"),
        age_S=state.age_S.at[slot_go].set(age_L, mode="drop"),
        admitted_1=state.admitted_1 + jnp.sum(use_L, dtype=jnp.int32),
        next_job_1=state.next_job_1 + jnp.sum(use_L, dtype=jnp.int32),
    )


def _preempt(state: _State, need_S) -> tuple[_State, jax.Array]:
    """When the step needs more pages than are free: the youngest live sequences give
    theirs back and wait (as few as cover the need). Returns the slots still decoding.
    Most steps have the pages: the sort and the bookkeeping run only when they do not."""
    enough = state.free_1[0] >= jnp.sum(need_S, dtype=jnp.int32)
    return jax.lax.cond(enough, lambda s, need: (s, s.live_S), _preempt_youngest, state, need_S)


def _preempt_youngest(state: _State, need_S) -> tuple[_State, jax.Array]:
    """`_preempt` when the pool is short."""
    n_pages = state.free_N.shape[0]
    jobs = state.done_J.shape[0]
    live = state.live_S
    held_S = jnp.sum(state.own_table_SxM < n_pages, axis=1, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(live, -state.age_S, jnp.iinfo(jnp.int32).max), stable=True)
    total = jnp.sum(need_S, dtype=jnp.int32)
    freed_k = jnp.cumsum(held_S[order]) + 0
    needless_k = jnp.cumsum(need_S[order].astype(jnp.int32))
    # k victims: the first k of `order`; enough when free + freed >= the others' need.
    ok_k = state.free_1[0] + freed_k >= total - needless_k
    k = jnp.argmax(ok_k) + 1
    victim_S = jnp.zeros_like(live).at[order].set(jnp.arange(order.size) < k) & live
    state = _push(state, jnp.where(victim_S[:, None], state.own_table_SxM, n_pages))
    job_victims = jnp.where(victim_S, state.job_S, jobs)
    return state.replace(
        waiting_J=state.waiting_J.at[job_victims].set(True, mode="drop"),
        own_table_SxM=jnp.where(victim_S[:, None], n_pages, state.own_table_SxM),
        job_S=jnp.where(victim_S, jobs, state.job_S),
        live_S=live & ~victim_S,
        preemptions_1=state.preemptions_1 + jnp.sum(victim_S, dtype=jnp.int32),
    ), live & ~victim_S


def _decode(
    state: _State, params, keys_U, version, *, model_config, sampling_config, n, turns=False
):
    """One token for every live slot: a page where its pending token starts one
    (preempting the youngest when the pool is short), the step, the token written. With
    `turns` a slot whose turn ends is held, its pages kept (parked) for the host."""
    jobs = state.done_J.shape[0]
    pg = state.pool.page_size
    n_pages = state.free_N.shape[0]
    prompts = state.prompt_len_I.shape[0]
    inst_S = jnp.minimum(state.job_S // n, prompts - 1)
    # Own tokens in the cache (the prompt's tail, then the completion but its pending
    # token, which goes next): a page where that token starts one.
    own_len_S = _tails(state, inst_S) + state.step_S - 1
    first_S = state.own_table_SxM[:, 0] >= n_pages  # no own page yet: the tail's goes first
    need_S = state.live_S & ((own_len_S % pg == 0) | first_S)
    state, live_S = _preempt(state, need_S)
    need_S = need_S & live_S
    state, page_S = _pop(state, need_S)
    col_S = jnp.where(need_S, own_len_S // pg, state.own_table_SxM.shape[1])
    slots = jnp.arange(state.job_S.shape[0])
    own_table = state.own_table_SxM.at[slots, col_S].set(page_S, mode="drop")
    state = _copy_tails(state.replace(own_table_SxM=own_table), need_S & first_S, inst_S, page_S)
    logits, pool, experts_SxLxK = _model_pass(
        params, state, live_S, own_len_S, model_config=model_config, n=n,
        record=sampling_config.record_experts,
    )  # fmt: skip
    job_S = jnp.where(live_S, state.job_S, jobs)
    if experts_SxLxK is not None:  # the fed (pending) token's, at its column step - 1
        experts = state.experts_JxNxLxK.at[job_S, state.step_S - 1].set(experts_SxLxK, mode="drop")
        state = state.replace(experts_JxNxLxK=experts)
    token_S, logp_S = sampling.sample_token(
        logits, _sequence_keys(keys_U, state, job_S, state.step_S), sampling_config
    )
    stop_S = live_S & sampling.is_stop(token_S, sampling_config.stop_token_ids)
    ends_S = stop_S | (live_S & (state.step_S + 1 >= sampling_config.max_new_tokens))
    state = _write_tokens(
        state, job_S, state.step_S, token_S, logp_S, version, stop_S, ends_S, turns=turns
    )
    state = state.replace(pool=pool)
    if turns:  # a turn's end parks its sequence: slot and pages kept for the host's answer
        state = state.replace(held_S=state.held_S | ends_S)
    else:  # ended sequences give their pages back and free their slot
        state = _push(state, jnp.where(ends_S[:, None], own_table, n_pages))
        state = state.replace(
            own_table_SxM=jnp.where(ends_S[:, None], n_pages, own_table),
            job_S=jnp.where(ends_S, jobs, state.job_S),
        )
    return state.replace(
        step_S=state.step_S + live_S,
        last_token_S=jnp.where(live_S, token_S, state.last_token_S),
        live_S=live_S & ~ends_S,
        decode_steps_1=state.decode_steps_1 + 1,
        live_steps_1=state.live_steps_1 + jnp.sum(live_S, dtype=jnp.int32),
    )


def _model_pass(params, state: _State, live_S, own_len_S, *, model_config, n, record=False):
    """The model's pass of a decode step: each live slot's pending token at own position
    `own_len_S` (its pages already taken), written into its pages and attended. Returns
    (next-token logits [S, V], the new pool, with `record` the pending tokens' experts
    [S, L, K] (-1 on slots not live), else None)."""
    prompts = state.prompt_len_I.shape[0]
    inst_S = jnp.where(live_S, jnp.minimum(state.job_S // n, prompts - 1), prompts)
    view = _view(state, state.own_table_SxM, own_len_S, inst_S, grouped=True, n=n)
    positions = state.prompt_len_I[jnp.minimum(inst_S, prompts - 1)] + state.step_S - 1
    out = model_lib.apply(
        params, model_config, state.last_token_S[:, None], positions[:, None],
        live_S[:, None], last_only=True, paged=(state.pool, view), return_routing=record,
    )  # fmt: skip
    experts_SxLxK = None
    if record:
        out, routing = out
        experts_SxLxK = sampling.fed_experts(routing, live_S)
    logits, pool = out
    return logits[:, 0], pool, experts_SxLxK


def _model_step(params, state: _State, *, model_config, n):
    """`_decode`'s model pass over every slot as it stands (no page bookkeeping, no
    sampling): the decode roofline's probe. Returns (next-token logits [S, V], the state
    with the step's keys and values written)."""
    prompts = state.prompt_len_I.shape[0]
    own_len_S = _tails(state, jnp.minimum(state.job_S // n, prompts - 1)) + state.step_S - 1
    logits, pool, _ = _model_pass(
        params, state, state.live_S, own_len_S, model_config=model_config, n=n
    )
    return logits, state.replace(pool=pool)


def _run(
    params, state, keys_U, version, max_steps, *, model_config, sampling_config, lanes, n,
    turns=False,
):  # fmt: skip
    """Insert, then decode, until every sequence is done, `max_steps` decode steps ran, or
    a preempted sequence waits (the host resumes it) or nothing is live (with `turns`:
    or a turn ended in this call, for the host to take)."""
    first = state.decode_steps_1[0]
    jobs = state.done_J.shape[0]
    held_before_S = state.held_S

    def cond(state):
        queued = state.next_job_1[0] < jobs
        waiting = jnp.any(state.waiting_J)
        free_slot = jnp.any(state.job_S == jobs)
        going = jnp.any(state.live_S) | (queued & ~waiting & free_slot)
        steps = state.decode_steps_1[0] - first < max_steps
        go = going & ~_finished(state) & steps & ~_resumable_now(state)
        return go & ~jnp.any(state.held_S & ~held_before_S) if turns else go

    def body(state):
        refill = jnp.any(state.job_S == jobs) & (state.next_job_1[0] < jobs)
        state = jax.lax.cond(
            refill,
            lambda s: _insert(s, keys_U, lanes, n, sampling_config, turns),
            lambda s: s,
            state,
        )
        return jax.lax.cond(
            jnp.any(state.live_S),
            lambda s: _decode(
                s,
                params,
                keys_U,
                version,
                model_config=model_config,
                sampling_config=sampling_config,
                n=n,
                turns=turns,
            ),  # fmt: skip
            lambda s: s,
            state,
        )

    return jax.lax.while_loop(cond, body, state)


def _tails(state: _State, inst_X) -> jax.Array:
    """Tokens of each prompt instance's last, partly filled page (0: its pages are full)."""
    lengths = state.prompt_len_I[jnp.minimum(inst_X, state.prompt_len_I.shape[0] - 1)]
    return lengths % state.pool.page_size


def _copy_tails(state: _State, copy_X, inst_X, page_X) -> _State:
    """Where `copy_X`: the prompt's partly filled last page copied into `page_X`, the
    sequence's first own page (vLLM's layout: the one copy a sample makes of its prompt).
    Every call reads X pages and writes those it copies (the others' writes are dropped),
    with no branch around the pool: compiled for a TPU with whole-page copies, a
    `lax.cond` here made XLA copy every layer's pool in both branches, every step."""
    pg, n_pages = state.pool.page_size, state.free_N.shape[0]
    inst = jnp.minimum(inst_X, state.prompt_len_I.shape[0] - 1)
    copy_X = copy_X & (_tails(state, inst) > 0)
    last_X = state.prompt_table_IxM[inst, state.prompt_len_I[inst] // pg]
    to_X = jnp.where(copy_X, page_X, n_pages)
    return state.replace(pool=paged.copy_pages(state.pool, last_X, to_X))


def _resume_need(state: _State, job) -> jax.Array:
    """Pages a preempted sequence takes to resume and decode its pending token: those of
    all its tokens so far (at most a whole completion's: it always fits an empty pool)."""
    tokens = jnp.sum(state.valid_JxN[job], dtype=jnp.int32)
    inst = job // (state.done_J.shape[0] // state.prompt_len_I.shape[0])
    return -(-(tokens + _tails(state, inst)) // state.pool.page_size)


def _resumable_now(state: _State) -> jax.Array:
    """The oldest preempted sequence can resume: a free slot and its pages."""
    jobs = state.done_J.shape[0]
    first = jnp.argmax(state.waiting_J)
    return (
        jnp.any(state.waiting_J)
        & jnp.any(state.job_S == jobs)
        & (state.free_1[0] >= _resume_need(state, first))
    )


def _resume(params, state: _State, job_L, version, *, model_config, sampling_config, n, width):
    """Resumes preempted sequences `job_L` (J: unused lane) in free slots: their tokens so
    far but the last are recomputed into new pages by a prefill in chunks of
    `paged.RESUME_CHUNK` tokens (each attends to the pages the chunks before it wrote: the
    activations and scores held are a chunk's, not the whole width's); the last is
    pending, as a decode step left it."""
    del version
    slots, jobs = state.job_S.shape[0], state.done_J.shape[0]
    new = state.tokens_JxN.shape[1]
    n_pages = state.free_N.shape[0]
    pg = state.pool.page_size
    lanes = job_L.shape[0]
    (slot_L,) = jnp.nonzero(state.job_S == jobs, size=lanes, fill_value=slots)
    use_L = (job_L < jobs) & (slot_L < slots)
    j_L = jnp.minimum(job_L, jobs - 1)
    step_L = jnp.sum(state.valid_JxN[j_L], axis=1, dtype=jnp.int32)
    own_L = jnp.where(use_L, step_L - 1, 0)  # tokens to recompute
    prompts = state.prompt_len_I.shape[0]
    inst_L = jnp.where(use_L, jnp.minimum(j_L // n, prompts - 1), prompts)
    tail_L = jnp.where(use_L, _tails(state, inst_L), 0)  # copied, not recomputed
    pages_L = -(-(tail_L + own_L) // pg)
    m = state.own_table_SxM.shape[1]
    need_LxM = use_L[:, None] & (jnp.arange(m)[None] < pages_L[:, None])
    state, flat = _pop(state, need_LxM.reshape(-1))
    table_LxM = flat.reshape(lanes, m)
    state = _copy_tails(state, need_LxM[:, 0], inst_L, table_LxM[:, 0])
    tokens_LxW = jnp.take(state.tokens_JxN[j_L], jnp.arange(width), axis=1, mode="fill",
                          fill_value=sampling_config.pad_id)  # fmt: skip
    prompt_L = state.prompt_len_I[jnp.minimum(inst_L, prompts - 1)]
    chunk = min(width, paged.RESUME_CHUNK)  # both powers of two: chunks tile the width

    record = sampling_config.record_experts

    def recompute(carry):  # chunk c: columns c * chunk .. into the pages after its own
        c, pool, experts_JxNxLxK = carry
        start = c * chunk
        cols = start + jnp.arange(chunk)
        tokens = jax.lax.dynamic_slice_in_dim(tokens_LxW, start, chunk, axis=1)
        valid = (cols[None] < own_L[:, None]) & use_L[:, None]
        view = _view(state.replace(pool=pool), table_LxM, tail_L + start, inst_L,
                     grouped=False, n=n)  # fmt: skip
        out = model_lib.apply(
            params, model_config, tokens, prompt_L[:, None] + cols, valid, hidden_only=True,
            paged=(pool, view), return_routing=record,
        )  # fmt: skip
        if record:  # the recomputed sampled tokens' experts replace the decode steps'
            out, (_, experts_LxCxLxK) = out
            sampled = valid & state.sampled_JxN[j_L[:, None], jnp.minimum(cols, new - 1)[None]]
            rows = jnp.where(sampled, j_L[:, None], jobs)
            experts_JxNxLxK = experts_JxNxLxK.at[rows, cols[None]].set(
                experts_LxCxLxK.astype(sampling.EXPERTS_DTYPE), mode="drop"
            )
        _, pool = out
        return c + 1, pool, experts_JxNxLxK

    carry = (0, state.pool, state.experts_JxNxLxK)
    if chunk == width:  # one pass (no loop: XLA holds less around it)
        _, pool, experts = recompute(carry)
    else:
        chunks = -(-jnp.max(own_L) // chunk)
        _, pool, experts = jax.lax.while_loop(lambda cp: cp[0] < chunks, recompute, carry)
    state = state.replace(experts_JxNxLxK=experts)
    slot_go = jnp.where(use_L, slot_L, slots)
    job_go = jnp.where(use_L, job_L, jobs)
    age_L = state.admitted_1[0] + jnp.arange(lanes, dtype=jnp.int32)
    last_L = state.tokens_JxN[j_L, jnp.maximum(step_L - 1, 0)]
    del n_pages
    return state.replace(
        pool=pool,
        job_S=state.job_S.at[slot_go].set(job_L, mode="drop"),
        step_S=state.step_S.at[slot_go].set(step_L, mode="drop"),
        last_token_S=state.last_token_S.at[slot_go].set(last_L, mode="drop"),
        live_S=state.live_S.at[slot_go].set(True, mode="drop"),
        own_table_SxM=state.own_table_SxM.at[slot_go].set(table_LxM, mode="drop"),
        age_S=state.age_S.at[slot_go].set(age_L, mode="drop"),
        admitted_1=state.admitted_1 + jnp.sum(use_L, dtype=jnp.int32),
        waiting_J=state.waiting_J.at[job_go].set(False, mode="drop"),
    )


def _append(
    params, state: _State, keys_U, slot_L, delta_LxM, len_L, version, *, model_config,
    sampling_config, n,
):  # fmt: skip
    """Appends host tokens to held slots' sequences and resumes them (multi-turn).

    Lane l (slot `slot_L[l]`, out of range = unused) takes `delta_LxM[l, :len_L[l]]`: they
    are written into its sequence's row (valid, not sampled, version -1). Lanes whose
    pages the pool holds (in lane order) take them, run the turn's pending token and the
    appended ones through the model into their own pages (one multi-token paged forward
    from their cached own tokens: the history is never recomputed) and draw the next
    turn's first token from the last one's logits. The others give their pages and slot
    back and wait, as preempted sequences do: a resume recomputes their row, appended
    tokens included, and its decode step draws that token under the same key. The host
    guarantees that step + len < max_new_tokens.
    """
    slots, jobs = state.job_S.shape[0], state.done_J.shape[0]
    n_pages, pg = state.free_N.shape[0], state.pool.page_size
    lanes, m = delta_LxM.shape
    use_L = slot_L < slots
    s_L = jnp.minimum(slot_L, slots - 1)
    job_L = jnp.where(use_L, state.job_S[s_L], jobs)
    step_L = state.step_S[s_L]  # the sequence's tokens; its last is not in the cache yet
    state = _write_appended(state, job_L, step_L, use_L, delta_LxM, len_L)
    table_LxM = state.own_table_SxM[s_L]
    prompts = state.prompt_len_I.shape[0]
    tail_L = _tails(state, jnp.minimum(job_L // n, prompts - 1))
    have_L = jnp.sum(table_LxM < n_pages, axis=1, dtype=jnp.int32)
    need_L = jnp.where(use_L, -(-(tail_L + step_L + len_L) // pg) - have_L, 0)
    go_L = use_L & (jnp.cumsum(need_L) <= state.free_1[0])
    out_L = use_L & ~go_L
    col_M = jnp.arange(table_LxM.shape[1])
    new_LxM = go_L[:, None] & (col_M >= have_L[:, None]) & (col_M < (have_L + need_L)[:, None])
    state, flat = _pop(state, new_LxM.reshape(-1))
    table_LxM = jnp.where(new_LxM, flat.reshape(new_LxM.shape), table_LxM)
    inst_L = jnp.where(go_L, jnp.minimum(job_L // n, prompts - 1), prompts)
    state = _copy_tails(state, new_LxM[:, 0], inst_L, table_LxM[:, 0])  # a turn's first pages
    t_T = jnp.arange(m + 1, dtype=jnp.int32)
    tokens_LxT = jnp.concatenate([state.last_token_S[s_L][:, None], delta_LxM], axis=1)
    valid_LxT = go_L[:, None] & (t_T[None] <= len_L[:, None])
    own_L = jnp.where(go_L, tail_L + step_L - 1, 0)
    view = _view(state, jnp.where(go_L[:, None], table_LxM, n_pages), own_L, inst_L,
                 grouped=False, n=n)  # fmt: skip
    start_L = state.prompt_len_I[jnp.minimum(inst_L, prompts - 1)] + step_L - 1
    positions_LxT = start_L[:, None] + t_T
    out = model_lib.apply(
        params, model_config, tokens_LxT, positions_LxT, valid_LxT, hidden_only=True,
        paged=(state.pool, view), return_routing=sampling_config.record_experts,
    )  # fmt: skip
    if sampling_config.record_experts:  # the pending token's (column step - 1); appended: -1
        out, (_, experts_LxTxLxK) = out
        at = (jnp.where(go_L, job_L, jobs), step_L - 1)
        fed_LxLxK = experts_LxTxLxK[:, 0].astype(sampling.EXPERTS_DTYPE)
        state = state.replace(
            experts_JxNxLxK=state.experts_JxNxLxK.at[at].set(fed_LxLxK, mode="drop")
        )
    hidden_LxTxE, pool = out
    logits_LxV = model_lib.dense(
        hidden_LxTxE[jnp.arange(lanes), len_L], model_lib.head_weight(params, model_config)
    )
    draw_L = step_L + len_L  # the drawn token's index
    job_go = jnp.where(go_L, job_L, jobs)
    token_L, logp_L = sampling.sample_token(
        logits_LxV.astype(jnp.float32),
        _sequence_keys(keys_U, state, job_go, draw_L),
        sampling_config,
    )
    stop_L = sampling.is_stop(token_L, sampling_config.stop_token_ids)
    ends_L = stop_L | (draw_L + 1 >= sampling_config.max_new_tokens)
    state = _write_tokens(
        state, job_go, draw_L, token_L, logp_L, version, stop_L, ends_L, turns=True
    )
    slot_go, slot_out = jnp.where(go_L, slot_L, slots), jnp.where(out_L, slot_L, slots)
    state = _push(state.replace(pool=pool), jnp.where(out_L[:, None], table_LxM, n_pages))
    own = state.own_table_SxM.at[slot_go].set(table_LxM, mode="drop")
    return state.replace(
        own_table_SxM=own.at[slot_out].set(n_pages, mode="drop"),
        step_S=state.step_S.at[slot_go].set(draw_L + 1, mode="drop"),
        last_token_S=state.last_token_S.at[slot_go].set(token_L, mode="drop"),
        live_S=state.live_S.at[slot_go].set(~ends_L, mode="drop"),
        held_S=state.held_S.at[slot_go]
        .set(ends_L, mode="drop")
        .at[slot_out]
        .set(False, mode="drop"),
        job_S=state.job_S.at[slot_out].set(jobs, mode="drop"),
        waiting_J=state.waiting_J.at[jnp.where(out_L, job_L, jobs)].set(True, mode="drop"),
        preemptions_1=state.preemptions_1 + jnp.sum(out_L, dtype=jnp.int32),
    )


def _write_appended(state: _State, job_L, step_L, use_L, delta_LxM, len_L) -> _State:
    """Writes each lane's appended tokens into its sequence's row from column `step_L`:
    valid, not sampled (no loss), version -1 (padding lanes and columns dropped)."""
    jobs = state.done_J.shape[0]
    t_M = jnp.arange(delta_LxM.shape[1], dtype=jnp.int32)
    col_LxM = step_L[:, None] + t_M[None]
    row_LxM = jnp.where(use_L[:, None] & (t_M[None] < len_L[:, None]), job_L[:, None], jobs)
    return state.replace(
        tokens_JxN=state.tokens_JxN.at[row_LxM, col_LxM].set(delta_LxM, mode="drop"),
        valid_JxN=state.valid_JxN.at[row_LxM, col_LxM].set(True, mode="drop"),
        version_JxN=state.version_JxN.at[row_LxM, col_LxM].set(-1, mode="drop"),
    )


def _release(state: _State, slot_L, stopped_L) -> _State:
    """Ends the episodes in held slots `slot_L` (out of range = unused): their sequences
    are done (`stopped_L`: ended as the episode should, not cut by a budget), their pages
    back in the pool and their slots free."""
    slots, jobs = state.job_S.shape[0], state.done_J.shape[0]
    n_pages = state.free_N.shape[0]
    use_L = slot_L < slots
    s_L = jnp.minimum(slot_L, slots - 1)
    job_L = jnp.where(use_L, state.job_S[s_L], jobs)
    state = _push(state, jnp.where(use_L[:, None], state.own_table_SxM[s_L], n_pages))
    return state.replace(
        own_table_SxM=state.own_table_SxM.at[slot_L].set(n_pages, mode="drop"),
        held_S=state.held_S.at[slot_L].set(False, mode="drop"),
        job_S=state.job_S.at[slot_L].set(jobs, mode="drop"),
        stopped_J=state.stopped_J.at[job_L].set(stopped_L, mode="drop"),
        done_J=state.done_J.at[job_L].set(True, mode="drop"),
    )


def _finish(state: _State, tokens_QxP, valid_QxP, *, n_samples: int):
    """The `SampleOutput` of the finished sequences (rows in prompt order), their versions
    and the pool's counters."""
    out, version_JxN, _ = slots_lib._finish(state, tokens_QxP, valid_QxP, n_samples=n_samples)
    counters = (state.decode_steps_1, state.live_steps_1, state.preemptions_1, state.peak_1)
    return out, version_JxN, counters


def _programs(model_config, sampling_config, n_samples, size, mesh, turns=False) -> dict:
    """The jitted phases; on a mesh `shard_map`s over its row axes, one engine per batch
    shard (`size` is a shard's), the params replicated over them and every state leaf
    split by rows but the prefill's version ("tensor" left to XLA: the pool's KV heads
    split over it). With `turns` those of `PagedEngine.episodes`, "append" and
    "release" included: one program each over the whole mesh, partitioned by XLA."""
    statics = dict(model_config=model_config, sampling_config=sampling_config)
    on = (lambda fn, *_: fn) if mesh is None else (lambda fn, *_: sharding.on_mesh(fn, mesh))
    if mesh is not None and not turns:
        from jax.sharding import PartitionSpec as P

        rows, rep = P(row_axes(mesh)), P()
        names = [field.name for field in dataclasses.fields(_State)]
        state = _State(**dict.fromkeys(names, rows)).replace(prefill_version=rep)
        if size["layout"] == paged.SPLIT:  # [2, K, NP, PG, D]: pages on the third axis
            layers = model_config.num_layers
            pages = P(None, None, row_axes(mesh))
            state = state.replace(pool=paged.PagedPool(kv=(pages,) * layers, layout=paged.SPLIT))
        specs = {  # (in_specs, out_specs) by phase
            "prefill": ((rep, rows, rows, rep), state),
            "start": ((state, rep, rows, rows), state),
            "run": ((rep, state, rep, rep, rep), state),
            "resume": ((rep, state, rows, rep), state),
            "probe": ((rep, state), (rows, state)),
        }

        # Manual over the row axes; "tensor" is left to XLA, the pool's KV heads split over
        # it (when they divide) and the params as they come (the sampling layout).
        tensor = mesh.shape.get("tensor", 1)
        manual = set(row_axes(mesh))

        def split_heads(fn):
            def constrained(*args):  # the state, or (..., the state)
                out = fn(*args)
                state = out[-1] if isinstance(out, tuple) else out
                heads = P()
                if model_config.num_kv_heads % tensor == 0:
                    heads = P(*[None] * state.pool.heads_axis, "tensor")
                pool = jax.tree.map(
                    lambda x: jax.lax.with_sharding_constraint(x, heads), state.pool
                )
                state = state.replace(pool=pool)
                return (*out[:-1], state) if isinstance(out, tuple) else state

            return constrained

        def on(fn, phase):  # traced with the mesh in context (`sharding.on_mesh`)
            in_specs, out_specs = specs[phase]
            fn = jax.shard_map(
                split_heads(fn), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                axis_names=manual, check_vma=False,
            )  # fmt: skip
            return sharding.on_mesh(fn, mesh)

    def prefill(params, tokens, valid, version):
        return _prefill(params, tokens, valid, version, **statics, size=size)

    def start(state, keys_U, unit_J, seq_id_J):
        state = state.replace(unit_J=unit_J.astype(jnp.int32), seq_id_J=seq_id_J.astype(jnp.int32))
        return _insert(state, keys_U, size["slots"], n_samples, sampling_config, turns)

    resumes: dict = {}

    def resume(width: int, lanes: int):
        if (width, lanes) not in resumes:
            fn = functools.partial(_resume, **statics, n=n_samples, width=width)
            resumes[width, lanes] = jax.jit(on(fn, "resume"), donate_argnums=(1,))
        return resumes[width, lanes]

    run = functools.partial(_run, **statics, lanes=size["lanes"], n=n_samples, turns=turns)
    probe = functools.partial(_model_step, model_config=model_config, n=n_samples)
    programs = {
        "probe": jax.jit(on(probe, "probe"), donate_argnums=(1,)),
        "prefill": jax.jit(on(prefill, "prefill")),
        "start": jax.jit(on(start, "start"), donate_argnums=(0,)),
        "run": jax.jit(on(run, "run"), donate_argnums=(1,)),
        "resume": resume,
        "finish": jax.jit(functools.partial(_finish, n_samples=n_samples)),
    }
    if turns:
        append = functools.partial(_append, **statics, n=n_samples)
        programs["append"] = jax.jit(on(append), donate_argnums=(1,))
        programs["release"] = jax.jit(on(_release), donate_argnums=(0,))
    return programs
