"""More real pretrained models whose weights ship inside their pip wheels (``docs/zoo.md``), registered in
:data:`MORE_THIRD_PARTY_MODELS` and reachable through :func:`quantlens.zoo.third_party.load_third_party`.

=================  ================================  ==========================================  ==================
model              package (``pip install            weights                                     task metric
                   --no-deps``)
=================  ================================  ==========================================  ==================
``resemblyzer``    resemblyzer 0.1.4                 ``resemblyzer/pretrained.pt``               speaker embedding
``pesto_pitch``    pesto-pitch 2.0.1 (+ omegaconf    ``pesto/weights/mir-1k_g7.ckpt``            pitch (cents)
                   2.3.0, antlr4 4.9.3: the pickle)
``fcpe``           torchfcpe 0.0.4 (+ einops 0.8.2,  ``torchfcpe/assets/fcpe_c_v001.pt``         pitch (cents)
                   local-attention 1.11.2)
=================  ================================  ==========================================  ==================

As in :mod:`quantlens.zoo.third_party`, the networks are the packages' own module code, unchanged, loaded
without running the package ``__init__`` (which imports librosa/webrtcvad for resemblyzer, torchaudio for pesto
and torchfcpe). The feature front ends (mel spectrogram, constant-Q transform) run on the host, in float, before
the QuantStub: PESTO's and FCPE's are the packages' own code (PESTO's full model is run and its encoder's input
captured; FCPE's ``MelModule`` is compiled from its verbatim source); resemblyzer's librosa mel spectrogram is
rebuilt in torch (:func:`_librosa_mel`, librosa's defaults) because librosa would replace the pinned numpy.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import os
import sys
import types

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.zoo.wheel_loading import ThirdPartyModel, Wrapped, bare_package, module_from_file, package_dir

__all__ = ["MORE_THIRD_PARTY_MODELS", "resemblyzer", "pesto_pitch", "fcpe"]

_RATE = 16000


def _defs_from_file(path: str, names: list[str], namespace: dict) -> dict:
    """The named top-level functions and classes of a module file, compiled from its verbatim source."""
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return {n: namespace[n] for n in names}


def _harmonic_tone(f0: float, n: int, g: torch.Generator, tilt: float = 1.0) -> torch.Tensor:
    """A harmonic tone [n] at 16 kHz (harmonics 1/h^tilt below 7.6 kHz, random phases, 1 % noise), peak 0.5."""
    phase = 2 * math.pi * f0 * torch.arange(n, dtype=torch.float64) / _RATE
    offsets = torch.rand(40, generator=g, dtype=torch.float64) * 2 * math.pi
    x = sum(torch.sin(h * phase + offsets[h - 1]) / h ** tilt for h in range(1, 41) if f0 * h < _RATE / 2 * 0.95)
    x = x + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    return (0.5 * x / x.abs().max()).float()


def _cents_error(f0: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (1200 * torch.log2(f0.double().clamp_min(1e-3) / ref.double().clamp_min(1e-3))).abs()


# -- Resemblyzer (speaker embedding): 3-layer LSTM (40 -> 256), linear, ReLU, L2 normalisation ------------------

#: synthetic speakers: (mean f0 Hz, formant scale (vocal tract length), spectral tilt of the glottal source)
_SPEAKERS = [(105.0, 1.00, 1.0), (128.0, 0.90, 1.5), (205.0, 1.15, 0.8), (238.0, 1.22, 1.3), (160.0, 1.06, 1.9),
             (92.0, 0.86, 0.9)]
_VOWELS = [(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410),
           (440, 1020, 2240), (660, 1720, 2410)]


def _resemblyzer_module() -> types.ModuleType:
    """``resemblyzer/voice_encoder.py``. It imports ``resemblyzer.audio`` (librosa, webrtcvad: the waveform
    preprocessing of ``embed_utterance``), which ``VoiceEncoder.forward`` never calls: without those libraries
    that one module is a placeholder whose functions say what is missing."""
    name = "resemblyzer.voice_encoder"
    if name in sys.modules:
        return sys.modules[name]
    bare_package("resemblyzer")
    if "resemblyzer.audio" not in sys.modules and (importlib.util.find_spec("librosa") is None
                                                   or importlib.util.find_spec("webrtcvad") is None):
        placeholder = types.ModuleType("resemblyzer.audio")

        def _needs_librosa(*args, **kwargs):
            raise QuantLensError("resemblyzer's waveform preprocessing needs librosa and webrtcvad; quantlens "
                                 "loads only its VoiceEncoder network (features: third_party_more._librosa_mel).")

        for fn in ("preprocess_wav", "wav_to_mel_spectrogram", "trim_long_silences", "normalize_volume"):
            setattr(placeholder, fn, _needs_librosa)
        sys.modules["resemblyzer.audio"] = placeholder
    return importlib.import_module(name)


def resemblyzer() -> nn.Module:
    # VoiceEncoder.__init__ loads the wheel's pretrained.pt itself (torch.load of a plain dict of tensors)
    encoder = _resemblyzer_module().VoiceEncoder("cpu", verbose=False)
    return Wrapped(encoder.eval()).eval()


def _librosa_mel(wav: torch.Tensor, n_fft: int = 400, hop: int = 160, n_mels: int = 40) -> torch.Tensor:
    """``librosa.feature.melspectrogram(y=wav, sr=16000, n_fft=400, hop_length=160, n_mels=40)`` as resemblyzer
    calls it (power 2, centred frames zero-padded, periodic Hann window, Slaney mel scale and area norm), [T, 40]."""
    spec = torch.stft(wav.double(), n_fft, hop, window=torch.hann_window(n_fft, dtype=torch.float64),
                      center=True, pad_mode="constant", return_complex=True).abs() ** 2  # [1 + n_fft/2, T]

    def hz_to_mel(f):  # Slaney: linear below 1 kHz, logarithmic above
        f = torch.as_tensor(f, dtype=torch.float64)
        return torch.where(f < 1000, f * 3 / 200, 15 + torch.log(f.clamp_min(1e-9) / 1000) / (math.log(6.4) / 27))

    def mel_to_hz(m):
        return torch.where(m < 15, m * 200 / 3, 1000 * torch.exp((math.log(6.4) / 27) * (m - 15)))

    mel_f = mel_to_hz(torch.linspace(float(hz_to_mel(0.0)), float(hz_to_mel(_RATE / 2)), n_mels + 2,
                                     dtype=torch.float64))
    fft_f = torch.linspace(0, _RATE / 2, 1 + n_fft // 2, dtype=torch.float64)
    ramps = mel_f[:, None] - fft_f[None, :]
    fdiff = mel_f.diff()
    lower, upper = -ramps[:-2] / fdiff[:-1, None], ramps[2:] / fdiff[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0) * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return (weights @ spec).T.float()


def _voice(speaker: int, seconds: float, seed: int) -> torch.Tensor:
    """One utterance [N] of a synthetic speaker: a glottal pulse train (the speaker's f0 with intonation and
    jitter, 1/h^tilt harmonics) through the speaker's formants (three per vowel, scaled by its vocal tract),
    syllables of random vowels, aspiration noise; at resemblyzer's -30 dBFS."""
    f0_mean, scale, tilt = _SPEAKERS[speaker]
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * _RATE)
    t = torch.arange(n, dtype=torch.float64) / _RATE
    f0 = f0_mean * (1 + 0.12 * torch.sin(2 * math.pi * 0.6 * t + 6 * float(torch.rand(1, generator=g)))
                    + 0.01 * torch.randn(n, generator=g, dtype=torch.float64).cumsum(0) / math.sqrt(n))
    phase = torch.cumsum(2 * math.pi * f0 / _RATE, 0)
    source = sum((f0 * h < _RATE / 2) * torch.sin(h * phase) / h ** tilt for h in range(1, 60))
    spectrum, freqs = torch.fft.rfft(source), torch.fft.rfftfreq(n, 1 / _RATE)
    out, seg = torch.zeros(n, dtype=torch.float64), int(0.2 * _RATE)
    for start in range(0, n, seg):
        formants = _VOWELS[int(torch.randint(0, len(_VOWELS), (1,), generator=g))]
        gain = sum(a / (1 + ((freqs - fc * scale) / (60 + 0.06 * fc)) ** 2)
                   for fc, a in zip(formants, (1.0, 0.6, 0.3))) + 0.02
        out[start:start + seg] = torch.fft.irfft(spectrum * gain, n)[start:start + seg]
    out = out * (0.55 - 0.45 * torch.cos(2 * math.pi * t / 0.2))
    out = out / out.abs().max() + 0.02 * torch.randn(n, generator=g, dtype=torch.float64)
    return (out * (10 ** (-30 / 20)) / out.pow(2).mean().sqrt()).float()


