"""Suite-wide pytest configuration. Area fixtures live in each area's own conftest.py."""
