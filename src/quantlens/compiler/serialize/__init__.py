"""Save and load an IR module (qat or quantized) as ONE versioned file.

The file is a `safetensors <https://github.com/huggingface/safetensors>`_ file:

* its tensors are the graph constants, keyed by constant name, in their own dtype (float, int8/16/32/64, bool...);
* its metadata (``str -> str``) holds two keys: ``"quantlens"``, whose value is a JSON header (magic
  ``"quantlens-ir"``, ``format_version``, ``ir_version``, the module kind, nodes, inputs/outputs, value types,
  input leaves, the input/output pytree specs, meta), and ``"quantlens_sha256"``, a SHA-256 over the header text
  and every constant's name, dtype, shape and bytes: one checksum for the whole model.

JSON cannot hold every Python value the IR uses, so the header encodes them explicitly (strict JSON, no NaN
literals): a non-finite float is ``{"$float": "nan" | "inf" | "-inf"}``, a tuple is ``{"$tuple": [...]}``, and a
dict whose keys are not all plain strings (or start with ``$``) is ``{"$dict": [[key, value], ...]}``. The layout
and the error cases are documented in ``docs/ir.md``.

Writes are atomic (a temporary file in the target folder, fsync, ``os.replace``): a failed ``save`` leaves the
folder as it was. ``load`` raises ``QuantLensError`` naming the file, what is wrong and what was expected for a
damaged, truncated, foreign, older or newer file: it checks the checksum, then validates the header (known
ops of the module's kind, attr types and ranges, value types, every referenced name defined before use, each
node's shapes as its op computes them), and refuses anything that is not a regular file (a FIFO, a device)
without opening it.

The package, one job per module: :mod:`.schema` declares the file format (magic, versions, metadata keys, header
fields, tensor dtypes, the checksum), :mod:`.codec` the JSON encoding of IR values, :mod:`.writer` writes
(``save``), :mod:`.reader` reads (``load``), :mod:`.validate` checks a header field by field, with :mod:`.arity`
(each node's inputs, outputs and attrs) and :mod:`.shapes` (each node's shapes, on meta tensors).
"""

from quantlens.compiler.serialize.reader import load

# file_checksum too: tests write damaged files whose checksum still matches, to reach the header checks
from quantlens.compiler.serialize.schema import CHECKSUM_KEY, FORMAT_VERSION, MAGIC, METADATA_KEY
from quantlens.compiler.serialize.schema import file_checksum as file_checksum
from quantlens.compiler.serialize.writer import save

__all__ = ["save", "load", "FORMAT_VERSION", "MAGIC", "METADATA_KEY", "CHECKSUM_KEY"]
