"""search_mixed_precision on quantlens.zoo's tiny_transformer (docs/mixed_precision.md)."""

from __future__ import annotations

import csv
import json
import re
import warnings

import pytest
import torch

from quantlens import zoo
from quantlens.quantization import calibrate, prepare
from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.search import (
    MixedPrecisionQconfigSetter,
    Promotion,
    int16_conflicts,
    mixed_precision_candidates,
    search_mixed_precision,
)
from quantlens.search.progress import PROGRESS_FILE

TARGET = 0.9999  # int8 calibration gives 0.99971 on this model and data


@pytest.fixture(scope="module")
def setup():
    model = zoo.get_model("tiny_transformer")
    example = zoo.example_inputs("tiny_transformer", batch_size=2)
    calib = zoo.sample_batches("tiny_transformer", num_batches=4, batch_size=8)
    held_out = zoo.sample_batches("tiny_transformer", num_batches=6, batch_size=16)[-1]
    with torch.no_grad():
        ref = model(*held_out)
    calls = {"n": 0}

    def evaluate(prepared) -> float:
        calls["n"] += 1
        out = prepared(*held_out)
        return torch.nn.functional.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0).item()

    return model, example, calib, evaluate, calls


def _build(model, example, calib, setter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return calibrate(prepare(model, example, setter, check_result_dir=None), calib)


@pytest.fixture(scope="module")
def searched(setup, tmp_path_factory):
    model, example, calib, evaluate, _ = setup
    out = tmp_path_factory.mktemp("search")
    return search_mixed_precision(model, example, calib, evaluate, TARGET, out_dir=out, prune=False,
                                  progress=False), out


def test_reaches_a_target_int8_misses_with_few_promotions(setup, searched):
    model, example, calib, evaluate, _ = setup
    result, _ = searched
    base = evaluate(_build(model, example, calib, default_calibration_qconfig_setter))
    assert base < TARGET
    assert result.base_metric == base
    assert result.reached and result.metric >= TARGET
    assert 0 < result.num_int16 < len(result.candidates) // 2
    # the curve starts at int8 and has one point per promotion
    assert [p.num_int16 for p in result.curve] == list(range(result.num_int16 + 1))
    assert tuple(p.added for p in result.curve[1:]) == result.chosen
    assert result.curve[-1].metric == result.metric
    # where the time went: each pass named, every measurement counted once
    steps = [t.step for t in result.step_times]
    assert steps[:3] == ["base: prepare and calibrate", "ranking: the profiler's sensitivity", "base: evaluate"]
    assert "greedy" in steps
    assert sum(t.measurements for t in result.step_times) == result.measurements


def test_setter_reproduces_the_metric_through_prepare(setup, searched):
    model, example, calib, evaluate, _ = setup
    result, _ = searched
    prepared = _build(model, example, calib, result.setter())
    assert evaluate(prepared) == result.metric
    plans = prepared._quantlens_state.plans
    for p in result.chosen:
        plan = plans[p.site]
        if p.kind == "activation":
            assert plan.output_dtype == "qint16", p
        else:
            assert plan.qconfig.weight.dtype.value == "qint16", p
    int16_outputs = {n for n, plan in plans.items() if plan.output_dtype == "qint16"}
    assert int16_outputs == {p.site for p in result.chosen if p.kind == "activation"} | \
        {p.site for p in result.chosen if p.kind == "weight" and plans[p.site].output.value == "weight"}


def test_int16x16_rule_matches_prepare_and_is_respected(setup, tmp_path):
    model, example, calib, evaluate, _ = setup
    base = _build(model, example, calib, default_calibration_qconfig_setter)
    # a GEMM's int16 weight with an int16 producer: our rule and prepare's resolution agree
    pair = [Promotion("norm1", "activation"), Promotion("attn.q_proj", "weight")]
    assert int16_conflicts(base, pair)
    both = _build(model, example, calib, MixedPrecisionQconfigSetter(pair))
    assert "attn.q_proj" in [n for n, p in both._quantlens_state.plans.items()
                             if any("no int16 x int16" in s for s in p.notes)]
    qk = [Promotion("attn.q_proj", "activation"), Promotion("attn.k_proj", "activation")]
    assert int16_conflicts(base, qk)  # both operands of q @ k^T
    assert not int16_conflicts(base, pair[:1] + qk[:1])
    # a search over exactly such pairs, with an unreachable target, never forms one
    cands = pair + qk + [Promotion("attn.k_proj", "weight"), Promotion("attn.v_proj", "weight")]
    result = search_mixed_precision(model, example, calib, evaluate, 2.0, candidates=cands, ranking=cands,
                                    out_dir=tmp_path, progress=False, tries=6)
    assert not result.reached
    assert not int16_conflicts(base, result.chosen)
    assert result.int16x16_resolutions == ()
    assert not set(pair) <= set(result.chosen) and not set(qk) <= set(result.chosen)
    assert Promotion("norm1", "activation") in result.chosen or Promotion("attn.q_proj", "weight") in result.chosen
    # 6 candidates, two of them excluded by the rule once their partner is chosen
    assert result.num_int16 <= 4


def test_budget_limits_promotions(setup, searched, tmp_path):
    model, example, calib, evaluate, _ = setup
    full, _ = searched
    result = search_mixed_precision(model, example, calib, evaluate, TARGET, budget=2, out_dir=tmp_path,
                                    progress=False)
    assert result.num_int16 == 2 and not result.reached
    assert result.chosen == full.chosen[:2]  # same greedy path, stopped by the budget


def test_resume_from_partial_progress_gives_the_same_result(setup, searched, tmp_path):
    model, example, calib, evaluate, calls = setup
    full, _ = searched

    class Stop(Exception):
        pass

    def flaky(prepared):
        if calls["n"] >= stop_at:
            raise Stop
        return evaluate(prepared)

    calls["n"] = 0
    stop_at = 6  # the base and one step of 4 tries, then part of the second step
    with pytest.raises(Stop):
        search_mixed_precision(model, example, calib, flaky, TARGET, out_dir=tmp_path, prune=False, progress=False)
    saved = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert len(saved["measurements"]) == 6 and len(saved["steps"]) == 1 and not saved["done"]
    calls["n"] = 0
    stop_at = 10 ** 9
    resumed = search_mixed_precision(model, example, calib, flaky, TARGET, out_dir=tmp_path, prune=False,
                                     progress=False)
    assert resumed.chosen == full.chosen and resumed.curve == full.curve and resumed.metric == full.metric
    assert calls["n"] == full.measurements - 6  # only what was not measured before
    # without resume: everything again
    calls["n"] = 0
    again = search_mixed_precision(model, example, calib, evaluate, TARGET, out_dir=tmp_path, prune=False,
                                   progress=False, resume=False)
    assert again == full and calls["n"] == full.measurements
    # a progress file of other inputs (another target) is not reused
    calls["n"] = 0
    with pytest.warns(UserWarning, match="other inputs"):
        other = search_mixed_precision(model, example, calib, evaluate, 0.99985, out_dir=tmp_path, prune=False,
                                       progress=False)
    assert calls["n"] == other.measurements


def test_curve_csv_and_html_are_written(searched):
    result, out = searched
    with open(result.csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["num_int16"]) for r in rows] == [p.num_int16 for p in result.curve]
    assert [float(r["metric"]) for r in rows] == [p.metric for p in result.curve]
    assert [r["added_site"] for r in rows[1:]] == [p.site for p in result.chosen]
    page = open(result.html_path).read()
    assert page.count("<svg") == 1 and "<path d='M" in page  # no latency: one plot
    assert len(re.findall(r"<circle", page)) == len(result.curve)
    assert not re.search(r"(src|href)=['\"]?https?:", page)  # self-contained
    assert f"target {TARGET}" in page


