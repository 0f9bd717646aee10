"""Multi-turn episodes (m2po_jax/rollout/episodes.py) through the continuous engine (and the
paged engine: the same rollout, decoding while an environment step is pending): the
rows are the tokens attended over, masks and versions per token, budgets and statuses,
tools that fail, and a chat template that strips <think> from earlier turns."""

import dataclasses
import time

import jax
import numpy as np
import pytest
from sampling_test import _random_params

from m2po_jax.models import model as model_lib
from m2po_jax.models import model_config
from m2po_jax.rollout import batches as rollout_lib
from m2po_jax.rollout import engines as engine_lib
from m2po_jax.rollout import episodes as episodes_lib
from m2po_jax.rollout import sampling
from m2po_jax.tasks import calculator, environments, tool_calls, tools

TASK = calculator.CalculatorTask(seed=0, eval_size=8)
TOKENIZER = TASK.tokenizer
CONFIG = model_config.ModelConfig(
    vocab_size=TOKENIZER.vocab_size,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)
EXAMPLES = TASK.train_examples(0, 6)
N = 2


class _Prompts:
    """The task's prompt encoder for a char tokenizer (BOS + text)."""

    pad_id = TOKENIZER.pad_id
    tokenizer = TOKENIZER

    def decode(self, ids):
        return TOKENIZER.decode(ids)


class Echo(environments.Environment):
    """Answers every turn with its length in digits, for `turns` turns; reward = turns."""

    turns = 2

    def __init__(self):
        self.seen = []

    def step(self, text):
        self.seen.append(text)
        if len(self.seen) > self.turns:
            return environments.StepResult([], reward=float(len(self.seen)), done=True)
        return environments.StepResult([{"role": "tool", "content": str(len(text))}])


@pytest.fixture(scope="module")
def params():
    return _random_params(CONFIG, seed=0, std=0.3)


def _run(
    params, factory, *, new=24, max_turns=8, temperature=1.0, key=0, append=8, paged=False,
    **agent,
):  # fmt: skip
    settings = sampling.SamplingConfig(
        max_new_tokens=new,
        temperature=temperature,
        pad_id=TOKENIZER.pad_id,
        stop_token_ids=(TOKENIZER.eos_id,),
    )
    engine = engine_lib.ContinuousEngine(CONFIG, settings, slots=4)
    if paged:  # a pool that preempts (the prompts take up to 12 pages, a sequence 6)
        engine = engine_lib.PagedEngine(CONFIG, settings, slots=4, page_size=4, pages=24)
    made = episodes_lib.Agent(
        factory, TASK.chat_format(), max_turns=max_turns, max_append=append, **agent
    )
    envs = []

    def tracked():
        envs.append(factory())
        return envs[-1]

    made.env_factory = tracked
    sampled = rollout_lib.sample_rollout(
        params,
        CONFIG,
        settings,
        EXAMPLES,
        _Prompts(),
        jax.random.key(key),
        n_samples=N,
        version=5,
        max_prompt_len=10,
        engine=engine,
        agent=made,
    )
    return sampled, envs


