"""Step / layer selectors: "0,1,4-6", lists of ints, and clear errors for bad input."""

import pytest

from fx_fp8.config.selectors import format_selector, parse_selector


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, set()),
        ("", set()),
        ("  ", set()),
        (3, {3}),
        ("0", {0}),
        ("0,1", {0, 1}),
        ("0, 1 ,4-6", {0, 1, 4, 5, 6}),
        ("2-2", {2}),
        ([0, 3, "5-6"], {0, 3, 5, 6}),
        ((1, 1), {1}),
    ],
)
def test_parse_valid(value, expected):
    assert parse_selector(value) == frozenset(expected)


@pytest.mark.parametrize(
    "text, token",
    [
        ("a", "a"),
        ("3-1", "3-1"),
        ("-1", "-1"),
        ("1-", "1-"),
        ("1.5", "1.5"),
        ("0,x-2", "x"),
        ("1,-3", "-3"),
    ],
)
def test_bad_token_quotes_token_and_selector(text, token):
    with pytest.raises(ValueError) as e:
        parse_selector(text, what="diffusion_kv_cache_skip_steps")
    msg = str(e.value)
    assert repr(token) in msg, msg
    assert repr(text) in msg, msg
    assert "diffusion_kv_cache_skip_steps" in msg


def test_reversed_range_explains():
    with pytest.raises(ValueError, match="below its start"):
        parse_selector("3-1")


def test_stray_comma_quotes_selector():
    with pytest.raises(ValueError) as e:
        parse_selector("1,,2")
    assert "empty token" in str(e.value) and "'1,,2'" in str(e.value)


@pytest.mark.parametrize("bad", [-1, True, 1.5, [1, 2.0], [None], {"a": 1}])
def test_bad_non_string_values(bad):
    with pytest.raises(ValueError, match="invalid"):
        parse_selector(bad)


@pytest.mark.parametrize("values", [set(), {0}, {0, 1, 2, 5}, {3, 7, 8, 9, 20}])
def test_format_round_trip(values):
    text = format_selector(values)
    assert parse_selector(text) == frozenset(values)


def test_format_compacts_ranges():
    assert format_selector({0, 1, 2, 5}) == "0-2,5"


def test_huge_range_is_held_as_a_range():
    import time

    from fx_fp8.config.selectors import Selector

    t0 = time.perf_counter()
    sel = parse_selector("0-1000000000,5", what="diffusion_kv_cache_skip_layers")
    assert time.perf_counter() - t0 < 0.05  # no expansion: a range, not a billion ints
    assert isinstance(sel, Selector) and sel.ranges == ((0, 1000000000),)
    assert 999_999_999 in sel and 1_000_000_001 not in sel and len(sel) == 1_000_000_001
    assert str(sel) == "0-1000000000" and format_selector(sel) == "0-1000000000"
    assert str(sel.at_least(4)) == "4-1000000000"


@pytest.mark.parametrize("text", ["٣", "1,²", "１", "0-٣"])
def test_non_ascii_digits_rejected_naming_the_key(text):
    with pytest.raises(ValueError) as e:
        parse_selector(text, what="diffusion_kv_cache_skip_steps")
    assert "diffusion_kv_cache_skip_steps" in str(e.value) and "ASCII" in str(e.value)


def test_selector_equality_with_sets():
    assert parse_selector("0-2,5") == {0, 1, 2, 5} and parse_selector([5, 1, 0, 2]) == parse_selector("0-2,5")
    assert parse_selector("") == set() and not parse_selector(None)
