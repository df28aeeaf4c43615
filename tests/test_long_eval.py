"""The long suite of ``mlxevict eval``: prose halves, long tasks, protocols, simulated storage, end to end.

Fast tests use a random-weight llama with a byte tokenizer; the slow one runs
``mlxevict eval demo --quick`` (the long suite) on the real SmolLM2 model. They
check structure and invariants, never the numbers.
"""

from __future__ import annotations

import argparse
import json
import re

import mlx.core as mx
import pytest

from tiny_models import tiny_model

import mlxevict
from mlxevict.plan import calibrated_layers
from mlxevict.benchmarks import cli as bcli
from mlxevict.benchmarks import long_eval as le
from mlxevict.benchmarks import long_cli, long_feed, long_report, long_runs, long_tasks, prose, tasks
from mlxevict.benchmarks import storage_variants as sv
from mlxevict.benchmarks.caches import CacheSettings

TOK = tasks.ByteTokenizer()
LENGTH = 1200  # bytes: room for three facts and the question


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size, head_dim=64)


# ---- prose and tasks ------------------------------------------------------------------
def test_tuning_and_test_halves_share_no_part_and_each_has_every_source():
    tuning, test = prose.documents("tuning"), prose.documents("test")
    assert not {(d.source, d.name, d.part) for d in tuning} & {(d.source, d.name, d.part) for d in test}
    assert prose.sources("tuning") == prose.sources("test") == ["docstrings", "license", "pydoc"]
    assert not {d.text for d in tuning} & {d.text for d in test}
    # the licence is one document: its parts alternate between the halves
    assert {d.part % 2 for d in tuning if d.source == "license"} != {d.part % 2 for d in test if d.source == "license"}


def test_a_long_document_is_cut_at_paragraph_ends_into_about_equal_parts():
    paragraphs = [f"paragraph {i} " + "word " * (20 + 7 * (i % 5)) for i in range(40)]
    text = "\n\n".join(paragraphs)
    parts = prose.cut(text, size=1000)
    assert len(parts) == -(-len(text) // 1000)
    assert "\n\n".join(parts) == text
    assert max(map(len, parts)) < 1.3 * min(map(len, parts))
    assert prose.cut("short text", size=1000) == ["short text"]


def test_a_missing_source_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(prose, "license_path", lambda: str(tmp_path / "LICENSE.txt"))
    prose.documents.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="licence text is missing at .*LICENSE.txt"):
            prose.documents("test")
    finally:
        prose.documents.cache_clear()


def test_long_rows_hide_the_facts_in_the_streamed_text():
    rows = long_tasks.make_long_rows(TOK, LENGTH, "tuning", seed=0)
    assert rows == long_tasks.make_long_rows(TOK, LENGTH, "tuning", seed=0)
    assert [r.kind for r in rows] == list(long_tasks.KINDS)
    for row in rows:
        assert len(row.tokens) == LENGTH
        body = TOK.decode(row.tokens[: row.question_start])
        for a, b in row.answers:
            answer = TOK.decode(row.tokens[a:b]).strip()
            assert answer in row.facts.values() and answer in body
            assert a >= row.question_start
        # every fact comes after the first streamed chunk, in order of depth
        assert all(d * LENGTH >= long_tasks.FIRST_FACT_AFTER for d in row.depths)
        assert row.depths == sorted(row.depths)
    spread = rows[1].depths  # three pass keys
    assert spread[-1] - spread[0] > 0.4  # asked 0.15 to 0.85; a fact goes to a sentence end
    other = long_tasks.make_long_rows(TOK, LENGTH, "test", seed=1)
    assert all(a.tokens != b.tokens for a, b in zip(rows, other))


def test_long_texts_come_from_the_asked_half():
    texts = long_tasks.make_long_texts(TOK, 2, 600, "test", seed=1)
    assert all(len(t) == 600 for t in texts) and texts[0] != texts[1]
    assert TOK.decode(texts[0])[:200] in "\n\n".join(d.text for d in prose.documents("test"))


