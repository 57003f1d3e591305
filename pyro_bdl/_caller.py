"""Where a warning of the library points: at the user's line that called into it.

``warnings.warn(..., stacklevel=user_stacklevel())`` attributes the warning to the first frame
outside the ``pyro_bdl`` package, however many of the library's own calls (a decorator such as
:func:`~pyro_bdl._grad_mode.differentiates`, a helper) lie between; a fixed ``stacklevel`` breaks
whenever one is added or removed. (Python 3.12's ``skip_file_prefixes`` does the same; the
library supports 3.11.)
"""

from __future__ import annotations

import os
import sys

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the function calling this one that names
    the first frame outside the package (1 if that function is itself outside it)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
