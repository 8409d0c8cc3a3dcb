"""The ``rill`` command line: ``serve``, ``demo-model``, ``models``, ``pull``, ``check-config``,
``client …`` and more.

Subcommands owned by other packages register themselves: a module listed in ``PLUGINS``
that exists exposes ``register(subparsers)`` and sets ``func`` on its parser(s); a module
under ``rill.clients`` exposing ``register(client_subparsers)`` adds ``rill client NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import pkgutil
import sys

from rill import __version__, config
from rill.errors import ConfigError, RillError

PLUGINS = ("rill.bench",)


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = config.load(_config_flags(args))
    logging.basicConfig(level=cfg.http.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rill.engine.allocator import limit_arenas

    limit_arenas()  # before the server's threads exist: each would otherwise get an arena of its own
    from rill.server import serve

    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from rill.database import redact

    cfg = config.load(_config_flags(args))
    cfg.api_keys()  # reads --api-key-file: a file with no key is an error here as in serve
    shown = dataclasses.asdict(cfg)
    if cfg.storage.database is not None:
        shown["storage"]["database"] = redact(cfg.storage.database)
    # Secrets are shown as set or not, never as they are (the output lands in terminals and tickets).
    shown["policy"]["api_key"] = ["***" for _ in cfg.policy.api_key]
    print(json.dumps(shown, indent=2))
    return 0


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from rill.demo import ensure_demo_model

    path = ensure_demo_model(progress=True)
    print(path)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from rill.models import catalog

    if args.json:
        import json

        print(json.dumps([catalog.describe(entry) for entry in catalog.ENTRIES], indent=2))
    else:
        print(catalog.format_table())
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from rill.models import catalog

    entry = catalog.lookup(args.name)
    if entry is None:
        names = ", ".join(e.name for e in catalog.ENTRIES)
        raise ConfigError(f"no model named {args.name!r} in the catalog (rill models lists them: {names})")
    if entry.source == "default":
        print(
            f"{entry.name} comes with rill's install ({entry.packages[0].name}=={entry.packages[0].version}); "
            f"it is installed: {catalog.pull(entry)}"
        )
        return 0
    already = catalog.installed_path(entry) is not None
    path = catalog.pull(entry)
    print(f"{entry.name}: {'already installed' if already else 'installed'}, size and sha256 verified: {path}")
    flag = "--embedding-model" if entry.kind == "embedding" else "--model"
    print(f"serve it: rill serve {flag} {entry.name}")
    return 0


def _cmd_feedback_export(args: argparse.Namespace) -> int:
    from rill import feedback

    # Here, not in rill.feedback: the store sits below the configuration it is given.
    if args.database is not None:
        from rill.database import check_url

        check_url(args.database)
        return feedback.export(args.database, sys.stdout)
    if args.data_dir is not None:
        return feedback.export(args.data_dir, sys.stdout)
    configured = config.load({})
    return feedback.export(configured.storage.database or configured.http.data_dir, sys.stdout)


def _config_flags(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k == "config" or "." in k}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used to render ``--help``)."""
    parser = argparse.ArgumentParser(prog="rill", description="rill: a streaming LLM inference server")
    parser.add_argument("--version", action="version", version=f"rill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the server (all protocols, one process)")
    config.add_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser("check-config", help="print the effective configuration and exit")
    config.add_arguments(check)
    check.set_defaults(func=_cmd_check_config)

    demo = sub.add_parser("demo-model", help="build (once) and print the folder of the demo model")
    demo.set_defaults(func=_cmd_demo_model)

    models = sub.add_parser("models", help="list the named models of the catalog and whether they are installed")
    models.add_argument("--json", action="store_true", help="print the catalog as JSON")
    models.set_defaults(func=_cmd_models)

    pull = sub.add_parser("pull", help="download (once) a named model of the catalog into rill's cache")
    pull.add_argument("name", help="a name or alias that `rill models` lists")
    pull.set_defaults(func=_cmd_pull)

    client = sub.add_parser("client", help="command-line clients for each protocol")
    client_sub = client.add_subparsers(dest="client", required=True)
    import rill.clients

    for info in pkgutil.iter_modules(rill.clients.__path__):
        module = importlib.import_module(f"rill.clients.{info.name}")
        if hasattr(module, "register"):
            module.register(client_sub)

    for name in PLUGINS:
        if importlib.util.find_spec(name) is not None:
            module = importlib.import_module(name)
            if hasattr(module, "register"):
                module.register(sub)

    feedback = sub.add_parser("feedback", help="stored client feedback")
    feedback_sub = feedback.add_subparsers(dest="feedback_command", required=True)
    export = feedback_sub.add_parser("export", help="print every feedback record as JSON lines")
    where = export.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default=None, help="the server's data folder (default: the configured data_dir)")
    where.add_argument(
        "--database",
        default=None,
        help="the server's PostgreSQL database, postgresql://… (default: the configured database, if any)",
    )
    export.set_defaults(func=_cmd_feedback_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rill`` script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, RillError) as exc:
        print(f"rill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