def test_more_texts_than_sources_never_repeat_a_text():
    texts = long_tasks.make_long_texts(TOK, 6, 600, "test", seed=1)
    assert len({TOK.decode(t)[:300] for t in texts}) == 6
    license_parts = sum(d.source == "license" for d in prose.documents("test"))
    with pytest.raises(ValueError, match=f"has {license_parts} parts of license"):
        long_tasks.make_long_texts(TOK, 3 * license_parts + 3, 600, "test", seed=1)


def test_recall_texts_restate_an_earlier_passage_token_for_token():
    texts, starts = long_tasks.make_recall_texts(TOK, 2, LENGTH, 100, "test", seed=1)
    assert (texts, starts) == long_tasks.make_recall_texts(TOK, 2, LENGTH, 100, "test", seed=1)
    cue = tasks.encode(TOK, long_tasks.RECALL_CUE)
    for text, start, share in zip(texts, starts, long_tasks.RECALL_FROM):
        assert len(text) == LENGTH and text[-100:] == text[start : start + 100]
        assert text[-100 - len(cue) : -100] == cue
        assert start >= share * LENGTH and TOK.decode([text[start - 1]]).rstrip().endswith((".", "\n"))
    assert starts[0] < starts[1] and texts[0][:300] != texts[1][:300]
    assert all(texts[0][:300] != t[:300] for t in long_tasks.make_long_texts(TOK, 2, LENGTH, "test", seed=1))
    with pytest.raises(ValueError, match="cannot hold a 300-token passage and its restatement"):
        long_tasks.make_recall_texts(TOK, 1, 500, 300, "test", seed=1)


def test_choose_storage_uses_retrieval_first_then_kl():
    rows = [
        {"cache": "a", "budget_of": "memory", "fraction": 0.25, "retrieval_accuracy": 1.0, "fidelity_kl": 0.05},
        {"cache": "b", "budget_of": "memory", "fraction": 0.25, "retrieval_accuracy": 0.5, "fidelity_kl": 0.01},
        {"cache": "c", "budget_of": "memory", "fraction": 0.25, "retrieval_accuracy": 1.0, "fidelity_kl": 0.03},
        {"cache": "d", "budget_of": "tokens", "fraction": 0.25, "retrieval_accuracy": 1.0, "fidelity_kl": 0.0},
    ]
    assert le.choose_storage(rows, (0.25, 0.125)) == {0.25: "c"}


# ---- protocols -------------------------------------------------------------------------
def test_a_forked_compress_prefill_equals_its_own_prefill(model):
    x = mx.random.randint(0, 256, (2, 300), key=mx.random.key(3))
    settings = CacheSettings()
    with mlxevict.patched(model):
        run = long_runs.Run("default", "tokens", 0.25, "compress")
        direct = long_feed.build(model, run, 300, settings)
        long_feed.feed(model, direct, x, 0, 260, 64)
        held = long_feed.build(model, long_runs.Run("default", "tokens", 1.0, "compress"), 300, settings)
        long_feed.feed(model, held, x, 0, 260, 64)
        forked = long_feed.fork(held, long_feed.build(model, run, 300, settings), 64)
        a = mx.concatenate(long_feed.feed(model, direct, x, 260, 300, 1), axis=1)
        b = mx.concatenate(long_feed.feed(model, forked, x, 260, 300, 1), axis=1)
    assert direct[0].evictions > 0 and forked[0].size() == direct[0].size() <= 75
    assert mx.allclose(a, b, atol=1e-5)


# ---- simulated storage -------------------------------------------------------------------
def test_fake_quantization_is_close_and_channel_groups_quantize_over_tokens():
    x = mx.random.normal((1, 2, 32, 64), key=mx.random.key(0))
    for bits in (8, 5, 3):
        err = mx.abs(sv.fake_quant(x, bits, rotation=sv.hadamard(64)) - x).mean().item()
        assert 0 < err < 2.0 ** (2 - bits)
    per_channel = sv.fake_quant_channels(x, 4)
    assert mx.allclose(per_channel, sv.fake_quant(x.swapaxes(-1, -2), 4, group=32).swapaxes(-1, -2))
    assert mx.allclose(sv.hadamard(64) @ sv.hadamard(64).T, mx.eye(64), atol=1e-5)