def test_candidates_and_errors(setup, tmp_path):
    model, example, calib, evaluate, _ = setup
    base = _build(model, example, calib, default_calibration_qconfig_setter)
    cands = mixed_precision_candidates(base)
    assert Promotion("attn.q_proj", "weight") in cands and Promotion("attn.softmax_0", "activation") in cands
    assert Promotion("classifier", "activation") not in cands  # int32 high-precision output: nothing to promote
    from quantlens.errors import QuantLensError

    with pytest.raises(QuantLensError, match="cannot be promoted"):
        search_mixed_precision(model, example, calib, evaluate, TARGET, candidates=["classifier"],
                               out_dir=tmp_path, progress=False)


def test_latency_curve_and_latency_budget(setup, searched, tmp_path):
    from quantlens.compiler import convert, export
    from quantlens.search import MaxLatency

    model, example, calib, evaluate, _ = setup
    full, _ = searched
    q_ir = convert(export(_build(model, example, calib, default_calibration_qconfig_setter), example))
    int8_cycles = q_ir.latency_estimate().cycles
    result = search_mixed_precision(model, example, calib, evaluate, TARGET, latency=True, out_dir=tmp_path,
                                    progress=False)
    assert result.chosen == full.chosen  # the latency estimates only annotate the curve
    assert result.curve[0].latency_cycles == int8_cycles
    assert all(isinstance(p.latency_cycles, int) and p.latency_cycles > 0 for p in result.curve)
    page = open(result.html_path).read()
    assert page.count("<svg") == 2 and "latency estimate (cycles)" in page
    # a budget below the int8 model's latency admits no promotion at all
    tight = search_mixed_precision(model, example, calib, evaluate, TARGET, budget=MaxLatency(int8_cycles - 1),
                                   out_dir=tmp_path / "tight", progress=False)
    assert tight.chosen == () and not tight.reached


