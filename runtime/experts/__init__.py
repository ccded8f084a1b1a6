"""Experts implementations, one class per registry id; base.py holds the shared contract."""
