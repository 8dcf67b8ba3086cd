"""The API's JSON answers are strict JSON: a number JSON cannot carry is written as null
and logged naming its place, never a 500 (the guard behind finite figures at the source)."""

from __future__ import annotations

import json
import logging
import math

import pytest

from gpu_arbiter.server.errors import error_response
from gpu_arbiter.server.responses import FiniteJSONResponse
from gpu_arbiter.web.jsontext import dumps


def test_finite_figures_are_written_as_starlette_writes_them() -> None:
    body = {"id": "lease-1", "holder": "é ✓", "reason": {"until": 2.5, "gpus": [1, 2]}}
    response = FiniteJSONResponse(body, status_code=202)
    assert response.status_code == 202
    assert response.body == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def test_a_non_finite_figure_is_written_as_null_and_logged_by_its_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {
        "state": "pending",
        "reason": {"blockers": [{"until": -math.inf}, {"expires_at": math.inf}]},
        "effective_priority": math.nan,
    }
    with caplog.at_level(logging.ERROR, logger="gpu_arbiter.web"):
        response = FiniteJSONResponse(body, status_code=202)
    written = json.loads(response.body)  # strict: no NaN, no Infinity
    assert written["reason"]["blockers"] == [{"until": None}, {"expires_at": None}]
    assert written["effective_priority"] is None and written["state"] == "pending"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "reason.blockers[0].until (-inf)" in record.getMessage()
    assert "reason.blockers[1].expires_at (inf)" in record.getMessage()
    assert "effective_priority (nan)" in record.getMessage()


def test_an_error_answer_is_guarded_too() -> None:
    response = error_response(422, "unschedulable", "no GPU", {"reason": {"until": math.inf}})
    assert json.loads(response.body)["error"]["details"] == {"reason": {"until": None}}


def test_what_json_cannot_write_but_a_number_still_raises() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        dumps(loop)


def test_ascii_escapes_on_request() -> None:
    assert dumps({"holder": "é"}, ensure_ascii=True) == '{"holder":"\\u00e9"}'
    assert dumps({"holder": "é"}) == '{"holder":"é"}'
