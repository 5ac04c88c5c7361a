"""Command line: ``underlay info``, ``underlay demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from underlay.interfaces import UnderlayError

__all__ = ["main"]


def _print_info(data: dict[str, Any]) -> None:
    print("underlay " + str(data["versions"]["underlay"]))
    print("versions: " + ", ".join(f"{k}={v}" for k, v in data["versions"].items() if v and k != "underlay"))
    print(f"platform: {data['platform']}")
    hw = data["hardware"]
    tf = hw["peak_bf16_tflops"]
    peak = (
        "unknown" if tf is None else (f"{tf:.1f} TFLOP/s bf16" if tf >= 1 else f"{tf * 1e3:.1f} GFLOP/s bf16")
    )
    print(f"hardware: {hw['count']} x {hw['model']} ({hw['device']}; peak {peak})")
    if data["plugins_allowed"]:
        print(f"plugins allowed: {data['plugins_allowed']}")
    print("\nenvironment (every variable underlay reads; owner: who defines it):")
    for row in data["environment"]:
        value = "<unset>" if row["value"] is None else repr(row["value"])
        default = f"default {row['default']!r}" if row["default"] else "no default"
        print(
            f"  {row['name']:<29} {value:<12} {default:<34} {row['owner']:<9} {row['means']} "
            f"[{row['values']}]"
        )
    for kind, rows in data["backends"].items():
        sel = data["selected"].get(kind, {})
        chosen = sel.get("name")
        print(
            f"\n{kind}  ->  {chosen or 'none'}  ({sel.get('source', '')}{': ' + sel['reason'] if sel.get('source') == 'error' else ''})"
        )
        for r in rows:
            mark = "*" if r["name"] == chosen else " "
            state = (
                "available"
                if r["available"]
                else f"unavailable: {r['reason']}" + (f" ({r['hint']})" if r["hint"] else "")
            )
            origin = "" if r["origin"] == "builtin" else f" [plugin {r['origin']}]"
            print(f"  {mark} {r['name']:<12} prio {r['priority']:>3}  {state}{origin}  - {r['description']}")
            if r.get("recompute"):
                print("      recompute: " + "; ".join(f"{k}: {v}" for k, v in r["recompute"].items()))
            for o in r.get("options", []):
                print(f"      option {o['name']} ({o['type']}, default {o['default']!r}): {o['doc']}")
            for dev, values in r.get("auto_defaults", {}).items():
                print(f"      auto defaults on {dev}:")
                for opt, (value, why) in values.items():
                    print(f"        {opt} = {value!r}: {why}")


def _print_models(rows: list[Any], counts: dict[str, dict[str, int]]) -> None:
    for engine, per in counts.items():
        print(f"\n{engine}: " + ", ".join(f"{n} {status}" for status, n in per.items()))
        for r in rows:
            if r.engine == engine:
                reason = f": {r.reason}" if r.reason else ""
                print(f"  {r.model_type:<28} {r.status}{reason}")


def _cmd_info(args: argparse.Namespace) -> int:
    from underlay import registry

    if args.models:
        from dataclasses import asdict

        from underlay.models import coverage

        rows = coverage.coverage_matrix()
        counts = coverage.counts(rows)
        if args.json:
            print(json.dumps({"counts": counts, "rows": [asdict(r) for r in rows]}, indent=2))
        else:
            _print_models(rows, counts)
        return 0

    data = registry.info()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        _print_info(data)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="underlay", description="underlay: hardware and parallelism for RL post-training"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, hardware, backends and what auto selects")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--models",
        action="store_true",
        help="per engine, which causal-LM model types of the installed transformers run (exact / refused "
        "with the engine's reason); needs transformers",
    )
    p.set_defaults(func=_cmd_info)
    import importlib.util

    if importlib.util.find_spec("underlay.demo") is not None:
        importlib.import_module("underlay.demo").add_demo_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``underlay`` console script; returns the exit status (2 on an UnderlayError)."""
    args = _build_parser().parse_args(argv)
    try:
        from underlay.parallel.logging import setup_logging
        from underlay.utils import env

        # warnings and up unless UNDERLAY_LOG_LEVEL asks for more; the commands print their own output
        setup_logging(level=None if env.get_optional("UNDERLAY_LOG_LEVEL") else "WARNING")
        return int(args.func(args))
    except UnderlayError as exc:
        print(f"underlay: error: {exc}", file=sys.stderr)
        return 2