def test_each_step_tries_the_first_rankings_best_remaining_candidate(setup, searched):
    # the re-ranked candidates (those that helped, the promoted site's neighbours) must not crowd out the ranking
    model, example, calib, _, _ = setup
    result, out = searched
    saved = json.loads((out / "mixed_precision_progress.json").read_text())
    ranked0 = [Promotion(**p) for p in saved["ranking"]]
    base = _build(model, example, calib, default_calibration_qconfig_setter)
    for k, step in enumerate(saved["steps"]):
        selected = list(result.chosen[:k])
        tried = [Promotion(**p) for p in step["tried"]]
        first = next(c for c in ranked0 if c not in selected and not int16_conflicts(base, selected + [c]))
        assert first in tried, (k, first, tried)


def test_graph_neighbours_are_producers_and_consumers(setup):
    from quantlens.search.graph import search_graph as _graph

    model, example, calib, _, _ = setup
    base = _build(model, example, calib, default_calibration_qconfig_setter)
    g = _graph(base)
    record = base._quantlens_state.record
    for a, near in g.neighbours.items():
        assert a not in near and all(a in g.neighbours[b] for b in near)  # symmetric, no self-loop
    site = record.sites["attn.q_proj"]
    producers = {record.origin(i.producer) for i in site.inputs if i.producer and not i.is_parameter}
    assert producers and producers <= g.neighbours["attn.q_proj"]


