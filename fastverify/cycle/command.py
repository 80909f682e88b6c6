"""``fastverify report BUNDLE``: read a bundle of ``fastverify collect`` anywhere (no GPU) and say
where each speculative cycle's time goes, what is anomalous (with the evidence) and how much a
faster all-reduce can remove. Text (default), ``--json`` (one document), ``--png`` (the split)."""

from __future__ import annotations

import argparse
import sys

import msgspec
import orjson

from fastverify.cycle.flags import Answer, Evidence, Flag, answer, flags, mode_means
from fastverify.cycle.evidence import evidence
from fastverify.cycle.split import CycleSplit
from fastverify.errors import UserError, printable
from fastverify.output_paths import output_arg, path_arg

SCHEMA = "fastverify.cycle_report"
SCHEMA_VERSION = 1
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=path_arg, metavar="BUNDLE", help="the .tar.gz written by `fastverify collect`")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the text")
    p.add_argument("--png", type=output_arg, default=None, metavar="PATH",
                   help="also draw the cycle split per mode (a new file)")
    p.add_argument("--force", action="store_true", help="replace an existing --png file")


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
    from fastverify.output_paths import check_outputs
    from fastverify.outputs import claim_output

    if args.force and args.png is None:
        raise UserError("--force replaces an existing --png file; it does not apply without --png")
    if args.png is not None:
        check_outputs({"--png": args.png}, {"BUNDLE": args.bundle})
        claim_output(args.png, "--png", force=args.force)  # an existing file only with --force
    from fastverify.cycle.draft_section import draft_section

    with open_bundle(args.bundle) as bundle:  # one pass over the archive; its copies removed after
        ev, notes = evidence(bundle)
        if args.png is not None and ev.split is None:
            raise UserError(f"--png {args.png}: the bundle has no cycles to draw ({notes[0] if notes else 'no trace'})")
        found = flags(ev)
        ans = answer(ev, found)
        doc = document(bundle, ev, found, ans, notes)
        doc["draft_shape"] = draft_section(bundle, ev.split)  # the opened bundle: not read again
    if args.png is not None:  # drawn before anything is printed: a failure leaves no half output
        from fastverify.cycle.plot import plot_cycle

        plot_cycle(doc, args.png)
    if args.json:
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        from fastverify.cycle.printer import print_report

        print_report(doc)
        if args.png is not None:
            print(f"wrote {printable(args.png)}")
    return 0
