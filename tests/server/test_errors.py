"""The one rendering of errors: whatever text an error echoes, it is written."""

from __future__ import annotations

import json

from gpu_arbiter.server.errors import error_response


def test_text_that_is_not_unicode_is_written_escaped_not_refused() -> None:
    response = error_response(
        422, "invalid_input", "metadata.\ud800: é", {"errors": [{"field": "x\udfff"}]}
    )
    assert response.status_code == 422
    body = json.loads(response.body)
    assert body["error"]["message"] == "metadata.\\ud800: é"  # only what cannot be written
    assert body["error"]["details"] == {"errors": [{"field": "x\\udfff"}]}
    valid = json.loads(error_response(404, "not_found", "lease é ✓ not found").body)
    assert valid["error"]["message"] == "lease é ✓ not found"
