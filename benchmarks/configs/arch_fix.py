"""A CONFIG for `quantlens fix` on one architecture of quantlens.zoo's transformers builders (tiny random config,
transformers' own module code), named by the environment variable QUANTLENS_ARCH (benchmarks/bench_fix_sweep.py
sets it):

    QUANTLENS_ARCH=gpt2 OMP_NUM_THREADS=1 .venv/bin/quantlens fix benchmarks/configs/arch_fix.py --target 0.999
"""

import os

from quantlens.zoo.architectures import ARCHITECTURES, build
from quantlens.zoo.auto_architectures import build_auto

NAME = os.environ.get("QUANTLENS_ARCH", "bert")
march = "QL1"
dynamic_batch = False  # position ids and masks made inside forward export at one batch size
allow_no_stubs = True  # third-party code: no QuantStub

_built = None


def _get():
    global _built
    if _built is None:
        _built = build(NAME) if NAME in ARCHITECTURES else build_auto(NAME)
    return _built


def float_model():
    return _get()[0]


def example_inputs():
    return _get()[1]


def calibration_data():
    return list(_get()[2])


def evaluation_data():
    return [_get()[3]]