def test_pruning_takes_back_a_promotion_that_later_ones_made_redundant(setup, tmp_path):
    """A metric built so that greedy picks A first (alone the best), then needs B and C together, which make A
    useless: the forward pass ends with {A, B, C}, the pruning pass takes A back."""
    model, example, calib, _, _ = setup
    a, b, c = (Promotion(site) for site in ("norm1", "attn.v_proj", "norm2"))

    def int16(prepared):
        plans = prepared._quantlens_state.plans
        return {p for p in (a, b, c) if plans[p.site].output_dtype == "qint16"}

    def metric(prepared) -> float:
        on = int16(prepared)
        if b in on and c in on:
            return 1.0
        return 0.5 * (a in on) + 0.1 * (b in on) + 0.1 * (c in on)

    kwargs = dict(candidates=[a, b, c], ranking=[a, b, c], tries=3, progress=False)
    forward = search_mixed_precision(model, example, calib, metric, 0.95, out_dir=tmp_path / "f", prune=False,
                                     **kwargs)
    assert forward.chosen == (a, b, c) and forward.metric == 1.0
    pruned = search_mixed_precision(model, example, calib, metric, 0.95, out_dir=tmp_path / "p", **kwargs)
    assert set(pruned.chosen) == {b, c} and pruned.reached and pruned.metric == 1.0
    last = pruned.curve[-1]
    assert last.removed == a and last.added is None and last.num_int16 == 2
    with open(pruned.csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [r["added_site"] for r in rows if r["added_site"]] == ["norm1", "attn.v_proj", "norm2"]
    assert [r["removed_site"] for r in rows if r["removed_site"]] == ["norm1"]
    assert "(pruned)" in open(pruned.html_path).read()
    # the setter is the pruned set
    assert set(pruned.setter().promotions) == {b, c}


def test_descend_finds_the_pair_that_helps_only_together(setup, tmp_path):
    """method="descend": every activation int16, the cost of sending each back to int8 alone, the fewest
    most-needed sites by bisection: it lands on {B, C} at once, where greedy needs A first."""
    model, example, calib, _, _ = setup
    a, b, c = (Promotion(site) for site in ("norm1", "attn.v_proj", "norm2"))
    measured = []

    def metric(prepared) -> float:
        plans = prepared._quantlens_state.plans
        on = {p for p in (a, b, c) if plans[p.site].output_dtype == "qint16"}
        measured.append(frozenset(on))
        if b in on and c in on:
            return 1.0
        return 0.5 * (a in on) + 0.1 * (b in on) + 0.1 * (c in on)

    result = search_mixed_precision(model, example, calib, metric, 0.95, candidates=[a, b, c], ranking=[a, b, c],
                                    method="descend", out_dir=tmp_path, progress=False)
    assert set(result.chosen) == {b, c} and result.reached and result.metric == 1.0
    assert frozenset({a, b, c}) in measured and frozenset({a, c}) in measured  # every site back to int8 alone
    assert all(p.added is None and p.kept == p.num_int16 for p in result.curve[1:])
    assert result.curve[-1].num_int16 == 2 and result.curve[-1].metric == 1.0
    assert "most needed sites (descend)" in open(result.html_path).read()
    with pytest.raises(Exception, match="method must be"):
        search_mixed_precision(model, example, calib, metric, 0.95, candidates=[a], method="best",
                               out_dir=tmp_path / "x", progress=False)


def test_descend_reaches_the_target_on_tiny_transformer(setup, tmp_path):
    model, example, calib, evaluate, _ = setup
    result = search_mixed_precision(model, example, calib, evaluate, TARGET, method="descend", out_dir=tmp_path,
                                    progress=False)
    assert result.reached and result.metric >= TARGET
    assert 0 < result.num_int16 < len([c for c in result.candidates if c.kind == "activation"])
    assert not result.int16x16_resolutions
    prepared = _build(model, example, calib, result.setter())
    assert evaluate(prepared) == result.metric


def test_exchange_swaps_a_site_after_which_pruning_takes_one_more(setup, tmp_path):
    """A metric built so that greedy ends with {A, B, C} (nothing to prune), where B and C do best together
    and F helps only beside them: the exchange round swaps A (whose removal costs least) for F, and pruning
    then takes B back: {C, F}, one site fewer than greedy and pruning alone."""
    model, example, calib, _, _ = setup
    a, b, c, f = (Promotion(site) for site in ("norm1", "attn.v_proj", "norm2", "attn.out_proj"))
    weight = {a: 0.5, b: 0.3, c: 0.2, f: 0.0}
    table = {frozenset({a, b, c}): 0.96, frozenset({b, c}): 0.85, frozenset({b, c, f}): 0.97,
             frozenset({c, f}): 0.955}
    measured = []

    def metric(prepared) -> float:
        plans = prepared._quantlens_state.plans
        on = frozenset(p for p in (a, b, c, f) if plans[p.site].output_dtype == "qint16")
        measured.append(on)
        return table.get(on, sum(weight[p] for p in on))

    kwargs = dict(candidates=[a, b, c, f], ranking=[a, b, c, f], tries=4, progress=False)
    plain = search_mixed_precision(model, example, calib, metric, 0.95, out_dir=tmp_path / "plain", **kwargs)
    assert set(plain.chosen) == {a, b, c} and plain.metric == 0.96
    result = search_mixed_precision(model, example, calib, metric, 0.95, out_dir=tmp_path / "x", exchange=2,
                                    **kwargs)
    assert set(result.chosen) == {c, f} and result.reached and result.metric == 0.955
    swap, pruned = result.curve[-2:]
    assert (swap.removed, swap.added, swap.num_int16, swap.metric) == (a, f, 3, 0.97)
    assert (pruned.removed, pruned.added, pruned.num_int16) == (b, None, 2)
    assert frozenset({b, c, f}) in measured  # every outside candidate was tried in the removed site's place
    assert "(exchange)" in open(result.html_path).read()
    with open(result.csv_path) as fh:
        rows = list(csv.DictReader(fh))
    assert (rows[-2]["removed_site"], rows[-2]["added_site"]) == ("norm1", "attn.out_proj")
    # the setter is the exchanged set; the second round found no better pair and changed nothing
    assert set(result.setter().promotions) == {c, f} and len(result.curve) == len(plain.curve) + 2
    with pytest.raises(Exception, match="exchange must be"):
        search_mixed_precision(model, example, calib, metric, 0.95, out_dir=tmp_path / "e", exchange=-1, **kwargs)


def test_the_shared_calibration_gives_the_scales_and_outputs_of_a_full_one(setup):
    """The int16 search calibrates once per observer: a promotion's configuration takes the statistics of those
    calibrated before. Each fake quant's scale and the model's output equal a full prepare + calibrate bit for
    bit, for activation and weight promotions, alone and together, on top of per-site observers (a histogram
    observer's statistics included) and learned (fixed) ranges."""
    from quantlens.search.measure import Builder
    from quantlens.search.remedies import ObserverQconfigSetter
    from quantlens.search.remedies.learned_ranges import FixedRangeQconfigSetter

    model, example, calib, _, _ = setup
    cands = mixed_precision_candidates(_build(model, example, calib, default_calibration_qconfig_setter))
    acts = [p for p in cands if p.kind == "activation"][:3]
    weights = [p for p in cands if p.kind == "weight"][:1]
    site = acts[1].site
    base = ObserverQconfigSetter({site: "kl"}, FixedRangeQconfigSetter({acts[2].site: 0.5}))
    build = Builder(model, example, calib, base)
    held = zoo.sample_batches("tiny_transformer", num_batches=6, batch_size=16)[-1]
    selections = [(), (acts[0],), tuple(weights), (acts[0], acts[1]), (acts[0],), (acts[1],), (acts[2],)]
    for selection in selections:
        fast = build(selection)
        full = _build(model, example, calib, MixedPrecisionQconfigSetter(selection, base))
        fq_fast, fq_full = fast._quantlens_state.fq, full._quantlens_state.fq
        assert fq_fast.keys() == fq_full.keys()
        for key in fq_full:
            if not fq_full[key].is_weight:
                assert torch.equal(fq_fast[key].scale, fq_full[key].scale), (selection, key)
        with torch.no_grad():
            assert torch.equal(fast(*held), full(*held)), selection
    # the promotions seen before (and every weight promotion) took the statistics: the batches ran only where an
    # op site's observer had not been calibrated yet (the base, the first int16 activations)
    assert build.stats.reused >= 3 and build.stats.ran <= 4, (build.stats.reused, build.stats.ran)


class _Attention(torch.nn.Module):
    """sdpa: prepare decomposes it, and its scores and probabilities get fake quants of their own."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_the_shared_calibration_covers_the_fake_quants_inside_decomposed_ops():
    from quantlens.search.measure import Builder

    torch.manual_seed(0)
    model = _Attention().eval()
    calib = [(torch.randn(2, 5, 8),) for _ in range(2)]
    held = torch.randn(4, 5, 8)
    build = Builder(model, calib[0], calib, default_calibration_qconfig_setter)
    cands = mixed_precision_candidates(build(()))
    for selection in [(p,) for p in cands[:4]] + [()]:
        fast = build(selection)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = calibrate(prepare(model, calib[0], MixedPrecisionQconfigSetter(selection, build.base_setter),
                                     check_result_dir=None, allow_no_stubs=True), calib)
        with torch.no_grad():
            assert torch.equal(fast(held), full(held)), selection
    assert build.stats.reused >= 2


def test_a_search_that_misses_its_target_gives_the_best_set_it_measured(setup, tmp_path):
    """Promotions past the best lower this metric (as on transformers' GPT-2 at a target it cannot reach: all 36
    sites 0.99178, the first 15 0.99186): the greedy pass adds every candidate, then goes back to its best set."""
    model, example, calib, _, _ = setup
    cands = [Promotion(s, "activation") for s in ("add_0", "norm2", "act", "mean_0")]

    def evaluate(prepared) -> float:  # best with exactly two int16 outputs
        n = sum(p.output_dtype == "qint16" for p in prepared._quantlens_state.plans.values())
        return -float((n - 2) ** 2)

    result = search_mixed_precision(model, example, calib, evaluate, 1.0, candidates=cands, ranking=cands,
                                    out_dir=tmp_path, progress=False, tries=1)
    assert not result.reached and result.metric == 0.0 and result.num_int16 == 2
    assert [p.metric for p in result.curve] == [-4.0, -1.0, 0.0, -1.0, -4.0, 0.0]
    assert result.curve[-1].back and result.chosen == tuple(cands[:2])
    assert "back to the best set measured" in (tmp_path / "mixed_precision_curve.html").read_text()
    assert _build(model, example, calib, result.setter()) is not None
