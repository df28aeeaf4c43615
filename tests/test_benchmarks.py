"""The evaluation and benchmark harness: task generators, metrics, and both runs end to end.

The fast tests drive the harness on a random-weight llama with a byte tokenizer;
the slow one runs ``--quick`` through the command line on the real SmolLM2 model.
They check the structure of the results, never the numbers.
"""

from __future__ import annotations

import argparse
import json
import math

import mlx.core as mx
import pytest

from tiny_models import tiny_model

import mlxevict
from mlxevict.benchmarks import caches as bcaches
from mlxevict.benchmarks import cli as bcli
from mlxevict.benchmarks import quality, report, speed, tasks, variants

TOK = tasks.ByteTokenizer()
EVAL_KEYS = (
    "retrieval_accuracy", "fidelity_top1", "fidelity_kl", "generation_agreement", "trace_length",
    "decode_tok_s", "decode_ratio", "peak_memory", "kv_bytes",
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size, head_dim=64)  # quantized caches group by 64


# ---- task generators ----------------------------------------------------------------
def test_retrieval_tasks_are_deterministic_and_exact_length():
    a = tasks.make_retrieval_tasks(TOK, 4, 400, seed=3)
    b = tasks.make_retrieval_tasks(TOK, 4, 400, seed=3)
    c = tasks.make_retrieval_tasks(TOK, 4, 400, seed=4)
    assert a == b
    assert [t.tokens for t in a] != [t.tokens for t in c]
    assert all(len(t.tokens) == 400 for t in a)
    assert {t.kind for t in a} == {"passkey", "keyvalue"}


def test_retrieval_answer_is_stated_in_the_prompt_and_scored_at_the_end():
    for task in tasks.make_retrieval_tasks(TOK, 4, 400, seed=1):
        prompt = TOK.decode(task.prompt)
        for span in task.answer_positions():
            answer = TOK.decode([task.tokens[p] for p in span]).strip()
            assert answer in task.facts.values()
            assert answer in prompt
            assert min(span) >= len(task.prompt) + len(task.reasoning)
        assert not any(v in TOK.decode(task.reasoning) for v in task.facts.values())


def test_too_short_a_context_is_a_clear_error():
    with pytest.raises(ValueError, match="raise --context"):
        tasks.make_retrieval_tasks(TOK, 1, 50)


def test_fidelity_and_generation_inputs_are_deterministic():
    assert tasks.make_fidelity_texts(TOK, 2, 300) == tasks.make_fidelity_texts(TOK, 2, 300)
    texts = tasks.make_fidelity_texts(TOK, 2, 300)
    assert texts[0] != texts[1] and all(len(t) == 300 for t in texts)
    gen = tasks.make_generation_tasks(TOK, 3, 260)
    assert gen == tasks.make_generation_tasks(TOK, 3, 260)
    assert all(len(g.prompt) == 260 and g.question in TOK.decode(g.prompt) for g in gen)


# ---- metrics -------------------------------------------------------------------------
def test_kl_of_identical_distributions_is_zero_and_positive_otherwise():
    logits = mx.random.normal((3, 5, 11), key=mx.random.key(0))
    lp = quality.log_softmax(logits)
    assert mx.allclose(quality.kl_divergence(lp, lp), mx.zeros((3, 5)), atol=1e-6)
    other = quality.log_softmax(logits + mx.random.normal(logits.shape, key=mx.random.key(1)))
    assert (quality.kl_divergence(lp, other) > 0).all()


