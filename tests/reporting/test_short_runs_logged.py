"""A run shorter than one scalar period (half a second) still leaves its TensorBoard log: the
steps since the last scalar point are written when the writer closes, even when nothing was
written before. A job whose rank 0 fails early is the one whose log is wanted most."""

import json

import pytest
import torch

from training import batches, mlp, train

pytest.importorskip("tensorboard")


def test_a_short_run_is_logged_at_close(ap, tmp_path):
    ap.enable(logdir=str(tmp_path), mode="off")
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches(4))
    ap.disable()
    records = [json.loads(line) for line in (tmp_path / "autopatch.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "start", records
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    [point] = EventAccumulator(str(tmp_path)).Reload().Scalars("autopatch/step_time_ms")
    assert point.step == 4 and point.value > 0, point      # three timed steps, one point
