"""Tools for the tool-environment tests, loaded by import path as a user's would be."""

import threading

RELEASE = threading.Event()  # a hung tool's thread ends when a test sets it


def echo(argument: str) -> str:
    return f"echo {argument}"


def boom(argument: str) -> str:
    raise RuntimeError(f"boom on {argument!r}")


def garbage(argument: str):
    return {"not": "a string"}


def hang(argument: str) -> str:
    RELEASE.wait(60)
    return "too late"


NOT_CALLABLE = 3


def huge(argument: str) -> str:
    return "x " * 5000  # more than any episode of the tests holds