def test_spec_bytes_match_the_product_layout():
    cost = sv.VARIANTS["sim-k5v3w8"].bytes_per_token(64)
    assert cost["low"] / cost["16bit"] == pytest.approx(72 / 256)  # the "5/3 bits ≈ 28%"
    assert sv.VARIANTS["kivi-k5v3"].bytes_per_token(64)["low"] == cost["low"]  # groups of 64 tokens: same bytes


@pytest.mark.parametrize("name", ["tiers-k3v2", "kivi-tiers", "kivi-k2v2", "sim-k5v3w8"])
def test_simulated_storage_holds_its_bytes_and_tiers_evict_only_when_the_low_tier_is_full(model, name):
    context, fraction = 600, 0.25
    x = mx.random.randint(0, 256, (1, context), key=mx.random.key(1))
    with mlxevict.patched(model):
        caches = sv.make_simulated(model, name, fraction, context)
        limit = fraction * context * 256
        fits = sv.entries_for(sv.VARIANTS[name], limit, 64)
        for start in range(0, context, 16):
            model(x[:, start : start + 16], cache=caches)
            c = caches[0]
            assert c.stored_bytes() <= limit + 1e-6
            if c.offset <= fits:
                assert c.evictions == 0
    assert caches[0].offset == context and caches[0].size() <= fits
    if sv.VARIANTS[name].tiers:  # the bytes hold every entry only with most of them demoted, some not
        low = int(caches[0].low[..., : caches[0].size()].sum(axis=-1).min().item())
        assert 0 < low < caches[0].done


# ---- end to end ----------------------------------------------------------------------------
def test_long_suite_end_to_end_structure(model, tmp_path):
    config = long_runs.LongConfig(
        lengths=(LENGTH,), tuning_lengths=(LENGTH - 100,), kinds=("passkeys",), fidelity_texts=2, fidelity_length=LENGTH,
        fidelity_scored=32,
        policies=("default",), compress_policies=("default",), token_fractions=(0.25,), memory_fractions=(0.25,),
        variants=("tiers-k3v2",), baselines=("quantized4",),
    )  # fmt: skip
    labels = []
    results = le.run_long(model, TOK, config, labels.append)
    assert set(results["splits"]) == {"tuning", "test"}
    assert len(labels) == sum(len(s["rows"]) for s in results["splits"].values()) <= long_runs.total_runs(config)
    # the memory rule's storage at 25% of so short a context: the tiers (the page store's 512 entries read a step
    # alone would take more than the budget); at 25% of the model's 4,096-token context, its page store
    product = le.product_storage(model, 0.25, LENGTH - 100)
    assert product == "default:k5v4w8c64l32" and le.product_storage(model, 0.25, 4096) == "disk-32"
    assert results["chosen"]["0.25"] in ("default", product, "tiers-k3v2")
    test = results["splits"]["test"]
    tuned = {L for r in results["splits"]["tuning"]["rows"] for L in r["retrieval_by_length"]}
    assert tuned == {str(LENGTH - 100)} and {L for r in test["rows"] for L in r["retrieval_by_length"]} == {str(LENGTH)}
    keys = {(r["cache"], r["protocol"], r["budget_of"]) for r in test["rows"]}
    assert {("kvcache", "stream", None), ("quantized4", "stream", None), ("rotating", "stream", "tokens"),
            ("default", "compress", "tokens"), (product, "stream", "memory")} <= keys  # fmt: skip
    assert sum(r["picked_on_tuning"] for r in test["rows"]) == 1
    for row in test["rows"]:
        assert row["retrieval"][1] == test["rows"][0]["retrieval"][1]  # the full cache's answers, for every row
        assert 0 < row["kv_fraction_16bit"] <= 1.0 and row["fidelity_kl"] >= 0
        by_text = row["fidelity_kl_by_text"]  # the mean over texts of equal length is the row's KL
        assert len(by_text) == 2 and abs(sum(by_text) / 2 - row["fidelity_kl"]) < 1e-5
        assert abs(sum(row["fidelity_top1_by_text"]) / 2 - row["fidelity_top1"]) < 1e-5
    assert next(t for t in test["tasks"] if t["batch"] == "fidelity")["leads"] == ["docstrings", "license"]
    recall = next(t for t in test["tasks"] if t["batch"] == "recall")
    assert recall["rows"] == 1 and recall["tail_from"] == LENGTH - 32 and len(recall["restated_from"]) == 1
    ref = test["rows"][0]
    assert ref["fidelity_top1"] == ref["recall_top1"] == 1.0 and ref["fidelity_kl"] == ref["recall_kl"] == 0.0
    assert all(r["recall_kl"] >= 0 and 0 <= r["recall_top1"] <= 1 for r in test["rows"])
    assert any(r["recall_kl"] > 0 for r in test["rows"])
    paths = long_report.write_long(results, tmp_path)
    assert {p.name for p in paths} == {"long.json", "long.md", "long_tuning.png", "long_test.png"}
    md = (tmp_path / "long.md").read_text()
    assert f"Retrieval rows of {LENGTH - 100} (tuning half), {LENGTH} (test half) tokens" in md
    assert "## test half (seed 1)" in md and "Ranking" in md and "(picked on tuning)" in md
    assert "| cache | protocol | budget | 1: docstrings | 2: license |" in md
    assert "| top-1 | KL | recall top-1 | recall KL |" in md and "Recall: 1 text(s)" in md
    assert md.count("| quantized4 | stream | all |") == 2  # in the half's table and the per-text one
    merged = long_report.merge([results, json.loads((tmp_path / "long.json").read_text())])
    assert len(merged["splits"]["test"]["rows"]) == len(test["rows"])


