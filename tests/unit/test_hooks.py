import pytest

from miles_ray.hooks import HookContext, Hooks, TrainerHooksConfig


def test_bad_hook_fails_at_config_time_naming_it():
    with pytest.raises(ValueError, match=r"hooks.after_save\[1\] 'no_such_pkg:fn' cannot be imported"):
        TrainerHooksConfig(after_save=[print, "no_such_pkg:fn"])
    with pytest.raises(ValueError, match="not callable"):
        TrainerHooksConfig(after_init=["miles_ray.hooks:POINTS"])


def test_hooks_run_in_order_and_merge_returned_dicts():
    seen = []
    hooks = Hooks(
        TrainerHooksConfig(
            after_train_step=[
                lambda ctx, m: seen.append(("a", m["loss"])) or {"x": 1},
                lambda ctx, m: {"x": 2, "y": ctx.rank},
                "builtins:print",  # an import path resolves too; a non-dict result is ignored
            ]
        )
    )
    ctx = HookContext(rank=3, world_size=4, model=None, optimizer=None, config=None)
    assert hooks.call("after_train_step", ctx, {"loss": 0.5}) == {"x": 2, "y": 3}
    assert seen == [("a", 0.5)] and hooks.call("after_init", ctx) == {}
