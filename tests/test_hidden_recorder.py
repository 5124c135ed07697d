"""The engine's hidden-state recorder: states by position, a recomputed request's overwritten."""

from types import SimpleNamespace

import pytest
import torch

from draftwise.engine.hidden_states import HiddenRecorder


def states(values: list[float]) -> dict[int, torch.Tensor]:
    return {2: torch.tensor(values)[:, None].repeat(1, 3)}  # layer 2: [T, H=3]


def test_positions_follow_the_kept_tokens_and_a_recompute_overwrites():
    recorder = HiddenRecorder((2,))
    row = [SimpleNamespace(request_id="a")]
    recorder.record(row, [0], states([0, 1, 2]), [torch.tensor([0, 1, 2])])  # a prefill of 3
    recorder.record(row, [3], states([3, 9, 4]), [torch.tensor([0, 2])])  # fed 3 (two drafts), kept 1st and 3rd
    recorder.record(row, [2], states([7, 8]), [torch.tensor([0, 1])])  # recomputed from position 2
    taken = recorder.take("a")[2][:, 0].tolist()
    assert taken == [0, 1, 7, 8]
    assert recorder.take("a") == {}


def test_a_gap_is_an_error_and_a_request_running_before_the_recorder_is_left_out():
    recorder = HiddenRecorder((2,))
    recorder.record([SimpleNamespace(request_id="b")], [4], states([1]), [torch.tensor([0])])  # begun before
    assert recorder.take("b") == {}
    row = [SimpleNamespace(request_id="c")]
    recorder.record(row, [0], states([1, 2]), [torch.tensor([0, 1])])
    with pytest.raises(RuntimeError, match="never fed"):
        recorder.record(row, [3], states([3]), [torch.tensor([0])])