def test_the_full_caches_outcome_round_trips_through_the_reference_dir(model, tmp_path):
    config = long_runs.LongConfig(
        lengths=(LENGTH,), kinds=("passkey",), fidelity_texts=1, fidelity_length=400, fidelity_scored=16,
        splits=("test",), parts=(), reference_dir=str(tmp_path),
    )  # fmt: skip
    first = le.run_long(model, TOK, config)["splits"]["test"]["rows"][0]
    assert len(list(tmp_path.glob("test-*.json"))) == 3 and len(list(tmp_path.glob("test-fidelity-*.npy"))) == 1
    assert len(list(tmp_path.glob("test-recall-*.npy"))) == 1
    again = le.run_long(model, TOK, config)["splits"]["test"]["rows"][0]
    assert again["retrieval"] == first["retrieval"] and again["fidelity_kl"] == again["recall_kl"] == 0.0


def test_eval_parser_defaults_to_the_long_suite_and_rejects_short_options():
    parser = argparse.ArgumentParser()
    bcli.add_eval_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", "demo", "--out", "docs/results/long"])
    assert args.suite == "long" and not args.long
    config = long_cli.long_config(args)
    assert config.lengths == (1024, 2048) and config.splits == ("tuning", "test")
    assert config.lengths_of("tuning") == (1024,) and config.lengths_of("test") == (1024, 2048)  # tested past its tuning
    given = long_cli.long_config(parser.parse_args(["eval", "demo", "--lengths", "1024,2048"]))
    assert given.lengths_of("tuning") == (1024, 2048)  # --lengths alone: both halves, as before --tuning-lengths
    both = ["eval", "demo", "--lengths", "4096", "--tuning-lengths", "2048"]
    assert long_cli.long_config(parser.parse_args(both)).lengths_of("tuning") == (2048,)
    assert config.token_fractions == config.memory_fractions == (0.25, 0.125)  # what the targets compare
    assert config.variants == () and long_runs.ONE_TIER in long_runs.LONG["variants"]  # the old rule: --long only
    full = long_cli.long_config(parser.parse_args(["eval", "demo", "--long"]))
    assert full.lengths[-1] == 8192 and 0.5 in full.token_fractions and len(full.baselines) == 3
    assert full.lengths_of("tuning") == (1024, 2048) and "window" in full.policies and "default" in full.compress_policies
    assert long_runs.total_runs(full) > 2 * long_runs.total_runs(config)
    assert long_cli.long_config(parser.parse_args(["eval", "demo", "--long", "--lengths", "4096"])).lengths == (4096,)
    with pytest.raises(ValueError, match="--long and --quick: choose one"):
        long_cli.long_config(parser.parse_args(["eval", "demo", "--long", "--quick"]))
    with pytest.raises(ValueError, match="--recall-texts -1: give 0 or more"):
        long_cli.long_config(parser.parse_args(["eval", "demo", "--recall-texts", "-1"]))
    with pytest.raises(ValueError, match="--instances 0: give 1 or more"):
        long_cli.long_config(parser.parse_args(["eval", "demo", "--instances", "0"]))
    assert long_cli.long_config(parser.parse_args(["eval", "demo", "--recall-texts", "0"])).recall_texts == 0
    with pytest.raises(ValueError, match="--memory belongs to the 512-token suite: add --suite short"):
        long_cli.long_config(parser.parse_args(["eval", "demo", "--memory"]))


