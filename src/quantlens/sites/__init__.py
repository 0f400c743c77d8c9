"""Op-site capture: what every stage above names things by (``docs/architecture.md``, "Layers").

The tracer (a ``TorchFunctionMode`` over the user's forward) sees every op a model calls; the record
(:mod:`.record`) keeps a float model's op sites and their data flow; :mod:`.op_rules` says, from the op set, how
each op type is treated; :mod:`.stubs` marks the boundaries; the decompositions run recurrent layers and norms op
by op; :mod:`.source_location` names the user's line. Nothing here knows of quantization.
"""
