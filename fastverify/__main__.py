import sys

try:
    from fastverify.cli import run
except KeyboardInterrupt:  # Ctrl-C during start-up: the CLI's one line, not a traceback
    sys.stderr.write("fastverify: interrupted\n")
    raise SystemExit(130) from None

run()
