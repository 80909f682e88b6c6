"""Test-only stand-in HTTP server for the supervision tests of ``launch --load`` / ``--baseline``."""
