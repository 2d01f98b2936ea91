import json
import pickle

import pytest

from miles_ray.checkpoint import RunCheckpointer


class Boom:
    def __reduce__(self):  # what a pickle planted in a checkpoint could do: run code on load
        return (exec, ("raise SystemExit('unpickled')",))


def test_a_pickled_format_1_checkpoint_is_not_unpickled_unless_asked(tmp_path):
    """Format 1 stored buffer/data/RNG state as pickles (#23): loading it now refuses before reading any file."""
    step = tmp_path / "step_00000001"
    step.mkdir()
    (step / "data.pkl").write_bytes(pickle.dumps(Boom()))
    meta = {"format": 1, "step": 1, "has": ["data.pkl", "trainer"], "extra": {}, "time": 0.0}
    (step / "run.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format 1: .* pickles, .*allow_pickle=True only if you trust"):
        RunCheckpointer(tmp_path).load(step, trainer=None, data_source=object())