def _resemblyzer_batch(utterances: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mel frames [S * utterances, 160, 40] (one 1.6 s partial each, resemblyzer's partial length) and the
    speaker of each."""
    mels, speakers = [], []
    for u in range(utterances):
        for s in range(len(_SPEAKERS)):
            mels.append(_librosa_mel(_voice(s, 1.6, seed * 1000 + u * 10 + s))[:160])
            speakers.append(s)
    return torch.stack(mels), torch.tensor(speakers)


def _resemblyzer_data():
    calib, _ = _resemblyzer_batch(2, seed=1)
    evalx, speakers = _resemblyzer_batch(4, seed=2)
    return (evalx[:2],), [(calib[i:i + 6],) for i in range(0, len(calib), 6)], (evalx,), speakers


def _nearest_speaker(embeds: torch.Tensor, speakers: torch.Tensor) -> torch.Tensor:
    """Each utterance's nearest other utterance's speaker (cosine; the embeddings are L2-normalised)."""
    sim = embeds.double() @ embeds.double().T
    sim.fill_diagonal_(-2.0)
    return speakers[sim.argmax(dim=1)]


def _same_speaker(embeds: torch.Tensor, threshold: float) -> torch.Tensor:
    """The same-speaker decision (cosine above ``threshold``) of every pair of utterances i < j."""
    sim = embeds.double() @ embeds.double().T
    i, j = torch.triu_indices(len(embeds), len(embeds), 1)
    return sim[i, j] > threshold


def _resemblyzer_metric(reference, output, speakers) -> dict[str, float]:
    """Cosine to the float embeddings; speaker identification (each utterance's nearest other utterance) against
    the truth and the float model; same/different-speaker decisions on every pair at the float model's threshold
    (midway between its mean same-speaker and mean different-speaker cosine)."""
    cos = F.cosine_similarity(reference.double(), output.double(), dim=1)
    nearest, nearest_ref = _nearest_speaker(output, speakers), _nearest_speaker(reference, speakers)
    i, j = torch.triu_indices(len(speakers), len(speakers), 1)
    same = speakers[i] == speakers[j]
    sim_ref = (reference.double() @ reference.double().T)[i, j]
    threshold = float(sim_ref[same].mean() + sim_ref[~same].mean()) / 2
    decisions, decisions_ref = _same_speaker(output, threshold), _same_speaker(reference, threshold)
    return {"embedding_cosine_vs_float_min": float(cos.min()), "embedding_cosine_vs_float_mean": float(cos.mean()),
            "speaker_id_accuracy": float((nearest == speakers).double().mean()),
            "speaker_id_agreement": float((nearest == nearest_ref).double().mean()),
            "same_speaker_decision_agreement": float((decisions == decisions_ref).double().mean()),
            "same_speaker_decision_accuracy": float((decisions == same).double().mean())}


# -- PESTO (pitch): LayerNorm over the CQT frame, conv1d + LeakyReLU (residual), 1x1 convs, Toeplitz conv, softmax -

_PESTO_STEP_MS = 250.0  # the data's CQT hop: frames 250 ms apart (a frame does not depend on the hop)


def _pesto_full(sampling_rate: int | None = None):
    """PESTO's full model as ``pesto.loader.load_model`` builds it (CQT preprocessor, encoder, confidence); the
    CQT kernels are built only with a sampling rate."""
    bare_package("pesto")  # its __init__ imports pesto.core: torchaudio, tqdm
    loader = importlib.import_module("pesto.loader")
    return loader.load_model("mir-1k_g7", step_size=_PESTO_STEP_MS, sampling_rate=sampling_rate)


def pesto_pitch() -> nn.Module:
    return Wrapped(_pesto_full().encoder.eval()).eval()


def _pesto_frames(f0_hz: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The encoder's inputs [3 * len(f0_hz), 1, 219]: the frames at 0.25, 0.5 and 0.75 s of a 1 s harmonic tone
    per f0 (PESTO's own CQT, dB to log-power scaling and crop, captured at the encoder input); each frame's f0;
    PESTO's pitch shift."""
    full, captured = _pesto_full(_RATE), []
    hook = full.encoder.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach().clone()))
    g = torch.Generator().manual_seed(seed)
    tones = torch.stack([_harmonic_tone(f0, _RATE, g, tilt=1.2) for f0 in f0_hz])
    try:
        with torch.no_grad():
            full(tones)
    finally:
        hook.remove()
    frames = captured[0].view(len(f0_hz), -1, *captured[0].shape[1:])[:, 1:4].flatten(0, 1)
    return frames, torch.tensor([f for f in f0_hz for _ in range(3)], dtype=torch.float64), float(full.shift)


def _pesto_data():
    calib, _, _ = _pesto_frames([65 * 2 ** (i / 6) for i in range(25)], seed=1)  # 65 Hz .. 1 kHz
    evalx, f0, shift = _pesto_frames([72 * 2 ** (i / 5 + 0.07) for i in range(18)], seed=2)
    return (evalx[:2],), [(calib[i:i + 15],) for i in range(0, len(calib), 15)], (evalx,), (f0, shift)


def _pesto_hz(activations: torch.Tensor, shift: float) -> torch.Tensor:
    """Pitch in Hz as ``PESTO.forward`` decodes it: roll by the shift, ``reduce_activations`` (alwa)."""
    bare_package("pesto")
    reduce = importlib.import_module("pesto.utils.reduce_activations").reduce_activations
    bps = activations.shape[-1] // 128
    semitones = reduce(activations.roll(-round(shift * bps), -1), reduction="alwa")
    return 440 * 2 ** ((semitones.double() - 69) / 12)


def _pesto_metric(reference, output, truth) -> dict[str, float]:
    f0_true, shift = truth
    f0, f0_ref = _pesto_hz(output, shift), _pesto_hz(reference, shift)
    err = _cents_error(f0, f0_ref)
    return {"pitch_error_vs_float_cents_mean": float(err.mean()), "pitch_error_vs_float_cents_max": float(err.max()),
            "pitch_error_vs_truth_cents_mean": float(_cents_error(f0, f0_true).mean()),
            "float_pitch_error_vs_truth_cents_mean": float(_cents_error(f0_ref, f0_true).mean())}


# -- FCPE (pitch): conv1d, GroupNorm, LeakyReLU, conformer conv blocks (LayerNorm, GLU, depthwise conv, SiLU),
#    LayerNorm, weight-normed linear, sigmoid ----------------------------------------------------------------

_FCPE_SECONDS = 0.32  # 33 mel frames per clip


def _fcpe_checkpoint() -> dict:
    return torch.load(os.path.join(package_dir("torchfcpe"), "assets", "fcpe_c_v001.pt"), map_location="cpu",
                      weights_only=False)  # a dict of tensors and its config: plain Python types only


def _fcpe_models_module() -> types.ModuleType:
    """``torchfcpe/models.py``; its ``model_conformer_naive`` imports ``local_attention`` (for the local heads,
    which this config does not use), whose ``__init__`` needs hyper-connections: only its module file is loaded."""
    bare_package("torchfcpe")  # its __init__ imports tools -> mel_extractor -> torchaudio
    package = bare_package("local_attention")
    package.LocalAttention = importlib.import_module("local_attention.local_attention").LocalAttention
    return importlib.import_module("torchfcpe.models")


def fcpe() -> nn.Module:
    ckpt = _fcpe_checkpoint()
    m = ckpt["config_dict"]["model"]
    net = _fcpe_models_module().CFNaiveMelPE(  # as torchfcpe.models_infer.spawn_bundled_infer_model builds it
        input_channels=ckpt["config_dict"]["mel"]["num_mels"], out_dims=m["out_dims"], hidden_dims=m["hidden_dims"],
        n_layers=m["n_layers"], n_heads=m["n_heads"], f0_max=m["f0_max"], f0_min=m["f0_min"],
        use_fa_norm=m["use_fa_norm"], conv_only=m["conv_only"], conv_dropout=0.0, atten_dropout=0.0,
        use_harmonic_emb=m.get("use_harmonic_emb", False))
    net.load_state_dict(ckpt["model"])
    return Wrapped(net.eval()).eval()


def _fcpe_mel(wavs: torch.Tensor) -> torch.Tensor:
    """torchfcpe's own ``Wav2MelModule`` (from ``mel_extractor.py``'s verbatim source; its ``torchaudio`` import
    only serves resampling, never used at 16 kHz) on waveforms [B, N] -> [B, T, 128]."""
    root = package_dir("torchfcpe")
    librosa_mel = module_from_file("torchfcpe.mel_fn_librosa", os.path.join(root, "mel_fn_librosa.py")).mel
    namespace = {"torch": torch, "np": np, "F": F, "librosa_mel_fn": librosa_mel}
    defs = _defs_from_file(os.path.join(root, "mel_extractor.py"),
                           ["dynamic_range_compression_torch", "HannWindow", "MelModule", "Wav2MelModule"], namespace)
    mel = _fcpe_checkpoint()["config_dict"]["mel"]
    wav2mel = defs["Wav2MelModule"](sr=mel["sr"], n_mels=mel["num_mels"], n_fft=mel["n_fft"],
                                    win_size=mel["win_size"], hop_length=mel["hop_size"], fmin=mel["fmin"],
                                    fmax=mel["fmax"])
    return wav2mel(wavs[..., None], _RATE)


def _fcpe_clips(f0_hz: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wavs = torch.stack([_harmonic_tone(f0, int(_FCPE_SECONDS * _RATE), g, tilt=1.0 + 0.1 * (i % 5))
                        for i, f0 in enumerate(f0_hz)])
    return _fcpe_mel(wavs), torch.tensor(f0_hz, dtype=torch.float64)


def _fcpe_data():
    calib, _ = _fcpe_clips([50 * 2 ** (i / 6) for i in range(27)], seed=1)  # 50 Hz .. 1 kHz
    evalx, f0 = _fcpe_clips([60 * 2 ** (i / 5 + 0.11) for i in range(20)], seed=2)  # .. 900 Hz
    return (evalx[:2],), [(calib[i:i + 10],) for i in range(0, len(calib), 10)], (evalx,), f0


def _fcpe_hz(latent: torch.Tensor) -> torch.Tensor:
    """f0 [B, T] by FCPE's own ``latent2cents_local_decoder`` (local argmax, unmasked) and ``cent_to_f0``."""
    cls = _fcpe_models_module().CFNaiveMelPE
    table = torch.linspace(1200 * math.log2(32.7 / 10), 1200 * math.log2(1975.5 / 10), latent.shape[-1])
    decoder = types.SimpleNamespace(cent_table=table, out_dims=latent.shape[-1])
    cents = cls.latent2cents_local_decoder(decoder, latent.float(), mask=False)
    return cls.cent_to_f0(None, cents)[..., 0].double()


def _fcpe_metric(reference, output, truth) -> dict[str, float]:
    f0, f0_ref = _fcpe_hz(output)[:, 2:-2], _fcpe_hz(reference)[:, 2:-2]  # frames whose window is all tone
    err = _cents_error(f0, f0_ref)
    return {"pitch_error_vs_float_cents_mean": float(err.mean()), "pitch_error_vs_float_cents_max": float(err.max()),
            "pitch_error_vs_truth_cents_mean": float(_cents_error(f0, truth[:, None]).mean()),
            "float_pitch_error_vs_truth_cents_mean": float(_cents_error(f0_ref, truth[:, None]).mean())}


MORE_THIRD_PARTY_MODELS: dict[str, ThirdPartyModel] = {
    "resemblyzer": ThirdPartyModel("resemblyzer", "resemblyzer", "speaker embedding", resemblyzer,
                                   _resemblyzer_data, _resemblyzer_metric),
    "pesto_pitch": ThirdPartyModel("pesto_pitch", "pesto", "audio pitch", pesto_pitch, _pesto_data, _pesto_metric),
    "fcpe": ThirdPartyModel("fcpe", "torchfcpe", "audio pitch", fcpe, _fcpe_data, _fcpe_metric),
}
