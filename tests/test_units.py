"""Number strings, exactly as DeepSpeed 0.19.8's helpers of the same names write them (scripts parse them)."""

import pytest

from flops_callbacks.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
    quantity_to_string,
)


def test_numbers_take_the_largest_prefix_up_to_tera_and_keep_a_trailing_space() -> None:
    assert number_to_string(0) == "0 "
    assert number_to_string(999) == "999 "
    assert number_to_string(1000) == "1 K"
    assert number_to_string(1340) == "1.34 K"
    assert number_to_string(1e12) == "1 T"
    assert number_to_string(2.5e15) == "2500 T"  # no P: T is the largest prefix
    assert number_to_string(0.5) == "500 m"
    assert number_to_string(4e-7) == "0.4 u"
    assert number_to_string(-3) == "-3e+06 u"  # negatives fall through to u, as DeepSpeed's
    assert number_to_string(6279.86e9, units="G") == "6279.86 G"
    assert number_to_string(1234.5678, precision=3) == "1.235 K"
    assert number_to_string(1234.5, units="") == "1234.5 "


def test_unit_helpers_append_their_unit_to_the_number() -> None:
    assert flops_to_string(6.28e12) == "6.28 TFLOPS"
    assert flops_to_string(2.5e15) == "2500 TFLOPS"
    assert flops_to_string(0) == "0 FLOPS"
    assert macs_to_string(3139.93e9) == "3.14 TMACs"
    assert macs_to_string(670) == "670 MACs"
    assert bytes_to_string(2.5e9) == "2.5 GB"
    assert duration_to_string(0.07667) == "76.67 ms"
    assert duration_to_string(34.09e-6) == "34.09 us"
    assert duration_to_string(0) == "0 s"
    assert quantity_to_string(412.5, "J") == "412.5 J"  # ours: energy is no DeepSpeed figure
    assert quantity_to_string(0.00241, "J") == "2.41 mJ"
    assert quantity_to_string(1810, "W") == "1.81 kW" and quantity_to_string(2500, "J") == "2.5 kJ"  # SI: k
    assert quantity_to_string(1810, "W", units="") == "1810 W"


def test_params_say_b_for_billions_without_a_trailing_space() -> None:
    assert params_to_string(336.23e6) == "336.23 M"
    assert params_to_string(6.74e9) == "6.74 B"
    assert params_to_string(6.74e9, units="B") == "6.74 B"
    assert params_to_string(999) == "999"
    assert params_to_string(0) == "0"


def test_percent_rounds_to_two_places_without_trailing_zeros() -> None:
    assert percent(1, 3) == "33.33%"
    assert percent(2, 2) == "100%"
    assert percent(1, 0) == "0%"


def test_unknown_units_name_the_accepted_ones() -> None:
    accepted = r"\('T', 'G', 'M', 'K', '', 'm', 'u'\)"
    with pytest.raises(ValueError, match=f"units must be None or one of {accepted}"):
        number_to_string(1.0, units="P")
