"""A newcomer's tiny transformers DeBERTa-v2 (issue #42): integer ids only, relative-position buckets made inside
forward, third-party code without stubs."""

import torch

allow_no_stubs = True


def float_model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64, relative_attention=True,
                                       position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16)
    return transformers.DebertaV2Model(cfg).eval()


def example_inputs():
    torch.manual_seed(1)
    return torch.randint(0, 99, (2, 8))


def calibration_data():
    torch.manual_seed(2)
    return [torch.randint(0, 99, (2, 8)) for _ in range(3)]


def evaluation_data():
    torch.manual_seed(3)
    return [torch.randint(0, 99, (2, 8)) for _ in range(2)]
