"""The site overrides that compute a table op site through the march's integer tables (``docs/march.md`` §13).

:class:`TableOverride` (base, reports a :class:`LutSiteInfo`) and one subclass per kind: :class:`ElementwiseOverride`,
:class:`DivOverride`, :class:`SoftmaxOverride`, :class:`LogSoftmaxOverride`, :class:`LayerNormOverride` and the
norms of :mod:`.norms`; the table-op registry's ``TableOpSpec.kind`` names which (:func:`override_class`). :mod:`quantlens.quantization.pre_export`
finds and installs them.

The package: :mod:`.base` (the base override: scale checks, rebuilds, the straight-through QAT result),
:mod:`.report` (:class:`LutSiteInfo` and the probe rows of the error
measurement), and one module per kind: :mod:`.elementwise`, :mod:`.div`, :mod:`.softmax`, :mod:`.log_softmax`,
:mod:`.layer_norm`.
"""

from quantlens.quantization.table_overrides.base import TableOverride
from quantlens.quantization.table_overrides.div import DivOverride
from quantlens.quantization.table_overrides.elementwise import ElementwiseOverride
from quantlens.quantization.table_overrides.layer_norm import LayerNormOverride
from quantlens.quantization.table_overrides.log_softmax import LogSoftmaxOverride
from quantlens.quantization.table_overrides.norms import NormalizeOverride, RmsNormOverride, VectorNormOverride
from quantlens.quantization.table_overrides.report import LutSiteInfo
from quantlens.quantization.table_overrides.softmax import SoftmaxOverride
from quantlens.quantization.table_registry import TableKind

__all__ = ["LutSiteInfo", "TableOverride", "ElementwiseOverride", "DivOverride", "SoftmaxOverride",
           "LogSoftmaxOverride", "LayerNormOverride", "RmsNormOverride", "NormalizeOverride", "VectorNormOverride",
           "override_class"]

_CLASSES: dict[TableKind, type[TableOverride]] = {cls.override_kind: cls for cls in (
    ElementwiseOverride, DivOverride, SoftmaxOverride, LogSoftmaxOverride, LayerNormOverride, RmsNormOverride,
    NormalizeOverride, VectorNormOverride)}


def override_class(kind: TableKind) -> type[TableOverride]:
    """The site override class of a table op's ``TableOpSpec.kind``."""
    return _CLASSES[kind]
