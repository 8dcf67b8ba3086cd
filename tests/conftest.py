"""Fixtures for the whole suite: a throwaway PostgreSQL server and a database per test;
llama.cpp's real server and tiny models (tests/llama.py).

A launcher that runs the suite with SIGINT ignored (SIG_IGN is inherited across exec)
would pass that on to every process a test starts, and a test that stops one with SIGINT
would wait in vain: the suite takes SIGINT back (a handler, which each child's exec resets
to the default) before any test starts a process."""

import signal

from tests.llama import llama_server, tiny_models
from tests.postgres import postgres_dsn, postgres_server

__all__ = ["llama_server", "postgres_dsn", "postgres_server", "tiny_models"]

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
