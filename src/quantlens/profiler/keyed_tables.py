"""Results holding one table per model output, looked up by position or by key (``"<output>_<metric>"``) or by
output name: the sensitivity and the joint sensitivity results share this."""

from __future__ import annotations

__all__ = ["KeyedTables"]


class KeyedTables:
    """Mixin of a result with ``tables`` (each with ``key`` and ``output``): ``result[0]``, ``result["out_L1"]``,
    ``result["out"]``, ``len``, iteration and ``keys()``."""

    tables: tuple | list

    def __getitem__(self, item):
        if isinstance(item, str):
            for table in self.tables:
                if table.key == item or table.output == item:
                    return table
            raise KeyError(f"{item!r}; tables: {self.keys()}")
        return self.tables[item]

    def __len__(self) -> int:
        return len(self.tables)

    def __iter__(self):
        return iter(self.tables)

    def keys(self) -> list[str]:
        return [t.key for t in self.tables]