def test_kl_matches_a_hand_computed_value():
    p, q = mx.array([0.5, 0.5]), mx.array([0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert quality.kl_divergence(mx.log(p), mx.log(q)).item() == pytest.approx(expected, rel=1e-5)


def test_divergence_and_trace_length():
    assert quality.divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert quality.divergence([1, 2, 3], [1, 2, 3]) == 3
    assert quality.divergence([5], [6]) == 0
    assert quality.trace_length([4, 4, 7, 4], {7}) == 3
    assert quality.trace_length([4, 4], {7}) == 2


def test_answer_correct_checks_the_prediction_before_each_answer_token():
    task = tasks.make_retrieval_tasks(TOK, 2, 400)[1]  # key-value: two answers
    perfect = task.tokens[1:] + [0]  # predicting every next token
    assert quality.answer_correct(task, perfect) == [True, True]
    broken = list(perfect)
    first = task.answer_positions()[0]
    broken[first[-1] - 1] = (broken[first[-1] - 1] + 1) % 256
    assert quality.answer_correct(task, broken) == [False, True]


def test_chunk_bounds_prefill_then_decode_sized_steps():
    assert quality.chunk_bounds(50, 20, 16) == [(0, 20), (20, 36), (36, 50)]
    assert quality.chunk_bounds(10, 20, 16) == [(0, 10)]


def test_parse_names_keeps_the_reference_and_rejects_unknown_names():
    assert bcaches.parse_names("rkv,window")[0] == "kvcache"
    assert "default" not in bcaches.parse_names("all")
    storage = [n for n in bcaches.parse_names("all", storage=True) if n not in bcaches.parse_names("all")]
    assert storage == [f"{mlxevict.DEFAULT_POLICY}{s}" for s in (":q8", ":q4", ":q4w8", ":k5v3w8")]
    with pytest.raises(ValueError, match="unknown cache or policy nope"):
        bcaches.parse_names("rkv,nope")


def test_budget_check_names_the_fix():
    why = bcaches.check_budget("rkv", 4, bcaches.CacheSettings())
    assert why and "raise --context" in why
    assert bcaches.check_budget("kvcache", 4, bcaches.CacheSettings()) is None


# ---- end to end on a random-weight model ------------------------------------------------
def test_eval_end_to_end_structure(model, tmp_path):
    names = bcaches.default_names(storage=True)
    config = quality.EvalConfig(
        names=tuple(names),
        context=400,
        fractions=(0.5, 0.25),
        retrieval=2,
        fidelity=1,
        generation=2,
        prompt_tokens=240,
        new_tokens=12,
    )
    labels = []
    results = quality.run_eval(model, TOK, config, labels.append)
    rows = {(r["cache"], r["budget_fraction"]) for r in results["rows"]}
    for name in names:
        fractions = (0.5, 0.25) if bcaches.takes_budget(name) else (None,)
        for f in fractions:
            assert (name, f) in rows, (name, f)
    for row in results["rows"]:
        for key in EVAL_KEYS:
            assert key in row, key
        assert row["peak_memory"] > 0 and row["kv_bytes"] > 0
    ref = results["rows"][0]
    assert ref["cache"] == "kvcache" and ref["fidelity_kl"] == 0.0 and ref["fidelity_top1"] == 1.0
    assert len(labels) == len(results["rows"])
    # 8-bit storage of the same policy and budget holds fewer bytes than the model's dtype
    by_name = {(r["cache"], r["budget_fraction"]): r for r in results["rows"]}
    default = mlxevict.DEFAULT_POLICY
    assert by_name[(f"{default}:q8", 0.5)]["kv_fraction_16bit"] < by_name[(default, 0.5)]["kv_fraction_16bit"]
    paths = report.write_eval(results, tmp_path)
    assert {p.name for p in paths} == {"eval.json", "eval.md", "eval.png", "eval_bytes.png"}
    assert json.loads((tmp_path / "eval.json").read_text())["rows"]
    md = (tmp_path / "eval.md").read_text()
    assert "| cache |" in md and "KV / 16-bit full |" in md and f"| {default}:q8 (= default:q8) |" in md
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def _bytes_at(model, name, budget):
    """KV bytes of ``name`` at ``budget`` once it holds its whole budget (storage grows to it)."""
    caches = bcaches.make_caches(model, name, budget, bcaches.CacheSettings())
    model(mx.zeros((1, budget + 8), dtype=mx.int32), cache=caches)  # the patch feeds it in chunks that fit
    return bcaches.kv_bytes_16bit(caches, bound=True)


@pytest.mark.parametrize("name", ["default", "snapkv:q8", "default:q4w8", "default:k5v3w8", "default:k5v3w8c64", "default:k5v3w8c64l32"])
def test_memory_budget_is_the_most_entries_that_fit(model, name):
    context, fraction = 400, 0.25
    limit = fraction * context * bcaches.layer_kv_bytes_per_token(model, 2)
    budget = bcaches.entries_within(model, name, fraction, context, bcaches.CacheSettings())
    assert _bytes_at(model, name, budget) <= limit < _bytes_at(model, name, budget + 1)


def test_memory_budgets_buy_quantized_storage_more_entries(model):
    settings = bcaches.CacheSettings()
    names = ("rotating", "default", "default:k5v3w8")
    entries = {n: bcaches.entries_within(model, n, 0.25, 400, settings) for n in names}
    assert entries["rotating"] == entries["default"] == 100  # 16-bit entries: a quarter of the tokens
    assert entries["default:k5v3w8"] > 3 * entries["default"]
    assert bcaches.entries_within(model, "default:q8", 1.0, 400, settings) == 400  # never more than the context
    # except precision tiers: entries at the low tier's bytes, the rest of the bytes keep entries high
    tiers = bcaches.entries_within(model, "default:k5v3w8c64l32", 0.4, 400, settings)
    assert tiers > 400 and _bytes_at(model, "default:k5v3w8c64l32", tiers) <= 0.4 * 400 * bcaches.layer_kv_bytes_per_token(model, 2)


def test_eval_with_memory_budgets(model, tmp_path):
    names = ("kvcache", "rotating", "default", "default:k5v3w8", "quantized3")
    config = quality.EvalConfig(
        names=names, context=400, fractions=(0.25,), retrieval=2, fidelity=1, generation=2,
        prompt_tokens=240, new_tokens=12, memory=True,
    )  # fmt: skip
    results = quality.run_eval(model, TOK, config)
    rows = {r["cache"]: r for r in results["rows"]}
    assert results["config"]["budgets_of"] == "memory" and set(rows) == set(names)
    assert rows["default:k5v3w8"]["budget"] > 3 * rows["default"]["budget"]
    for name in ("rotating", "default", "default:k5v3w8"):
        assert 0.2 < rows[name]["kv_fraction_16bit"] <= 0.25, name
    assert rows["quantized3"]["kv_fraction_16bit"] < rows["kvcache"]["kv_fraction_16bit"] / 4
    report.write_eval(results, tmp_path)
    assert "fraction of the KV bytes of a 16-bit full cache" in (tmp_path / "eval.md").read_text()


def test_bench_end_to_end_structure(model, tmp_path):
    names = tuple(bcaches.default_names())
    config = speed.BenchConfig(
        names=names, context_names=names, budget=48, new_tokens=12, segment=5, contexts=(64, 96), probe_tokens=2
    )
    results = speed.run_bench(model, config)
    assert {r["cache"] for r in results["decode"]} == set(names)
    for row in results["decode"]:
        assert row["tokens"] == 12
        for key in ("decode_tok_s", "ratio_to_rotating", "ratio_to_kvcache", "peak_memory", "kv_bytes"):
            assert row[key] is not None, (row["cache"], key)
    assert {(r["cache"], r["context"]) for r in results["context"]} == {(n, L) for n in names for L in (64, 96)}
    for row in results["context"]:
        for key in ("prefill_tok_s", "prefill_ratio", "decode_tok_s", "decode_ratio", "peak_memory", "kv_bytes"):
            assert row[key] is not None
    paths = report.write_bench(results, tmp_path)
    assert {p.name for p in paths} == {"bench.json", "bench.md", "memory.png"}


def test_peak_runs_every_cache_it_names(model):
    from mlxevict.benchmarks import peak

    prompt = speed.random_prompt(40, TOK.vocab_size, seed=0)
    for name in ("kvcache", "default", "quantized4"):
        assert peak.peak_of(model, name, prompt, budget=64, new_tokens=3) > 0, name


def test_scoring_benchmark_times_both_kernels_on_the_same_inputs():
    from mlxevict import kernels
    from mlxevict.benchmarks import scoring

    args = scoring.inputs(slots=40, queries=4)
    ref, fast = (kernel(*args, 0.125) for kernel in scoring.KERNELS.values())
    assert mx.allclose(fast, ref, atol=1e-6).item() and ref.shape == (1, 3, 3, 4, 40)
    assert scoring.KERNELS["compiled (exp_poly)"] is kernels.attention_probs_compiled
    ms = scoring.score_ms(slots=40, queries=4, rounds=2, steps=1)
    assert set(ms) == set(scoring.KERNELS) and all(t > 0 for t in ms.values())


def test_cli_parsers_and_bad_budgets():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bcli.add_eval_parser(sub)
    bcli.add_bench_parser(sub)
    args = parser.parse_args(["eval", "demo", "--quick", "--budgets", "0.5,0.25", "--policies", "rkv"])
    assert args.budgets == (0.5, 0.25) and args.quick and args.func is bcli._run_eval and not args.memory
    assert args.suite == "long"  # the default; the 512-token tasks are --suite short
    assert parser.parse_args(["eval", "demo", "--memory"]).memory
    args = parser.parse_args(["bench", "demo", "--contexts", "128,256"])
    assert args.contexts == (128, 256) and args.func is bcli._run_bench
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "demo", "--budgets", "1.5"])


