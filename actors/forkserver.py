"""Imported by the supervisor's forkserver first, and by nothing else: it ties the forkserver's life
to the supervisor's. The forkserver holds the modules the actors preload (ActorSpec.preload), so a
start or a restart after a crash forks with them already imported; the actors it forks die with it."""

from transport.lifetime import on_parent_death

on_parent_death()
