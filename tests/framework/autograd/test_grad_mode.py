"""Grad modes: no_grad, enable_grad and set_grad_enabled as contexts and decorators."""

import pytest

import framework as fw


def _records(x):
    """True when an op on x records history right now."""
    return (x * 2.0).grad_fn is not None


@pytest.fixture
def x():
    return fw.tensor([1.0, 2.0], requires_grad=True)


def test_grad_is_enabled_by_default_and_ops_record(x):
    assert fw.is_grad_enabled() is True
    y = x * 2.0
    assert y.requires_grad and y.grad_fn is not None and not y.is_leaf


def test_no_grad_context_stops_recording_and_restores(x):
    with fw.no_grad():
        assert fw.is_grad_enabled() is False
        y = x * 2.0
        assert y.grad_fn is None and not y.requires_grad and y.is_leaf
    assert fw.is_grad_enabled() is True
    assert _records(x)


def test_no_grad_restores_after_an_exception(x):
    with pytest.raises(ValueError), fw.no_grad():
        raise ValueError("boom")
    assert fw.is_grad_enabled() and _records(x)


def test_enable_grad_inside_no_grad(x):
    with fw.no_grad():
        with fw.enable_grad():
            assert fw.is_grad_enabled()
            assert _records(x)
        assert not fw.is_grad_enabled()
        assert not _records(x)
    assert fw.is_grad_enabled()


def test_nesting_three_levels(x):
    with fw.no_grad():
        with fw.enable_grad():
            with fw.no_grad():
                assert not _records(x)
            assert _records(x)
        assert not _records(x)
    assert _records(x)


def test_set_grad_enabled_as_function_and_context(x):
    fw.set_grad_enabled(False)  # as a function: takes effect immediately
    assert not fw.is_grad_enabled() and not _records(x)
    fw.set_grad_enabled(True)
    assert fw.is_grad_enabled()
    with fw.set_grad_enabled(False):
        assert not _records(x)
        with fw.set_grad_enabled(True):
            assert _records(x)
        assert not _records(x)
    assert fw.is_grad_enabled()  # restored to the mode before the with


def test_no_grad_and_enable_grad_as_decorators(x):
    @fw.no_grad()
    def frozen(t):
        """doc"""
        return t * 2.0

    @fw.enable_grad()
    def recorded(t):
        return t * 2.0

    y = frozen(x)
    assert y.grad_fn is None and fw.is_grad_enabled()
    assert frozen.__name__ == "frozen" and frozen.__doc__ == "doc"  # functools.wraps
    with fw.no_grad():
        assert recorded(x).grad_fn is not None
        assert not fw.is_grad_enabled()


def test_no_grad_and_enable_grad_as_bare_decorators(x):
    # PyTorch 2 accepts @torch.no_grad without parentheses.
    @fw.no_grad
    def frozen(t):
        return t * 2.0

    @fw.enable_grad
    def recorded(t):
        return t * 2.0

    assert frozen(x).grad_fn is None and fw.is_grad_enabled()
    with fw.no_grad():
        assert recorded(x).grad_fn is not None


def test_set_grad_enabled_as_decorator_does_not_change_the_mode_when_applied(x):
    @fw.set_grad_enabled(False)
    def frozen(t):
        return t * 2.0

    assert fw.is_grad_enabled()  # decorating alone must not switch grad off (PyTorch)
    assert frozen(x).grad_fn is None
    assert fw.is_grad_enabled()


def test_decorator_restores_mode_after_an_exception():
    @fw.no_grad()
    def fails():
        raise KeyError("x")

    with pytest.raises(KeyError):
        fails()
    assert fw.is_grad_enabled()


def test_grad_mode_names_are_shared_with_autograd():
    assert fw.no_grad is fw.autograd.no_grad
    assert fw.enable_grad is fw.autograd.enable_grad
    assert fw.set_grad_enabled is fw.autograd.set_grad_enabled
    assert fw.is_grad_enabled is fw.autograd.is_grad_enabled
