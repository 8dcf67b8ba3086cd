"""``gpu-arbiter tls ca`` and ``tls cert``: files written, and one line naming the field
(exit 2) for a CA that would be overwritten, a bad address, a missing CA."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from gpu_arbiter.cli import app


def test_ca_then_cert_then_refusals(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["tls", "ca", "--dir", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert f"CA certificate {tmp_path / 'ca.pem'}" in done.output
    again = runner.invoke(app, ["tls", "ca", "--dir", str(tmp_path)])
    assert again.exit_code == 2
    assert "dir:" in again.output
    assert "holds a CA already" in again.output
    made = runner.invoke(
        app, ["tls", "cert", "box-1", "--dir", str(tmp_path), "--ip", "127.0.0.2", "--dns", "box-1"]
    )
    assert made.exit_code == 0, made.output
    assert (tmp_path / "box-1.pem").is_file()
    assert (tmp_path / "box-1-key.pem").stat().st_mode & 0o777 == 0o600
    bad = runner.invoke(app, ["tls", "cert", "box-2", "--dir", str(tmp_path), "--ip", "box-2"])
    assert bad.exit_code == 2
    assert "ip: 'box-2' is not an IP address" in bad.output
    missing = runner.invoke(app, ["tls", "cert", "b", "--dir", str(tmp_path / "no"), "--ip", "::1"])
    assert missing.exit_code == 2
    assert "dir: no CA in" in missing.output
