"""Rollout helpers: the prompt ids the policy sees, and the stale queue's order through a
checkpoint (the trainer's own save / resume)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2po_jax import trainer as trainer_lib
from m2po_jax.common.types import RolloutBatch
from m2po_jax.learner import train_step as step_lib
from m2po_jax.models import prompts as prompts_lib
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.run import checkpoint as ckpt_lib


class _Words:
    """A tokenizer stand-in: "w12 w5" -> [12, 5]; pad id 0, BOS id 1."""

    pad_id = 0
    bos_id = 1

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]


def _text(ids):
    return " ".join(f"w{i}" for i in ids)


def test_encode_prompts_keeps_the_last_tokens_left_padded():
    width = 5
    long = [11, 12, 13, 14, 15, 16, 17, 18]  # 8 tokens: over the width
    exact = [21, 22, 23, 24, 25]
    short = [31, 32]
    ids, valid = rollout_lib.encode_prompts(
        [_text(p) for p in (long, exact, short)], _Words(), width
    )
    assert ids.shape == valid.shape == (3, width) and ids.dtype == np.int32
    # An over-long prompt keeps its tail (task.long_prompts="left", verl's truncation="left"):
    # the question's end and the generation prompt, which is what the policy answers.
    np.testing.assert_array_equal(ids[0], [14, 15, 16, 17, 18])
    np.testing.assert_array_equal(valid[0], [True] * 5)
    np.testing.assert_array_equal(ids[1], exact)
    # A short one is right-aligned after pad ids: the first completion column follows it.
    np.testing.assert_array_equal(ids[2], [0, 0, 0, 31, 32])
    np.testing.assert_array_equal(valid[2], [False, False, False, True, True])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        rollout_lib.encode_prompts(["w3", ""], _Words(), width)


def test_encode_prompts_through_the_prompt_encoder_drops_the_head_with_bos():
    encoder = prompts_lib.PromptEncoder(_Words())  # no chat template: BOS + the text
    assert encoder.encode("w7 w8") == [1, 7, 8]
    ids, valid = rollout_lib.encode_prompts(["w7 w8", "w2 w3 w4 w5 w6"], encoder, 4)
    np.testing.assert_array_equal(ids, [[0, 1, 7, 8], [3, 4, 5, 6]])
    np.testing.assert_array_equal(valid, [[False, True, True, True], [True] * 4])


def _batch(i, rows=2, width=6):
    """A host rollout batch whose every field says which batch it is (i)."""
    return RolloutBatch(
        tokens_BxT=np.full((rows, width), 10 * i + 1, np.int32),
        valid_BxT=np.tile(np.arange(width) >= i, (rows, 1)),
        behav_logp_BxT=np.full((rows, width), -0.5 * (i + 1), np.float32),
        loss_mask_BxT=np.tile(np.arange(width) >= i + 1, (rows, 1)),
        prompt_len_B=np.full((rows,), i + 2, np.int32),
        completion_len_B=np.full((rows,), 5 - i, np.int32),
        stopped_B=np.full((rows,), i % 2 == 0),
        version_B=np.full((rows,), i, np.int32),
        group_id_B=np.arange(rows, dtype=np.int32) + 100 * i,
        rewards_B=np.full((rows,), 0.25 * i, np.float32),
        version_BxT=np.full((rows, width), i, np.int32) + (np.arange(width) > 3),
    )


def test_stale_queue_is_fifo():
    queue = rollout_lib.StaleQueue(2, [_batch(0), _batch(1)])
    queue.push(_batch(2))
    assert int(queue.pop().version_B[0]) == 0
    assert [int(b.version_B[0]) for b in queue.state()] == [1, 2]  # oldest first
    with pytest.raises(RuntimeError, match="popping needs more than k=2"):
        queue.pop()
    with pytest.raises(TypeError, match="RolloutBatch records, got dict"):
        queue.push(_batch(3).arrays())
    with pytest.raises(ValueError, match=r"queue item 2: lacks \['rewards_B'\]"):
        arrays = _batch(2).arrays()
        del arrays["rewards_B"]
        RolloutBatch.from_arrays(arrays, "queue item 2")
    assert rollout_lib.ROLLOUT_KEYS == tuple(_batch(0).arrays())


def _stand_in(tmp_path, queue):
    """The attributes `Trainer.save` / `Trainer.try_resume` read, without building a run."""
    state = step_lib.TrainState(
        step=jnp.int32(3),
        params={"w": jnp.arange(4, dtype=jnp.float32)},
        opt_state={"m": jnp.zeros(4, jnp.float32)},
        nonfinite_steps=jnp.int32(0),
    )
    cfg = types.SimpleNamespace(
        actor=types.SimpleNamespace(kl_ctl=0.0),
        rollout=types.SimpleNamespace(max_head_offpolicyness=queue.staleness),
    )
    return types.SimpleNamespace(
        cfg=cfg,
        state=state,
        rng=jax.random.key(7),
        queue=queue,
        data_position=5,
        sft_steps=0,
        ref_params=None,
        checkpointer=ckpt_lib.Checkpointer(tmp_path, keep=2),
        async_rollouts=None,
        lora_base=lambda: None,  # no LoRA: checkpoints hold the whole params
        model_config=types.SimpleNamespace(lora_rank=0),
    )


def test_the_queue_resumes_in_fifo_order_through_the_trainers_checkpoint(tmp_path):
    k = 3
    queue = rollout_lib.StaleQueue(k)
    for i in range(k):
        queue.push(_batch(i))
    saved = _stand_in(tmp_path, queue)
    trainer_lib.Trainer.save(saved)
    assert saved.checkpointer.all_steps() == [3]

    resumed = _stand_in(tmp_path, rollout_lib.StaleQueue(k))
    assert trainer_lib.Trainer.try_resume(resumed)
    assert resumed.queue is not queue and len(resumed.queue) == k
    restored = resumed.queue.state()
    for i, batch in enumerate(restored):
        assert isinstance(batch, RolloutBatch)
        got = batch.arrays()
        for key, value in _batch(i).arrays().items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"batch {i} {key}")
            assert got[key].dtype == value.dtype, key
    # The next steps (push the fresh batch, pop the stale one) train on the batches in the
    # order they were generated.
    popped = []
    for step in range(k + 1):
        resumed.queue.push(_batch(k + step))
        popped.append(int(resumed.queue.pop().version_B[0]))
    assert popped == [0, 1, 2, 3]


def test_scoring_on_several_threads_gives_the_same_rewards_in_order():
    import threading
    import time

    examples = [types.SimpleNamespace(answer=i) for i in range(6)]
    texts = [f"{i}" for i in range(12)]
    threads = set()

    def reward(example, text):
        threads.add(threading.get_ident())
        time.sleep(0.01 * (int(text) % 3))  # later rows may finish first
        return example.answer * 100 + int(text)

    sampled = rollout_lib.SampledRollout(_batch(0, rows=12), texts, examples, n_samples=2)
    serial = rollout_lib.score_rollout(sampled, reward).rewards_B
    threads.clear()
    pooled = rollout_lib.score_rollout(sampled, reward, workers=4).rewards_B
    np.testing.assert_array_equal(serial, [(i // 2) * 100 + i for i in range(12)])
    np.testing.assert_array_equal(pooled, serial)
    assert len(threads) > 1


def test_a_rollout_stored_before_token_versions_gives_each_token_its_rows_version():
    arrays = _batch(2).arrays()
    del arrays["version_BxT"]  # a checkpoint written before the field existed
    batch = RolloutBatch.from_arrays(arrays)
    np.testing.assert_array_equal(batch.version_BxT, np.full((2, 6), 2))
    assert batch.version_BxT.dtype == np.int32
    del arrays["version_B"]
    with pytest.raises(ValueError, match=r"queue item 0: lacks \['version_B', 'version_BxT'\]"):
        RolloutBatch.from_arrays(arrays, "queue item 0")
