"""The rollout engines on a mixture of experts (Qwen3-MoE, `model.MoE`): the static,
continuous and paged engines' behaviour log-probs, and a calculator tool episode's, are a
teacher-forced forward of the same params (the rollout's routing is the full pass's: every
token reaches its experts whatever else is in the batch, padding and dead slots included),
also when the paged engine's short pool preempts and recomputes sequences."""

import jax
import numpy as np
import pytest
from engine_test import PAD, TOKENS, VALID, WIDTH
from episodes_test import EXAMPLES, TASK, TOKENIZER, _Prompts
from sampling_test import CONFIG, _apply, _random_params

from m2po_jax.models import model as model_lib
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.rollout import engines as engine_lib
from m2po_jax.rollout import episodes as episodes_lib
from m2po_jax.rollout import sampling
from m2po_jax.tasks import calculator, environments, tool_calls, tools

# One layer of 4 experts, top-2 (renormalised), on sampling_test's attention.
MOE = CONFIG.replace(
    model_type="qwen3_moe",
    qk_norm=True,
    num_layers=1,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
N = 2
SAMPLED = sampling.SamplingConfig(max_new_tokens=12, temperature=0.8, pad_id=PAD)


@pytest.fixture(scope="module")
def params():
    return _random_params(MOE, seed=0, std=0.1)


def _teacher_forced(params, config, tokens_BxT, valid_BxT, temperature):
    logits = _apply(params, config, tokens_BxT, valid_BxT=valid_BxT)
    return np.asarray(model_lib.token_logp(logits, tokens_BxT, temperature))


@pytest.mark.parametrize("engine", ["static", "continuous", "paged"])
def test_behaviour_log_probs_are_a_teacher_forced_forward(params, engine):
    """The paged engine on a pool of 21 pages (the 12 prompts take 17 of 4 tokens, a
    completion up to 4 more: paged_engine_test), so it preempts and recomputes."""
    made = {
        "static": lambda: engine_lib.StaticEngine(MOE, SAMPLED),
        "continuous": lambda: engine_lib.ContinuousEngine(MOE, SAMPLED, slots=4),
        "paged": lambda: engine_lib.PagedEngine(MOE, SAMPLED, slots=4, page_size=4, pages=21),
    }[engine]()
    got = made.generate(params, TOKENS, VALID, jax.random.key(3), n_samples=N)
    out = jax.device_get(got.out)
    mask = np.asarray(out.completion_mask_BxT)
    assert mask[:, WIDTH:].sum() > 200  # 24 rows of up to 12 sampled tokens
    want = _teacher_forced(params, MOE, out.tokens_BxT, out.valid_BxT, 0.8)
    # Float32 on both sides (cached decode steps against one full forward): sums of <= 64
    # products in another order, ~1e-6 in the logits; measured <= 2e-6.
    np.testing.assert_allclose(np.asarray(out.behav_logp_BxT)[mask], want[mask], atol=2e-5)
    if engine == "paged":
        assert got.preemptions > 0
    # The routing is not trivial: the tokens' first experts cover all 4.
    logits, state = jax.jit(
        lambda p, t, v: model_lib.CausalLM(MOE).apply(
            {"params": p}, t, valid_BxT=v, mutable=["intermediates"]
        )
    )(params, out.tokens_BxT, out.valid_BxT)
    router_LxBxTxX = model_lib.router_logits(state["intermediates"], MOE)
    first = np.argmax(np.asarray(router_LxBxTxX)[0][np.asarray(out.valid_BxT)], -1)
    assert set(first.tolist()) == {0, 1, 2, 3}


def _always_a_call(text):
    """Every turn the calculator call "(347*86)" (well-formed, whatever a random policy
    writes)."""
    return "", [tool_calls.ToolCall("calculator", {"expression": "347*86"})]


tool_calls.register_parser("test_moe_always_a_call", _always_a_call)


def test_a_calculator_episode_s_behaviour_log_probs_are_a_teacher_forced_forward():
    """A multi-turn rollout (continuous engine, 2 turns) whose turns call the calculator:
    the rows hold the calculator's answers where the environment appended them (not
    trained), and the sampled tokens' behaviour log-probs are the full rows' forward."""
    config = MOE.replace(vocab_size=TOKENIZER.vocab_size)
    params = _random_params(config, seed=1, std=0.3)
    settings = sampling.SamplingConfig(
        max_new_tokens=48, pad_id=TOKENIZER.pad_id, stop_token_ids=(TOKENIZER.eos_id,)
    )
    calc = [tools.tool(calculator.calculator)]
    agent = episodes_lib.Agent(
        lambda: environments.ToolEnv(calc, "test_moe_always_a_call", timeout_s=5.0),
        TASK.chat_format(),
        max_turns=2,
        max_append=8,
    )
    try:
        sampled = rollout_lib.sample_rollout(
            params,
            config,
            settings,
            EXAMPLES[:4],
            _Prompts(),
            jax.random.key(0),
            n_samples=N,
            version=0,
            max_prompt_len=10,
            engine=engine_lib.ContinuousEngine(config, settings, slots=4),
            agent=agent,
        )
    finally:
        agent.close()
    batch = sampled.batch
    mask, valid = batch.loss_mask_BxT, batch.valid_BxT
    appended = valid & ~mask
    appended[:, :10] = False  # the prompts
    rows = np.flatnonzero(appended.any(1))
    assert len(rows) >= 3  # episodes that got the calculator's answer
    answer = TOKENIZER.encode("29842=")  # the calculator's product, and "="
    for row in rows:
        completion = batch.tokens_BxT[row, 10:][valid[row, 10:]]
        trained = mask[row, 10:][valid[row, 10:]]
        first = np.argmin(trained)  # after the first turn's EOS
        assert completion[first - 1] == TOKENIZER.eos_id
        np.testing.assert_array_equal(completion[first : first + len(answer)], answer)
        assert not trained[first : first + len(answer)].any()
    want = _teacher_forced(params, config, batch.tokens_BxT, valid, 1.0)
    # As the engines above, on larger weights (std 0.3): measured <= 1e-5.
    np.testing.assert_allclose(batch.behav_logp_BxT[mask], want[mask], atol=2e-5)
