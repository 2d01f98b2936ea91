import json
import random

import numpy as np
import pytest
import torch

from miles_ray.state_codec import TAG, load_state, save_state
from miles_ray.types import Sample


def test_run_state_round_trips_without_pickle(tmp_path):
    """Buffer payloads (Samples with MoE routes), RNG states and odd containers come back equal; the files are
    JSON and safetensors only."""
    sample = Sample([1, 2], [3], [-0.5], loss_mask=[1], reward=1.0, metadata={"entry": {"answer": "7"}, 3: (1, 2)})
    sample.routes = torch.arange(12, dtype=torch.int16).reshape(2, 3, 2)
    state = {
        "groups": [((2, 5, 17), [sample, Sample([4], [5], [-1.0])])],
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "array": np.arange(4, dtype=np.int64),
        "weird": {(1, "a"): {"x", "y"}, TAG: b"\x00\xff", "nan": float("inf")},
        "counters": {"added": 3},
    }
    files = save_state(tmp_path / "buffer", state)
    assert [f.name for f in files] == ["buffer.json", "buffer.safetensors"]
    json.loads(files[0].read_text())  # plain JSON
    back = load_state(tmp_path / "buffer")
    ((meta, [s0, s1]),) = back["groups"]
    assert meta == (2, 5, 17) and isinstance(s0, Sample) and s1 == Sample([4], [5], [-1.0])
    assert s0.metadata == {"entry": {"answer": "7"}, 3: (1, 2)} and torch.equal(s0.routes, sample.routes)
    assert s0.routes.dtype == torch.int16 and back["python_rng"] == random.getstate()
    assert torch.equal(back["torch_rng"], torch.get_rng_state()) and np.array_equal(back["array"], np.arange(4))
    assert back["weird"] == {(1, "a"): {"x", "y"}, TAG: b"\x00\xff", "nan": float("inf")}
    assert back["counters"] == {"added": 3}


def test_objects_outside_the_format_fail_at_save_and_at_load(tmp_path):
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\['groups'\]\[0\]\.metadata\['x'\] is a .*Opaque: .*no pickle"):
        save_state(tmp_path / "s", {"groups": [Sample([1], [2], [0.0], metadata={"x": Opaque()})]})
    forged = {"format": 1, "state": {TAG: "dataclass", "type": "subprocess:Popen", "fields": {"args": ["true"]}}}
    (tmp_path / "f.json").write_text(json.dumps(forged))
    with pytest.raises(ValueError, match="only miles_ray dataclasses are rebuilt"):
        load_state(tmp_path / "f")
    (tmp_path / "g.json").write_text(json.dumps({"format": 1, "state": {TAG: "eval", "code": "1"}}))
    with pytest.raises(ValueError, match="unknown value tag 'eval'"):
        load_state(tmp_path / "g")
