"""Utilities every layer uses, importing nothing of the package above them: atomic file writes, staged folders and
locks (`fileio`), progress of long work (`progress`), CPU threads (`threads`), redaction of secrets (`redaction`),
provenance (`provenance`), typed YAML (`schema`) and the lazy exports of the package `__init__`s (`lazy`).
"""
