"""Built-in schedulers, registered through the ``dspec`` entry-point group like any plugin."""

from dspec_cli.core.hookspecs import hookimpl
from dspec_cli.runtime.schedule import BUILTIN_SCHEDULERS


@hookimpl
def dspec_register_schedulers(register):
    for cls in BUILTIN_SCHEDULERS:
        register(cls)
