"""fastverify's SGLang patch: tuned settings and the chosen all-reduce backend in every TP rank.

Two halves:

* :mod:`fastverify.patch.launch` (the ``fastverify launch`` command) runs in the launcher: it
  validates the env file, decides which route loads the patch in the ranks, puts everything in the
  environment and ``exec``s the user's SGLang command.
* :mod:`fastverify.patch.install` runs inside every rank (SGLang spawns one scheduler process per TP
  rank, so nothing patched in the launcher reaches them). It is reached through SGLang's general
  plugin entry point (group ``sglang.srt.plugins``, name ``fastverify``, function
  :func:`plugin`) or, for SGLang releases without plugins, through the ``sitecustomize`` import
  hook that ``launch`` puts on ``PYTHONPATH``. Both call :func:`plugin`.

Nothing happens unless ``FASTVERIFY_PATCH=1`` is in the environment (set by ``launch``): an
installed fastverify never changes an SGLang server started without it. ``launch`` also sets
``FASTVERIFY_BACKEND`` (one registry name, or ``auto``/``off``) and ``FASTVERIFY_DEPLOYMENT`` (the
deployment record, :mod:`fastverify.deploy`). Once SGLang's groups exist, every TP rank prints one
line to stderr, ``fastverify patch [TP r]: backend=... applied=... built=... skipped=... (why)``
(:mod:`fastverify.patch.rank`, :func:`fastverify.patch.install.install`). The variables' names, the
plugin group and the routes: :mod:`fastverify.patch.handoff`.
"""

from __future__ import annotations

import os

from fastverify.patch.handoff import ENV_FLAG


def enabled(environ=None) -> bool:
    """Whether ``launch`` asked for the patch in this process."""
    env = os.environ if environ is None else environ
    return env.get(ENV_FLAG) == "1"


def plugin() -> None:
    """SGLang plugin entry point (and the import hook's target). Does nothing unless
    ``FASTVERIFY_PATCH=1``; never raises into SGLang."""
    if not enabled():
        return
    try:
        from fastverify.patch.install import install  # lazy: plugin

        install()
    except Exception as err:  # the server must start even if our patch is broken
        import logging

        logging.getLogger("fastverify.patch").warning("fastverify patch: not applied (%s: %s)", type(err).__name__, err)


__all__ = ["enabled", "plugin"]
