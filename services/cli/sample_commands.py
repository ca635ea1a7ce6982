"""`lockstep samples RUN --step S [--worst|--best|--group G]`: what the policy wrote at one step, as a table."""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.cli.client import CoordinatorClient


def add_samples_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("samples", help="Show the samples a step trained on (prompt, response, reward, advantage, "
                       "length, finish reason, policy version).")
    s.add_argument("run_id")
    s.add_argument("--step", type=int, required=True, help="The step (1-based).")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--worst", action="store_true", help="Lowest reward first.")
    which.add_argument("--best", action="store_true", help="Highest reward first.")
    s.add_argument("--group", default=None, help="Only this group's samples (one prompt's).")
    s.add_argument("--limit", type=int, default=20, help="Samples to show (default 20).")
    s.add_argument("--offset", type=int, default=0, help="Samples to skip.")
    s.add_argument("--width", type=int, default=160, help="Characters of prompt and response shown (0: all).")
    s.add_argument("--json", action="store_true", help="Print the API's JSON page instead (token ids included).")


def _clip(text: str, width: int) -> str:
    return text if width <= 0 or len(text) <= width else text[:width - 1] + "…"


def samples_table(page: dict, width: int) -> Table:
    iw = page.get("iw") or {}
    iw_text = (f", step IW {iw['iw_min']:.6g} .. {iw['iw_max']:.6g} (mean {iw['iw_mean']:.6g})"
               if {"iw_min", "iw_max", "iw_mean"} <= set(iw) else "")
    shown = f"{page['offset'] + 1}-{page['offset'] + len(page['samples'])}" if page["samples"] else "none"
    table = Table("#", "sample", "reward", "adv", "len", "finish", "ver", "IW", "prompt", "response", show_lines=True,
                  title=f"run {page['run_id']} step {page['step']}: samples {shown} of {page['total']} "
                        f"({page['order']}){iw_text}")
    for s in page["samples"]:
        version = str(s["policy_version"]) if s["policy_version"] == s["policy_version_last"] \
            else f"{s['policy_version']}-{s['policy_version_last']}"
        iw = "?" if s.get("iw_min") is None else f"{s['iw_min']:.6g}..{s['iw_max']:.6g}"
        # escape: model output is text, never rich markup
        table.add_row(str(s["index"]), escape(s["sample_id"]), f"{s['reward']:.4g}", f"{s['advantage']:+.4f}",
                      str(s["length"]), escape(s["finish_reason"]), version, iw,
                      escape(_clip(s["prompt"], width)), escape(_clip(s["response"], width)))
    return table


def run_samples(args: argparse.Namespace, client: CoordinatorClient, console: Console) -> int:
    order = "worst" if args.worst else "best" if args.best else "record"
    page = client.samples(args.run_id, args.step, order=order, group=args.group, offset=args.offset,
                          limit=args.limit)
    if args.json:
        print(json.dumps(page, indent=2))
    else:
        console.print(samples_table(page, args.width))
    return 0
