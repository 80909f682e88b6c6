"""``fastverify report BUNDLE``: read a bundle of ``fastverify collect`` anywhere (no GPU) and say
where each speculative cycle's time goes, what is anomalous (with the evidence) and how much a
faster all-reduce can remove. Text (default), ``--json`` (one document), ``--png`` (the split)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import msgspec
import orjson

from fastverify.cycle.flags import Answer, Evidence, Flag, answer, flags, mode_means
from fastverify.cycle.evidence import evidence
from fastverify.cycle.split import CycleSplit
from fastverify.errors import UserError

SCHEMA = "fastverify.cycle_report"
SCHEMA_VERSION = 1
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="the .tar.gz written by `fastverify collect`")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the text")
    p.add_argument("--png", type=Path, default=None, metavar="PATH", help="also draw the cycle split per mode")


def document(bundle, ev: Evidence, found: list[Flag], ans: Answer | None, notes: list[str]) -> dict:
    """The report as one JSON-ready dict."""
    split: CycleSplit | None = ev.split
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "bundle": str(bundle.path),
        "collected_utc": bundle.manifest.created_utc, "host": bundle.manifest.host,
        "clock": split.clock if split else None,
        "world_size": ev.world_size, "verify_msg_bytes": ev.msg_bytes,
        "cycles": msgspec.to_builtins(split) if split else None,
        "modes_mean_us": mode_means(split) if split else None,
        "flags": [msgspec.to_builtins(f) for f in found],
        "answer": msgspec.to_builtins(ans) if ans else None,
        "sources": ev.sources, "notes": notes,
    }


def run(args: argparse.Namespace) -> int:
    from fastverify.bundle import open_bundle
    from fastverify.output_paths import check_outputs, check_writable

    if args.png is not None:
        check_outputs({"--png": args.png}, {"BUNDLE": args.bundle})
        check_writable(args.png)
        if args.png.is_file() and args.png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            raise UserError(f"--png {args.png}: the file exists and is not a PNG; name a new file")
    bundle = open_bundle(args.bundle)
    with tempfile.TemporaryDirectory(prefix="fastverify-report-") as tmp:
        ev, notes = evidence(bundle, Path(tmp))
    if args.png is not None and ev.split is None:
        raise UserError(f"--png {args.png}: the bundle has no cycles to draw ({notes[0] if notes else 'no trace'})")
    found = flags(ev)
    ans = answer(ev, found)
    doc = document(bundle, ev, found, ans, notes)
    from fastverify.cycle.draft_section import draft_section

    doc["draft_shape"] = draft_section(args.bundle, ev.split)
    if args.png is not None:  # drawn before anything is printed: a failure leaves no half output
        from fastverify.cycle.plot import plot_cycle

        plot_cycle(doc, args.png)
    if args.json:
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        from fastverify.cycle.printer import print_report

        print_report(doc)
        if args.png is not None:
            print(f"wrote {args.png}")
    return 0
