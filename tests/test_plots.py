"""Plots and tables people can read: fixed looks per cache, few lines per panel, percent axes, legends
outside the data, titles that say what the axes show, tables wrapped to the terminal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlxevict.benchmarks import caches as bcaches
from mlxevict.benchmarks import cli as bcli
from mlxevict.benchmarks import replot, report, style, terminal
from mlxevict.benchmarks.storage_variants import VARIANTS
from mlxevict.policies import DEFAULT_POLICY, policy_names

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
EVERY_NAME = list(dict.fromkeys([
    *bcaches.cache_names(),
    *(f"{DEFAULT_POLICY}{suffix}" for suffix in bcaches.STORAGE_SUFFIXES),
    f"{DEFAULT_POLICY}:k5v3w8",
    f"{DEFAULT_POLICY}:k5v3w8c64",
    f"{DEFAULT_POLICY}:k5v3w8c64l32",  # the memory rule's storages: one tier, and the tiers
    *VARIANTS,  # the long suite's storage variants and its caches compressed once after prefill
    *(f"{p}{style.COMPRESS}" for p in policy_names() if p not in ("full", "default")),
]))


def test_each_policy_and_cache_has_its_own_look_everywhere():
    names = [n for n in EVERY_NAME if n != "default"]
    looks = {n: style.style(n) for n in names}
    assert len({(s.color, s.marker, str(s.linestyle)) for s in looks.values()}) == len(names)
    # One colour and marker per policy, whatever its storage; "default" is drawn as the policy it names.
    bases = [n for n in names if ":" not in n and n not in bcaches.MLX_LM_CACHES and n not in VARIANTS and " " not in n]
    assert len({(looks[n].color, looks[n].marker) for n in bases}) == len(bases) == len(policy_names()) - 1
    assert style.style("default", DEFAULT_POLICY) == looks[DEFAULT_POLICY]
    assert looks[f"{DEFAULT_POLICY}:q8"].marker == looks[DEFAULT_POLICY].marker
    assert looks[f"{DEFAULT_POLICY}:q8"].linestyle != looks[DEFAULT_POLICY].linestyle
    assert looks[f"snapkv{style.COMPRESS}"].marker == looks["snapkv"].marker
    assert style.style(f"default{style.COMPRESS}") == looks[f"{DEFAULT_POLICY}{style.COMPRESS}"]


def test_groups_hold_at_most_eight_and_place_every_name():
    panels = style.groups(EVERY_NAME + ["someone-elses-cache"], DEFAULT_POLICY)
    assert all(len(names) <= style.MAX_SERIES for _, names in panels)
    assert {n for _, names in panels for n in names} == set(EVERY_NAME + ["someone-elses-cache"])
    assert all(names[0] == DEFAULT_POLICY for _, names in panels)  # the default is every panel's reference


@pytest.fixture(scope="module")
def eval_results() -> dict:
    return json.loads((RESULTS / "eval.json").read_text())


def test_eval_figure_reads_in_percent_with_legends_outside(eval_results):
    fig = report.quality_figure(
        eval_results["rows"], x=report._kept, xlabel="kept", title="quality vs kept fraction",
        default_policy=eval_results["default_policy"], log_kl=False,
    )  # fmt: skip
    fig.canvas.draw()
    for ax in fig.axes:
        assert len(ax.get_lines()) <= style.MAX_SERIES
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(label.endswith("%") for label in labels), labels
        legend = ax.get_legend()
        if legend is not None:  # the rightmost panel of each row: placed beyond the data area
            assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1
    assert sum(ax.get_legend() is not None for ax in fig.axes) == len(fig.axes) // 3
    report._pyplot().close(fig)


def test_titles_match_the_axes(eval_results):
    memory = json.loads((RESULTS / "eval_memory" / "eval.json").read_text())
    for results, words, axis in (
        (eval_results, "quality vs kept fraction", "kept (% of the context's tokens"),
        (memory, "quality vs the KV memory budget", "budget (% of a 16-bit full cache's KV bytes)"),
    ):
        fig = report.eval_figure(results)
        assert words in fig._suptitle.get_text()
        assert all(ax.get_xlabel().startswith(axis) for ax in fig.axes)
        report._pyplot().close(fig)


def test_wide_tables_wrap_to_the_terminal():
    markdown = (RESULTS / "eval.md").read_text()
    names = {line.split("|")[1].strip() for line in markdown.splitlines()[2:] if line.startswith("|")}
    for width in (80, 120):
        text = terminal.render(markdown, width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert all(name in text for name in names)  # cache names whole
        assert "16-bit" in text and "retrieval" in text  # every column, in a second block if need be


def test_replot_draws_the_saved_results_again(tmp_path):
    results = json.loads((RESULTS / "eval_memory" / "eval.json").read_text())
    results["rows"] = [r for r in results["rows"] if r["cache"] in ("kvcache", "window", DEFAULT_POLICY)]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text(json.dumps(results))
    shutil.copy(RESULTS / "bench_default" / "bench.json", tmp_path / "bench.json")
    (tmp_path / "long").mkdir()
    shutil.copy(RESULTS / "long" / "long.json", tmp_path / "long" / "long.json")
    assert replot.main([str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.rglob("*.png")} == {"eval.png", "eval_bytes.png", "memory.png", "long_tuning.png",
                                                         "long_test.png"}  # fmt: skip


def test_quick_runs_a_handful_of_caches():
    names = bcaches.parse_names(",".join(bcli.QUICK_EVAL).format(default=DEFAULT_POLICY), storage=True)
    assert len(names) <= 8 and bcaches.REFERENCE in names
    assert len(bcaches.parse_names(",".join(bcli.QUICK_BENCH))) <= 6
