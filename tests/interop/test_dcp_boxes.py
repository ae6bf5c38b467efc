"""``interop.dcp_writer.flat_boxes``: a run of a tensor's flattened index as the DCP chunk
boxes that tile it (pure arithmetic, no processes)."""

from __future__ import annotations

import itertools
import math

import torch

from meshtrain.interop.dcp_writer import flat_boxes


def test_boxes_tile_every_run_in_order():
    for shape in [(7,), (5, 3), (4, 3, 2), (2, 1, 3, 4), ()]:
        numel = math.prod(shape)
        ids = torch.arange(numel).reshape(shape)
        for start, end in itertools.combinations(range(numel + 1), 2):
            boxes = list(flat_boxes(shape, start, end))
            assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, start, end)
            covered = []
            for off, size, first in boxes:
                box = ids[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))]
                flat = box.reshape(-1).tolist()
                assert flat == list(range(first, first + len(flat)))  # contiguous
                covered += flat
            assert covered == list(range(start, end)), (shape, start, end)
