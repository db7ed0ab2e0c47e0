from __future__ import annotations

import inspect

import pytest

import journeyman as jm
from journeyman import errors
from journeyman.errors import (
    BackendError,
    InvalidDataError,
    MissingDependencyError,
    ServerStartError,
    StorageError,
)


def test_every_error_derives_from_the_root_and_is_drawn_in_the_docstring() -> None:
    classes = [obj for _, obj in inspect.getmembers(errors, inspect.isclass) if issubclass(obj, Exception)]
    assert jm.JourneymanError in classes
    doc = errors.__doc__ or ""
    for cls in classes:
        assert issubclass(cls, jm.JourneymanError), cls
        assert cls.__name__ in doc, f"{cls.__name__} is missing from the hierarchy drawn in errors.py"
        assert cls.__name__ in errors.__all__


def test_errors_are_also_the_builtin_kind_callers_expect() -> None:
    assert issubclass(InvalidDataError, ValueError)
    assert issubclass(StorageError, OSError)
    assert issubclass(MissingDependencyError, ImportError)
    assert issubclass(ServerStartError, BackendError)


def test_missing_dependency_names_the_extra_to_install() -> None:
    error = MissingDependencyError("crewai", "crewai", "CrewTracer")
    assert str(error) == (
        "CrewTracer needs the 'crewai' package, which is not installed. "
        "Install journeyman's 'crewai' extra: pip install \"./journeyman[crewai]\" beside your clone of "
        'journeyman, or pip install -e ".[crewai]" inside it'
    )
    with pytest.raises(jm.JourneymanError):
        raise error
