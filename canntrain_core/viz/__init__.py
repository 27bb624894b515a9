"""Plots of runs."""
