"""`gatekeeper certs ...`: thin CLI over gatekeeper.certs.pki."""

from __future__ import annotations

import argparse

from gatekeeper.base.errors import UsageError, non_negative_int, positive_int
from gatekeeper.certs.pki import CLUSTER_CA, FRONT_PROXY_CA, PKI

NAME = "certs"
HELP = "create CAs and issue serving/client certificates"
DESCRIPTION = (
    "Certificate tooling for the control plane and gatekeeper: a cluster CA, a front-proxy CA "
    "(the only CA whose client certificates may stamp X-Remote-User), a service-account key pair, "
    "and ECDSA P-256 leaf certificates signed by them."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options and handler (``set_defaults(func=...)``); the CLI makes the parser."""
    csub = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)

    def with_dir(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--dir", default="certs", help="directory holding the CAs and issued files (default: certs)")

    init = csub.add_parser("init", help="create the cluster CA, front-proxy CA and service-account keys")
    with_dir(init)
    init.add_argument("--force", action="store_true", help="regenerate even if the files exist")
    init.add_argument("--algorithm", choices=["ecdsa", "rsa"], default="ecdsa")
    init.set_defaults(func=_init)

    issue = csub.add_parser("issue", help="issue a serving or client certificate")
    isub = issue.add_subparsers(dest="kind", metavar="KIND", required=True)
    serving = isub.add_parser("serving", help="a TLS server certificate (serverAuth) signed by the cluster CA")
    with_dir(serving)
    serving.add_argument("--name", required=True, help="file stem: writes NAME.crt and NAME.key")
    serving.add_argument("--dns", action="append", default=[], help="DNS subject alternative name (repeatable)")
    serving.add_argument("--ip", action="append", default=[], help="IP subject alternative name (repeatable)")
    serving.add_argument("--days", type=positive_int, default=365, help="validity in days (default 365)")
    serving.add_argument("--algorithm", choices=["ecdsa", "rsa"], default="ecdsa")
    serving.set_defaults(func=_issue)
    client = isub.add_parser("client", help="a client certificate (clientAuth): CN=user, O=groups")
    with_dir(client)
    client.add_argument("--name", required=True, help="file stem: writes NAME.crt and NAME.key")
    client.add_argument("--user", required=True, help="user name (certificate CN)")
    client.add_argument("--group", action="append", default=[], help="group (certificate O, repeatable)")
    client.add_argument(
        "--ca", choices=[CLUSTER_CA, FRONT_PROXY_CA], default=CLUSTER_CA,
        help="signing CA: 'ca' for users, 'front-proxy-ca' for a front proxy's own client cert",
    )
    client.add_argument("--days", type=positive_int, default=365, help="validity in days (default 365)")
    client.add_argument("--algorithm", choices=["ecdsa", "rsa"], default="ecdsa")
    client.set_defaults(func=_issue)

    bundle = csub.add_parser("ca-bundle", help="print the base64 caBundle for webhook configurations")
    with_dir(bundle)
    bundle.add_argument("--ca", choices=[CLUSTER_CA, FRONT_PROXY_CA], default=CLUSTER_CA)
    bundle.set_defaults(func=_bundle)

    check = csub.add_parser("check", help="report the expiry of every certificate in --dir")
    with_dir(check)
    check.add_argument("--warn-days", type=non_negative_int, default=30,
                       help="flag certificates expiring sooner (default 30)")
    check.set_defaults(func=_check)


def _init(args: argparse.Namespace) -> int:
    made = PKI(args.dir).init(force=args.force, algorithm=args.algorithm)
    for path in made:
        print(f"wrote {path}")
    if not made:
        print(f"{args.dir}: CAs and service-account keys already exist (use --force to regenerate)")
    return 0


def _issue(args: argparse.Namespace) -> int:
    pki = PKI(args.dir)
    try:
        if args.kind == "serving":
            out = pki.issue_serving(args.name, dns=args.dns, ips=args.ip, days=args.days, algorithm=args.algorithm)
        else:
            out = pki.issue_client(args.name, user=args.user, groups=args.group, ca=args.ca, days=args.days,
                                   algorithm=args.algorithm)
    except ValueError as exc:  # a bad --dns/--ip/... is the user's to fix: one line, no traceback
        raise UsageError(str(exc)) from None
    print(f"wrote {out.cert} and {out.key}")
    return 0


def _bundle(args: argparse.Namespace) -> int:
    print(PKI(args.dir).ca_bundle(args.ca))
    return 0


def _check(args: argparse.Namespace) -> int:
    rows = PKI(args.dir).check(args.warn_days)
    if not rows:
        print(f"{args.dir}: no certificates found")
        return 1
    bad = 0
    for r in rows:
        when = r.not_after.strftime("%Y-%m-%d") if r.not_after else "-"
        print(f"{r.state:9} {when}  {r.days_left if r.days_left is not None else '-':>5}d  {r.path.name}  {r.subject}")
        bad += r.state != "ok"
    return 1 if bad else 0
