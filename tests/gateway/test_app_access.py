"""Who may use the gateway's port: the Host check, the simple-request rule, API keys."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.gateway.requests.access import Access, ApiKey, check_exposure

KEYS = (ApiKey("one", "key-one-0123456789"), ApiKey("two", "key-two-0123456789"))
JSON = {b"content-type": "application/json", b"content-length": "2"}


def _code(access: Access, method: str, headers: dict[bytes, str], path: str = "/v1/x") -> str:
    denial = access.check(method, path, headers)
    return "" if denial is None else f"{denial.status} {denial.code}"


def test_without_keys_only_what_a_browser_cannot_send_cross_site_goes_on() -> None:
    access = Access((), "127.0.0.1", ("127.0.0.1", "gpu.example"))
    assert _code(access, "POST", JSON) == ""
    bearer = {b"authorization": "Bearer anything", b"content-length": "9"}
    assert _code(access, "POST", {**bearer, b"content-type": "multipart/form-data; b=x"}) == ""
    assert _code(access, "POST", {**bearer, b"content-type": "text/plain"}) == ""
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {b"content-type": kind, b"content-length": "9"}
        assert _code(access, "POST", headers) == "415 unsupported_media_type"
    assert _code(access, "POST", {b"content-length": "9"}) == "415 unsupported_media_type"
    assert _code(access, "GET", {}) == ""


@pytest.mark.parametrize(
    ("host", "code"),
    [
        ("localhost:8080", ""),
        ("127.0.0.1:8080", ""),
        ("[::1]:8080", ""),
        ("10.1.2.3", ""),  # an address: no rebinding attack has one of its own
        ("GPU.example.:8080", ""),
        ("attacker.example", "421 misdirected_request"),
    ],
)
def test_the_host_must_name_this_gateway(host: str, code: str) -> None:
    access = Access((), "127.0.0.1", ("127.0.0.1", "gpu.example"))
    assert _code(access, "GET", {b"host": host}) == code


def test_with_keys_each_key_and_no_other_and_healthz_open() -> None:
    access = Access(KEYS, "127.0.0.1", ())
    for key in KEYS:
        headers = {b"authorization": f"Bearer {key.key}"}
        assert _code(access, "GET", headers, "/metrics") == ""
        assert access.key_of(headers) is key
    for wrong in ("Bearer key-one-012345678", "Bearer ", "Basic a2V5", "key-one-0123456789"):
        assert _code(access, "GET", {b"authorization": wrong}) == "401 invalid_api_key"
    assert _code(access, "GET", {}, "/metrics") == "401 invalid_api_key"
    assert _code(access, "GET", {}, "/healthz") == ""
    form = {b"content-type": "text/plain", b"content-length": "9"}  # the 401 says it first
    assert _code(access, "POST", form) == "401 invalid_api_key"
    denial = access.check("GET", "/v1/models", {b"authorization": "Bearer nope-nope-nope"})
    assert denial is not None and "nope" not in denial.message


def test_admin_routes_need_an_admin_key_when_there_are_keys() -> None:
    admin = ApiKey("ops", "admin-key-0123456789", "admin")
    access = Access((*KEYS, admin), "127.0.0.1", ())
    bearer = {b"authorization": f"Bearer {admin.key}"}
    assert _code(access, "POST", bearer, "/admin/models/chat/unload") == ""
    assert _code(access, "GET", bearer, "/v1/models") == ""  # an admin key is a user's too
    user = {b"authorization": f"Bearer {KEYS[0].key}"}
    assert _code(access, "POST", user, "/admin/models/chat/pin") == "403 permission_denied"
    denial = access.check("POST", "/admin/models/chat/pin", user)
    assert denial is not None and "'one' is a user key" in denial.message
    assert KEYS[0].key not in denial.message
    assert _code(access, "POST", user, "/v1/chat/completions") == ""
    assert _code(access, "POST", {}, "/admin/models/chat/pin") == "401 invalid_api_key"
    open_access = Access((), "127.0.0.1", ())  # no keys: loopback only, open like the rest
    assert _code(open_access, "POST", JSON, "/admin/models/chat/pin") == ""


def test_a_key_is_never_shown() -> None:
    assert "key-one" not in repr(KEYS)


def test_beyond_loopback_keys_are_required() -> None:
    for host in ("127.0.0.1", "127.8.0.1", "::1", "localhost"):
        check_exposure(host, ())
    check_exposure("0.0.0.0", KEYS)
    for host in ("0.0.0.0", "::", "192.168.1.2", "gpu.example"):
        with pytest.raises(InvalidInput, match=f"refusing to listen on {host} without API keys"):
            check_exposure(host, ())
