"""More real pretrained models from pip wheels (quantlens.zoo.third_party_more): resemblyzer's speaker encoder,
PESTO and FCPE (pitch). Each is built from its package's own module code with the wheel's weights; the float
model is checked on inputs whose answer is known (a tone's pitch, separable speakers, librosa's mel scale), and
prepare + calibration run and keep the task. The full stage sweep and the figures are in docs/zoo.md
(the stage sweep: quantlens.zoo.coverage.run_stages; the task metrics: benchmarks/third_party_models.py)."""

import importlib.util
import math
import os
import warnings

import pytest
import torch

from quantlens.errors import QuantLensError
from quantlens.quantization import calibrate, prepare
from quantlens.zoo import third_party_more as more
from quantlens.zoo.coverage import SETTERS
from quantlens.zoo.third_party import load_third_party

#: the Python packages each model needs (pip install --no-deps -r requirements-third-party.txt)
PACKAGES = {"resemblyzer": ["resemblyzer"], "pesto_pitch": ["pesto", "omegaconf", "yaml", "scipy"],
            "fcpe": ["torchfcpe", "einops", "local_attention"]}


def _needs(*packages):
    """Skip unless installed. Not pytest.importorskip: the packages' __init__ files import what the networks never
    use (torchaudio, librosa, webrtcvad), which the loaders avoid."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"not installed: {missing} (pip install --no-deps -r requirements-third-party.txt)")


def _entry(name):
    _needs(*PACKAGES[name])
    return load_third_party(name)


def test_load_third_party_knows_the_new_models():
    with pytest.raises(QuantLensError, match="'fcpe', 'mtcnn_onet', 'mtcnn_pnet', 'pesto_pitch', 'resemblyzer'"):
        load_third_party("no_such_model")
    assert set(more.MORE_THIRD_PARTY_MODELS) == set(PACKAGES)


def test_slaney_mel_filterbank_by_hand():
    """librosa's Slaney mel: 3 mels per 200 Hz below 1 kHz (1 kHz = 15 mels), 27 mels per factor 6.4 above.
    With 2 mel bands on 0..8 kHz the band edges are at 0, mel 15 + ... ; a 1 kHz tone lands in one band only."""
    t = torch.arange(4000) / 16000
    mel = more._librosa_mel(torch.sin(2 * math.pi * 1000 * t), n_fft=400, hop=160, n_mels=40)
    assert mel.shape == (26, 40)  # centred frames: 1 + 4000 // 160
    # band centres: 42 points evenly spaced in Slaney mels from 0 to hz_to_mel(8000) = 15 + ln(8)/(ln(6.4)/27)
    top = 15 + math.log(8.0) / (math.log(6.4) / 27)
    centres_mel = [top * i / 41 for i in range(42)]
    centres_hz = [m * 200 / 3 if m < 15 else 1000 * math.exp((m - 15) * math.log(6.4) / 27) for m in centres_mel]
    # the band whose centre is nearest 1 kHz holds the tone
    nearest = min(range(40), key=lambda i: abs(centres_hz[i + 1] - 1000))
    assert int(mel[13].argmax()) == nearest


def test_librosa_mel_matches_librosa_filterbank():
    """The rebuilt mel spectrogram against librosa's own filterbank code, as torchfcpe vendors it."""
    _needs("torchfcpe")

    from quantlens.zoo.wheel_loading import module_from_file, package_dir

    vendored = module_from_file("torchfcpe.mel_fn_librosa",
                                 os.path.join(package_dir("torchfcpe"), "mel_fn_librosa.py"))
    weights = torch.tensor(vendored.mel(sr=16000, n_fft=400, n_mels=40), dtype=torch.float64)
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    power = torch.stft(x.double(), 400, 160, window=torch.hann_window(400, dtype=torch.float64), center=True,
                       pad_mode="constant", return_complex=True).abs() ** 2
    expected = (weights @ power).T
    assert torch.allclose(more._librosa_mel(x).double(), expected, rtol=1e-5, atol=1e-6 * float(expected.max()))


def test_resemblyzer_float_embeds_and_separates_speakers():
    entry = _entry("resemblyzer")
    model = entry.build()
    with torch.no_grad():
        ones = model(torch.ones(1, 160, 40))[0]
    assert abs(float(ones.norm()) - 1) < 1e-5 and float(ones.min()) >= 0  # ReLU then L2 normalisation
    top = ones.topk(3)  # the wheel's weights on a fixed input (measured; any change of weights or loader shows)
    assert top.indices.tolist() == [89, 139, 59]
    assert torch.allclose(top.values, torch.tensor([0.2841, 0.2303, 0.2212]), atol=2e-4)
    mels, speakers = more._resemblyzer_batch(2, seed=7)  # 6 synthetic speakers, 2 clips each
    with torch.no_grad():
        embeds = model(mels)
    sim = embeds @ embeds.T
    same = speakers[:, None] == speakers[None, :]
    off_diagonal = ~torch.eye(len(speakers), dtype=torch.bool)
    # measured: 0.92 between two clips of one speaker, 0.62 between speakers; nearest clip's speaker 9 of 12
    assert float(sim[same & off_diagonal].mean()) - float(sim[~same].mean()) > 0.2
    assert float((more._nearest_speaker(embeds, speakers) == speakers).double().mean()) >= 0.7


