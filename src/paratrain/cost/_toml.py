"""The one place the systems model imports a TOML reader.

``tomllib`` is in the standard library from Python 3.11; on 3.10 (which pyproject.toml
declares supported) the same API comes from the ``tomli`` backport, a dependency there.
Every other module of :mod:`paratrain.systems` imports ``tomllib`` from here
(``tests/test_systems_imports.py`` checks it).
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["tomllib"]
