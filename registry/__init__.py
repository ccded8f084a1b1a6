"""The source of truth as data: implementations, model declarations, and the selection rules over them.

Everything here is pure Python. The core (identity, tactics, requests, eligibility, resolution) uses
only the standard library, so a generic build can resolve its layers on a machine without pydantic;
the typed declarations and the deployment selection use pydantic and are imported on demand.
"""
