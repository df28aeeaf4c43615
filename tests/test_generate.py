"""The generation loop and ChatSession on random-weight mlx-lm models; the real SmolLM2 marked slow."""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from forcing import force
from model_files import EOS, build_tiny_model

import mlxevict
from mlxevict.errors import MlxEvictError
from mlxevict.events import Finished, Progress, TextChunk
from mlxevict.generate import ChatSession, ThinkSplitter, opens_think, render, stream_events
from mlxevict.kernels import prediction_entropy
from mlxevict.memory import MemoryGuard

PROMPT = "What is the capital of France? Think about it step by step."


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return load(str(build_tiny_model(tmp_path_factory.mktemp("chatml") / "m", template="chatml")))


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    return load(str(build_tiny_model(tmp_path_factory.mktemp("think") / "m", template="think")))


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("short") / "m", max_position_embeddings=64)
    return load(str(path))


def run(model, tokenizer, prompt=PROMPT, **kwargs):
    events = list(stream_events(model, tokenizer, prompt, **kwargs))
    assert isinstance(events[-1], Finished) and not any(isinstance(e, Finished) for e in events[:-1])
    return events, events[-1]


# ---- splitting reasoning from the answer ------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    reasoning=st.text(alphabet="ab <>/thinkx\n", max_size=30),
    answer=st.text(alphabet="ab <>/thinkx\n", max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_splitter_finds_tags_split_anywhere(reasoning, answer, cuts):
    reasoning = reasoning.replace("</think>", "").replace("<think>", "").strip()
    answer = answer.replace("<think>", "").replace("</think>", "").strip()
    text = f"<think>\n{reasoning}</think>\n\n{answer}"
    pieces, last = [], 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    splitter = ThinkSplitter()
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    got = {"reasoning": "", "answer": ""}
    for kind, piece in out:
        got[kind] += piece
    assert got["reasoning"].rstrip() == reasoning.strip() and got["answer"] == answer.strip()


def test_splitter_starts_in_reasoning_when_the_prompt_opened_the_block():
    splitter = ThinkSplitter(in_reasoning=True)
    out = splitter.feed("\nfirst I add</th") + splitter.feed("ink>\n\n42") + splitter.flush()
    assert out == [("reasoning", "first I add"), ("answer", "42")]


def test_splitter_keeps_an_unfinished_tag_as_text():
    splitter = ThinkSplitter()
    assert splitter.feed("a <thi") == [("answer", "a ")]
    assert splitter.flush() == [("answer", "<thi")]


def test_opens_think():
    assert opens_think("<|User|>hi<|Assistant|><think>\n")
    assert not opens_think("<think>a</think> b")
    assert not opens_think("plain")


# ---- the loop ---------------------------------------------------------------------------
def test_stream_events_yields_text_progress_and_finished(chatml):
    model, tokenizer = chatml
    caches = mlxevict.make_cache(model, "entropy", 64)
    events, fin = run(model, tokenizer, caches=caches, max_tokens=40, temp=0.8, seed=3, progress_every=8)
    chunks = [e for e in events if isinstance(e, TextChunk)]
    progress = [e for e in events if isinstance(e, Progress)]
    assert fin.reason == "length" and len(fin.tokens) == 40 and fin.progress.generated_tokens == 40
    assert "".join(c.text for c in chunks) == fin.answer and fin.reasoning == ""
    assert all(c.kind == "answer" for c in chunks)
    assert fin.answer == tokenizer.decode(list(fin.tokens))
    # Once after the prompt, then every 8 tokens.
    assert [p.generated_tokens for p in progress] == [1, 8, 16, 24, 32, 40]
    for p in progress + [fin.progress]:
        assert p.cache.kept <= p.cache.capacity == 64
        assert p.cache.tokens_seen == p.prompt_tokens + p.generated_tokens
        assert p.memory.kv_nbytes == p.cache.nbytes
    assert fin.progress.cache.evicted > 0 and fin.progress.tokens_per_s > 0
    vocab = model.args.vocab_size
    assert all(0 <= c.prediction_entropy <= math.log(vocab) + 1e-4 for c in chunks)


def test_reported_entropy_is_that_of_the_distribution_each_token_came_from(chatml):
    model, tokenizer = chatml
    events, fin = run(model, tokenizer, caches=None, max_tokens=12, temp=0.0)
    prompt = tokenizer.encode(render(tokenizer, [{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    logits = model(mx.array(prompt + list(fin.tokens))[None])  # one fresh pass over everything
    expected = prediction_entropy(logits[0, len(prompt) - 1 : -1]).tolist()  # position t predicts token t+1
    chunks = [e for e in events if isinstance(e, TextChunk)]
    assert len(chunks) >= 6
    step = 0
    for chunk in chunks:  # chunks come in step order; a step may emit no text (a partial character)
        step = fin.tokens.index(chunk.token, step)
        assert chunk.prediction_entropy == pytest.approx(expected[step], abs=1e-3)


def test_greedy_generation_is_deterministic_and_seeded_sampling_reproducible(chatml):
    model, tokenizer = chatml
    a = run(model, tokenizer, max_tokens=16, temp=0.0)[1].tokens
    b = run(model, tokenizer, max_tokens=16, temp=0.0)[1].tokens
    c = run(model, tokenizer, max_tokens=16, temp=1.0, seed=7)[1].tokens
    d = run(model, tokenizer, max_tokens=16, temp=1.0, seed=7)[1].tokens
    e = run(model, tokenizer, max_tokens=16, temp=1.0, seed=8)[1].tokens
    assert a == b and c == d and c != e


def test_think_template_starts_in_reasoning_and_splits_at_the_close_tag(think):
    model, tokenizer = think
    script = "the answer is four</think>\n\nFour."
    events, fin = run(model, tokenizer, max_tokens=60, logits_processors=[force(tokenizer, script, then_eos=True)])
    assert fin.reason == "stop" and fin.message == ""
    assert fin.reasoning == "the answer is four" and fin.answer == "Four."
    kinds = [e.kind for e in events if isinstance(e, TextChunk)]
    assert kinds == sorted(kinds, key=lambda k: k == "answer")  # all reasoning, then all answer
    assert fin.tokens[-1] == tokenizer.convert_tokens_to_ids(EOS)


def test_model_that_opens_its_own_think_block(chatml):
    model, tokenizer = chatml
    script = "<think>\nhmm</think>\nyes"
    _, fin = run(model, tokenizer, max_tokens=40, logits_processors=[force(tokenizer, script, then_eos=True)])
    assert (fin.reasoning, fin.answer) == ("hmm", "yes")


def test_empty_prompt_is_refused(chatml):
    model, tokenizer = chatml
    for prompt in ("", "  \n", [], [{"role": "user", "content": " "}]):
        with pytest.raises(MlxEvictError, match="empty prompt"):
            next(stream_events(model, tokenizer, prompt))


def test_prompt_longer_than_the_context_is_refused(short_context):
    model, tokenizer = short_context
    with pytest.raises(MlxEvictError, match="the prompt takes 81 tokens, but the model's context limit is 64; shorten the prompt"):
        next(stream_events(model, tokenizer, list(range(5, 86))))


def test_generation_stops_at_the_context_limit_and_says_so(short_context):
    model, tokenizer = short_context
    caches = mlxevict.make_cache(model, "window", 32)
    _, fin = run(model, tokenizer, list(range(5, 45)), caches=caches, max_tokens=100)
    assert fin.reason == "length" and len(fin.tokens) == 24
    assert fin.message == "stopped at the model's context limit of 64 tokens"


def test_ctrl_c_inside_the_model_keeps_the_text(chatml):
    model, tokenizer = chatml
    calls = {"n": 0}

    def ctrl_c_at_step_10(tokens, logits):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return logits

    caches = mlxevict.make_cache(model, "rkv", 64)
    events, fin = run(model, tokenizer, caches=caches, max_tokens=50, logits_processors=[ctrl_c_at_step_10])
    assert fin.reason == "interrupted" and fin.message == "stopped by Ctrl-C"
    assert 0 < len(fin.tokens) < 10 and fin.answer == tokenizer.decode(list(fin.tokens))
    assert fin.progress.cache.tokens_seen >= fin.progress.prompt_tokens + len(fin.tokens)


def test_stop_event_ends_the_turn_and_keeps_the_text(chatml):
    model, tokenizer = chatml
    stop = threading.Event()
    kept = []
    for event in stream_events(model, tokenizer, PROMPT, max_tokens=200, stop=stop):
        if isinstance(event, TextChunk):
            kept.append(event.text)
            stop.set()
        if isinstance(event, Finished):
            fin = event
    assert fin.reason == "interrupted" and fin.answer == "".join(kept) and len(fin.tokens) < 5


def test_stop_event_abandons_a_long_prompt(chatml):
    model, tokenizer = chatml
    stop = threading.Event()
    stop.set()
    _, fin = run(model, tokenizer, list(range(5, 600)), stop=stop, prefill_step_size=64)
    assert fin.reason == "interrupted" and fin.tokens == ()


def test_memory_guard_stops_generation_keeping_the_text(chatml):
    model, tokenizer = chatml
    guard = MemoryGuard(margin=1 << 60, check_every=4)  # no machine has that much left: stop at once
    _, fin = run(model, tokenizer, max_tokens=50, guard=guard)
    assert fin.reason == "memory" and len(fin.tokens) == 4
    assert fin.message.startswith("stopped before the machine would swap")
    assert fin.answer == tokenizer.decode(list(fin.tokens))


def test_long_prompt_is_prefilled_in_chunks_under_the_budget(chatml):
    model, tokenizer = chatml
    caches = mlxevict.make_cache(model, "h2o", 128)
    _, fin = run(model, tokenizer, list(range(5, 700)), caches=caches, max_tokens=5)
    assert fin.progress.cache.tokens_seen == 695 + 5 and fin.progress.cache.kept <= 128
    assert fin.progress.cache.capacity == 128


# ---- ChatSession ------------------------------------------------------------------------
def fed_text(tokenizer, session: ChatSession, turns: list[tuple[list[int], tuple[int, ...]]]) -> str:
    return tokenizer.decode([t for fed, out in turns for t in (*fed, *out)])


def test_chat_session_feeds_only_the_new_turn(chatml):
    model, tokenizer = chatml
    session = ChatSession(model, tokenizer, policy="full", budget=4096, max_tokens=6, temp=0.0)
    first_prompt = session._turn_tokens("Hello!")
    one = [e for e in session.send("Hello!", logits_processors=[force(tokenizer, "Hi there", then_eos=True)])][-1]
    assert one.reason == "stop" and one.answer == "Hi there"
    after_one = session.caches[0].offset
    assert after_one == len(first_prompt) + len(one.tokens)
    second_prompt = session._turn_tokens("And you?")
    two = [e for e in session.send("And you?")][-1]
    assert session.caches[0].offset == after_one + len(second_prompt) + len(two.tokens)
    # What the caches saw is exactly the conversation as the chat template writes it.
    fed = tokenizer.decode(first_prompt + list(one.tokens) + second_prompt)
    assert fed == render(
        tokenizer,
        [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi there"},
            {"role": "user", "content": "And you?"},
        ],
    )
    assert tokenizer.decode(second_prompt) == "\n<|im_start|>user\nAnd you?<|im_end|>\n<|im_start|>assistant\n"
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_chat_session_closes_a_turn_that_ran_out_of_tokens(chatml):
    model, tokenizer = chatml
    session = ChatSession(model, tokenizer, policy="full", budget=4096, max_tokens=4, temp=0.0)
    list(session.send("Hello!"))
    assert tokenizer.decode(session._turn_tokens("Next")).startswith("<|im_end|>\n<|im_start|>user\nNext")


def test_chat_session_keeps_the_budget_across_turns_and_can_change_it(chatml):
    model, tokenizer = chatml
    session = ChatSession(model, tokenizer, policy="entropy", budget=64, max_tokens=30, temp=0.7, seed=1)
    for text in ("one", "two", "three"):
        fin = [e for e in session.send(text)][-1]
        assert fin.progress.cache.kept <= 64 and fin.progress.cache.budget == 64
    seen = session.caches[0].offset
    assert seen > 90 and session.stats.evicted > 0
    session.configure(policy="window", budget=128)
    assert session.caches[0].offset == 0  # fresh caches; the conversation is fed again next turn
    fin = [e for e in session.send("four")][-1]
    assert fin.progress.cache.policy == "window" and fin.progress.cache.budget == 128
    assert fin.progress.prompt_tokens == len(encode_history(tokenizer, session.messages[:-1]))
    with pytest.raises(MlxEvictError, match="leaves no room to evict"):
        session.configure(budget=4, window=8)
    assert session.budget == 128 and session.policy == "window"  # a bad change leaves the session as it was


def encode_history(tokenizer, messages):
    return tokenizer.encode(render(tokenizer, messages), add_special_tokens=False)


def test_chat_session_reset_frees_the_caches(chatml):
    model, tokenizer = chatml
    session = ChatSession(model, tokenizer, policy="window", budget=64, max_tokens=10)
    list(session.send("hello"))
    assert session.caches[0].offset > 0
    session.reset()
    assert session.messages == [] and session.caches[0].offset == 0 and session.stats is None
    fin = [e for e in session.send("again")][-1]
    assert fin.progress.prompt_tokens == len(encode_history(tokenizer, [{"role": "user", "content": "again"}]))


def test_chat_session_refuses_empty_messages_and_context_overflow(short_context):
    model, tokenizer = short_context
    session = ChatSession(model, tokenizer, policy="window", budget=32, max_tokens=100)
    with pytest.raises(MlxEvictError, match="empty message"):
        next(session.send("   "))
    fin = [e for e in session.send("hi")][-1]
    assert fin.message == "stopped at the model's context limit of 64 tokens"
    with pytest.raises(MlxEvictError, match="the prompt and the conversation so far take .* reset the conversation"):
        next(session.send("more"))
    assert len(session.messages) == 2  # the refused turn is not in the history


def test_chat_session_stop_from_another_thread(chatml):
    model, tokenizer = chatml
    session = ChatSession(model, tokenizer, max_tokens=100_000)
    for event in session.send("go"):
        if isinstance(event, Progress) and event.generated_tokens >= 8:
            threading.Thread(target=session.stop).start()
        if isinstance(event, Finished):
            fin = event
    assert fin.reason == "interrupted" and 8 <= len(fin.tokens) < 1000
    assert session.messages[-1] == {"role": "assistant", "content": fin.answer}


def test_chat_session_with_a_think_template(think):
    model, tokenizer = think
    session = ChatSession(model, tokenizer, policy="entropy", budget=64, max_tokens=30)
    script = "plan</think>\n\ndone"
    fin = [e for e in session.send("q1", logits_processors=[force(tokenizer, script, then_eos=True)])][-1]
    assert (fin.reasoning, fin.answer) == ("plan", "done")
    events = list(session.send("q2"))
    assert all(e.kind == "reasoning" for e in events if isinstance(e, TextChunk))  # the template opened <think>


# ---- the real model ------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm_answers_paris(smollm_path):
    model, tokenizer = load(str(smollm_path))
    caches = mlxevict.make_cache(model, "entropy", 256)
    _, fin = run(model, tokenizer, "What is the capital of France?", caches=caches, max_tokens=40, temp=0.0)
    assert fin.reason == "stop" and "Paris" in fin.answer
    assert fin.progress.prompt_tokens_per_s > 0 and fin.progress.tokens_per_s > 0


@pytest.mark.slow
def test_smollm_chat_reuses_the_cache_like_a_fresh_prefill(smollm_path):
    model, tokenizer = load(str(smollm_path))
    session = ChatSession(model, tokenizer, policy="full", budget=4096, max_tokens=40, temp=0.0)
    one = [e for e in session.send("My name is Ada. Say hello to me.")][-1]
    assert one.reason == "stop"
    two = [e for e in session.send("What is my name?")][-1]
    # The same conversation fed in one go into fresh caches gives the same greedy answer.
    history = session.messages[:3]
    fresh = mlxevict.make_cache(model, "full", 4096)
    _, again = run(model, tokenizer, history, caches=fresh, max_tokens=40, temp=0.0)
    assert two.reason == again.reason and two.answer == again.answer
