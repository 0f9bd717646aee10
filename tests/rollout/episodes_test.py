"""Multi-turn episodes (m2po_jax/rollout/episodes.py) through the continuous engine: the
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
from m2po_jax.rollout import engine as engine_lib
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


def _run(params, factory, *, new=24, max_turns=8, temperature=1.0, key=0, append=8, **agent):
    settings = sampling.SamplingConfig(
        max_new_tokens=new,
        temperature=temperature,
        pad_id=TOKENIZER.pad_id,
        stop_token_ids=(TOKENIZER.eos_id,),
    )
    engine = engine_lib.ContinuousEngine(CONFIG, settings, slots=4)
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
                tokens[row] += ids
                sampled[row] += [True] * len(ids)
                room = self.new - len(tokens[row]) - 1
                turns.append(engine_lib.Turn(row, ids, False, room, len(tokens[row]) - len(ids)))
            for turn, answer in zip(turns, on_turns(turns), strict=True):
                if answer is None:
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
