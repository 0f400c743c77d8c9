"""Shared test fixtures, and the tests' thread count.

The tests run with ``QUANTLENS_TEST_THREADS`` torch threads (default 1; ``./dev test`` also sets OMP_NUM_THREADS
and runs one pytest worker per core): on a small or busy machine torch's intra-op pool waits for cores that other
processes hold, and the suite's time grew six-fold at two threads on a loaded 2-core machine.
"""

import os
import warnings

import pytest
import torch

torch.set_num_threads(int(os.environ.get("QUANTLENS_TEST_THREADS", "1")))


@pytest.fixture
def small_conv_analysis(tmp_path):
    """``run(model) -> (calibration model, bad case, QuantAnalysis)``: calibrate a small (2, 3, 8, 8)-input model at
    int8 and trace the fake_quant pair on one bad case (``qa.run()`` done, into ``tmp_path``)."""
    from quantlens.profiler import QuantAnalysis
    from quantlens.quantization import calibrate, prepare
    from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter

    def run(model):
        x = torch.randn(2, 3, 8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calib = calibrate(prepare(model, (x,), default_calibration_qconfig_setter, check_result_dir=None,
                                      allow_no_stubs=True),
                              [(torch.randn(2, 3, 8, 8),) for _ in range(3)])
        qa = QuantAnalysis(model, calib, "fake_quant", out_dir=tmp_path, progress=False)
        qa.set_bad_case((x,))
        qa.run()
        return calib, x, qa

    return run


@pytest.fixture
def few_learning_epochs(monkeypatch):
    """The search's learned remedies (``learned_ranges``, ``learned_rounding``) train 2 epochs instead of 32 / 40.

    For tests that run ``quantlens fix`` or ``search_remedies`` end to end and assert what the search does (it runs
    to its end, writes its files, names its metric, replays), not how good a learned remedy gets: the same code
    path, a fraction of the time (their epochs were 40 of the 51 s of ``fix`` on the CNN + GRU newcomer). What
    the learned remedies reach is held by their own tests in tests/test_remedies_catalog.py."""
    import functools

    from quantlens.search.remedies import catalog

    monkeypatch.setattr(catalog, "learn_ranges", functools.partial(catalog.learn_ranges, epochs=2))
    monkeypatch.setattr(catalog, "learn_rounding", functools.partial(catalog.learn_rounding, epochs=2))
