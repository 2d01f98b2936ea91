import pytest

from miles_ray.placement import Slot, colocated, disaggregated


def test_colocated_shares_bundles():
    plan = colocated(2, cpus_per_bundle=1, gpus_per_bundle=1)
    assert plan.bundles == ({"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1})
    assert plan.trainer_slots == (Slot(0, 0.5, 0.4), Slot(1, 0.5, 0.4))
    assert [s.bundle for s in plan.engine_slots] == [0, 1]
    # a bundle's actors never ask for more than it has
    for t, e in zip(plan.trainer_slots, plan.engine_slots):
        assert t.num_gpus + e.num_gpus <= 1 and t.num_cpus + e.num_cpus <= 1


def test_disaggregated_separates_bundles():
    plan = disaggregated(2, 3, cpus_per_bundle=2, gpus_per_trainer=1, gpus_per_engine=1)
    assert len(plan.bundles) == 5
    assert [s.bundle for s in plan.trainer_slots] == [0, 1]
    assert [s.bundle for s in plan.engine_slots] == [2, 3, 4]
    assert all(s.num_cpus == 2 and s.num_gpus == 1 for s in plan.trainer_slots + plan.engine_slots)


def test_cpu_only_bundles_have_no_gpu_key():
    assert colocated(1).bundles == ({"CPU": 1.0},)


@pytest.mark.parametrize(
    ("fn", "args", "name"),
    [
        (colocated, (0,), "num_ranks"),
        (disaggregated, (1, 0), "num_engines"),
        (disaggregated, (1, 1, 1.0, -1.0), "gpus_per_trainer"),
    ],
)
def test_bad_counts_name_the_argument(fn, args, name):
    with pytest.raises(ValueError, match=name):
        fn(*args)


def test_colocated_critic_and_reference_share_each_bundle():
    plan = colocated(2, cpus_per_bundle=1, gpus_per_bundle=1, critic=True, reference=True)
    assert len(plan.bundles) == 2
    for i in range(2):
        slots = [plan.slots(role)[i] for role in ("trainer", "engine", "critic", "reference")]
        assert {s.bundle for s in slots} == {i}
        assert sum(s.num_cpus for s in slots) == pytest.approx(1.0)
        assert sum(s.num_gpus for s in slots) <= 1.0
    assert colocated(1).critic_slots == () and colocated(1).slots("reference") == ()


def test_disaggregated_critic_and_reference_get_their_own_bundles():
    plan = disaggregated(2, 1, gpus_per_trainer=1, num_critic_ranks=2, num_reference_ranks=1)
    assert [s.bundle for s in plan.critic_slots] == [3, 4] and [s.bundle for s in plan.reference_slots] == [5]
    assert len(plan.bundles) == 6 and all(s.num_gpus == 1 for s in plan.critic_slots + plan.reference_slots)
    with pytest.raises(ValueError, match="unknown placement role 'critc'"):
        plan.slots("critc")
