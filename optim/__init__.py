"""Optimizers the team researches (Muon, Lion, OLion, Adafactor2D) and resumable bundles."""
