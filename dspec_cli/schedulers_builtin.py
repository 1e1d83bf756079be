"""Built-in schedulers, registered through the ``dspec`` entry-point group like any plugin."""

from dspec_cli import hookimpl
from dspec_cli.schedule import BUILTIN_SCHEDULERS


@hookimpl
def dspec_register_schedulers(register):
    for cls in BUILTIN_SCHEDULERS:
        register(cls)
