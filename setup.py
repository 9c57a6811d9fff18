"""Builds rayflow's optional C loop (``rayflow.runtime._speedups``); everything else is in
pyproject.toml. Where no C compiler is at hand the build goes on without it and the loop
runs in Python (same results, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rayflow.runtime._speedups",
            ["rayflow/runtime/_speedups.c"],
            optional=True,
        )
    ]
)
