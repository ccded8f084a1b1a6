"""What a generated root runs that is the same for every root: `load_model` (it picks a build through the build index) and the `run` launcher.

This code once was rendered from templates that substituted no value at all; it is ordinary code now, and
each generated root holds two short shims (`__init__.py`, `run.py`) that hand it their package name. It is
its own top-level package because of the layering: it routes through the registry (checkpoint matching,
the build index decision) and builds, decodes and launches through the runtime, and neither of those may
import the other (the registry never imports torch; the runtime never imports the registry). It cannot
live in `generated/`, whose files are all generated (any other file there is an orphan), nor in codegen,
which never imports torch.
"""
