"""The package's version, in a module of its own so that any module can name it without importing the
package's ``__init__`` (which imports them). pyproject.toml holds the same string; scripts/check-install.sh
checks the two agree."""

__version__ = "0.1.0"
