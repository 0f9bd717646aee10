"""The static engine: `sampling.generate`, one batch decoded until its longest row stops.

Layout and keys are the sampler's: rows b * n .. b * n + n - 1 answer prompt b, the
completions start at column P, and token column t of the whole batch is drawn with one key
derived from the call's rng (`sampling.generate`), so the same key gives the same tokens.
Every row decodes until the batch's longest completion ends; the engine takes no weights in
flight (`weights` is ignored) and every token gets the call's `version`. Greedy decoding
gives the same completions as the continuous engine's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from m2po_jax.parallel import placement
from m2po_jax.rollout import sampling
from m2po_jax.rollout.engines.base import EngineProgram, Generation, RolloutEngine, register


@register("static")
class StaticEngine(RolloutEngine):
    """`sampling.generate`: every row decodes until the batch's longest completion ends.
    It takes no weights in flight (`weights` is ignored)."""

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
        # (an all-gather where the rows span several processes, as the caller's copy is)
        completion_len_B, steps = placement.to_host((out.completion_len_B, out.num_steps))
        # Step 0 is the prefill's token; decode steps 1 .. num_steps - 1 run every row.
        decode = int(steps) - 1
        return Generation(
            out=out,
            version_BxN=np.full((rows, new), version, np.int32),
            decode_steps=decode,
            slot_steps=decode * rows,
            live_steps=int(np.sum(np.asarray(completion_len_B) - 1)),
        )

    def programs(self, params, prompts, n_samples, *, prompt_len, max_append=0):
        """One program, "sampler": `sampling.generate`'s."""
        if max_append:
            raise self._no_episodes()
        key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
        return [
            EngineProgram(
                name="sampler",
                what=f"static sampler, {prompts} prompts x {n_samples} samples",
                jitted=sampling.generate_program(
                    self.model_config, self.sampling, n_samples, self.mesh
                ),
                args=(
                    params,
                    self._batch(jnp.int32, prompts, prompt_len),
                    self._batch(jnp.bool_, prompts, prompt_len),
                    self._replicated(key_dtype),
                ),
            )
        ]