def test_pesto_float_finds_the_pitch_of_a_tone():
    entry = _entry("pesto_pitch")
    model = entry.build()
    frames, f0, shift = more._pesto_frames([147.0, 440.0], seed=3)
    assert frames.shape == (6, 1, 219)
    with torch.no_grad():
        hz = more._pesto_hz(model(frames), shift)
    assert float(more._cents_error(hz, f0).max()) < 10.0


def test_fcpe_float_finds_the_pitch_of_a_tone():
    entry = _entry("fcpe")
    model = entry.build()
    mel, f0 = more._fcpe_clips([110.0, 523.25], seed=3)
    assert mel.shape == (2, 33, 128)
    with torch.no_grad():
        hz = more._fcpe_hz(model(mel))[:, 2:-2]
    assert float(more._cents_error(hz, f0[:, None]).max()) < 15.0


#: (qconfig, metric, op, bound) after prepare + calibration on one batch, against the float model. resemblyzer
#: runs at 8-bit weights / 16-bit activations: at int8 its linear power-mel input loses 85 % of its values to
#: zero (docs/zoo.md), measured 0.77 mean cosine here against 0.989 at w8a16; pesto measured 0.0 cents (its
#: softmax is one-hot), fcpe 1.7 cents
CALIBRATION_TARGETS = {
    "resemblyzer": ("w8a16", "embedding_cosine_vs_float_mean", ">=", 0.97),
    "pesto_pitch": ("int8", "pitch_error_vs_float_cents_mean", "<=", 5.0),
    "fcpe": ("int8", "pitch_error_vs_float_cents_mean", "<=", 5.0),
}


def _shorter(name, data):
    """Less data to keep the test fast: resemblyzer's clips cut to 48 mel frames (0.48 s; its LSTM takes any
    length), FCPE calibrated on 5 clips and evaluated on 8."""
    example, batches, evaluation, labels = data
    if name == "resemblyzer":
        cut = lambda call: tuple(t[:, :48] for t in call)  # noqa: E731
        return cut(example), [cut(b) for b in batches], cut(evaluation), labels
    if name == "fcpe":
        return example, [(batches[0][0][::2],)], (evaluation[0][::3],), labels[::3]
    return data


@pytest.mark.parametrize("name", sorted(CALIBRATION_TARGETS))
def test_prepare_and_calibrate_keep_the_task(name):
    entry = _entry(name)
    torch.manual_seed(0)
    model = entry.build()
    example, batches, evaluation, labels = _shorter(name, entry.data())
    reference = entry.evaluate(model, evaluation)
    qconfig, key, op, bound = CALIBRATION_TARGETS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrated = calibrate(prepare(model, example, SETTERS[qconfig], check_result_dir=None), batches[:1])
    metrics = entry.metric(reference, entry.evaluate(calibrated, evaluation), labels)
    assert (metrics[key] >= bound) if op == ">=" else (metrics[key] <= bound), metrics


def test_prepare_leaves_the_float_fcpe_usable():
    entry = _entry("fcpe")
    model = entry.build()
    example = entry.data()[0]
    with torch.no_grad():
        before = model(*example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepare(model, example, SETTERS["int8"], check_result_dir=None)
    with torch.no_grad():
        assert torch.equal(model(*example), before)  # AttributeError today: output_proj has no 'weight'


def test_an_lstm_exports_with_a_dynamic_batch():
    """An nn.LSTM without an initial state makes a batch-sized zero state: under a symbolic batch it is built from
    the tensor the batch size is read from (it used to stop export at prims.empty_strided; resemblyzer)."""
    from quantlens.compiler import convert, export
    from quantlens.quantization import pre_export
    from quantlens.zoo.third_party import Wrapped

    class LastState(torch.nn.Module):  # resemblyzer's forward: no initial state, the last layer's final h
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 8, batch_first=True)

        def forward(self, x):
            _, (hidden, _) = self.lstm(x)
            return hidden[-1]

    torch.manual_seed(0)
    model, x = Wrapped(LastState()).eval(), torch.randn(2, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrated = calibrate(prepare(model, (x,), SETTERS["int8"], check_result_dir=None), [(x,)])
    tables = pre_export(calibrated, example_inputs=(x,))
    qat_ir = export(tables, (x,), dynamic_batch=True)
    quantized_ir = convert(qat_ir)
    for batch in (1, 2, 5):
        xb = torch.randn(batch, 3, 4)
        with torch.no_grad():
            ref = tables(xb)
        assert torch.equal(qat_ir(xb), ref)
        assert (quantized_ir(xb) - ref).abs().max() < 0.05
