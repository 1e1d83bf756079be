"""pluggy hook specifications: what a dspec plugin can register."""

import pluggy

hookspec = pluggy.HookspecMarker("dspec")
hookimpl = pluggy.HookimplMarker("dspec")


@hookspec
def dspec_register_drafters(register):
    """Register drafter classes: ``register(DrafterClass, aliases=())``."""


@hookspec
def dspec_register_schedulers(register):
    """Register verification-length schedulers: ``register(SchedulerClass, aliases=())``."""


@hookspec
def dspec_register_layouts(register):
    """Register foreign checkpoint layouts: ``register(layout)``, a
    :class:`~dspec_cli.checkpoints.layouts.Layout` (read another project's checkpoint folders,
    write a drafter in that format for export)."""
