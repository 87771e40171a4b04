"""The tensor state machine: every move in the table, legal and illegal."""

from __future__ import annotations

import itertools

import pytest
import torch

from zerostack.chunk import TRANSITIONS, Chunk, TensorState


def _chunk_with_tensor():
    chunk = Chunk(16, None, torch.float32, compute_device="cpu")
    t = torch.zeros(4)
    chunk.append_tensor(t)
    return chunk, t


def _reach(chunk, t, state):
    """Drive ``t`` from HOLD to ``state`` through legal moves only."""
    path = {
        TensorState.HOLD: [],
        TensorState.FREE: [TensorState.FREE],
        TensorState.COMPUTE: [TensorState.COMPUTE],
        TensorState.HOLD_AFTER_BWD: [TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD],
        TensorState.READY_FOR_REDUCE: [
            TensorState.COMPUTE,
            TensorState.HOLD_AFTER_BWD,
            TensorState.READY_FOR_REDUCE,
        ],
    }[state]
    for s in path:
        chunk.trans_tensor_state(t, s)
    assert chunk.tensor_state(t) is state


def test_the_table_is_the_documented_one():
    S = TensorState
    assert {
        S.FREE: {S.HOLD, S.COMPUTE},
        S.HOLD: {S.FREE, S.COMPUTE},
        S.COMPUTE: {S.HOLD, S.HOLD_AFTER_BWD},
        S.HOLD_AFTER_BWD: {S.COMPUTE, S.READY_FOR_REDUCE},
        S.READY_FOR_REDUCE: {S.HOLD},
    } == TRANSITIONS


@pytest.mark.parametrize("by_info", [False, True], ids=["by-tensor", "by-info"])
@pytest.mark.parametrize(("old", "new"), list(itertools.product(TensorState, TensorState)))
def test_every_pair(old, new, by_info):
    chunk, t = _chunk_with_tensor()
    _reach(chunk, t, old)
    counts = dict(chunk.state_count)
    info = chunk.tensors_info[t]

    def move(tensor, state):  # trans_info_state is the hooks' lookup-free twin
        if by_info:
            chunk.trans_info_state(info, state)
        else:
            chunk.trans_tensor_state(tensor, state)

    if new in TRANSITIONS[old]:
        move(t, new)
        assert chunk.tensor_state(t) is new
        assert chunk.state_count[new] == 1 and sum(chunk.state_count.values()) == 1
    else:
        with pytest.raises(
            RuntimeError,
            match=rf"chunk 0: illegal transition {old.name} -> {new.name} for tensor at offset 0 \(shape \(4,\)\)",
        ):
            move(t, new)
        assert chunk.tensor_state(t) is old
        assert dict(chunk.state_count) == counts


def test_unknown_tensor():
    chunk, _ = _chunk_with_tensor()
    with pytest.raises(ValueError, match=r"chunk 0: tensor of shape \(3,\) is not in this chunk"):
        chunk.trans_tensor_state(torch.zeros(3), TensorState.FREE)


def test_path_between_follows_the_table():
    from zerostack.chunk import TRANSITIONS, path_between

    for old in TensorState:
        for new in TensorState:
            path = path_between(old, new)
            state = old
            for step in path:  # every move legal, ends at new
                assert step in TRANSITIONS[state]
                state = step
            assert state is new
    assert path_between(TensorState.HOLD, TensorState.READY_FOR_REDUCE) == [
        TensorState.COMPUTE,
        TensorState.HOLD_AFTER_BWD,
        TensorState.READY_FOR_REDUCE,
    ]
