"""The API's JSON answers: :class:`FiniteJSONResponse`, every route's and every error's."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ..web.jsontext import dumps

__all__ = ["FiniteJSONResponse"]


class FiniteJSONResponse(JSONResponse):
    """Strict JSON, as Starlette's, but a number JSON cannot carry (``NaN``, ``Infinity``)
    is written as ``null`` and logged as an error naming its place
    (:func:`~gpu_arbiter.web.jsontext.dumps`), not raised: one wrong figure, never a 500
    for a whole answer. The figures are finite at their source; this guards the edge."""

    def render(self, content: Any) -> bytes:
        return dumps(content, what="an API answer").encode("utf-8")
