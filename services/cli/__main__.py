"""`lockstep`: submit a recipe, list runs, watch one, cancel or resume one; prepare and launch a shipped recipe;
export, import and compare runs."""
from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.cli.client import ApiError, CoordinatorClient, load_recipe, parse_set_pairs
from services.cli.exchange_commands import add_exchange_parsers, run_exchange
from services.cli.recipe_commands import RecipeRequest, add_recipe_parser, run_recipe
from services.cli.sample_commands import add_samples_parser, run_samples
from services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV, AuthConfigError, load_token
from services.cli.progress import RunProgress


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lockstep", description="Lockstep command line (talks to the coordinator's REST API).")
    p.add_argument("--url", default=os.environ.get("LOCKSTEP_URL", "http://127.0.0.1:8000"),
                   help="Coordinator URL [env LOCKSTEP_URL]")
    p.add_argument("--token-file", default="",
                   help=f"File holding the deployment's bearer token [env {TOKEN_FILE_ENV}, else the token itself in "
                        f"{TOKEN_ENV}]")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="Submit a recipe (YAML run spec).")
    s.add_argument("recipe")
    s.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="Override a spec field (dotted for nested ones), value as JSON, e.g. --set steps=3 "
                        "--set task.options.path='\"/data/train.jsonl\"'")
    s.add_argument("--watch", action="store_true", help="Show live progress until the run ends.")
    sub.add_parser("list", help="List runs.")
    w = sub.add_parser("watch", help="Live progress of a run until it ends.")
    w.add_argument("run_id")
    c = sub.add_parser("cancel", help="Cancel a run.")
    c.add_argument("run_id")
    r = sub.add_parser("resume", help="Resume a paused run (once its checkpoint disk has space again).")
    r.add_argument("run_id")
    m = sub.add_parser("metrics", help="Print a run's per-step metrics as JSON.")
    m.add_argument("run_id")
    e = sub.add_parser("episodes", help="Print a recorded step's episodes (turns, rewards, end reasons) as JSON.")
    e.add_argument("run_id")
    e.add_argument("step", type=int)
    add_samples_parser(sub)
    add_recipe_parser(sub)
    add_exchange_parsers(sub)
    return p


def _watch(client: CoordinatorClient, run_id: str, console: Console) -> int:
    with RunProgress(console) as progress:
        run = client.wait(run_id, on_update=progress)
    console.print(f"run {run_id}: {run['status']}" + (f" ({run['error']})" if run.get("error") else ""))
    return 0 if run["status"] == "completed" else 1


def _recipe(args: argparse.Namespace, console: Console) -> int:
    """prepare and show read no token and open no connection; train reads the token only when it submits."""
    try:
        request = RecipeRequest.from_args(args)
        return run_recipe(
            request, emit=lambda text: (sys.stdout.write(text), sys.stdout.flush()),
            client_factory=lambda: CoordinatorClient(args.url, token=load_token(args.token_file)),
            watch=(lambda client, run_id: _watch(client, run_id, console)) if getattr(args, "watch", False) else None,
        )
    except (ValueError, AuthConfigError, ApiError) as exc:
        console.print(f"[red]error[/red] {escape(str(exc))}", highlight=False)
        return 2


def _exchange(args: argparse.Namespace, console: Console) -> int:
    """export, import, compare, replay-score: compare over bundles alone, and replay-score, read no token and
    open no connection."""
    try:
        return run_exchange(args, lambda: CoordinatorClient(args.url, token=load_token(args.token_file)),
                            emit=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    except (ValueError, OSError, RuntimeError, AuthConfigError, ApiError) as exc:
        console.print(f"[red]error[/red] {escape(str(exc))}", highlight=False)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if args.cmd == "recipe":
        return _recipe(args, console)
    if args.cmd in ("export", "import", "compare", "replay-score"):
        return _exchange(args, console)
    try:
        token = load_token(args.token_file)
    except AuthConfigError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    client = CoordinatorClient(args.url, token=token)
    try:
        if args.cmd == "submit":
            run = client.submit(load_recipe(args.recipe, parse_set_pairs(args.set)))
            console.print(f"submitted run {run['id']} ({run['name']})")
            return _watch(client, run["id"], console) if args.watch else 0
        if args.cmd == "list":
            table = Table("id", "name", "status", "step", "error")
            for r in client.runs():
                table.add_row(r["id"], r["name"], r["status"], f"{r['step']}/{r['steps']}", r["error"][:60])
            console.print(table)
            return 0
        if args.cmd == "watch":
            return _watch(client, args.run_id, console)
        if args.cmd in ("cancel", "resume"):
            run = client.cancel(args.run_id) if args.cmd == "cancel" else client.resume(args.run_id)
            console.print(f"run {run['id']}: {run['status']}")
            return 0
        if args.cmd == "metrics":
            print(json.dumps(client.metrics(args.run_id), indent=2))
            return 0
        if args.cmd == "samples":
            return run_samples(args, client, console)
        if args.cmd == "episodes":
            print(json.dumps(client.episodes(args.run_id, args.step), indent=2))
            return 0
    except ApiError as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    finally:
        client.close()
    return 2


if __name__ == "__main__":
    sys.exit(main())
