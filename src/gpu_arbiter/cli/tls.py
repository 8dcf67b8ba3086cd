"""``gpu-arbiter tls ca`` and ``gpu-arbiter tls cert``: the cluster's own CA and the
certificates of its hosts (:mod:`..certs`). Exit codes: 0 written; 2 a bad argument,
a missing CA, or a CA that would be overwritten (one line naming the field)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core import InvalidInput

tls_app = typer.Typer(
    help="The cluster's certificate authority and its hosts' certificates.",
    no_args_is_help=True,
)

DirOpt = Annotated[
    Path,
    typer.Option(
        "--dir", help="Where the CA and the certificates are (default: here).", metavar="DIR"
    ),
]


@tls_app.command("ca")
def ca(
    directory: DirOpt = Path(),
    days: Annotated[int, typer.Option(help="Valid this many days.", metavar="N")] = 3650,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing CA (its certificates die).")
    ] = False,
) -> None:
    """Make the cluster's CA: ca.pem (give it to every host) and ca-key.pem (mode 0600;
    keep it where certificates are made, and nowhere else)."""
    from ..certs import create_ca

    try:
        issued = create_ca(directory, days=days, force=force)
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"CA certificate {issued.cert}")
    typer.echo(f"CA key {issued.key} (0600: it signs every certificate; keep it here)")


@tls_app.command("cert")
def cert(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The host (files NAME.pem).")],
    directory: DirOpt = Path(),
    ip: Annotated[
        list[str] | None,
        typer.Option(help="An IP address clients reach the host by (repeat).", metavar="IP"),
    ] = None,
    dns: Annotated[
        list[str] | None,
        typer.Option(help="A DNS name clients reach the host by (repeat).", metavar="NAME"),
    ] = None,
    days: Annotated[int, typer.Option(help="Valid this many days.", metavar="N")] = 365,
) -> None:
    """Make a host's certificate, signed by the CA in --dir: for its listener (serve,
    gateway) and as its client certificate (mutual TLS). Run again to renew it: the
    listeners using the files load the new one without a restart."""
    from ..certs import create_cert

    try:
        issued = create_cert(directory, name, ips=tuple(ip or ()), dns=tuple(dns or ()), days=days)
    except InvalidInput as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"certificate {issued.cert}")
    typer.echo(f"key {issued.key} (0600)")
