"""Extension points given by import path: both spellings resolve; what does not resolve fails naming the field."""

import pytest

from miles_ray.callables import resolve_callable


def test_both_path_spellings_and_callables():
    join = __import__("os").path.join
    assert resolve_callable("os.path:join") is join  # "module:attr"
    assert resolve_callable("os.path.join") is join  # "module.attr"
    assert resolve_callable(join) is join


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module:f", r"group_filter 'no_such_module:f' cannot be imported"),
        ("os.path:no_such_attr", r"group_filter 'os.path:no_such_attr' cannot be imported"),
        ("os:sep", r"group_filter 'os:sep' is not callable"),
        ("", r"group_filter must be a callable or an import path"),
        (42, r"group_filter must be a callable or an import path 'pkg.module:attr', got 42"),
    ],
)
def test_errors_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_callable(spec, "group_filter")
