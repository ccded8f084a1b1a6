"""Turns the registry, the model declarations and a selection into checked-in model builds."""
