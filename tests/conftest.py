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
