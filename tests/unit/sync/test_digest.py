"""The weight digest: any changed byte or name changes it; digests taken on arrival stand in for a parameter only
when the parameter *is* that memory."""

import torch

from miles_ray.sync.digest import Known, TensorDigests, digest, named_tensors_checksum

W = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}


def test_a_byte_a_name_or_a_dtype_changes_the_digest():
    base = named_tensors_checksum(W.items())
    assert named_tensors_checksum(reversed(list(W.items()))) == base  # order does not matter
    changed = {**W, "a": W["a"].clone()}
    changed["a"][1, 2] += 1e-6
    assert named_tensors_checksum(changed.items()) != base
    assert named_tensors_checksum({"c": W["a"], "b": W["b"]}.items()) != base
    assert named_tensors_checksum({**W, "a": W["a"].double()}.items()) != base


def test_a_known_digest_stands_for_the_same_memory_only():
    honest = named_tensors_checksum(W.items())
    wrong = {"a": Known(W["a"], b"\0" * 16)}  # a digest that is not a's: shows whether it was used
    assert TensorDigests().add(W.items(), known=wrong).hexdigest() != honest  # same memory: taken, bytes not read
    copy = {**W, "a": W["a"].clone()}
    assert TensorDigests().add(copy.items(), known=wrong).hexdigest() == honest  # other memory: hashed
    right = {name: Known(t, digest(name, t)) for name, t in W.items()}
    assert TensorDigests().add(W.items(), known=right).hexdigest() == honest


def test_tied_parameters_count_once_under_the_first_name():
    tied = {"embed": W["a"], "head": W["a"], "b": W["b"]}
    assert named_tensors_checksum(tied.items()) == named_tensors_checksum({"embed": W["a"], "b": W["b"]}.items())
