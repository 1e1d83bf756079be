"""pluggy hook specifications: what a dspec plugin can register."""

import pluggy

hookspec = pluggy.HookspecMarker("dspec")


@hookspec
def dspec_register_drafters(register):
    """Register drafter classes: ``register(DrafterClass, aliases=())``."""


@hookspec
def dspec_register_schedulers(register):
    """Register verification-length schedulers: ``register(SchedulerClass, aliases=())``."""
