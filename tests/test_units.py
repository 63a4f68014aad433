"""DeepSpeed's number formatting, which users read at a glance."""

from flops_callbacks.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)


def test_deepspeed_style_strings() -> None:
    assert flops_to_string(6.28e12) == "6.28 TFLOPS"
    assert flops_to_string(2.5e15) == "2.5 PFLOPS"
    assert macs_to_string(3139.93e9) == "3.14 TMACs"
    assert duration_to_string(0.07667) == "76.67 ms"
    assert duration_to_string(34.09e-6) == "34.09 us"
    assert params_to_string(336.23e6) == "336.23 M"
    assert params_to_string(6.74e9) == "6.74 B"
    assert number_to_string(0) == "0 "
    assert number_to_string(999) == "999 "
    assert number_to_string(1000) == "1 K"
    assert number_to_string(6279.86e9, units="G") == "6279.86 G"
    assert percent(1, 3) == "33.33%" and percent(1, 0) == "0.00%"
