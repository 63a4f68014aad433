"""Reporting: one window's result as people read it: the report text, JSON, picture, Chrome trace, files."""
