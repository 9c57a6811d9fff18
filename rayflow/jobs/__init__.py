"""Runnable jobs that ship with rayflow (so they run from an installed wheel).

``rayflow.jobs.orders`` is the main job: ``rayflow demo`` runs its pipeline under each
delivery guarantee.
"""
