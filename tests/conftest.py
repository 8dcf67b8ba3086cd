"""Fixtures for the whole suite: a throwaway PostgreSQL server and a database per test."""

from tests.postgres import postgres_dsn, postgres_server

__all__ = ["postgres_dsn", "postgres_server"]
