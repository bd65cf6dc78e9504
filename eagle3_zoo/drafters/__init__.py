"""Drafter kinds, one subpackage each."""