# ---- the real model ------------------------------------------------------------------------
@pytest.mark.slow
def test_quick_eval_and_bench_on_the_real_model(smollm_path, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bcli.add_eval_parser(sub)
    bcli.add_bench_parser(sub)
    # One eval budget of --quick's three: the harness end to end, in a third of the time.
    for verb, options in (("eval", ["--suite", "short", "--policies", "default,default:q8,rotating", "--budgets", "0.25"]),
                          ("bench", ["--policies", "default,rotating"])):  # fmt: skip
        args = parser.parse_args([verb, str(smollm_path), "--quick", "--out", str(tmp_path), *options])
        assert args.func(args) == 0
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["config"]["retrieval_answers_solved_by_full_cache"] >= 0
    for row in results["rows"]:
        for key in (*EVAL_KEYS, "kv_fraction_16bit"):
            assert key in row
    assert "KV / 16-bit full" in (tmp_path / "eval.md").read_text()
    assert (tmp_path / "eval_bytes.png").stat().st_size > 0
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert {r["cache"] for r in bench["decode"]} == {"kvcache", "default", "rotating"}
    assert (tmp_path / "eval.png").stat().st_size > 0 and (tmp_path / "memory.png").stat().st_size > 0
    # Budgets in memory: the 5/3 default holds more entries than the 16-bit rotating cache in the same bytes.
    args = parser.parse_args(
        ["eval", str(smollm_path), "--quick", "--suite", "short", "--memory", "--out", str(tmp_path / "memory"),
         "--policies", "rotating,default:k5v3w8", "--budgets", "0.25"]
    )  # fmt: skip
    assert args.func(args) == 0
    rows = {r["cache"]: r for r in json.loads((tmp_path / "memory" / "eval.json").read_text())["rows"]}
    assert rows["default:k5v3w8"]["budget"] > 3 * rows["rotating"]["budget"]
    assert rows["default:k5v3w8"]["kv_fraction_16bit"] <= 0.25 >= rows["rotating"]["kv_fraction_16bit"]


def test_variant_specs_build_the_policy_with_its_arguments(model):
    settings = bcaches.CacheSettings()
    tuned = variants.make_variant(model, 'default|{"observation_window": 8, "kernel": 3}', 64, settings)
    assert (tuned[0].policy.query_window, tuned[0].policy.kernel) == (8, 3)
    assert variants.make_variant(model, "default", 64, settings)[0].policy.query_window == 32
    assert type(variants.make_variant(model, "rotating", 64, settings)[0]).__name__ == "RotatingKVCache"


def test_layer_probe_makes_the_named_layers_exact(model):
    """Every layer exact is the full cache itself (KL 0); the cache as it is, at 30% of the bytes, is not."""
    from mlxevict.benchmarks import layer_probe

    rows = layer_probe.probe(model, TOK, "default", 0.3, [[0], [0, 1]], texts=1, length=320, scored=64)
    assert [block for block, _ in rows] == [[], [0], [0, 1]]
    (_, as_is), _, (_, exact) = rows
    assert as_is.kl > 1e-4 and exact.kl == 0.0 and exact.top1 == 1.0
    assert layer_probe._blocks("0-2,5") == [[0, 1, 2], [5]]


def test_an_eight_bit_layer_is_measured_at_the_bytes_of_the_cache_alone(model):
    from mlxevict.benchmarks import layer_probe
    from mlxevict.benchmarks.long_runs import LongConfig

    config = LongConfig(lengths=(700,), tuning_lengths=(700,), kinds=("passkey",), fidelity_texts=1,
                        fidelity_length=320, fidelity_scored=64, recall_texts=0)  # fmt: skip
    rows = layer_probe.eight_bit_layer(model, TOK, "default", 0.5, 0, config)
    assert [(r["batch"], "8-bit" in r["setting"]) for r in rows] == [
        ("retrieval 700", False), ("retrieval 700", True), ("fidelity", False), ("fidelity", True)]
    for alone, mixed in (rows[:2], rows[2:]):
        assert abs(alone["kv"] - 0.5) < 0.02 and abs(mixed["kv"] - alone["kv"]) < 0.02, (alone, mixed)
    assert rows[0]["of"] >= rows[0]["answers"] >= 0 and rows[2]["kl"] > 0
