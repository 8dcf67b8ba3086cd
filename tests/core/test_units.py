from __future__ import annotations

import pytest

from gpu_arbiter.core import (
    InvalidInput,
    format_mb,
    parse_mb,
    parse_priority,
    parse_seconds,
    priority_name,
)


@pytest.mark.parametrize(
    ("text", "mb"),
    [
        ("8G", 8192),
        ("8GiB", 8192),
        ("8gib", 8192),
        ("8GB", 8192),
        ("512M", 512),
        ("512MiB", 512),
        ("512mb", 512),
        ("24000", 24000),
        (24000, 24000),
        ("1.5G", 1536),
        (" 2 G ", 2048),
        ("1T", 1024 * 1024),
        ("0", 0),
    ],
)
def test_parse_mb_reads_the_usual_forms(text: str | int, mb: int) -> None:
    assert parse_mb(text) == mb


@pytest.mark.parametrize(
    "bad",
    ["", "G", "8X", "8 GiBs", "-1", "-1G", "1e3", "8G8", "0.1M", "1.0001G", "nan", "inf", "8,5G"],
)
def test_parse_mb_rejects_bad_text_naming_the_field(bad: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_mb(bad, "vram_mb")
    assert caught.value.field == "vram_mb"
    assert str(caught.value).startswith("vram_mb: ")
    assert caught.value.code == "invalid_input"


@pytest.mark.parametrize("bad", [True, False, 1.5, None, [8], -5, 1 << 41])
def test_parse_mb_rejects_other_values(bad: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_mb(bad, "headroom_mb")  # type: ignore[arg-type]
    assert caught.value.field == "headroom_mb"


def test_invalid_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_mb("lots")


@pytest.mark.parametrize(
    ("value", "number"),
    [
        ("batch", 100),
        ("background", 300),
        ("normal", 500),
        ("interactive", 800),
        ("critical", 1000),
        ("Interactive", 800),
        (" critical ", 1000),
        ("650", 650),
        (0, 0),
        (1000, 1000),
        ("0", 0),
    ],
)
def test_parse_priority_names_and_numbers(value: str | int, number: int) -> None:
    assert parse_priority(value) == number


@pytest.mark.parametrize("bad", [-1, 1001, "-1", "1001", "urgent", "", "5.5", 5.5, True, None])
def test_parse_priority_rejects_out_of_range_and_unknown(bad: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_priority(bad)  # type: ignore[arg-type]
    assert caught.value.field == "priority"


def test_unknown_priority_name_lists_the_names() -> None:
    with pytest.raises(InvalidInput, match="batch, background, normal, interactive, critical"):
        parse_priority("urgent")


def test_priority_name_and_format_mb() -> None:
    assert priority_name(800) == "interactive"
    assert priority_name(650) == "650"
    assert format_mb(24576) == "24.0 GiB"
    assert format_mb(512) == "512 MiB"


@pytest.mark.parametrize("bad", ["١٢G", "１２G", "²G", "12G\u00a0x", "٨", "1\u0660G"])
def test_parse_mb_takes_ascii_digits_only(bad: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_mb(bad, "vram_mb")
    assert caught.value.field == "vram_mb"


@pytest.mark.parametrize("bad", ["٨٠٠", "²", "１０", "8\u0660"])
def test_parse_priority_takes_ascii_digits_only(bad: str) -> None:
    with pytest.raises(InvalidInput) as caught:  # "²" was a bare ValueError before
        parse_priority(bad)
    assert caught.value.field == "priority"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("10m", 600.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("45", 45.0),
        (" 1.5H ", 5400.0),
        (0, 0.0),
        (2.5, 2.5),
    ],
)
def test_parse_seconds_reads_the_usual_forms(text: str | float, seconds: float) -> None:
    assert parse_seconds(text, "deadline") == seconds


@pytest.mark.parametrize(
    "bad", ["٩٠s", "90x", "-1", "inf", "nan", "", "1e3", float("inf"), -1.0, True]
)
def test_parse_seconds_rejects_the_rest_naming_the_field(bad: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_seconds(bad, "deadline")  # type: ignore[arg-type]
    assert caught.value.field == "deadline"
