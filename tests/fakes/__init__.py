"""Fakes at the boundaries the project does not own. Never imported by the package."""
