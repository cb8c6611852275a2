"""``StartupError``: the base of everything that stops ``hkvd serve`` from starting.

``hkvd serve`` catches it alone, prints it and exits with its ``exit_code``. It never crosses the
wire; request errors are the wire registry's (``hkvd.transport.errors``), shared by both sides.
"""


class StartupError(Exception):
    """``hkvd serve`` cannot start here as configured; the message names the fix.

    ``exit_code``: 2 for a configuration a user must change, 1 for what the machine lacks.
    """

    exit_code = 1
