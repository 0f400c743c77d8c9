"""Planted faults in a real pretrained sentence transformer (all-MiniLM-L6-v2, :mod:`quantlens.zoo.sentence_transformer`)."""