@pytest.mark.slow
def test_quick_long_eval_on_the_real_model(smollm_path, tmp_path):
    parser = argparse.ArgumentParser()
    bcli.add_eval_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["eval", str(smollm_path), "--quick", "--out", str(tmp_path), "--splits", "test", "--parts", "memory",
         "--kinds", "passkey"]
    )  # fmt: skip
    assert args.func(args) == 0
    results = json.loads((tmp_path / "long.json").read_text())
    rows = {r["cache"]: r for r in results["splits"]["test"]["rows"]}
    # At 25% of the bytes the product's row is the memory rule's page store (bytes counted at 16 bits); its tiers,
    # where the rule picks them, carry the demo model's shipped calibration (its layers in 8 bits).
    layers = calibrated_layers(smollm_path)
    assert layers, "the demo model's calibration ships in mlxevict/calibrations/"
    assert le.product_storage(smollm_path, 0.2, 128) == "default:k5v4w8c64l32e" + ".".join(map(str, layers))
    product = "disk-32"
    assert le.product_storage(smollm_path, 0.25, 512) == product and set(rows) == {"kvcache", "default", product}
    assert rows[product]["kv_fraction_16bit"] <= 0.25
    assert (tmp_path / "long_test.png").stat().st_size > 0


def test_the_variants_help_names_every_simulated_storage():
    """The help lists the names by hand (the parser does not import MLX); it must not fall behind."""
    p = argparse.ArgumentParser()
    long_cli.add_long_arguments(p)
    helped = set(re.findall(r"[\w-]+", next(a.help for a in p._actions if a.dest == "variants")))
    assert [name for name in sv.VARIANTS if name not in helped] == []


@pytest.mark.parametrize("fraction", [0.125, 0.25])
def test_the_product_row_is_what_the_memory_rule_plans(model, fraction):
    """The eval's product row at a share of the bytes is the storage ``plan_cache`` picks for that share."""
    from mlxevict.geometry import kv_shape
    from mlxevict.plan import plan_cache, rule_pages

    for context in (1024, 4096):
        budget = f"{int(fraction * context * kv_shape(model, 2).bytes_per_token)}B"
        planned = plan_cache(model, budget, expected_tokens=context).storage
        pages = rule_pages(model, budget, context, dtype_size=2)
        assert le.product_storage(model, fraction, context) == ("disk-32" if pages else "default" + planned.suffix)
        # this model's page store fits a quarter of its whole context; an eighth of it, or a shorter one, is all sketch
        assert pages == (fraction == 0.25 and context == 4096)


def test_a_variant_named_as_a_storage_stays_that_storage(model):
    """The product row follows the rule per share; a variant spelled like the rule's storage at another share is
    still run as written (it was once replaced by the product's storage and dropped as a repeat)."""
    tiers = "default:k5v3w8c64l32"
    config = long_runs.LongConfig(parts=("memory",), variants=(tiers,), memory_fractions=(0.25, 0.125))
    runs, picked = le.split_runs(model, config, "tuning", {}, skipped := [])
    names = {(r.cache, r.fraction) for r in runs}
    product = le.product_storage(model, 0.125, min(config.lengths_of("tuning")))
    assert product != tiers and {(tiers, 0.125), (product, 0.125), (tiers, 0.25), ("default", 0.125)} <= names
    assert len(runs) == len(set(runs)) and not picked and not skipped  # the 25% product is the tiers: run once
