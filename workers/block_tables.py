"""Each request's block table as a rank holds it between steps.

The coordinator sends a request's table once and then only what changed (`SeqWork.block_ids`
from `block_table_start` on): a decode step of a request at 32k tokens would otherwise carry its
512 block ids again every step, through the executor's messages and into numpy. Applying a
`SeqWork` is idempotent (the entries from `block_table_start` on are overwritten, those after
them dropped), so a step re-run without a failed request (`Engine._execute_isolating`) gives the
same tables.
"""

from __future__ import annotations

import numpy as np

from workers.batch import SeqWork


class BlockTables:
    def __init__(self) -> None:
        self._tables: dict[str, np.ndarray] = {}  # int32, capacity >= length
        self._lengths: dict[str, int] = {}

    def update(self, seq: SeqWork) -> np.ndarray:
        """Apply the step's part of `seq`'s table; -> the whole table (a view, valid until the
        request's next update). ValueError where the step keeps entries this rank never had."""
        rid, start = seq.request_id, seq.block_table_start
        have = self._lengths.get(rid, 0)
        if start > have:
            raise ValueError(
                f"request {rid}: the step keeps the first {start} entries of its block table "
                f"and this rank holds {have}"
            )
        table = self._tables.get(rid)
        if start == have and not seq.block_ids and table is not None:
            return table[:have]  # most decode steps: nothing new
        length = start + len(seq.block_ids)
        if table is None or table.size < length:
            grown = np.empty(max(length, 2 * (0 if table is None else table.size), 16), np.int32)
            if start:
                grown[:start] = table[:start]
            table = self._tables[rid] = grown
        table[start:length] = seq.block_ids
        self._lengths[rid] = length
        return table[:length]

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._tables.pop(rid, None)
            self._lengths.pop(rid, None)

    def __len__(self) -> int:
        return len(self._tables)