def test_rows_are_the_tokens_attended_over_and_only_the_assistant_is_trained(params):
    sampled, envs = _run(params, Echo, new=48)
    batch, stats = sampled.batch, sampled.episodes
    width = 10
    rows = len(EXAMPLES) * N
    assert len(envs) == rows
    eos = TOKENIZER.eos_id
    for row, env in enumerate(envs):
        tokens = batch.tokens_BxT[row]
        mask, valid = batch.loss_mask_BxT[row], batch.valid_BxT[row]
        # The prompt as the format renders it, left-padded.
        prompt = [TOKENIZER.bos_id, *TOKENIZER.encode(EXAMPLES[row // N].prompt)]
        np.testing.assert_array_equal(tokens[width - len(prompt) : width], prompt)
        # The completion: assistant turns (trained) and the environment's answers (not),
        # alternating; each turn is the text the environment saw, each answer its reply.
        n = int(valid[width:].sum())
        assert valid[width - len(prompt) : width + n].all() and not valid[width + n :].any()
        assert not mask[:width].any() and not mask[width + n :].any()
        completion, trained = tokens[width : width + n], mask[width : width + n]
        cuts = np.flatnonzero(np.diff(trained.astype(int))) + 1
        segments = np.split(np.arange(n), cuts)
        turns = [completion[i] for i in segments if trained[i[0]]]
        answers = [completion[i] for i in segments if not trained[i[0]]]
        assert trained[0] and len(answers) == len(turns) - 1
        for i, answer in enumerate(answers):
            want = TOKENIZER.encode(str(len(env.seen[i]))) + TOKENIZER.encode("=")
            np.testing.assert_array_equal(answer, want)
            assert turns[i][-1] == eos
        status = stats.status_B[row]
        # Every turn the environment saw ended at EOS; a last turn it did not see was cut
        # by the budget (or its answer did not fit).
        for turn, text in zip(turns, env.seen, strict=False):
            assert TOKENIZER.decode(turn[:-1]) == text and turn[-1] == eos
        if len(env.seen) < len(turns):
            assert status == "max_tokens" and turns[-1][-1] != eos and n == 48
        assert batch.stopped_B[row] == (status not in ("max_tokens", "max_turns"))
        # Versions: the sampled tokens 5, the appended ones -1.
        versions = batch.version_BxT[row, width : width + n]
        np.testing.assert_array_equal(versions[trained], 5)
        np.testing.assert_array_equal(versions[~trained], -1)
        if stats.status_B[row] == "done":
            assert stats.turns_B[row] == 3 and stats.env_reward_B[row] == 3.0
    assert stats.status_B.count("done") >= rows // 2
    # The behaviour log-probs are the teacher-forced forward's on each whole row.
    logits = jax.jit(model_lib.apply, static_argnums=1)(
        params, CONFIG, batch.tokens_BxT, valid_BxT=batch.valid_BxT
    )
    want = np.asarray(model_lib.token_logp(logits, batch.tokens_BxT, 1.0))
    mask = batch.loss_mask_BxT
    np.testing.assert_allclose(batch.behav_logp_BxT[mask], want[mask], atol=1e-4)
    # The environment's reward is the row's reward; the texts are the final turns.
    scored = rollout_lib.score_rollout(sampled, lambda example, text: -1.0)
    for row, env in enumerate(envs):
        done = stats.status_B[row] == "done"
        assert scored.rewards_B[row] == (3.0 if done else -1.0)
        if done:
            assert sampled.texts[row] == env.seen[-1]


class Forever(Echo):
    turns = 100


def _slow_first_step():
    """An `Echo` factory whose first episode's first step takes 1 s."""
    made = []

    def factory():
        env = Echo()
        if not made:
            step = env.step

            def slow(text):
                if not env.seen:
                    time.sleep(1.0)
                return step(text)

            env.step = slow
        made.append(env)
        return env

    return factory


def test_the_paged_engine_gives_the_continuous_engines_rollout_and_decodes_while_waiting(
    params,
):
    """`sample_rollout(agent=...)` (the trainer's path) on the paged engine, with a pool
    that preempts: the continuous engine's rollout under the same key, statuses and
    rewards included; one episode's first step takes 1 s, during which the paged engine
    decodes the other episodes (`episode/decode_steps_while_waiting`) and the continuous
    one waits."""
    runs = [_run(params, _slow_first_step(), new=32, paged=paged)[0] for paged in (False, True)]
    (want, got) = runs
    for field in ("tokens_BxT", "valid_BxT", "loss_mask_BxT", "version_BxT", "stopped_B"):
        np.testing.assert_array_equal(getattr(got.batch, field), getattr(want.batch, field), field)
    # Float32 forwards in other orders (paged reads, recomputes), as the teacher-forced
    # comparison above on these weights: 1e-4.
    np.testing.assert_allclose(got.batch.behav_logp_BxT, want.batch.behav_logp_BxT, atol=1e-4)
    assert got.texts == want.texts and got.episodes.status_B == want.episodes.status_B
    np.testing.assert_array_equal(got.episodes.env_reward_B, want.episodes.env_reward_B)
    assert got.generation.preemptions > 0
    waited = [r.episodes.metrics()["episode/decode_steps_while_waiting"] for r in runs]
    assert waited[0] == 0 < waited[1]
    assert min(r.episodes.env_step_s for r in runs) >= 1.0


def test_budgets_end_episodes_with_their_status(params):
    sampled, _ = _run(params, Forever, max_turns=2, new=40)
    stats = sampled.episodes
    assert set(stats.status_B) <= {"max_turns", "max_tokens"}
    assert stats.status_B.count("max_turns") >= 4
    for row, status in enumerate(stats.status_B):
        if status == "max_turns":
            assert stats.turns_B[row] == 2
    # A short budget: the turn is cut, not stopped.
    sampled, _ = _run(params, Forever, max_turns=8, new=6, append=4)
    stats = sampled.episodes
    assert "max_tokens" in stats.status_B
    for row, status in enumerate(stats.status_B):
        if status == "max_tokens":
            assert not sampled.batch.stopped_B[row]
    assert stats.metrics()["episode/status/max_tokens"] == stats.status_B.count("max_tokens") / 12


class Raises(Echo):
    def step(self, text):
        raise RuntimeError("the sandbox is down")


def test_an_environment_that_raises_ends_its_episode_only(params):
    sampled, _ = _run(params, Raises)
    assert set(sampled.episodes.status_B) <= {"env_error", "max_tokens"}
    assert "env_error" in sampled.episodes.status_B


def test_on_the_paged_engine_a_failing_step_ends_its_episode_only(params):
    """The non-blocking driver keeps the failure paths: episode 0's steps hang past
    agent.step_timeout_s (env_timeout) and episode 1's raise (env_error) while the others
    decode on and end as ever; the failed two are out of the loss."""
    made = []

    def factory():
        env = [Hangs, Raises][len(made)]() if len(made) < 2 else Echo()
        made.append(env)
        return env

    sampled, _ = _run(params, factory, new=32, paged=True, step_timeout_s=0.3)
    status = sampled.episodes.status_B
    assert status[:2] == ("env_timeout", "env_error")
    assert set(status[2:]) <= {"done", "max_tokens"} and "done" in status[2:]
    assert not sampled.batch.loss_mask_BxT[:2].any() and sampled.batch.loss_mask_BxT[2:].any()
    assert sampled.episodes.decode_steps_while_waiting > 0


# A format where every turn is a call of the test's tools: a turn starting with 7, 8 or 9
# is malformed; the others call "slow", "broken" or "ok" by their length.
def _always(text):
    if text[:1] in ("7", "8", "9"):
        raise tool_calls.MalformedToolCall(f"not a call: {text!r}")
    return "", [tool_calls.ToolCall(("slow", "broken", "ok")[len(text) % 3], {"x": 1})]


tool_calls.register_parser("test_always", _always)


def slow(x: int) -> str:
    """Sleeps.

    Args:
      x: ignored.
    """
    time.sleep(3)
    return "1"


def broken(x: int) -> str:
    """Raises.

    Args:
      x: ignored.
    """
    raise ZeroDivisionError("no")


def ok(x: int) -> str:
    """Answers 7.

    Args:
      x: ignored.
    """
    return "7"


@pytest.mark.parametrize("on_error", ["reply", "end"])
def test_tool_errors_and_timeouts_are_counted_and_malformed_calls_get_their_reward(
    params, on_error
):
    made = [tools.tool(f) for f in (slow, broken, ok)]
    factory = lambda: environments.ToolEnv(
        made, "test_always", timeout_s=0.2, on_tool_error=on_error
    )
    t0 = time.perf_counter()
    sampled, _ = _run(params, factory, max_turns=3, bad_tool_call_reward=-0.5)
    assert time.perf_counter() - t0 < 20  # a 3 s tool is not waited for
    stats = sampled.episodes
    metrics = stats.metrics()
    assert metrics["episode/tool_timeouts_mean"] > 0 and metrics["episode/tool_errors_mean"] > 0
    assert metrics["episode/tool_calls_mean"] > 0
    bad = [s == "bad_tool_call" for s in stats.status_B]
    assert any(bad)
    np.testing.assert_array_equal(stats.env_reward_B[bad], -0.5)
    scored = rollout_lib.score_rollout(sampled, lambda example, text: 0.0)
    np.testing.assert_array_equal(scored.rewards_B[bad], -0.5)
    if on_error == "end":
        assert {"tool_timeout", "tool_error"} & set(stats.status_B)
    else:
        assert not {"tool_timeout", "tool_error"} & set(stats.status_B)


# ------------------------------------- a chat template that rewrites earlier reasoning


def lookup(city: str) -> str:
    """The weather in a city.

    Args:
      city: the city's name.
    """
    return f"sunny in {city}"


class Scripted:
    """Replays fixed assistant turns as the engine would have sampled them: a test double
    of `ContinuousEngine.episodes` (its `Turn` protocol and output layout) for the host
    side, whose token bookkeeping the engine's own tests check on a model."""

    def __init__(self, turns, new):
        self.turns, self.new = turns, new

    def episodes(self, params, tokens_BxP, valid_BxP, rng, on_turns, *, n_samples, **unused):
        rows = len(tokens_BxP) * n_samples
        done, count = set(), [0] * rows
        tokens, sampled = [[] for _ in range(rows)], [[] for _ in range(rows)]
        while len(done) < rows:
            turns = []
            for row in sorted(set(range(rows)) - done):
                ids = self.turns[count[row]]
                count[row] += 1
                cut = len(ids) > self.new - len(tokens[row])  # the budget ends mid-turn
                ids = ids[: self.new - len(tokens[row])]
                tokens[row] += ids
                sampled[row] += [True] * len(ids)
                room = self.new - len(tokens[row]) - 1
                turns.append(engine_lib.Turn(row, ids, cut, room, len(tokens[row]) - len(ids)))
            for turn, answer in zip(turns, on_turns(turns), strict=True):
                if answer is None or turn.cut:
                    done.add(turn.row)
                else:
                    tokens[turn.row] += answer
                    sampled[turn.row] += [False] * len(answer)
        pad = np.zeros((rows, self.new), np.int32)
        mask = np.zeros((rows, self.new), bool)
        for row in range(rows):
            pad[row, : len(tokens[row])] = tokens[row]
            mask[row, : len(tokens[row])] = sampled[row]
        valid = np.arange(self.new)[None] < np.asarray([len(t) for t in tokens])[:, None]
        prompt_valid = np.repeat(valid_BxP, n_samples, axis=0)
        out = sampling.SampleOutput(
            tokens_BxT=np.concatenate([np.repeat(tokens_BxP, n_samples, axis=0), pad], 1),
            valid_BxT=np.concatenate([prompt_valid, valid], 1),
            behav_logp_BxT=np.zeros((rows, tokens_BxP.shape[1] + self.new), np.float32),
            completion_mask_BxT=np.concatenate([np.zeros_like(prompt_valid), mask], 1),
            prompt_len_B=prompt_valid.sum(1),
            completion_len_B=valid.sum(1),
            stopped_B=np.ones(rows, bool),
            num_steps=0,
        )
        version = np.where(mask, 0, -1).astype(np.int32)
        return engine_lib.Generation(out, version, 0, 0, 0)


def _byte_level_checkpoint(path, template):
    """A byte-level tokenizer (any text) with Qwen's special and added tokens."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    added = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in added])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_qwen3_episode_keeps_its_reasoning_as_generated(tmp_path):
    from pathlib import Path

    from m2po_jax.models import chat
    from m2po_jax.models import prompts as prompts_lib
    from m2po_jax.models import tokenizer as tokenizer_lib

    template = (Path(__file__).parents[1] / "data/chat_templates/qwen3.jinja").read_text()
    tok = tokenizer_lib.load_tokenizer(_byte_level_checkpoint(tmp_path, template))
    prompts = prompts_lib.make_prompt_encoder(tok)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>'
    first = "<think>I need the weather.</think>\n\n" + call  # no newlines inside <think>
    final = "<think>\nIt says sunny.\n</think>\n\nIt is sunny."
    turns = [tok.encode(first + "<|im_end|>"), tok.encode(final + "<|im_end|>")]
    lookup_tool = tools.tool(lookup)
    agent = episodes_lib.Agent(
        lambda: environments.ToolEnv([lookup_tool], "hermes"),
        episodes_lib.TemplateFormat(prompts),
        max_turns=4,
    )
    settings = sampling.SamplingConfig(
        max_new_tokens=300, pad_id=tok.pad_id, stop_token_ids=(tok.eos_id,)
    )
    examples = [dataclasses.replace(EXAMPLES[0], prompt="Weather in Oslo?")]
    sampled = rollout_lib.sample_rollout(
        None,
        None,
        settings,
        examples,
        prompts,
        jax.random.key(0),
        n_samples=1,
        version=0,
        max_prompt_len=800,
        engine=Scripted(turns, 300),
        agent=agent,
    )
    batch = sampled.batch
    assert sampled.episodes.status_B == ("done",) and sampled.episodes.tool_calls_B[0] == 1
    valid, mask = batch.valid_BxT[0], batch.loss_mask_BxT[0]
    text = tok.decode(batch.tokens_BxT[0][valid], skip_special_tokens=False)
    user = {"role": "user", "content": "Weather in Oslo?"}
    answer = {"role": "tool", "name": "lookup", "content": "sunny in Oslo"}
    kwargs = dict(tok.special_tokens)
    prompt = chat.render(template, [user], tools=[lookup_tool.schema()], **kwargs)
    delta = chat.turn_delta(template, [answer], end_of_turn="<|im_end|>", **kwargs)
    assert text == prompt + first + "<|im_end|>" + delta + final + "<|im_end|>"
    # The trained tokens are the two turns as generated, reasoning included verbatim.
    trained = tok.decode(batch.tokens_BxT[0][mask], skip_special_tokens=False)
    assert trained == first + "<|im_end|>" + final + "<|im_end|>"
    # A re-render of the same conversation (what re-tokenising stacks train on) differs.
    rendered = chat.render(
        template,
        [user, {"role": "assistant", "content": first}, answer],
        tools=[lookup_tool.schema()],
        **kwargs,
    )
    assert "<think>I need the weather.</think>" not in rendered
    assert not (text.startswith(rendered))


def test_the_warm_up_trains_a_calculator_episode_s_turns_as_the_environment_appends():
    from types import SimpleNamespace

    from m2po_jax.models import prompts as prompts_lib
    from m2po_jax.trainer import sft

    task = calculator.CalculatorTask(seed=0, eval_size=8, tool_demos=0.5)
    cfg = SimpleNamespace(
        task=SimpleNamespace(max_prompt_len=10), gconfig=SimpleNamespace(max_new_tokens=24)
    )
    run = SimpleNamespace(
        cfg=cfg, task=task, tokenizer=TOKENIZER, prompts=prompts_lib.PromptEncoder(TOKENIZER)
    )
    tokens, valid, target = sft.sft_batch(run, 0, 16)
    fmt, eos, encode = task.chat_format(), TOKENIZER.eos_id, TOKENIZER.encode
    calls = 0
    for row, (prompt, segments) in enumerate(task.sft_examples(0, 16)):
        answer = segments[-1][0]
        completion = tokens[row, 10:][valid[row, 10:]]
        trained = target[row, 10:][valid[row, 10:]]
        if len(segments) == 3:  # a call, the calculator's answer as the environment appends it
            calls += 1
            call = encode(f"({prompt[:-1]})") + [eos]
            reply = fmt.delta_ids([{"role": "tool", "content": calculator.calculator(prompt[:-1])}])
            want = call + reply + encode(answer) + [eos]
            mask = [True] * len(call) + [False] * len(reply) + [True] * (len(answer) + 1)
        else:
            want, mask = encode(answer) + [eos], [True] * (len(answer) + 1)
        np.testing.assert_array_equal(completion, want)
        np.testing.assert_array_equal(trained, mask)
        assert answer == calculator.calculator(prompt[:-1])  # the right product
    assert 3 <= calls <= 13


# ------------------------------------------------ failure paths, on the scripted engine

EOS = TOKENIZER.eos_id


def _scripted(factory, turns, *, new=40, width=10, examples=EXAMPLES[:2], **agent):
    """A rollout of `examples` (N episodes each) through `Scripted(turns, new)`."""
    made = episodes_lib.Agent(factory, TASK.chat_format(), **{"max_turns": 4, **agent})
    settings = sampling.SamplingConfig(
        max_new_tokens=new, pad_id=TOKENIZER.pad_id, stop_token_ids=(EOS,)
    )
    try:
        return rollout_lib.sample_rollout(
            None,
            None,
            settings,
            examples,
            _Prompts(),
            jax.random.key(0),
            n_samples=N,
            version=0,
            max_prompt_len=width,
            engine=Scripted(turns, new),
            agent=made,
        )
    finally:
        made.close()


def _turn(text):
    return TOKENIZER.encode(text) + [EOS]


class Rewards(environments.Environment):
    """Gives 0.5 and 0.25 on its first two steps and 1.0 when it ends on the third."""

    rewards = (0.5, 0.25, 1.0)

    def __init__(self):
        self.steps = 0

    def step(self, text):
        self.steps += 1
        reward = self.rewards[self.steps - 1]
        done = self.steps == len(self.rewards)
        return environments.StepResult([{"role": "tool", "content": "1"}], reward, done)


def test_the_episode_reward_is_the_sum_of_its_steps_rewards():
    sampled = _scripted(Rewards, [_turn("1")] * 4)
    stats = sampled.episodes
    assert set(stats.status_B) == {"done"}
    np.testing.assert_array_equal(stats.env_reward_B, 1.75)
    scored = rollout_lib.score_rollout(sampled, lambda example, text: -1.0)
    np.testing.assert_array_equal(scored.rewards_B, 1.75)
    # A reward on the step that reaches max_turns is kept too.
    sampled = _scripted(Rewards, [_turn("1")] * 4, max_turns=2)
    assert set(sampled.episodes.status_B) == {"max_turns"}
    np.testing.assert_array_equal(sampled.episodes.env_reward_B, 0.75)


class Leaks(environments.Environment):
    """Raises with the problem's answer in its message."""

    def reset(self, example):
        self.answer = example.answer
        return super().reset(example)

    def step(self, text):
        raise RuntimeError(f"sandbox down; expected {self.answer}")


def _exact(example, text):
    return float(str(example.answer) in text)


def test_a_crashed_environment_is_never_scored_nor_trained_on(caplog):
    with caplog.at_level("WARNING"):
        sampled = _scripted(Leaks, [_turn("12")])
    stats = sampled.episodes
    assert set(stats.status_B) == {"env_error"}
    assert sampled.texts == ["12"] * 4  # the model's turn, not the exception's text
    scored = rollout_lib.score_rollout(sampled, _exact)
    np.testing.assert_array_equal(scored.rewards_B, 0.0)
    assert not sampled.batch.loss_mask_BxT.any() and stats.masked_B.all()
    assert stats.metrics()["episode/masked_failed"] == 1.0
    assert "4 of 4 episodes ended by the environment failing" in caplog.text
    assert "RuntimeError: sandbox down" in caplog.text
    # agent.mask_failed_episodes=False keeps them in the loss.
    kept = _scripted(Leaks, [_turn("12")], mask_failed=False)
    assert kept.batch.loss_mask_BxT.sum(1).tolist() == [3] * 4
    assert kept.episodes.metrics()["episode/masked_failed"] == 0.0


def test_budget_cut_episodes_leave_the_loss_when_asked():
    turns = [_turn("1"), _turn("22"), _turn("333")]
    kept = _scripted(Forever, turns, max_turns=2)
    assert set(kept.episodes.status_B) == {"max_turns"} and kept.batch.loss_mask_BxT.any(1).all()
    masked = _scripted(Forever, turns, max_turns=2, mask_truncated=True)
    assert not masked.batch.loss_mask_BxT.any() and masked.episodes.masked_B.all()
    assert masked.episodes.metrics()["episode/masked_truncated"] == 1.0
    # A turn the token budget cuts: its text is the cut tokens' (no stop token to drop).
    cut = _scripted(Forever, [_turn("1"), _turn("2345678")], new=7, mask_truncated=True)
    assert set(cut.episodes.status_B) == {"max_tokens"}
    assert cut.texts == ["234"] * 4 and cut.episodes.turns_B.tolist() == [2] * 4
    assert not cut.batch.loss_mask_BxT.any()
    # Done episodes stay in the loss.
    done = _scripted(Rewards, [_turn("1")] * 3, mask_truncated=True)
    assert done.batch.loss_mask_BxT.any(1).all() and not done.episodes.masked_B.any()


def test_masked_rows_get_no_advantage_and_nothing_divides_by_zero():
    from m2po_jax.algorithm import advantages

    mask_BxT = np.ones((4, 3), bool)
    mask_BxT[1] = False  # an episode out of the loss
    adv = np.asarray(
        advantages.grpo_token_advantages(
            np.asarray([1.0, 0.0, 0.0, 1.0], np.float32), mask_BxT, group_size=2
        )
    )
    assert np.isfinite(adv).all() and not adv[1].any() and adv[0].all()
    none_BxT = np.zeros((4, 3), bool)
    every = np.asarray(advantages.grpo_token_advantages(np.ones(4), none_BxT, group_size=2))
    assert np.isfinite(every).all() and not every.any()


class LongReset(environments.Environment):
    """Opens the episodes of problem uid 1 with a long prompt."""

    def reset(self, example):
        self.calls = 0
        return [{"role": "user", "content": "9" * (20 if example.uid == EXAMPLES[1].uid else 3)}]

    def step(self, text):
        return environments.StepResult([], done=True)


def test_long_agent_prompts_follow_task_long_prompts(caplog):
    uid = EXAMPLES[1].uid
    with pytest.raises(
        ValueError, match=f"problem {uid} .* is 21 tokens, over task.max_prompt_len=10"
    ):
        _scripted(LongReset, [_turn("1")], long_prompts="error")
    sampled = _scripted(LongReset, [_turn("1")], long_prompts="filter")
    stats = sampled.episodes
    assert stats.status_B == ("done", "done", "prompt_too_long", "prompt_too_long")
    assert stats.masked_B.tolist() == [False, False, True, True]
    assert (
        sampled.batch.loss_mask_BxT[:2].any(1).all() and not sampled.batch.loss_mask_BxT[2:].any()
    )
    assert stats.turns_B.tolist() == [1, 1, 0, 0]
    assert stats.metrics()["episode/prompts_filtered"] == 1
    with caplog.at_level("WARNING"):
        for _ in range(2):
            sampled = _scripted(LongReset, [_turn("1")], long_prompts="left")
    assert sampled.episodes.status_B == ("done",) * 4
    assert sampled.episodes.metrics()["episode/prompts_truncated"] == 1
    np.testing.assert_array_equal(sampled.batch.tokens_BxT[2, :10], TOKENIZER.encode("9" * 10))
    assert caplog.text.count("is 21 tokens, over task.max_prompt_len=10") == 2  # once per agent


class Hangs(environments.Environment):
    def step(self, text):
        time.sleep(1.0)
        return environments.StepResult([], done=True)


class AsyncHangs(environments.Environment):
    async def step(self, text):
        import asyncio

        await asyncio.sleep(1.0)
        return environments.StepResult([], done=True)


@pytest.mark.parametrize("env", [Hangs, AsyncHangs])
def test_a_hung_environment_step_ends_as_env_timeout(env, caplog):
    start = time.perf_counter()
    with caplog.at_level("WARNING"):
        sampled = _scripted(env, [_turn("1")], step_timeout_s=0.2, workers=4)
    assert time.perf_counter() - start < 0.8
    assert sampled.episodes.status_B == ("env_timeout",) * 4
    assert not sampled.batch.loss_mask_BxT.any()
    assert "ran past agent.step_timeout_s=0.2s" in caplog.text


class AsyncSleeps(environments.Environment):
    """Makes a queue in `reset` (bound to the loop it runs on) and reads it in `step`."""

    async def reset(self, example):
        import asyncio

        self.queue = asyncio.Queue()
        await self.queue.put("1")
        return [{"role": "user", "content": "12"}]

    async def step(self, text):
        import asyncio

        await asyncio.sleep(0.3)
        reward = float(await self.queue.get())
        return environments.StepResult([], reward=reward, done=True)


def test_async_environments_share_one_loop_and_overlap():
    examples = EXAMPLES[:4]  # 8 episodes, one worker thread
    start = time.perf_counter()
    sampled = _scripted(AsyncSleeps, [_turn("1")], examples=examples, workers=1)
    elapsed = time.perf_counter() - start
    assert sampled.episodes.status_B == ("done",) * 8
    np.testing.assert_array_equal(sampled.episodes.env_reward_B, 1.0)
    assert elapsed < 8 * 0.3 / 2, elapsed


def test_the_agent_starts_one_event_loop_however_many_threads_ask_first(monkeypatch):
    """The loop starts on first use, and two threads that ask at once (the async rollout
    worker, an evaluation on the main thread) get the same one: no loop left behind
    running. The loop's start is slowed to widen the race an unlocked check would lose."""
    import threading

    made = []

    class SlowLoop(environments.EnvLoop):
        def __init__(self):
            time.sleep(0.2)
            super().__init__()
            made.append(self)

    monkeypatch.setattr(environments, "EnvLoop", SlowLoop)
    agent = episodes_lib.Agent(environments.Environment, TASK.chat_format())
    got = []
    threads = [threading.Thread(target=lambda: got.append(agent.loop)) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(5.0)
        assert len(made) == 1 and got == [made[0], made[0]]
    finally:
        agent.close()
        for loop in made:
            loop.close()
    assert all(loop.loop.is_closed() for loop in made)
    assert agent.loop is not made[0]  # closed: the next use starts a fresh loop
    agent.close()
