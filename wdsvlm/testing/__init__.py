"""Tiny random models and processors for tests and benches, built offline."""
