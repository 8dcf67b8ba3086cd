"""Fixtures for the whole suite: a throwaway PostgreSQL server and a database per test;
llama.cpp's real server and tiny models (tests/llama.py)."""

from tests.llama import llama_server, tiny_models
from tests.postgres import postgres_dsn, postgres_server

__all__ = ["llama_server", "postgres_dsn", "postgres_server", "tiny_models"]
